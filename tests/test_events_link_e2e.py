"""The local events link end to end (docs/PROTOCOL.md §5; sink/links.py,
protocol/client_local.py): a client on this host gets its events over the
sink's plain link, exactly; what is not an offered token is refused,
counted, and harms nobody; a link that ends is a reconnect."""

from __future__ import annotations

import os
import signal
import socket
import uuid
from typing import Any

import msgpack
import pytest
import zmq

from streamfence.devtools.emulator.control import EmulatorClient
from streamfence.protocol.client_local import LocalEvents, is_local
from streamfence.protocol.credentials import load_credentials
from streamfence.protocol.messages import events_endpoint
from tests.harness import DaemonProcess, is_listening, wait_until
from tests.wires import DaemonFactory, request_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon(module_daemon: DaemonFactory) -> DaemonProcess:
    return module_daemon()


def _sink(daemon: DaemonProcess) -> dict[str, Any]:
    with daemon.client() as admin:  # (a status names no listener: no link of its own)
        sink: dict[str, Any] = admin.status()["sink"]
        return sink


def _stream(daemon: DaemonProcess, emu: EmulatorClient, chunks: int = 20) -> list[dict[str, Any]]:
    key = f"link-{uuid.uuid4().hex[:8]}"
    emu.script(key, [{"fault": "ok", "chunks": chunks}])
    with daemon.client(timeout_s=30.0) as client:
        events = list(client.events(client.submit("emu", request_for("openai", key)),
                                    timeout_s=30.0))
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert events[-1]["status"] == "completed"
    assert events[-1]["response"]["content"] == emu.log(key)[0]["text"]
    return events


def _offer(daemon: DaemonProcess) -> dict[str, Any]:
    """A link offer, as a raw client on the events socket gets it."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.linger = 0
        sock.setsockopt(zmq.ROUTING_ID, b"l-" + uuid.uuid4().hex.encode())
        load_credentials(daemon.credentials_path).apply(sock)
        sock.connect(events_endpoint(daemon.endpoint))
        sock.send(msgpack.packb({"v": 1, "op": "listen"}))
        assert sock.poll(10_000), "no answer to listen"
        answer = msgpack.unpackb(sock.recv())
    finally:
        sock.close()
    assert is_listening(answer) and set(answer["link"]) == {"path", "token"}, answer
    return dict(answer["link"])


def test_a_local_clients_events_come_over_the_link(daemon: DaemonProcess,
                                                   emu: EmulatorClient) -> None:
    assert is_local(daemon.endpoint), daemon.endpoint
    before = _sink(daemon)
    events = _stream(daemon, emu)
    after = _sink(daemon)
    assert after["events_links_attached"] == before["events_links_attached"] + 1
    # Every event went over the link: its bytes are at least the events'.
    size = sum(len(msgpack.packb(e)) for e in events)
    assert after["events_links_bytes"] - before["events_links_bytes"] >= size * 0.9, \
        (after["events_links_bytes"] - before["events_links_bytes"], size)


@pytest.mark.parametrize("first", [b"\xc1\xc1", msgpack.packb({"v": 1, "op": "attach",
                                                               "token": b"0" * 16}), b""])
def test_what_is_not_an_offered_token_is_refused_and_counted(
        daemon: DaemonProcess, emu: EmulatorClient, first: bytes) -> None:
    """Garbage, a token never offered, or silence (closed after a second)."""
    path = _offer(daemon)["path"]
    before = _sink(daemon)["events_links_refused"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10.0)
        sock.connect(path)
        if first:
            sock.sendall(first)
        assert sock.recv(64) == b"", "the sink answered what is not an offered token"
    wait_until(lambda: _sink(daemon)["events_links_refused"] == before + 1, 10.0,
               "the refusal to be counted")
    _stream(daemon, emu)  # and everyone else is served


def test_an_offer_is_taken_once(daemon: DaemonProcess) -> None:
    offer = _offer(daemon)
    first = LocalEvents.attach(offer, 1 << 20)
    assert first is not None
    try:
        assert LocalEvents.attach(offer, 1 << 20) is None  # the token served once
    finally:
        first.close()


def test_a_link_that_ends_is_a_reconnect_and_nothing_is_lost(
        make_daemon: Any, emu: EmulatorClient) -> None:
    """The sink is killed while a call streams (every link of it ends); the
    client listens again, takes a link from the restarted sink and
    resubscribes: the call's events arrive once each, in order."""
    proc: DaemonProcess = make_daemon()
    emu.script("link-end", [{"fault": "ok", "chunks": 40, "chunk_delay_s": 0.05}])
    with proc.client(timeout_s=30.0) as client:
        events = client.events(client.submit("emu", request_for("openai", "link-end")),
                               timeout_s=30.0)
        got = [next(events)]
        sink_pid = client.status()["processes"]["sink"]
        assert client.status()["sink"]["events_links_attached"] == 1
        os.kill(sink_pid, signal.SIGKILL)
        got += list(events)
        # The restarted sink's counters start at 0: this client's new link.
        assert client.status()["sink"]["events_links_attached"] == 1
    assert [e["seq"] for e in got] == list(range(1, len(got) + 1))
    assert got[-1]["status"] == "completed"
    assert got[-1]["response"]["content"] == emu.log("link-end")[0]["text"]
