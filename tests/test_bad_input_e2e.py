"""Bad input on the front socket: at least 200 malformed frames of varied
kinds, each answered with the right error code (where a reply is possible),
counted, and the daemon still completes a normal call afterwards."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest
import zmq

from streamfence.devtools.emulator.control import EmulatorClient
from streamfence.protocol.credentials import load_credentials
from tests.harness import DaemonProcess

pytestmark = pytest.mark.slow


def _cases(rng: random.Random) -> list[tuple[list[bytes], str]]:
    def pack(obj: Any) -> bytes:
        frame: bytes = msgpack.packb(obj, use_bin_type=True)
        return frame

    good_call = {"provider": "emu", "request": {"model": "m", "messages": []}}
    cases: list[tuple[list[bytes], str]] = []
    for i in range(20):
        cases.append(([bytes(rng.randrange(256) for _ in range(1 + i))[:1] + b"\xc1"],
                      "bad_frame"))  # 0xc1 is never valid msgpack
        cases.append(([pack({"v": 1, "op": "status", "ref": f"r{i}"}) + b"\x00"], "bad_frame"))
        cases.append(([pack({"v": 1, "op": "status"}), b"extra"], "bad_frame"))
        cases.append(([pack([1, 2, i])], "bad_message"))
        cases.append(([pack("a string")], "bad_message"))
        cases.append(([pack({"op": "status", "ref": "x"})], "bad_message"))
        cases.append(([pack({"v": 2 + i, "op": "status", "ref": "x"})], "unsupported_version"))
        cases.append(([pack({"v": 1, "op": f"nope{i}", "ref": "x"})], "unknown_op"))
        cases.append(([pack({"v": 1, "op": "submit", "ref": "x"})], "bad_message"))
        cases.append(([pack({"v": 1, "op": "submit", "ref": "x",
                             "call": dict(good_call, provider=f"missing{i}")})],
                      "unknown_provider"))
        cases.append(([pack({"v": 1, "op": "submit", "ref": "x",
                             "call": dict(good_call, request="not a map")})], "bad_message"))
        cases.append(([pack({"v": 1, "op": "submit", "ref": "x",
                             "call": dict(good_call, options={"max_attempts": "3"})})],
                      "bad_message"))
        cases.append(([pack({"v": 1, "op": "result", "ref": "x", "call_id": f"nope{i}"})],
                      "unknown_call"))
        cases.append(([pack({"v": 1, "op": "subscribe", "ref": "x", "call_id": 7})],
                      "bad_message"))
        cases.append(([pack({"v": 1, "op": "cancel", "ref": "x", "call_id": f"nope{i}"})],
                      "unknown_call"))
        cases.append(([pack(msgpack.ExtType(1, b"x"))], "bad_frame"))
        cases.append(([b""], "bad_frame"))
    cases.append(([b"\x00" * (64 * 1024 + 1)], "too_large"))
    rng.shuffle(cases)
    return cases


def test_hundreds_of_malformed_frames_get_precise_errors(make_daemon: Any,
                                                         emu: EmulatorClient) -> None:
    daemon: DaemonProcess = make_daemon(daemon={"max_frame_bytes": 64 * 1024})
    cases = _cases(random.Random(1234))
    assert len(cases) >= 200
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    load_credentials(daemon.credentials_path).apply(sock)
    sock.connect(daemon.endpoint)
    try:
        for frames, code in cases:
            sock.send_multipart(frames)
            assert sock.poll(10_000), f"no reply to {frames[0][:40]!r} (expected {code})"
            reply = msgpack.unpackb(sock.recv(), raw=False)
            assert reply["op"] == "error", reply
            assert reply["code"] == code, (frames[0][:60], reply)
            assert reply["message"]
    finally:
        sock.close()
        ctx.term()
    with daemon.client() as client:
        counters = client.status()["counters"]
        bad = sum(v for k, v in counters.items() if k.startswith("bad_input."))
        assert bad == len(cases), counters
        done = client.run("emu", {"model": "gpt-emu#after-bad",
                                  "messages": [{"role": "user", "content": "hi"}]},
                          timeout_s=30.0)
    assert done["status"] == "completed", done
    assert done["response"]["content"] == emu.log("after-bad")[0]["text"]
