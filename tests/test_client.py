"""streamfence.protocol.client against a real ZeroMQ ROUTER peer with scripted replies.

The peer runs in a thread on an ipc:// endpoint under tmp_path and binds both
of the daemon's sockets: the client endpoint and its events endpoint
(`events_endpoint`). On the client endpoint it decodes each request like the
daemon (decode_untrusted; an undecodable frame gets an `error` with ref nil),
records it, and sends whatever the test's handler returns: replies there,
pushed events (`delta`/`reset`/`done` without a ref) on the events socket to
the listener the client named in its submit/subscribe, interleaved at will.
On the events socket it answers `listen` with `listening` (after
`listen_delay_s`; never with None), like the sink. Every socket is created
through a tracking context and must be closed in teardown; every thread is
joined; an event the peer could not route to a connected listener fails the
test.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from time import monotonic
from typing import Any

import pytest
import zmq
import zmq.asyncio

from streamfence.protocol.client import AsyncClient, CallFailed, Client, ClientError
from streamfence.protocol.client_effects import Wait
from streamfence.protocol.client_router import ANY, LISTENING, Router
from streamfence.protocol.codec import DEFAULT_MAX_FRAME, decode_untrusted, encode
from streamfence.protocol.errors import ErrorCode, ProtocolError
from streamfence.protocol.messages import (
    CallStatus,
    accepted_msg,
    delta_event,
    done_event,
    empty_response,
    error_msg,
    events_endpoint,
    listening_msg,
    parse_listener_msg,
    parse_request,
    reset_event,
)
from tests.harness import wait_until

Out = dict[str, Any] | bytes | list[bytes]
Handler = Callable[[dict[str, Any]], list[Out]]
EVENT_OPS = ("delta", "reset", "done")


# ---- the scripted peer and the fixtures ------------------------------------------

class TrackingContext(zmq.Context):  # type: ignore[type-arg]
    tracked: list[Any]

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "tracked", [])  # pyzmq's setattr would take it for an option

    def socket(self, *args: Any, **kwargs: Any) -> Any:
        sock = super().socket(*args, **kwargs)
        self.tracked.append(sock)
        return sock


class TrackingAsyncContext(zmq.asyncio.Context):
    tracked: list[Any]

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "tracked", [])  # pyzmq's setattr would take it for an option

    def socket(self, *args: Any, **kwargs: Any) -> Any:
        sock = super().socket(*args, **kwargs)
        self.tracked.append(sock)
        return sock


def is_event(out: Out) -> bool:
    """A pushed event: it goes on the events socket, to a listener."""
    return isinstance(out, dict) and "ref" not in out and out.get("op") in EVENT_OPS


class Peer:
    """The daemon's two ROUTERs in a thread: requests answered with `handler(msg)`,
    `listen` with `listening`, events sent to the request's listener."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, handler: Handler,
                 max_frame: int = DEFAULT_MAX_FRAME, listen_delay_s: float | None = 0.0) -> None:
        self.received: list[dict[str, Any]] = []  # requests and listens, in arrival order
        self.timeline: list[tuple[float, str]] = []  # (monotonic, "got OP" | "sent listening")
        self.listen_ids: list[bytes] = []  # the routing id of each `listen`
        self.unroutable: list[tuple[bytes | None, Out]] = []  # events no listener took
        self.pushed = 0  # events pushed (sent, or unroutable)
        self.subscribes_answered = 0  # subscribes whose events were all pushed
        self._ctx, self._endpoint, self._handler = ctx, endpoint, handler
        self._max_frame = max_frame
        self._listen_delay_s = listen_delay_s
        self._listener_of: dict[bytes, bytes] = {}  # request identity -> its listener
        self._lock = threading.Lock()
        self._ready, self._stop = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="peer", daemon=True)
        self._thread.start()
        assert self._ready.wait(5), "peer did not bind"

    def ops(self) -> list[str]:
        with self._lock:
            return [m.get("op", "?") for m in self.received]

    def of_op(self, op: str) -> list[dict[str, Any]]:
        with self._lock:
            return [m for m in self.received if m.get("op") == op]

    def _note(self, what: str) -> None:
        with self._lock:
            self.timeline.append((monotonic(), what))

    def _answer(self, ident: bytes, frames: list[bytes]) -> list[Out]:
        if len(frames) != 1:
            return [error_msg(None, ErrorCode.BAD_FRAME, f"{len(frames)} frames, not 1")]
        try:
            msg = decode_untrusted(frames[0], self._max_frame)
        except ProtocolError as exc:
            return [error_msg(None, exc.code, exc.message)]
        with self._lock:
            self.received.append(msg)
        self._note(f"got {msg.get('op')}")
        listener = msg.get("listener")
        if isinstance(listener, str):
            self._listener_of[ident] = listener.encode()
        return self._handler(msg)

    def _on_events_socket(self, ev: zmq.Socket[bytes], due: list[tuple[float, bytes]]) -> None:
        ident, *frames = ev.recv_multipart()
        try:
            if len(frames) != 1:
                raise ProtocolError(ErrorCode.BAD_FRAME, f"{len(frames)} frames, not 1")
            msg = decode_untrusted(frames[0], self._max_frame)
            read = parse_listener_msg(msg)
        except ProtocolError as exc:
            ev.send_multipart([ident, encode(error_msg(None, exc.code, exc.message))])
            return
        if read is not None:
            return  # an ack: this fake daemon sends little, it needs none
        with self._lock:
            self.received.append(msg)
            self.listen_ids.append(ident)
        self._note("got listen")
        if self._listen_delay_s is not None:
            due.append((monotonic() + self._listen_delay_s, ident))

    def _push(self, ev: zmq.Socket[bytes], listener: bytes | None, event: Out) -> None:
        sent = False
        if listener is not None:
            try:
                ev.send_multipart([listener, encode(event)])
                sent = True
            except zmq.ZMQError:  # ROUTER_MANDATORY: that listener is not connected
                pass
        with self._lock:
            if not sent:
                self.unroutable.append((listener, event))
            self.pushed += 1

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        ev = self._ctx.socket(zmq.ROUTER)
        due: list[tuple[float, bytes]] = []  # `listening` answers to send, and when
        try:
            for s in (sock, ev):
                s.setsockopt(zmq.LINGER, 0)
            ev.setsockopt(zmq.ROUTER_MANDATORY, 1)  # like the sink: unknown listeners are seen
            sock.bind(self._endpoint)
            ev.bind(events_endpoint(self._endpoint))
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(ev, zmq.POLLIN)
            self._ready.set()
            while not self._stop.is_set():
                ready = dict(poller.poll(10))
                now = monotonic()
                for when, ident in [d for d in due if d[0] <= now]:
                    due.remove((when, ident))
                    ev.send_multipart([ident, encode(listening_msg())])
                    self._note("sent listening")
                if ev in ready:
                    self._on_events_socket(ev, due)
                if sock not in ready:
                    continue
                ident, *frames = sock.recv_multipart()
                known = len(self.received)
                for out in self._answer(ident, frames):
                    if is_event(out):
                        self._push(ev, self._listener_of.get(ident), out)
                    elif isinstance(out, dict):
                        sock.send_multipart([ident, encode(out)])
                    elif isinstance(out, bytes):
                        sock.send_multipart([ident, out])
                    else:
                        sock.send_multipart([ident, *out])
                if len(self.received) > known and self.received[-1].get("op") == "subscribe":
                    with self._lock:
                        self.subscribes_answered += 1
        except BaseException as exc:
            self.error = exc
        finally:
            sock.close(linger=0)
            ev.close(linger=0)
            self._ready.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        assert not self._thread.is_alive(), "peer thread did not stop"


class Env:
    def __init__(self, tmp_path: Path) -> None:
        path = tmp_path / "d.sock"
        if len(str(path)) > 90:  # the ipc path limit is about 107 bytes
            path = Path(tempfile.mkdtemp(prefix="sfc")) / "d.sock"
        self.endpoint = f"ipc://{path}"
        self.ctx = TrackingContext()
        self.actx = TrackingAsyncContext()
        self.peers: list[Peer] = []
        self.clients: list[Client | AsyncClient] = []

    def peer(self, handler: Handler, max_frame: int = DEFAULT_MAX_FRAME,
             listen_delay_s: float | None = 0.0) -> Peer:
        p = Peer(self.ctx, self.endpoint, handler, max_frame, listen_delay_s)
        self.peers.append(p)
        return p

    def client(self, timeout_s: float = 2.0) -> Client:
        c = Client(self.endpoint, timeout_s, context=self.ctx)
        self.clients.append(c)
        return c

    def aclient(self, timeout_s: float = 2.0) -> AsyncClient:
        c = AsyncClient(self.endpoint, timeout_s, context=self.actx)
        self.clients.append(c)
        return c

    def teardown(self) -> None:
        # A subscribe is not acknowledged: a client can read its call's done (pushed
        # for the submit) and be closed before the peer pushed the subscribe's replay,
        # which would then find no listener. Wait for the peers to answer them all.
        sent = sum(c._core.subscribes for c in self.clients)
        wait_until(lambda: sum(p.subscribes_answered for p in self.peers) >= sent, 5.0,
                   f"the peers to answer the clients' {sent} subscribes")
        for c in self.clients:
            c.close()
        for p in self.peers:
            p.stop()
        for ctx in (self.ctx, self.actx):
            leaked = [s for s in ctx.tracked if not s.closed]
            assert not leaked, f"sockets left open: {leaked}"
            ctx.term()
        errors = [p.error for p in self.peers if p.error is not None]
        if errors:
            raise errors[0]
        lost = [u for p in self.peers for u in p.unroutable]
        assert not lost, f"events the peer could not send to a connected listener: {lost}"


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = Env(tmp_path)
    try:
        yield e
    finally:
        e.teardown()


# ---- message helpers ---------------------------------------------------------------

def reply(msg: dict[str, Any], op: str, **fields: Any) -> dict[str, Any]:
    return {"v": 1, "op": op, "ref": msg["ref"], **fields}


def delta(call_id: str, seq: int, text: str = "x", kind: str = "text",
          attempt: int = 1) -> dict[str, Any]:
    return delta_event(call_id, attempt, seq, kind, text)


def done(call_id: str, seq: int, status: CallStatus = CallStatus.COMPLETED,
         error: dict[str, Any] | None = None) -> dict[str, Any]:
    return done_event(call_id, seq, status, empty_response(), error, 1)


def seqs(events: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(e["op"], e["seq"]) for e in events]


def accept_as(call_id: str, *then: Out) -> Handler:
    """A handler that accepts every submit as `call_id` and then sends `then`."""
    def handle(msg: dict[str, Any]) -> list[Out]:
        if msg["op"] == "submit":
            return [accepted_msg(msg["ref"], call_id), *then]
        return []
    return handle


# ---- requests and replies ------------------------------------------------------------

def test_submit_sends_a_valid_request_and_returns_the_call_id(env: Env) -> None:
    peer = env.peer(accept_as("c1"))
    c = env.client()
    assert c.submit("openai", {"model": "m", "messages": []}, session_id="s1",
                    options={"stale_timeout_s": 5, "on_partial": "restart"}) == "c1"
    assert c.submit("openai", {"model": "m"}, idempotency_key="k", subscribe=False) == "c1"
    first, second = peer.of_op("submit")
    # subscribed: the listener is the events connection's routing id; not: no listener
    (listen_id,) = peer.listen_ids
    assert first["v"] == 1 and first["listener"] == listen_id.decode()
    assert "listener" not in second
    assert "subscribe" not in first and "subscribe" not in second
    assert first["call"] == {"provider": "openai", "request": {"model": "m", "messages": []},
                             "session_id": "s1",
                             "options": {"stale_timeout_s": 5, "on_partial": "restart"}}
    assert "session_id" not in second["call"] and "options" not in second["call"]
    assert first["ref"] != second["ref"] and len(first["ref"]) == 32
    assert parse_request(first).listener == listen_id.decode()  # type: ignore[union-attr]
    assert parse_request(second).listener is None  # type: ignore[union-attr]


def test_error_reply_raises_client_error_with_code_and_message(env: Env) -> None:
    env.peer(lambda m: [error_msg(m["ref"], ErrorCode.UNKNOWN_PROVIDER, "no profile 'x'")])
    with pytest.raises(ClientError) as info:
        env.client().submit("x", {"model": "m"})
    assert info.value.code == "unknown_provider" and info.value.message == "no profile 'x'"
    assert info.value.reply is not None and info.value.reply["op"] == "error"


def test_invalid_request_is_refused_locally_without_sending(env: Env) -> None:
    peer = env.peer(lambda m: [reply(m, "status_reply")])
    c = env.client()
    with pytest.raises(ClientError, match=r"call\.request\.stream") as info:
        c.submit("openai", {"model": "m", "stream": True})
    assert info.value.code == "bad_message"
    with pytest.raises(ClientError, match="max_attempts"):
        c.submit("openai", {"model": "m"}, options={"max_attempts": 0})
    c.status()
    assert peer.ops() == ["status"]


def test_replies_are_matched_by_ref_and_strays_are_buffered_or_dropped(env: Env) -> None:
    def handle(msg: dict[str, Any]) -> list[Out]:
        return [{"v": 1, "op": "status_reply", "ref": "somebody-else"}, delta("c9", 1),
                done("c9", 2), reply(msg, "status_reply", workers=3)]
    def handle_or_follow(msg: dict[str, Any]) -> list[Out]:
        return [] if msg["op"] == "subscribe" else handle(msg)  # its events come with the status
    peer = env.peer(handle_or_follow)
    c = env.client()
    c.subscribe("c9")
    status = c.status()
    assert status["workers"] == 3 and status["ref"] == peer.of_op("status")[-1]["ref"]
    assert seqs(list(c.events("c9", timeout_s=1))) == [("delta", 1), ("done", 2)]


def test_a_late_reply_to_a_request_that_timed_out_is_discarded(env: Env) -> None:
    first_ref: list[str] = []

    def handle(msg: dict[str, Any]) -> list[Out]:
        if not first_ref:
            first_ref.append(msg["ref"])
            return []  # answer nothing: the client times out
        return [{"v": 1, "op": "status_reply", "ref": first_ref[0], "late": True},
                reply(msg, "status_reply", late=False)]
    env.peer(handle)
    c = env.client(timeout_s=0.2)
    t0 = monotonic()
    with pytest.raises(TimeoutError) as info:
        c.status()
    assert 0.2 <= monotonic() - t0 < 2
    text = str(info.value)
    assert "status" in text and first_ref[0] in text and env.endpoint in text and "0.2 s" in text
    assert c.status()["late"] is False


def test_result_pending_then_done(env: Env) -> None:
    answers = iter(["pending", "done"])

    def handle(msg: dict[str, Any]) -> list[Out]:
        if next(answers) == "pending":
            return [reply(msg, "pending", call_id="c1")]
        return [{**done("c1", 3), "ref": msg["ref"]}]
    peer = env.peer(handle)
    c = env.client()
    assert c.result("c1") is None
    got = c.result("c1", wait_s=0.5)
    assert got is not None and got["op"] == "done" and got["status"] == "completed"
    assert [m["wait_s"] for m in peer.of_op("result")] == [0.0, 0.5]


def test_cancel_and_status_replies(env: Env) -> None:
    def handle(msg: dict[str, Any]) -> list[Out]:
        if msg["op"] == "cancel":
            return [reply(msg, "cancelling", call_id=msg["call_id"])]
        return [reply(msg, "pending", call_id="c1")]  # the wrong op for a status
    env.peer(handle)
    c = env.client()
    assert c.cancel("c1")["op"] == "cancelling"
    with pytest.raises(ClientError, match="unexpected reply op 'pending' to status") as info:
        c.status()
    assert info.value.code == "bad_reply"


def test_unknown_call_error_on_result(env: Env) -> None:
    env.peer(lambda m: [error_msg(m["ref"], ErrorCode.UNKNOWN_CALL, "no call 'zz'")])
    with pytest.raises(ClientError) as info:
        env.client().result("zz")
    assert info.value.code == "unknown_call"


# ---- raw requests and errors without a ref ------------------------------------------

def test_request_sends_odd_maps_as_they_are(env: Env) -> None:
    def handle(msg: dict[str, Any]) -> list[Out]:
        try:
            parse_request(msg)
        except ProtocolError as exc:
            ref = msg.get("ref") if isinstance(msg.get("ref"), str) else None
            return [error_msg(ref, exc.code, exc.message)]
        return [reply(msg, "status_reply")]
    env.peer(handle)
    c = env.client()
    got = c.request({"v": 1, "op": "frobnicate", "ref": "odd-1"})
    assert got == error_msg("odd-1", ErrorCode.UNKNOWN_OP, "unknown op 'frobnicate'")
    no_ref = c.request({"v": 1, "op": "status"})
    assert no_ref["ref"] is None and no_ref["message"] == "field 'ref' is missing"
    int_ref = c.request({"v": 1, "op": "status", "ref": 5})
    assert int_ref["ref"] is None and "'ref' must be a string" in int_ref["message"]
    assert c.request({"v": 2, "op": "status", "ref": "r"})["code"] == "unsupported_version"


def test_request_raw_gets_the_unattributed_error(env: Env) -> None:
    env.peer(lambda m: [], max_frame=64)
    c = env.client()
    assert c.request_raw(b"\xc1")["code"] == "bad_frame"
    assert c.request_raw([encode({"v": 1}), b"x"])["code"] == "bad_frame"
    assert c.request_raw(b"\x00" * 65)["code"] == "too_large"


def test_an_error_without_ref_answers_the_only_outstanding_request(env: Env) -> None:
    env.peer(lambda m: [], max_frame=1024)
    with pytest.raises(ClientError) as info:
        env.client().submit("openai", {"model": "m", "messages": ["x" * 2000]})
    assert info.value.code == "too_large"


@pytest.mark.parametrize("garbage", [b"\xc1", [b"a", b"b"], encode([1, 2])],
                         ids=["undecodable", "two-frames", "not-a-map"])
def test_garbage_from_the_daemon_fails_loudly(env: Env, garbage: Out) -> None:
    env.peer(lambda m: [garbage])
    with pytest.raises(ClientError) as info:
        env.client(timeout_s=1).status()
    assert info.value.code == "bad_reply"


def test_closed_client_refuses_and_close_is_idempotent(env: Env) -> None:
    env.peer(lambda m: [])
    with env.client() as c:
        pass
    c.close()
    with pytest.raises(RuntimeError, match="closed"):
        c.status()


# ---- events ----------------------------------------------------------------------------

def test_events_before_the_accept_are_buffered_sorted_and_deduplicated(env: Env) -> None:
    def handle(msg: dict[str, Any]) -> list[Out]:
        if msg["op"] != "submit":  # a probe's subscribe (under load) gets nothing
            return []  # more: sent again, the events could find the client closed
        return [delta("c1", 2, "b"), delta("c1", 1, "a"), accepted_msg(msg["ref"], "c1"),
                delta("c1", 1, "a"), reset_event("c1", 2, 3), delta("c1", 4, "c", attempt=2),
                done("c1", 5), delta("c1", 6, "after done")]
    peer = env.peer(handle)
    c = env.client()
    call_id = c.submit("openai", {"model": "m"})
    events = list(c.events(call_id, timeout_s=1))
    assert seqs(events) == [("delta", 1), ("delta", 2), ("reset", 3), ("delta", 4), ("done", 5)]
    assert [e.get("data") for e in events[:2]] == ["a", "b"]
    assert c.last_seq(call_id) == 5
    # The delta after the done reaches the open client (which drops it) before the
    # test ends: pushed later (a loaded machine), it would find the client closed.
    wait_until(lambda: peer.pushed >= 7, 5.0, "the peer to push every event")
    assert list(c.events(call_id, timeout_s=1)) == []  # each event is handed out once


def test_events_interleaved_with_replies_to_other_requests(env: Env) -> None:
    def handle(msg: dict[str, Any]) -> list[Out]:
        op = msg["op"]
        if op == "submit":
            return [accepted_msg(msg["ref"], "c1"), delta("c1", 1)]
        if op == "status":
            return [delta("c1", 2), reply(msg, "status_reply"), delta("c1", 3)]
        if op == "result":
            return [delta("c1", 4), reply(msg, "pending", call_id="c1")]
        return [reply(msg, "cancelling", call_id="c1"), done("c1", 5, CallStatus.CANCELLED)]
    env.peer(handle)
    c = env.client()
    call_id = c.submit("openai", {"model": "m"})
    c.status()
    assert c.result(call_id) is None
    assert c.cancel(call_id)["op"] == "cancelling"
    events = list(c.events(call_id, timeout_s=1))
    assert seqs(events) == [("delta", 1), ("delta", 2), ("delta", 3), ("delta", 4), ("done", 5)]
    assert events[-1]["status"] == "cancelled"


def test_events_timeout_names_the_call(env: Env) -> None:
    env.peer(accept_as("c-quiet", delta("c-quiet", 1)))
    c = env.client()
    call_id = c.submit("openai", {"model": "m"})
    it = c.events(call_id, timeout_s=0.2)
    assert next(it)["seq"] == 1
    t0 = monotonic()
    with pytest.raises(TimeoutError) as info:
        next(it)
    assert 0.2 <= monotonic() - t0 < 2
    assert "call c-quiet" in str(info.value) and "0.2 s" in str(info.value)
    assert "last seq received: 1" in str(info.value)


def test_subscribe_from_seq_resumes_after_it(env: Env) -> None:
    def handle(msg: dict[str, Any]) -> list[Out]:
        # a replay that (wrongly) starts one early: the client drops seq 2
        return [delta("c1", 2), delta("c1", 3), done("c1", 4)]
    peer = env.peer(handle)
    c = env.client()
    c.subscribe("c1", from_seq=2)
    assert seqs(list(c.events("c1", timeout_s=1))) == [("delta", 3), ("done", 4)]
    assert peer.of_op("subscribe")[0]["from_seq"] == 2


def test_a_reconnecting_program_resumes_from_last_seq(env: Env) -> None:
    def handle(msg: dict[str, Any]) -> list[Out]:
        if msg["op"] == "submit":
            return [accepted_msg(msg["ref"], "c1"), delta("c1", 1), delta("c1", 2)]
        first = msg["from_seq"] + 1
        return [*(delta("c1", s) for s in range(first, 4)), done("c1", 4)]
    peer = env.peer(handle)
    old = env.client()
    call_id = old.submit("openai", {"model": "m"})
    it = old.events(call_id, timeout_s=1)
    assert [next(it)["seq"], next(it)["seq"]] == [1, 2]
    resume_at = old.last_seq(call_id)
    old.close()
    new = env.client()
    new.subscribe(call_id, from_seq=resume_at)
    assert seqs(list(new.events(call_id, timeout_s=1))) == [("delta", 3), ("done", 4)]
    assert peer.of_op("subscribe")[-1]["from_seq"] == 2


def test_subscribe_error_is_raised_by_events(env: Env) -> None:
    env.peer(lambda m: [error_msg(m["ref"], ErrorCode.UNKNOWN_CALL, "no call 'nope'")])
    c = env.client()
    c.subscribe("nope")
    with pytest.raises(ClientError, match="subscribe to call nope") as info:
        next(c.events("nope", timeout_s=1))
    assert info.value.code == "unknown_call"


def test_a_gap_is_refilled_by_subscribing_from_the_last_seq(env: Env) -> None:
    def handle(msg: dict[str, Any]) -> list[Out]:
        if msg["op"] == "submit":  # seq 2 is lost on the way
            return [accepted_msg(msg["ref"], "c1"), delta("c1", 1), delta("c1", 3)]
        return [*(delta("c1", s) for s in range(msg["from_seq"] + 1, 4)), done("c1", 4)]
    peer = env.peer(handle)
    c = env.client()
    call_id = c.submit("openai", {"model": "m"})
    events = list(c.events(call_id, timeout_s=1))
    assert seqs(events) == [("delta", 1), ("delta", 2), ("delta", 3), ("done", 4)]
    assert [m["from_seq"] for m in peer.of_op("subscribe")] == [1]


def test_a_finished_call_is_replayed_after_a_new_subscribe(env: Env) -> None:
    def handle(msg: dict[str, Any]) -> list[Out]:
        if msg["op"] == "submit":
            return [accepted_msg(msg["ref"], "c1"), delta("c1", 1), done("c1", 2)]
        return [delta("c1", 1), done("c1", 2)]
    env.peer(handle)
    c = env.client()
    call_id = c.submit("openai", {"model": "m"})
    assert len(list(c.events(call_id, timeout_s=1))) == 2
    c.subscribe(call_id)
    assert seqs(list(c.events(call_id, timeout_s=1))) == [("delta", 1), ("done", 2)]


# ---- the events socket: listen once, then name the listener -------------------------------

def _when(peer: Peer, what: str) -> float:
    """When the peer first noted `what` (it must have)."""
    times = [t for t, w in peer.timeline if w == what]
    assert times, f"the peer never saw {what!r}: {peer.timeline}"
    return times[0]


@pytest.mark.parametrize("first", ["submit", "subscribe"])
def test_the_client_says_listen_once_and_names_its_listener_only_after_listening(
        env: Env, first: str) -> None:
    def handle(msg: dict[str, Any]) -> list[Out]:
        if msg["op"] == "submit":
            return [accepted_msg(msg["ref"], "c1"), delta("c1", 1), done("c1", 2)]
        if msg["op"] == "subscribe":
            return [delta(msg["call_id"], 1), done(msg["call_id"], 2)]
        return [reply(msg, "status_reply")]
    peer = env.peer(handle, listen_delay_s=0.3)
    c = env.client()
    t0 = monotonic()
    call_id = c.submit("openai", {"model": "m"}) if first == "submit" else c.subscribe("c1")
    assert monotonic() - t0 >= 0.3  # it waited for `listening`
    assert seqs(list(c.events("c1", timeout_s=1))) == [("delta", 1), ("done", 2)]
    # the request naming the listener left only after `listening` was sent
    assert _when(peer, "got listen") <= _when(peer, "sent listening") <= _when(peer, f"got {first}")
    assert call_id in ("c1", None)
    # listening once is enough: the next requests naming it go without a second listen
    c.subscribe("c2")
    c.submit("openai", {"model": "m"}, idempotency_key="k")
    c.status()
    assert seqs(list(c.events("c2", timeout_s=1))) == [("delta", 1), ("done", 2)]
    assert peer.ops().count("listen") == 1 and peer.ops()[0] == "listen"
    (listen_id,) = peer.listen_ids
    named = peer.of_op("submit") + peer.of_op("subscribe")
    # 4: the second submit answers c1, read to its done already, so the client
    # subscribes it again (its replay may have come before `accepted`, and dropped).
    assert len(named) == 4 and {m["listener"] for m in named} == {listen_id.decode()}


def test_no_listening_is_a_timeout_and_the_request_is_never_sent(env: Env) -> None:
    peer = env.peer(accept_as("c1"), listen_delay_s=None)  # `listen` is never answered
    c = env.client(timeout_s=0.2)
    t0 = monotonic()
    with pytest.raises(TimeoutError, match=r"no answer to listen from the events endpoint "
                                           r"ipc://.*\.events within 0\.2 s"):
        c.submit("openai", {"model": "m"})
    assert 0.2 <= monotonic() - t0 < 2
    # requests that name no listener do not need it
    assert c.submit("openai", {"model": "m"}, subscribe=False) == "c1"
    assert peer.ops() == ["listen", "submit"]
    assert "listener" not in peer.of_op("submit")[0]


def test_a_client_without_subscriptions_never_listens(env: Env) -> None:
    peer = env.peer(accept_as("c1"))
    c = env.client()
    assert c.submit("openai", {"model": "m"}, subscribe=False) == "c1"
    assert "listen" not in peer.ops() and peer.listen_ids == []


def test_async_client_says_listen_once_before_naming_its_listener(env: Env) -> None:
    def handle(msg: dict[str, Any]) -> list[Out]:
        if msg["op"] == "submit":
            return [accepted_msg(msg["ref"], "c1"), delta("c1", 1), done("c1", 2)]
        return [delta(msg["call_id"], 1), done(msg["call_id"], 2)]

    async def main() -> None:
        async with env.aclient() as c:
            t0 = monotonic()
            call_id = await c.submit("openai", {"model": "m"})
            assert monotonic() - t0 >= 0.3
            assert seqs([e async for e in c.events(call_id, timeout_s=1)]) == [
                ("delta", 1), ("done", 2)]
            await c.subscribe("c2")
            assert seqs([e async for e in c.events("c2", timeout_s=1)]) == [
                ("delta", 1), ("done", 2)]
    peer = env.peer(handle, listen_delay_s=0.3)
    asyncio.run(main())
    assert peer.ops() == ["listen", "submit", "subscribe"]
    assert _when(peer, "sent listening") <= _when(peer, "got submit")
    (listen_id,) = peer.listen_ids
    assert [m["listener"] for m in peer.received[1:]] == [listen_id.decode()] * 2


# ---- liveness probes while a call is silent ------------------------------------------------

def test_probes_keep_a_long_silent_call_alive(env: Env) -> None:
    results = 0

    def handle(msg: dict[str, Any]) -> list[Out]:
        nonlocal results
        if msg["op"] == "submit":
            return [accepted_msg(msg["ref"], "c1")]
        if msg["op"] == "result":
            results += 1
            if results == 1:
                return [reply(msg, "pending", call_id="c1")]
            return [reply(msg, "pending", call_id="c1"), delta("c1", 1), done("c1", 2)]
        return []
    peer = env.peer(handle)
    c = env.client(timeout_s=0.2)
    call_id = c.submit("openai", {"model": "m"})
    assert seqs(list(c.events(call_id))) == [("delta", 1), ("done", 2)]
    assert peer.ops() == ["listen", "submit", "subscribe", "result", "subscribe", "result"]
    assert [m["from_seq"] for m in peer.of_op("subscribe")] == [0, 0]


def test_a_probe_without_answer_raises_timeout(env: Env) -> None:
    env.peer(accept_as("c1"))
    c = env.client(timeout_s=0.2)
    call_id = c.submit("openai", {"model": "m"})
    with pytest.raises(TimeoutError, match=r"events of call c1 .*liveness probe.*result of call c1"):
        next(c.events(call_id))


def test_a_probe_that_finds_the_call_done_delivers_its_done(env: Env) -> None:
    def handle(msg: dict[str, Any]) -> list[Out]:
        if msg["op"] == "submit":  # the pushed done never comes
            return [accepted_msg(msg["ref"], "c1"), delta("c1", 1)]
        if msg["op"] == "result":
            return [{**done("c1", 2), "ref": msg["ref"]}]
        return []
    env.peer(handle)
    c = env.client(timeout_s=0.2)
    events = list(c.events(c.submit("openai", {"model": "m"})))
    assert seqs(events) == [("delta", 1), ("done", 2)]
    assert "ref" not in events[-1]


def test_events_lost_when_the_daemon_says_done_but_never_replays(env: Env) -> None:
    def handle(msg: dict[str, Any]) -> list[Out]:
        if msg["op"] == "submit":
            return [accepted_msg(msg["ref"], "c1"), delta("c1", 1)]
        if msg["op"] == "result":
            return [{**done("c1", 5), "ref": msg["ref"]}]
        return []
    env.peer(handle)
    c = env.client(timeout_s=0.2)
    it = c.events(c.submit("openai", {"model": "m"}))
    assert next(it)["seq"] == 1
    with pytest.raises(ClientError) as info:
        next(it)
    assert info.value.code == "events_lost" and "after seq 1" in info.value.message


# ---- stream_text and run -----------------------------------------------------------------

def streaming(status: CallStatus = CallStatus.COMPLETED,
              error: dict[str, Any] | None = None, prefix: str = "c") -> Handler:
    """Each submit is a new call c1, c2, ... (`prefix`) streaming the same script."""
    calls = 0

    def handle(msg: dict[str, Any]) -> list[Out]:
        nonlocal calls
        calls += 1
        cid = f"{prefix}{calls}"
        return [accepted_msg(msg["ref"], cid), delta(cid, 1, "Hel"),
                delta(cid, 2, "thinking", kind="reasoning"), delta(cid, 3, "lo"),
                delta(cid, 4, "reconnecting", kind="notice"), reset_event(cid, 2, 5),
                delta(cid, 6, "Hello!", attempt=2), done(cid, 7, status, error)]
    return handle


def test_stream_text_yields_text_and_keeps_the_done(env: Env) -> None:
    env.peer(streaming())
    c = env.client()
    stream = c.stream_text("openai", {"model": "m"}, timeout_s=1)
    assert stream.call_id is None  # nothing is sent before the first next()
    assert list(stream) == ["Hel", "lo", "Hello!"]
    assert stream.call_id == "c1" and stream.done is not None
    assert stream.done["status"] == "completed"
    marked = "".join(c.stream_text("openai", {"model": "m"}, markers=True, timeout_s=1))
    assert "[notice: reconnecting]" in marked and "[reset:" in marked and "attempt 2" in marked


def test_stream_text_raises_call_failed_after_the_text(env: Env) -> None:
    env.peer(streaming(CallStatus.FAILED, {"code": "provider_error", "message": "HTTP 400"}))
    got: list[str] = []
    with pytest.raises(CallFailed) as info:
        got.extend(env.client().stream_text("openai", {"model": "m"}, timeout_s=1))
    assert got == ["Hel", "lo", "Hello!"]
    assert info.value.code == "provider_error" and "HTTP 400" in info.value.message
    assert info.value.done["status"] == "failed"


def test_run_returns_the_done_event_whatever_the_status(env: Env) -> None:
    env.peer(streaming(CallStatus.PARTIAL))
    got = env.client().run("openai", {"model": "m"}, timeout_s=1)
    assert got["op"] == "done" and got["status"] == "partial" and got["seq"] == 7


def test_a_duplicate_submit_replays_the_call_to_its_new_reader(env: Env) -> None:
    def handle(msg: dict[str, Any]) -> list[Out]:
        # the same call for the same idempotency key; subscribing replays it from seq 1
        replay: list[Out] = [delta("c1", 1, "Hi"), done("c1", 2)]
        if msg["op"] == "subscribe":
            return replay[msg["from_seq"]:]
        return [accepted_msg(msg["ref"], "c1", duplicate=msg["call"].get("idempotency_key")
                             == "dup"), *replay]
    env.peer(handle)
    c = env.client()
    assert c.run("openai", {"model": "m"}, idempotency_key="dup", timeout_s=1)["seq"] == 2
    assert list(c.stream_text("openai", {"model": "m"}, idempotency_key="dup",
                              timeout_s=1)) == ["Hi"]


# ---- AsyncClient -----------------------------------------------------------------------

def test_async_submit_events_and_replies_interleaved(env: Env) -> None:
    def handle(msg: dict[str, Any]) -> list[Out]:
        if msg["op"] == "submit":
            return [delta("c1", 2), accepted_msg(msg["ref"], "c1"), delta("c1", 1)]
        if msg["op"] == "status":
            return [delta("c1", 3), reply(msg, "status_reply", calls=1), done("c1", 4)]
        if msg["op"] == "cancel":
            return [reply(msg, "cancelling", call_id="c1")]
        return [reply(msg, "pending", call_id="c1")]

    async def main() -> None:
        async with env.aclient() as c:
            call_id = await c.submit("openai", {"model": "m"})
            assert (await c.status())["calls"] == 1
            assert await c.result(call_id) is None
            assert (await c.cancel(call_id))["op"] == "cancelling"
            events = [e async for e in c.events(call_id, timeout_s=1)]
            assert seqs(events) == [("delta", 1), ("delta", 2), ("delta", 3), ("done", 4)]
            assert c.last_seq(call_id) == 4
    env.peer(handle)
    asyncio.run(main())


def test_async_concurrent_requests_get_their_own_replies(env: Env) -> None:
    held: list[dict[str, Any]] = []
    first_arrived = threading.Event()

    def handle(msg: dict[str, Any]) -> list[Out]:
        if not held:  # hold the first request until the second arrives, answer in reverse
            held.append(msg)
            first_arrived.set()
            return []
        first = held[0]
        return [reply(msg, "pending", call_id=msg["call_id"]),
                {**done(first["call_id"], 1), "ref": first["ref"]}]

    async def main() -> None:
        c = env.aclient()
        first = asyncio.ensure_future(c.result("A"))
        assert await asyncio.to_thread(first_arrived.wait, 5)
        second = await c.result("B")
        assert second is None
        got = await first
        assert got is not None and got["call_id"] == "A"
    env.peer(handle)
    asyncio.run(main())


def test_async_concurrent_event_readers(env: Env) -> None:
    def handle(msg: dict[str, Any]) -> list[Out]:
        # Both calls' events, once (for A's subscribe): B's reader gets them
        # too. Sent again for B's, they could find the client closed already.
        if msg.get("call_id") != "A":
            return []
        return [delta("A", 1), delta("B", 1), delta("B", 2), delta("A", 2), done("B", 3),
                done("A", 3)]

    async def read(c: AsyncClient, call_id: str) -> list[tuple[str, int]]:
        await c.subscribe(call_id)
        return seqs([e async for e in c.events(call_id, timeout_s=1)])

    async def main() -> None:
        c = env.aclient()
        a, b = await asyncio.gather(read(c, "A"), read(c, "B"))
        assert a == b == [("delta", 1), ("delta", 2), ("done", 3)]
    env.peer(handle)
    asyncio.run(main())


class CountingClient(AsyncClient):
    """Counts, per `Wait.on`, the waits that returned: how often each flow was woken."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.returned: Counter[str | None] = Counter()

    async def _wait(self, wait: Wait) -> None:
        try:
            await super()._wait(wait)
        finally:
            self.returned[wait.on] += 1


def test_async_a_message_wakes_only_the_flows_it_is_for(env: Env) -> None:
    """Eight tasks read quiet calls while another task's requests are answered,
    each answer with events of a third call: no quiet reader is woken until its
    own done comes (goes red if every waiting flow is woken per routed batch)."""
    quiet = [f"Q{i}" for i in range(8)]

    def handle(msg: dict[str, Any]) -> list[Out]:
        if msg["op"] == "status" and msg["ref"].startswith("busy"):
            n = int(msg["ref"][4:])
            return [reply(msg, "status_reply"), *(delta("A", 3 * n + k) for k in (1, 2, 3))]
        if msg["op"] == "status":
            return [reply(msg, "status_reply"), done("A", 16), *(done(q, 1) for q in quiet)]
        return []

    async def read(c: AsyncClient, call_id: str) -> list[tuple[str, int]]:
        await c.subscribe(call_id)
        return seqs([e async for e in c.events(call_id, timeout_s=10)])

    async def main() -> None:
        c = CountingClient(env.endpoint, 10.0, context=env.actx)  # no probe meanwhile
        env.clients.append(c)
        readers = [asyncio.ensure_future(read(c, q)) for q in quiet]
        a = asyncio.ensure_future(read(c, "A"))
        for _ in range(500):
            if len(peer.of_op("subscribe")) == len(quiet) + 1:
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail(f"the peer got {peer.ops()}, not every subscribe")
        for n in range(5):  # one routing pass each, at least
            await c.request({"v": 1, "op": "status", "ref": f"busy{n}"})
        assert {q: c.returned[q] for q in quiet} == dict.fromkeys(quiet, 0), c.returned
        await c.request({"v": 1, "op": "status", "ref": "end"})
        assert [await r for r in readers] == [[("done", 1)]] * len(quiet)
        assert await a == [*(("delta", s) for s in range(1, 16)), ("done", 16)]
        assert {q: c.returned[q] for q in quiet} == dict.fromkeys(quiet, 1), c.returned
    peer = env.peer(handle)
    asyncio.run(main())


def test_async_short_waiter_times_out_while_another_task_receives(env: Env) -> None:
    a_arrived = threading.Event()

    def handle(msg: dict[str, Any]) -> list[Out]:
        if msg["ref"] == "a":
            a_arrived.set()
        if msg["ref"] == "c":  # answer the long waiter only now
            return [reply(msg, "status_reply"), {"v": 1, "op": "status_reply", "ref": "a"}]
        return []

    async def main() -> None:
        c = env.aclient()
        long = asyncio.ensure_future(c.request({"v": 1, "op": "status", "ref": "a"}, 5))
        assert await asyncio.to_thread(a_arrived.wait, 5)
        t0 = monotonic()
        with pytest.raises(TimeoutError, match=r"ref b"):
            await c.request({"v": 1, "op": "status", "ref": "b"}, 0.2)
        assert 0.2 <= monotonic() - t0 < 2
        assert (await c.request({"v": 1, "op": "status", "ref": "c"}))["ref"] == "c"
        assert (await long)["ref"] == "a"
    env.peer(handle)
    asyncio.run(main())


def test_async_timeouts_are_loud(env: Env) -> None:
    async def main() -> None:
        c = env.aclient(timeout_s=0.2)
        with pytest.raises(TimeoutError, match=r"no reply to status \(ref [0-9a-f]{32}\)"):
            await c.status()
        call_id = await c.submit("openai", {"model": "m"})
        with pytest.raises(TimeoutError, match=r"no event for call c1 within 0\.1 s"):
            async for _ in c.events(call_id, timeout_s=0.1):
                pass
        with pytest.raises(TimeoutError, match="liveness probe"):
            async for _ in c.events(call_id):
                pass
    env.peer(accept_as("c1"))
    asyncio.run(main())


def test_async_stream_text_run_and_call_failed(env: Env) -> None:
    async def main() -> None:
        c = env.aclient()
        stream = c.stream_text("openai", {"model": "m"}, timeout_s=1)
        assert [t async for t in stream] == ["Hel", "lo", "Hello!"]
        assert stream.done is not None and stream.call_id == "c1"
        assert (await c.run("openai", {"model": "m"}, timeout_s=1))["status"] == "failed"
        with pytest.raises(CallFailed, match="HTTP 400"):
            async for _ in c.stream_text("openai", {"model": "m"}, timeout_s=1):
                pass
    failing = streaming(CallStatus.FAILED, {"code": "provider_error", "message": "HTTP 400"},
                        prefix="f")  # new calls: ids the client has not seen
    ok = streaming()
    calls = 0

    def handle(msg: dict[str, Any]) -> list[Out]:
        nonlocal calls
        calls += 1
        return ok(msg) if calls == 1 else failing(msg)
    env.peer(handle)
    asyncio.run(main())


def test_async_raw_requests_and_subscribe_errors(env: Env) -> None:
    def handle(msg: dict[str, Any]) -> list[Out]:
        return [error_msg(msg["ref"], ErrorCode.UNKNOWN_CALL, "no call 'x'")]

    async def main() -> None:
        c = env.aclient()
        assert (await c.request_raw(b"\x92\x01"))["code"] == "bad_frame"
        assert (await c.request({"v": 1, "op": "cancel", "ref": "r"}))["code"] == "unknown_call"
        await c.subscribe("x")
        with pytest.raises(ClientError, match="unknown_call"):
            async for _ in c.events("x", timeout_s=1):
                pass
        c.close()
        with pytest.raises(RuntimeError, match="closed"):
            await c.status()
    env.peer(handle)
    asyncio.run(main())


# ---- the Router alone (no sockets) ----------------------------------------------------

def _frame(msg: dict[str, Any]) -> list[bytes]:
    return [encode(msg)]


def test_router_hands_out_each_event_once_in_seq_order() -> None:
    r = Router()
    for seq in (3, 1, 2, 2, 1):
        r.route(_frame(delta("c", seq)))
    assert r.gap("c") is None
    assert [r.next_event("c")["seq"] for _ in range(3)] == [1, 2, 3]  # type: ignore[index]
    assert r.next_event("c") is None
    r.route(_frame(delta("c", 5)))
    assert r.next_event("c") is None and r.gap("c") == 3 and r.gap("c") is None  # once
    r.route(_frame(delta("c", 4)))
    r.route(_frame(done("c", 6)))
    assert [r.next_event("c")["seq"] for _ in range(3)] == [4, 5, 6]  # type: ignore[index]
    assert r.is_finished("c") and r.last_seq("c") == 6
    r.route(_frame(delta("c", 6)))  # late duplicate of a finished call: no state kept
    assert r.next_event("c") is None


def test_router_marks_woken_what_each_message_was_for() -> None:
    r = Router()
    r.expect("a")
    r.route([encode([delta("c1", 1), delta("c2", 1)])])
    r.route(_frame({"v": 1, "op": "pending", "ref": "a"}))
    r.route(_frame({"v": 1, "op": "pending", "ref": "nobody"}))
    assert r.woken == {"c1", "c2", "a"}
    r.woken.clear()
    r.route(_frame({"v": 1, "op": "listening"}))
    r.subscribing("s", "c3", 0)
    r.route(_frame(error_msg("s", ErrorCode.UNKNOWN_CALL, "no such call")))
    r.expect_raw()
    r.route(_frame(error_msg(None, ErrorCode.TOO_LARGE, "big")))
    assert r.woken == {LISTENING, "c3", ANY}


def test_router_reply_matching_and_stale_replies() -> None:
    r = Router()
    r.expect("a")
    assert r.route(_frame({"v": 1, "op": "pending", "ref": "zzz"})) is False  # nobody waits
    assert r.route(_frame({"v": 1, "op": "pending", "ref": "a"})) is True
    assert r.take_reply("a") == {"v": 1, "op": "pending", "ref": "a"}
    assert r.take_reply("a") is None


def test_router_error_without_ref_goes_to_the_only_request_or_nowhere() -> None:
    r = Router()
    err = error_msg(None, ErrorCode.TOO_LARGE, "big")
    r.expect("a")
    assert r.route(_frame(err)) is True and r.take_reply("a") == err
    r.expect("b")
    r.expect("c")
    assert r.route(_frame(err)) is False  # two outstanding: cannot tell, discarded
    assert r.take_reply("b") is None and r.take_reply("c") is None
    r.expect_raw()
    assert r.route(_frame(err)) is True and r.take_unattributed() == err


def test_router_subscribe_from_seq_skips_and_replays_a_finished_call() -> None:
    r = Router()
    r.route(_frame(delta("c", 1)))
    r.subscribing("s1", "c", 1)
    assert r.next_event("c") is None and r.last_seq("c") == 1
    r.route(_frame(done("c", 2)))
    assert r.next_event("c")["op"] == "done"  # type: ignore[index]
    r.subscribing("s2", "c", 0)  # a replay of a finished call is read afresh
    r.route(_frame(delta("c", 1)))
    assert r.next_event("c")["seq"] == 1  # type: ignore[index]


def test_router_events_without_call_id_or_seq_are_discarded() -> None:
    r = Router()
    r.route(_frame({"v": 1, "op": "delta", "call_id": "c", "seq": True}))
    r.route(_frame({"v": 1, "op": "delta", "seq": 1}))
    r.route(_frame({"v": 1, "op": "frobnicate"}))
    assert r.next_event("c") is None


def test_closing_clients_never_freezes_their_context(tmp_path: Path) -> None:
    """libzmq's I/O thread sends monitor events with a blocking send. A client
    that closed its monitor while its events connection's handshake was still
    in flight froze that thread, and with it every socket of the context: all
    the clients of a program then got no reply and no error. Here 100 clients
    are opened and closed at once against a live peer, then one message goes
    through the same context."""
    endpoint = f"ipc://{Path(tempfile.mkdtemp(prefix='sfz')) / 'd.sock'}"
    ctx: zmq.Context[Any] = zmq.Context()
    front, events = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    front.bind(endpoint)
    events.bind(events_endpoint(endpoint))
    for _ in range(100):
        Client(endpoint, context=ctx).close()
    probe = ctx.socket(zmq.DEALER)
    probe.connect(endpoint)
    probe.send(b"ping", zmq.NOBLOCK)
    assert front.poll(5000), ("a message through the clients' context did not arrive within "
                              "5 s: its I/O thread is frozen")
    for sock in (probe, front, events):
        sock.close(linger=0)
    ctx.term()
