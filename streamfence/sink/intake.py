"""The worker wire's two doors and the per-delta hot path.

Workers write T_DELTA, T_FINAL and T_HELLO (protocol/internal/worker_wire.py) on their AF_UNIX
stream connections (`drain_streams`, sink/streams.py); the ROUTER `sink.in`
takes the same messages as ZeroMQ frames, for tests and tools
(`drain_in`). Both doors decode before `_take`.

Per delta (`_take`): the fence check (`FenceTable.check`); on ACCEPT the
call's next public seq, the public delta event built from pre-encoded
pieces, queued for the store (`LiveCall.pending`, the call listed in
`Commits.dirty`) and the content accumulated. Nothing per delta for the
listeners: the commit hands each call's run to them whole
(`Commits.flush_pending`). `_take` is
one flat loop on purpose: an integer tag test, a dict lookup in the fence,
list appends and pre-encoded byte pieces, every bound method a local.
Refused deltas and bad frames are counted (sink/counters.py), never fatal;
anything that is not a delta (a final, a hello, garbage) goes out of line.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import msgpack
import zmq

from streamfence.protocol.codec import decode_untrusted
from streamfence.protocol.errors import ProtocolError
from streamfence.protocol.failpoints import ARMED, failpoint
from streamfence.protocol.internal import T_DELTA, T_HELLO
from streamfence.protocol.internal.checks import BadFrame
from streamfence.protocol.internal.worker_wire import (
    TOOL_CALL,
    check_tool_fragment,
    parse_final,
    parse_hello,
)
from streamfence.sink.event_pieces import KIND_TAIL
from streamfence.sink.fence import Verdict
from streamfence.sink.routers import resync, send
from streamfence.sink.state import SinkState
from streamfence.sink.streams import READ_BYTES, WorkerStreams

_ACCEPT = Verdict.ACCEPT
_PARSE_ERRORS = (ValueError, TypeError, KeyError, IndexError, msgpack.UnpackException)
_STREAM_ERRORS = (ValueError, msgpack.UnpackException, msgpack.BufferFull, RecursionError)


class WorkerIntake:
    """Reads the worker wire's doors (`sin`, `streams`: the Sink owns and
    closes them) into the state's calls, commit schedule and counters."""

    def __init__(self, sin: zmq.Socket[bytes], streams: WorkerStreams, state: SinkState) -> None:
        self._sin = sin
        self._streams = streams
        self._state = state
        # What the hot path works on, bound once: each stays the same object for
        # the process (`dirty` is only ever changed in place).
        self._commits, self._counters = state.commits, state.counters
        self._check = state.calls.fence.check
        self._lives = state.calls.lives
        self._dirty_append = state.commits.dirty.append
        self._pack = msgpack.Packer(use_bin_type=True, datetime=False).pack

    def _out_of_line(self, msg: Any, reply: Callable[[bytes], bool]) -> None:
        """Anything from a worker that is not a well-formed delta: a final, a
        hello, or garbage."""
        state = self._state
        try:
            if msg[0] == T_HELLO:
                state.rebinds.hello(parse_hello(msg), reply)
                return
            final = parse_final(msg)
        except BadFrame as exc:
            self._counters.bad_frame("in", exc.reason)
            return
        state.fencing.final(final, functools.partial(self._ack, reply))

    def _ack(self, reply: Callable[[bytes], bool], ack: bytes) -> None:
        """A final's ack, to the worker that sent it."""
        if ARMED and failpoint("sink.before_final_ack"):
            return  # the ack is lost
        if not reply(ack):
            # The worker exited without waiting for its ack (it will count the
            # attempt as unfinished); the supervisor has E_ENDED anyway.
            self._counters.acks_unroutable += 1

    def _take(self, msgs: Iterable[Any], reply: Callable[[bytes], bool]) -> None:
        """Decoded worker messages from one sender (the per-delta hot path, a
        loop with locals on purpose: module docstring); `reply` sends a
        final's ack back."""
        commits, counters = self._commits, self._counters
        check = self._check
        lives = self._lives
        pack = self._pack
        tails = KIND_TAIL
        dirty_append = self._dirty_append
        n = 0
        try:
            for msg in msgs:
                try:
                    tag = msg[0]
                    if tag != T_DELTA or type(tag) is not int:
                        # Out of line (finals, garbage). It may commit: settle
                        # the counters first.
                        commits.pending_events += n
                        counters.accepted += n
                        n = 0
                        self._out_of_line(msg, reply)
                        continue
                    # worker_wire.parse_delta's checks, inline: a call per
                    # delta would cost about a quarter of the parse.
                    _, call, attempt, seq, kind, data = msg
                    tail = tails[kind]
                    if type(call) is not str or type(attempt) is not int \
                            or type(seq) is not int:
                        raise TypeError
                    if kind == TOOL_CALL:
                        check_tool_fragment(data)
                    elif type(data) is not str:
                        raise TypeError
                except _PARSE_ERRORS:
                    counters.bad_frame("in", "malformed T_DELTA")
                    continue
                verdict = check(call, attempt, seq)
                if verdict is not _ACCEPT:
                    counters.drop(call, attempt, seq, verdict)
                    continue
                live = lives[call]
                pseq = live.seq + 1
                live.seq = pseq
                event = live.prefix + pack(pseq) + tail + pack(data)
                pending = live.pending
                if not pending:
                    live.pending_seq = pseq
                    dirty_append(live)
                pending.append(event)
                live.add[kind](data)
                n += 1
        finally:
            commits.pending_events += n
            counters.accepted += n

    def drain_streams(self) -> bool:
        """The workers' stream connections: every message that arrived. True if
        the input ran dry (no connection filled its read)."""
        idle = True
        streams = self._streams
        for conn, data in streams.ready():
            idle = idle and len(data) < READ_BYTES
            try:
                conn.unpacker.feed(data)  # BufferFull: a message over the frame limit
                self._take(conn.unpacker, conn.send)
            except _STREAM_ERRORS:
                self._counters.bad_frame(
                    "in", "a worker's stream cannot be framed (not msgpack, or a message over "
                          "the frame limit); connection closed")
                streams.drop(conn)
        return idle

    def drain_in(self, budget: int) -> bool:
        """The ZeroMQ door of the worker wire (`sink.in`, kept beside the
        stream socket that workers use): up to `budget` single-frame messages.
        True if the input ran dry."""
        sock = self._sin
        counters = self._counters
        for _ in range(budget):
            try:
                ident = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            try:
                frame = sock.recv(zmq.NOBLOCK)  # never block: a message arrives whole
            except zmq.Again:
                counters.bad_frame("in", "lone frame (a misaligned multi-part message)")
                return True
            if resync(sock):
                counters.bad_frame("in", "more than one frame")
                continue
            try:
                msg = decode_untrusted(frame)
            except ProtocolError as exc:
                counters.bad_frame("in", exc.message)
                continue
            self._take((msg,), functools.partial(send, sock, ident))
        return False
