"""supervisor/replies.py over real ZeroMQ sockets: the bytes of large replies
queued to a connection that does not read are bounded, the requests past the
bound are answered `reply_backlog` and counted, and a connection that reads
again is served again. (Issue 29 item 2: 2,000 unread `result` replies of
0.88 MiB grew the supervisor by 3.2 GiB.)"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from streamfence.supervisor import replies
from streamfence.supervisor.replies import ReplyQueues
from tests.harness import wait_until

DONE = b"x" * 900_000  # the size of the done event


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes], bytes]]:
    """The daemon's kind of client socket, and a client connected to it that
    reads nothing until told to (its routing id: the third)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.linger = 0
    server.sndhwm = replies.SEND_HWM
    server.router_mandatory = True
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = ctx.socket(zmq.DEALER)
    client.linger = 0
    client.rcvhwm = 1
    client.connect(f"tcp://127.0.0.1:{port}")
    client.send(b"hello")
    assert server.poll(5000), "the client's first message did not arrive"
    identity, _ = server.recv_multipart()
    try:
        yield server, client, identity
    finally:
        client.close(linger=0)
        server.close(linger=0)
        ctx.term()


def _socket_buffers() -> int:
    """The most a loopback TCP connection's send and receive buffers hold."""
    return sum(int(Path(f"/proc/sys/net/ipv4/tcp_{b}").read_text().split()[2])
               for b in ("wmem", "rmem"))


def _answers(client: zmq.Socket[bytes]) -> list[bytes]:
    got = []
    while client.poll(200):
        got.append(client.recv())
    return got


def test_large_replies_to_a_connection_that_does_not_read_are_bounded(
        pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes], bytes]) -> None:
    server, client, identity = pair
    counters: Counter[str] = Counter()
    queues = ReplyQueues(server, counters)
    for n in range(200):
        queues.send(identity, DONE, f"r{n}")
    assert queues.total <= replies.CONNECTION_BYTES, queues.total
    refused = counters["refused.reply_backlog"]
    # Queued: the budget's worth, plus what libzmq's I/O thread wrote on
    # meanwhile into the loopback connection's kernel buffers (how much of
    # that it did depends on the machine's load).
    queued_max = (replies.CONNECTION_BYTES + _socket_buffers()) // len(DONE) + 1
    assert refused >= 200 - queued_max, counters

    answers = _answers(client)  # it reads at last: what was queued, then the refusals
    dones = [a for a in answers if a == DONE]
    errors = [msgpack.unpackb(a) for a in answers if a != DONE]
    assert len(dones) + len(errors) == 200 and len(errors) == refused, (len(dones), counters)
    assert {e["code"] for e in errors} == {"reply_backlog"}, errors[0]
    assert "not read yet" in errors[0]["message"], errors[0]

    # Read, its replies were written: it gets large replies again.
    wait_until(lambda: queues.queued_to(identity) == 0, 10,
               "the replies it read to be forgotten")
    queues.send(identity, DONE, "again")
    assert _answers(client) == [DONE] and counters["refused.reply_backlog"] == refused


def test_small_replies_past_the_queue_are_dropped_and_counted(
        pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes], bytes]) -> None:
    server, _, identity = pair
    counters: Counter[str] = Counter()
    queues = ReplyQueues(server, counters)
    small = b"y" * (replies.TRACK_BYTES - 1)
    sent = 0
    # The kernel's buffers take some MiB first, then the socket's queue its SEND_HWM.
    while not counters["replies_dropped.unread"] and sent < 100_000:
        queues.send(identity, small, None)
        sent += 1
    assert counters["replies_dropped.unread"] == 1, (sent, counters)
    queues.send(b"nobody", small, None)  # a connection that is gone
    assert counters["replies_dropped.gone"] == 1, counters
