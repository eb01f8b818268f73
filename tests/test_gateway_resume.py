"""Issue 28, defect 2: an HTTP stream resumed while its call is live gets
exactly the rest. A streaming client with an `Idempotency-Key` reads the
events up to seq 5, drops the connection and at once re-POSTs with
`Last-Event-ID: 2`: it must get seqs 3, 4, 5, 6, ... to the end, no gap and
no repeat, on both wires that stream (OpenAI chat completions, Anthropic
messages). The failpoint `gateway.replay_to_live` pauses the gateway where
the resumed stream has rebuilt its state from the events up to
Last-Event-ID and is about to send what follows, so live events arrive
meanwhile."""

from __future__ import annotations

import contextlib
import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess, emulator_profile
from streamfence.gateway.keys import http_key
from streamfence.protocol import failpoints
from streamfence.protocol.codec import encode
from streamfence.protocol.credentials import load_credentials
from streamfence.protocol.messages import (
    CallStatus,
    accepted_msg,
    delta_event,
    done_event,
    empty_response,
    listening_msg,
)
from tests.harness import DaemonProcess, free_port, healthy, wait_until
from tests.test_client_core import core, drive
from tests.test_gateway_e2e import _frames

POINT = "gateway.replay_to_live"
# Twenty visible pieces, one per provider chunk: every seq of the call has a frame.
TEXT = "".join(f"w{i:02d}." for i in range(20))
RESUME_AT = 2  # the Last-Event-ID of the re-POST
READ_UP_TO = 5  # the seq the first connection reads to before it drops


class Wire:
    def __init__(self, path: str, model: str, body: dict[str, Any]) -> None:
        self.path, self.model, self.body = path, model, body

    def text(self, frames: list[tuple[int, str]]) -> str:
        out = ""
        for _, data in frames:
            if data == "[DONE]":
                continue
            msg = json.loads(data)
            if self.path == "/v1/chat/completions":
                out += "".join(c["delta"].get("content") or "" for c in msg["choices"])
            elif msg.get("type") == "content_block_delta" and msg["delta"]["type"] == "text_delta":
                out += msg["delta"]["text"]
        return out


WIRES = {
    "openai": Wire("/v1/chat/completions", "oa/gpt-emu", {}),
    "anthropic": Wire("/v1/messages", "an/claude-emu", {"max_tokens": 100}),
}


class Armed:
    def __init__(self, daemon: DaemonProcess, url: str, key: str, where: Path) -> None:
        self.daemon, self.url, self.key, self.where = daemon, url, key, where

    def open(self, wire: Wire, script: str, headers: dict[str, str]) -> tuple[Any, Any]:
        conn = http.client.HTTPConnection(self.url.removeprefix("http://"), timeout=30.0)
        body = json.dumps({"model": f"{wire.model}#{script}", "stream": True,
                           "messages": [{"role": "user", "content": "hello"}], **wire.body})
        conn.request("POST", wire.path, body, {
            "Authorization": f"Bearer {self.key}", "Content-Type": "application/json",
            **headers})
        reply = conn.getresponse()
        assert reply.status == 200, reply.read()
        return conn, reply


@pytest.fixture(scope="module")
def armed(tmp_path_factory: pytest.TempPathFactory,
          emulator: EmulatorProcess) -> Iterator[Armed]:
    """A daemon with [http] whose gateway pauses 300 ms at `gateway.replay_to_live`
    (the module's tests share it: each counts its own passes of the point)."""
    port = free_port()
    tmp_path = tmp_path_factory.mktemp("gateway_resume")
    where = tmp_path / "failpoints"
    where.mkdir()
    daemon = DaemonProcess(
        tmp_path / "state",
        {"oa": emulator_profile("openai", emulator.base_url),
         "an": emulator_profile("anthropic", emulator.base_url)},
        tables={"http": {"listen": f"127.0.0.1:{port}"}},
        env={failpoints.ENV: f"{POINT}=pause(300ms)", failpoints.DIR_ENV: str(where)})
    daemon.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(url), 30.0, f"the gateway to answer {url}/healthz")
        yield Armed(daemon, url, http_key(load_credentials(daemon.credentials_path)), where)
    finally:
        daemon.cleanup()


def _read_to(reply: Any, seq: int) -> list[tuple[int, str]]:
    """Frames of `reply` up to the first one with id `seq` (and the frames of
    that event already read with it)."""
    frames: list[tuple[int, str]] = []
    while not frames or frames[-1][0] < seq:
        got = _frames(reply, limit=1)
        assert got, f"the stream ended before seq {seq}: {frames}"
        frames += got
    return frames


def _ids(frames: list[tuple[int, str]]) -> list[int]:
    """The seqs the frames carry, each once, in order (an event may be several frames)."""
    out: list[int] = []
    for seq, _ in frames:
        if not out or out[-1] != seq:
            out.append(seq)
    return out


@pytest.mark.parametrize("name", sorted(WIRES))
def test_a_live_resume_after_last_event_id_gets_exactly_the_rest(
        armed: Armed, emu: EmulatorClient, name: str) -> None:
    wire, script = WIRES[name], f"live-resume-{name}"
    emu.script(script, [{"fault": "ok", "text": TEXT, "chunks": 20, "chunk_delay_s": 0.1}])
    headers = {"Idempotency-Key": script}
    passed = failpoints.hits(str(armed.where)).count(POINT)
    conn, reply = armed.open(wire, script, headers)
    first = _read_to(reply, READ_UP_TO)
    conn.close()  # the connection drops mid-answer; the call runs on (an Idempotency-Key)
    conn, reply = armed.open(wire, script, dict(headers, **{"Last-Event-ID": str(RESUME_AT)}))
    rest = _frames(reply)
    conn.close()
    sent = emu.log(script)
    assert len(sent) == 1 and not sent[0]["aborted"], sent
    # The pause was passed: events came live.
    assert failpoints.hits(str(armed.where)).count(POINT) > passed
    # The whole call, read again after its end, is what "the rest" is measured by.
    conn, reply = armed.open(wire, script, headers)
    whole = _frames(reply)
    conn.close()
    assert _ids(whole) == list(range(1, _ids(whole)[-1] + 1)), _ids(whole)
    assert _ids(rest) == [seq for seq in _ids(whole) if seq > RESUME_AT], \
        (_ids(first), _ids(rest))
    assert wire.text([f for f in first if f[0] <= RESUME_AT]) + wire.text(rest) \
        == wire.text(whole) == sent[0]["text"] == TEXT


def test_the_same_key_again_while_its_first_request_reads_takes_the_call_over(
        armed: Armed, emu: EmulatorClient) -> None:
    """The first connection is still open (not dropped) when the same key comes
    again: the two requests would share the call's events on the gateway's
    client, each missing what the other took. The newer one takes the call
    over and gets exactly the rest; the earlier one is closed before its end."""
    wire, script = WIRES["openai"], "live-takeover"
    emu.script(script, [{"fault": "ok", "text": TEXT, "chunks": 20, "chunk_delay_s": 0.1}])
    headers = {"Idempotency-Key": script}
    conn1, reply1 = armed.open(wire, script, headers)
    first = _read_to(reply1, READ_UP_TO)
    conn2, reply2 = armed.open(wire, script, dict(headers, **{"Last-Event-ID": str(RESUME_AT)}))
    rest = _frames(reply2)
    conn2.close()
    with contextlib.suppress(http.client.IncompleteRead):  # closed mid-chunk: taken over
        first += _frames(reply1)
    conn1.close()
    assert [data for _, data in first if data == "[DONE]"] == []  # it did not get the end
    assert _ids(rest) == list(range(RESUME_AT + 1, _ids(rest)[-1] + 1)), _ids(rest)
    assert rest[-1][1] == "[DONE]"
    assert wire.text([f for f in first if f[0] <= RESUME_AT]) + wire.text(rest) == TEXT
    assert len(emu.log(script)) == 1


def test_a_duplicate_submit_reads_a_live_call_again_from_seq_1() -> None:
    """The client side of it, without a socket: a reader took seqs 1-3 of a
    live call; the same key submitted again is subscribed from seq 1, and its
    replay (routed before the `accepted`, as the events socket may) must not
    be dropped as repeats: the new reader gets 1, 2, 3, 4, 5."""
    c = core(timeout_s=5.0)  # a liveness probe would come too late for the 0.5 s reads
    events = [*(delta_event("c1", 1, k, "text", f"p{k}") for k in (1, 2, 3, 4)),
              done_event("c1", 5, CallStatus.COMPLETED, empty_response(), None, 1)]
    stored = 3  # the events the daemon has so far

    def daemon(msg: dict[str, Any]) -> None:
        if msg["op"] == "listen":
            c.router.route([encode(listening_msg())])
            return
        for event in events[:stored]:  # the replay, routed before the reply
            if event["seq"] > msg.get("from_seq", 0):
                c.router.route([encode(event)])
        if msg["op"] == "submit":
            c.router.route([encode(accepted_msg(msg["ref"], "c1", duplicate=stored > 3))])

    def read(call_id: str, n: int | None) -> list[int]:
        reader = c.events(call_id, 0.5)
        got: list[int] = []
        while len(got) != n and (event := reader.take() or drive(reader.wait(), daemon)):
            got.append(event["seq"])
        return got

    assert read(drive(c.submit("openai", {"model": "m"}, idempotency_key="k"), daemon),
                3) == [1, 2, 3]
    stored = 5  # the call went on meanwhile
    assert read(drive(c.submit("openai", {"model": "m"}, idempotency_key="k"), daemon),
                None) == [1, 2, 3, 4, 5]
