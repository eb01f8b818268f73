"""Issue 28: an HTTP stream the gateway serves goes on when the sink restarts.

The gateway reads the calls' events through its AsyncClient, whose events
connection reconnects to the restarted sink. The stream must go on at once
(the supervisor subscribes the listener again at the new sink, and the
client subscribes again from its last seq on the new handshake), not after
the client's 30 s liveness probe or the HTTP client's re-POST. Several
streams at once, quick ones among them: the rest of a call the provider
ended while the sink was down comes in one burst after the rebind, maybe
before the events connection is made again (dropped: no later event shows
a gap), so only the handshake tells the client to subscribe again.

Two defects were found here: the AsyncClient never heard a handshake (the
monitor's descriptor raises no edge until its state is read once), and a
`listen` said to a sink that died before answering was never said again
(both clients: the flow waited timeout_s for `listening`).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess, emulator_profile
from streamfence.gateway.keys import http_key
from streamfence.protocol import failpoints
from streamfence.protocol.client_effects import Send, Wait
from streamfence.protocol.codec import encode
from streamfence.protocol.credentials import load_credentials
from streamfence.protocol.messages import events_endpoint, listening_msg
from tests.harness import DaemonProcess, free_port, healthy, process_state, wait_until
from tests.test_client_core import core, sent
from tests.test_gateway_e2e import _content, _frames

STREAMS = 4
TEXT = "".join(f"w{i:02d}." for i in range(30))  # thirty pieces, one per chunk
GOES_ON_S = 10.0  # the stream's end after the kill: the defect is a 30 s silence


class Gateway:
    def __init__(self, daemon: DaemonProcess, url: str, key: str) -> None:
        self.daemon, self.url, self.key = daemon, url, key


# How the sink dies: killed from outside, or crashed at a failpoint; "twice":
# killed, then the restarted sink is killed too while it stands still at its
# first rebind (its events socket took the gateway's connection and `listen`,
# which its loop never answers).
DEATHS = {"kill": None, "crash": f"sink.after_commit=crash@{STREAMS * 8}",
          "twice": "sink.after_rebind=pause(3s)"}


def test_a_listen_lost_with_its_sink_is_said_again_on_the_next_connection() -> None:
    """The client side, without a socket: a subscribe says `listen`; the sink
    that heard it dies before answering and the connection is made to the
    next one (a handshake): the waiting flow says `listen` there, and goes
    on with the subscribe once it is answered."""
    c = core(timeout_s=30.0)
    c.router.handshake()  # the first connection
    flow = c.subscribe("c1", 3)
    assert sent(next(flow)) == {"v": 1, "op": "listen"}
    assert isinstance(next(flow), Wait)
    c.router.handshake()  # a reconnect: that listen is lost
    again = next(flow)
    assert isinstance(again, Send) and again.to_events and sent(again)["op"] == "listen"
    assert isinstance(next(flow), Wait)
    c.router.route([encode(listening_msg())])
    assert sent(next(flow))["op"] == "subscribe"


@pytest.fixture(params=sorted(DEATHS))
def gateway(request: pytest.FixtureRequest, tmp_path: Path,
            emulator: EmulatorProcess) -> Iterator[Gateway]:
    """A daemon with [http] whose sink dies as DEATHS[param] says."""
    port = free_port()
    where = tmp_path / "failpoints"
    where.mkdir()
    env = {failpoints.DIR_ENV: str(where)}
    if DEATHS[request.param] is not None:
        env[failpoints.ENV] = str(DEATHS[request.param])
    daemon = DaemonProcess(tmp_path / "state",
                           {"oa": emulator_profile("openai", emulator.base_url)},
                           tables={"http": {"listen": f"127.0.0.1:{port}"}}, env=env)
    daemon.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(url), 30.0, f"the gateway to answer {url}/healthz")
        gw = Gateway(daemon, url, http_key(load_credentials(daemon.credentials_path)))
        gw.death = request.param  # type: ignore[attr-defined]
        gw.where = where  # type: ignore[attr-defined]
        yield gw
    finally:
        daemon.cleanup()


class Stream(threading.Thread):
    """One streaming request, read to its end (or its socket's 60 s timeout)."""

    def __init__(self, gw: Gateway, script: str) -> None:
        super().__init__(daemon=True)
        self.gw, self.script = gw, script
        self.started = threading.Event()  # a few frames came
        self.frames: list[tuple[int, str]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            conn = http.client.HTTPConnection(self.gw.url.removeprefix("http://"), timeout=60.0)
            body = json.dumps({"model": f"oa/gpt-emu#{self.script}", "stream": True,
                               "messages": [{"role": "user", "content": "hello"}]})
            conn.request("POST", "/v1/chat/completions", body, {
                "Authorization": f"Bearer {self.gw.key}", "Content-Type": "application/json",
                "Idempotency-Key": self.script})
            reply = conn.getresponse()
            assert reply.status == 200, reply.read()
            self.frames += _frames(reply, limit=3)
            self.started.set()
            self.frames += _frames(reply)
            conn.close()
        except BaseException as exc:
            self.error = exc
            self.started.set()


@pytest.mark.slow
def test_http_streams_go_on_when_the_sink_restarts(gateway: Gateway,
                                                   emu: EmulatorClient) -> None:
    scripts = [f"sink-restart-{i}" for i in range(STREAMS)]
    for i, script in enumerate(scripts):
        emu.script(script, [{"fault": "ok", "text": TEXT, "chunks": 30,
                             "chunk_delay_s": 0.01 + 0.01 * i}])
    with gateway.daemon.client() as client:
        sink = client.status()["processes"]["sink"]
    streams = [Stream(gateway, script) for script in scripts]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(30.0), "no stream began"
        assert stream.error is None, stream.error
    death = gateway.death  # type: ignore[attr-defined]
    children = _children(gateway.daemon)
    if death == "crash":
        wait_until(lambda: not _alive(sink), 20.0, "the sink to crash at its failpoint")
    else:
        os.kill(sink, signal.SIGKILL)
    if death == "twice":
        wait_until(lambda: "sink.after_rebind" in failpoints.hits(
            str(gateway.where)), 20.0, "the restarted sink to stand still at its rebind")  # type: ignore[attr-defined]
        (second,) = _children(gateway.daemon) - children
        # The gateway's events connection is made to it meanwhile (its I/O
        # thread accepts while the sink stands still): kill it once it is.
        events = events_endpoint(gateway.daemon.endpoint).removeprefix("ipc://")
        wait_until(lambda: sum(c.laddr == events for c in psutil.Process(second)
                               .net_connections("unix")) >= 2, 20.0,
                   "the gateway's events connection to the restarted sink")
        os.kill(second, signal.SIGKILL)
    for stream in streams:
        stream.join(GOES_ON_S)
    silent = [s.script for s in streams if s.is_alive()]
    assert not silent, (f"the HTTP streams of {silent} stopped after the sink's restart "
                        f"(read so far: {[_ids(s.frames) for s in streams if s.is_alive()]})")
    for stream in streams:
        assert stream.error is None, stream.error
        assert stream.frames[-1][1] == "[DONE]", stream.frames[-3:]
        assert _content(stream.frames) == TEXT
        assert len(emu.log(stream.script)) == 1
    with gateway.daemon.client() as client:
        assert client.status()["processes"]["sink"] != sink


def _alive(pid: int) -> bool:
    try:
        return process_state(pid) != "Z"
    except FileNotFoundError:
        return False


def _children(daemon: DaemonProcess) -> set[int]:
    assert daemon.proc is not None
    return {p.pid for p in psutil.Process(daemon.proc.pid).children()}


def _ids(frames: list[tuple[int, str]]) -> list[int]:
    return sorted({seq for seq, _ in frames})
