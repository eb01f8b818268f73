"""The readiness notification (supervisor/notify.py) on real AF_UNIX datagram
sockets: a path, an abstract name ('@'), none, and one nobody listens on."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator

import pytest

from streamfence.supervisor.notify import Notifier


@pytest.fixture
def short_dir() -> Iterator[str]:
    """A directory with a path short enough for a unix socket."""
    path = tempfile.mkdtemp(prefix="sfn")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _listener(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5.0)  # a missing datagram fails the test instead of hanging it
    return sock


def _received(sock: socket.socket) -> list[str]:
    try:
        return sock.recv(4096).decode().split("\n")
    except TimeoutError:
        pytest.fail("no notification arrived within 5 s")


def test_ready_then_stopping_each_once_on_a_path(short_dir: str) -> None:
    address = os.path.join(short_dir, "notify")
    env = {"NOTIFY_SOCKET": address}
    with _listener(address) as sock:
        notifier = Notifier(env)
        assert "NOTIFY_SOCKET" not in env  # the children must not inherit it
        notifier.ready("serving on\ntcp://x")
        notifier.ready("again")
        notifier.stopping("stopping")
        notifier.stopping("again")
        assert _received(sock) == ["READY=1", "STATUS=serving on tcp://x"]
        assert _received(sock) == ["STOPPING=1", "STATUS=stopping"]
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(4096)  # nothing sent twice


def test_an_abstract_socket_name() -> None:
    name = f"streamfence-test-{os.getpid()}-{os.urandom(4).hex()}"
    with _listener("\0" + name) as sock:
        Notifier({"NOTIFY_SOCKET": "@" + name}).ready("up")
        assert _received(sock) == ["READY=1", "STATUS=up"]


def test_without_notify_socket_nothing_is_sent() -> None:
    notifier = Notifier({})
    notifier.ready("up")
    notifier.stopping("down")


def test_a_socket_nobody_listens_on_is_a_warning_not_an_error(
        short_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "streamfence.supervisor")
    Notifier({"NOTIFY_SOCKET": os.path.join(short_dir, "absent")}).ready("up")
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "could not notify the service manager (NOTIFY_SOCKET)"]
