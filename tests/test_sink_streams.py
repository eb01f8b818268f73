"""The worker wire's stream door: the real sink process, workers' AF_UNIX
stream connections (the real SinkChannel and raw sockets), the test playing
the supervisor on sink.ctl (tests/test_sink_process.py's harness)."""

from __future__ import annotations

import socket
import threading
from typing import Any

import msgpack

from streamfence.protocol.codec import encode
from streamfence.protocol.internal import C_AUTHORIZE, E_ENDED, T_FINAL_ACK
from streamfence.workers.sink_channel import SinkChannel
from tests.test_sink_process import WAIT_S, SinkUnderTest, delta, final, sink

__all__ = ["sink"]  # the fixture, re-used from the harness module


def _raw(sink: SinkUnderTest) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(WAIT_S)
    conn.connect(sink.ep.sink_stream)
    return conn


def test_deltas_and_final_over_a_stream_are_fenced_stored_and_acked(sink: SinkUnderTest) -> None:
    sink.sup.attempt_stats(C_AUTHORIZE, "c", 1, False, "m")
    channel = SinkChannel(sink.ep.sink_stream)
    try:
        for seq in range(1, 4):
            channel.send(delta("c", 1, seq, f"t{seq}"))
        channel.send(final("c", 1, 3))
        ack = channel.wait_reply(WAIT_S)
    finally:
        channel.close()
    assert ack is not None and ack[:4] == [T_FINAL_ACK, "c", 1, True]
    assert [e["data"] for e in sink.events("c", 3)] == ["t1", "t2", "t3"]
    sink.sup.wait(E_ENDED, "c", "the accepted final")
    assert [e["data"] for e in sink.transcript("c")] == ["t1", "t2", "t3"]


def test_messages_split_and_joined_arbitrarily_are_each_taken_once(sink: SinkUnderTest) -> None:
    sink.sup.attempt_stats(C_AUTHORIZE, "s", 1, False, "m")
    data = b"".join(delta("s", 1, seq, "x" * seq) for seq in range(1, 201)) + final("s", 1, 200)
    conn = _raw(sink)
    try:
        for i in range(0, len(data), 7):  # 7-byte pieces: messages cut anywhere
            conn.sendall(data[i:i + 7])
        ack = msgpack.unpackb(conn.recv(65536))
    finally:
        conn.close()
    assert ack[:4] == [T_FINAL_ACK, "s", 1, True]
    assert [len(e["data"]) for e in sink.transcript("s")] == list(range(1, 201))


def test_garbage_closes_only_its_connection_and_is_counted(sink: SinkUnderTest) -> None:
    sink.sup.attempt_stats(C_AUTHORIZE, "g", 1, False, "m")
    bad = _raw(sink)
    good = _raw(sink)
    try:
        bad.sendall(b"\xc1" * 16)  # 0xc1: never valid msgpack
        assert bad.recv(1) == b"", "the sink keeps a connection it cannot frame"
        good.sendall(delta("g", 1, 1) + encode(["not", "a delta"]) + final("g", 1, 1))
        ack = msgpack.unpackb(good.recv(65536))
    finally:
        bad.close()
        good.close()
    assert ack[:4] == [T_FINAL_ACK, "g", 1, True]
    stats = sink.sup.wait_stats(lambda s: s["bad_frames"]["in"] >= 2, "two bad frames counted")
    assert stats["bad_frames"]["in"] == 2 and len(sink.transcript("g")) == 1


def test_a_channel_queues_until_the_sink_listens(tmp_path: Any) -> None:
    """Sent before anyone listens: kept in order, written once the sink is there."""
    path = str(tmp_path / "s.stream")
    channel = SinkChannel(path)
    channel.send(b"\x01")
    channel.send(b"\x02")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    got = bytearray()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(WAIT_S)
            while len(got) < 2:
                got.extend(conn.recv(10))
            conn.sendall(msgpack.packb([T_FINAL_ACK, "c", 1, True, ""]))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        assert channel.wait_reply(WAIT_S) == [T_FINAL_ACK, "c", 1, True, ""]
    finally:
        channel.close()
        thread.join(WAIT_S)
        listener.close()
    assert bytes(got) == b"\x01\x02"


def test_a_message_over_the_frame_limit_closes_its_connection(sink: SinkUnderTest) -> None:
    conn = _raw(sink)
    try:
        conn.sendall(b"\xc6" + (64 << 20).to_bytes(4, "big"))  # bin32 header: a 64 MiB blob
        conn.sendall(b"\x00" * (17 << 20))  # past the 16 MiB limit, not yet the whole blob
        assert conn.recv(1) == b"", "the sink buffers past its frame limit"
    except (BrokenPipeError, ConnectionResetError):
        pass  # closed while we were still writing: the same verdict
    finally:
        conn.close()
    sink.sup.wait_stats(lambda s: s["bad_frames"]["in"] >= 1, "the oversized message counted")
