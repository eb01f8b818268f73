"""The sink's plain links (sink/links.py) on real Unix sockets: who may
attach, what is refused and counted, writes that never block, and ends."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from streamfence.protocol.codec import decode_untrusted, encode
from streamfence.sink.links import ATTACH_WITHIN_S, PENDING_MAX, TOKEN_TTL_S, Links


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


_OPENED: list[socket.socket] = []  # the test's client sockets, closed at its end


@pytest.fixture
def links(tmp_path: Path, clock: Clock) -> Iterator[Links]:
    made = Links(str(tmp_path / "events.link"), clock)
    try:
        yield made
    finally:
        made.close()
        while _OPENED:
            _OPENED.pop().close()


def _poll_until(links: Links, done: Callable[[], bool], what: str) -> list[bytes]:
    """Poll the links on each event of their epoll until `done()`; the
    listeners whose links ended meanwhile."""
    ended: list[bytes] = []
    deadline = time.monotonic() + 5.0
    while not done():
        left = deadline - time.monotonic()
        assert left > 0, f"timed out waiting for {what}"
        select.select([links.fileno()], [], [], left)
        ended += links.poll()
    return ended


def _connect(links: Links) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    _OPENED.append(sock)
    sock.settimeout(5.0)
    sock.connect(links.path)
    return sock


def _attach(links: Links, token: bytes) -> socket.socket:
    """Connect and attach with `token`; returns once the links took or refused it."""
    before = links.attached + links.refused
    sock = _connect(links)
    sock.sendall(encode({"v": 1, "op": "attach", "token": token}))
    _poll_until(links, lambda: links.attached + links.refused > before, "the attach's answer")
    return sock


def _closed(sock: socket.socket) -> bool:
    return sock.recv(1) == b""


def test_an_offered_token_attaches_and_the_listeners_frames_go_there(links: Links) -> None:
    sock = _attach(links, links.offer(b"L1"))
    assert decode_untrusted(sock.recv(64)) == {"v": 1, "op": "attached"}
    link = links.get(b"L1")
    assert link is not None and links.attached == 1
    frames = [encode({"op": "delta", "seq": n}) for n in range(1, 4)]
    for frame in frames:
        assert links.write(link, frame)
    want = b"".join(frames)
    got = b""
    while len(got) < len(want):
        got += sock.recv(4096)
    assert got == want  # the events socket's bytes, back to back
    sock.close()


@pytest.mark.parametrize("message", [
    {"v": 1, "op": "attach", "token": b"x" * 16},  # never offered
    {"v": 1, "op": "attach", "token": "not bytes"},
    {"v": 1, "op": "listen"},
    "garbage"])
def test_anything_but_an_offered_token_is_closed_and_counted(
        links: Links, message: object) -> None:
    links.offer(b"L1")
    sock = _connect(links)
    sock.sendall(encode(message) if message != "garbage" else b"\xc1\xc1\xc1")
    _poll_until(links, lambda: links.refused == 1, "the refusal")
    assert _closed(sock) and links.refused == 1 and links.get(b"L1") is None


def test_a_token_serves_once_and_a_newer_offer_voids_the_older(links: Links) -> None:
    first = links.offer(b"L1")
    second = links.offer(b"L1")
    stale = _attach(links, first)
    assert _closed(stale) and links.refused == 1
    good = _attach(links, second)
    assert decode_untrusted(good.recv(64))["op"] == "attached"
    again = _attach(links, second)
    assert _closed(again) and links.refused == 2
    good.close()


def test_an_expired_token_is_refused(links: Links, clock: Clock) -> None:
    token = links.offer(b"L1")
    clock.now += TOKEN_TTL_S
    assert _closed(_attach(links, token)) and links.refused == 1


def test_a_connection_silent_past_the_attach_time_is_closed(links: Links, clock: Clock) -> None:
    sock = _connect(links)
    _poll_until(links, lambda: links.due() is not None, "the connection to be accepted")
    clock.now += ATTACH_WITHIN_S
    links.tick()
    assert _closed(sock) and links.refused == 1 and links.due() is None


def test_unattached_connections_past_the_bound_are_closed_at_once(links: Links) -> None:
    for _ in range(PENDING_MAX):
        _connect(links)
    extra = _connect(links)
    _poll_until(links, lambda: links.refused == 1, "the extra connection's refusal")
    assert _closed(extra) and links.due() is not None


def test_a_slow_reader_fills_the_buffer_not_the_loop(links: Links) -> None:
    sock = _attach(links, links.offer(b"L1"))
    sock.recv(64)  # attached
    link = links.get(b"L1")
    assert link is not None
    frame = encode({"op": "delta", "data": "x" * 60_000})
    written = 0
    while not link.out:  # the kernel's buffer is full: the rest waits in the link's
        assert links.write(link, frame)
        written += len(frame)
    got = 0
    while got < written:
        got += len(sock.recv(1 << 20))
        links.poll()  # writable again: the buffer drains
    assert not link.out and got == written
    sock.close()


def test_a_link_the_client_closed_ends_and_its_listener_is_named(links: Links) -> None:
    sock = _attach(links, links.offer(b"L1"))
    sock.recv(64)
    sock.close()
    ended = _poll_until(links, lambda: links.get(b"L1") is None, "the link to end")
    assert ended == [b"L1"]


def test_a_newer_link_replaces_the_older(links: Links) -> None:
    old = _attach(links, links.offer(b"L1"))
    old.recv(64)
    new = _attach(links, links.offer(b"L1"))
    assert _closed(old) and decode_untrusted(new.recv(64))["op"] == "attached"
    assert links.attached == 2
    new.close()
