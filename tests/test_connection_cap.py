"""The cap on the client socket's connections, through a real daemon and real
CURVE clients (docs/SECURITY.md; issue 12): within the cap every connection
is served; past it a new handshake is refused (ZAP 400: libzmq closes the
connection, so it holds no descriptor), one WARNING says so, and the daemon
stays idle; a slot freed by a closing client is taken by the next one.

The cap is `[daemon] max_connections`; status shows it and the refusals.
With auth = "none" (NULL handshakes) the same cap holds: checked in-process
on a socket secured by `ClientAuth`, with its counters."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from streamfence.protocol.credentials import Credentials
from streamfence.protocol.keys import KeyStore
from streamfence.supervisor.auth import ClientAuth
from tests.harness import DaemonProcess, wait_until

CAP = 8
REPLY_S = 5.0  # a status reply of an idle daemon comes in milliseconds
# No provider call is made: the profile only has to be valid.
PROFILE = {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"}


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(tmp_path / "state", {"emu": PROFILE},
                         daemon={"workers_spare": 1, "max_connections": CAP})
    with proc:
        yield proc
    assert not proc.survivors, f"processes outlived the daemon: {proc.survivors}"


def _status(n: int) -> bytes:
    packed: bytes = msgpack.packb({"v": 1, "op": "status", "ref": f"cap-{n}"},
                                  use_bin_type=True)
    return packed


def _dealer(ctx: zmq.Context[zmq.Socket[bytes]], daemon: DaemonProcess,
            creds: Credentials) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    creds.apply(sock)
    return sock


def _answered(sock: zmq.Socket[bytes], n: int, timeout_s: float) -> bool:
    """Send status #n on `sock`; True if its reply comes within `timeout_s`."""
    sock.send(_status(n), zmq.NOBLOCK)
    if not sock.poll(int(timeout_s * 1000)):
        return False
    reply = msgpack.unpackb(sock.recv())
    assert reply["op"] == "status_reply" and reply["ref"] == f"cap-{n}", reply
    return True


def _cpu_s(pid: int) -> float:
    """User + system CPU time of process `pid` so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _warnings(daemon: DaemonProcess) -> list[str]:
    return [r.get("message", "") for r in daemon.log_records()
            if r.get("level") == "WARNING" and "at the cap" in r.get("message", "")]


def test_connections_past_the_cap_are_refused_logged_and_released(daemon: DaemonProcess) -> None:
    creds = KeyStore(daemon.state_dir / "keys").register("capped", daemon.endpoint)
    assert daemon.proc is not None
    supervisor = daemon.proc.pid
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        # CAP idle authenticated connections, each confirmed by a reply.
        idle = []
        for n in range(CAP):
            sock = _dealer(ctx, daemon, creds)
            sock.connect(daemon.endpoint)
            idle.append(sock)
            assert _answered(sock, n, REPLY_S), \
                f"connection {n + 1} of {CAP} (within the cap) got no status reply"

        # One more: its handshake is refused, and its request never answered.
        extra = _dealer(ctx, daemon, creds)
        monitor = extra.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        extra.connect(daemon.endpoint)
        extra.send(_status(CAP), zmq.NOBLOCK)  # queued until the handshake, which fails
        assert monitor.poll(int(REPLY_S * 1000)), \
            f"connection {CAP + 1}: no handshake event within {REPLY_S} s"
        event = parse_monitor_message(monitor.recv_multipart())
        assert (event["event"], event["value"]) == (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400), \
            f"connection {CAP + 1} past the cap of {CAP} was not refused: {event}"
        wait_until(lambda: _warnings(daemon), 5.0, "the 'at the cap' WARNING in the log")
        assert _warnings(daemon)[0].startswith(
            f"client connections at the cap ({CAP}); refusing new connections"), _warnings(daemon)

        # The refused state is idle: no reply comes, and the supervisor does not
        # spin (lenient: an idle loop uses a few ms of the second).
        before = _cpu_s(supervisor)
        assert not extra.poll(1000), f"connection {CAP + 1} past the cap got a reply"
        used = _cpu_s(supervisor) - before
        assert used < 0.5, f"the supervisor used {used:.2f} s of CPU in 1 s at the cap"
        extra.close(linger=0)
        monitor.close(linger=0)

        # Three clients leave: a new client is served (its slot was released).
        for sock in idle[:3]:
            sock.close(linger=0)
        attempts = []

        def new_client_served() -> bool:
            sock = _dealer(ctx, daemon, creds)
            sock.connect(daemon.endpoint)
            attempts.append(sock)
            return _answered(sock, 100 + len(attempts), 1.0)

        wait_until(new_client_served, 8.0, "a new client's status reply after 3 of the "
                   f"{CAP} connections closed", interval=0.05)
        for n, sock in enumerate(idle[3:]):
            assert _answered(sock, 200 + n, REPLY_S), "a connection within the cap lost its replies"
        assert len(_warnings(daemon)) == 1, f"the WARNING is rate-limited: {_warnings(daemon)}"
        for sock in attempts:
            sock.close(linger=0)
        with daemon.client() as admin:
            status = admin.status()
        assert status["connections"]["max"] == CAP, status["connections"]
        assert status["counters"]["connections_refused"] >= 1, status["counters"]
    finally:
        ctx.destroy(linger=0)


def _handshake(sock: zmq.Socket[bytes], endpoint: str) -> tuple[int, int]:
    """Connect `sock` to `endpoint`; its first handshake event (event, value)."""
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                      | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        sock.connect(endpoint)
        assert monitor.poll(int(REPLY_S * 1000)), f"no handshake event within {REPLY_S} s"
        event = parse_monitor_message(monitor.recv_multipart())
        return event["event"], event["value"]
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


def test_the_cap_holds_for_null_handshakes_and_counts(tmp_path: Path) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    auth = ClientAuth(ctx, KeyStore(tmp_path / "keys"), "none", {}, "unused")
    front = ctx.socket(zmq.ROUTER)
    front.linger = 0
    clients: list[zmq.Socket[bytes]] = []
    try:
        auth.secure(front, 2)
        endpoint = f"ipc://{tmp_path}/front"
        front.bind(endpoint)
        assert auth.max_connections == 2
        for _ in range(3):
            clients.append(ctx.socket(zmq.DEALER))
            clients[-1].linger = 0
        assert _handshake(clients[0], endpoint) == (zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)
        assert _handshake(clients[1], endpoint) == (zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)
        assert _handshake(clients[2], endpoint) == (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)
        assert auth.connections_refused == 1
        clients[0].send(b"within the cap")
        assert front.poll(int(REPLY_S * 1000)), "a NULL client within the cap was not heard"
        assert front.recv_multipart()[1] == b"within the cap"
        wait_until(lambda: auth.connections == 2, REPLY_S,
                   "the refused connection to be closed (2 live)")
        clients[0].close(linger=0)
        wait_until(lambda: auth.connections == 1, REPLY_S,
                   "the closed connection to be released (1 live)")
        late = ctx.socket(zmq.DEALER)
        late.linger = 0
        clients.append(late)
        assert _handshake(late, endpoint) == (zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)
        assert auth.connections == 2 and auth.connections_refused == 1
    finally:
        for sock in clients:
            sock.close(linger=0)
        front.close(linger=0)
        auth.stop()
        ctx.term()
