"""The messages of the client: the requests it builds and the replies it accepts.

Every request is validated with the daemon's own `parse_request` before it is
sent, so a request the daemon would refuse fails here, without a round trip.
Pure functions: no socket, no clock, no state. `client_core` composes them
into the operations both client flavours run.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from streamfence.protocol.client_router import BAD_REPLY, CallFailed, ClientError
from streamfence.protocol.errors import ProtocolError
from streamfence.protocol.fields import MAX_REF_LEN
from streamfence.protocol.messages import VERSION, CallOptions, Op, parse_request

DEFAULT_ENDPOINT = "tcp://127.0.0.1:7755"
Options = Mapping[str, Any] | CallOptions


def new_ref() -> str:
    return uuid.uuid4().hex


def checked(msg: dict[str, Any]) -> dict[str, Any]:
    """Validate an outgoing request with the daemon's own parser: fail here, not there."""
    try:
        parse_request(msg)
    except ProtocolError as exc:
        raise ClientError(exc.code.value, exc.message) from None
    return msg


def submit_msg(ref: str, provider: str, request: Mapping[str, Any], *, session_id: str | None,
               idempotency_key: str | None, options: Mapping[str, Any] | CallOptions | None,
               listener: str | None) -> dict[str, Any]:
    """`listener`: the events socket connection that follows the call (None: none)."""
    call: dict[str, Any] = {"provider": provider, "request": dict(request)}
    if session_id is not None:
        call["session_id"] = session_id
    if idempotency_key is not None:
        call["idempotency_key"] = idempotency_key
    if options is not None:
        opts = options.to_map() if isinstance(options, CallOptions) else dict(options)
        call["options"] = {k: v for k, v in opts.items() if v is not None}
    msg = {"v": VERSION, "op": Op.SUBMIT.value, "ref": ref, "call": call}
    if listener is not None:
        msg["listener"] = listener
    return checked(msg)


def call_msg(op: Op, ref: str, call_id: str, **extra: Any) -> dict[str, Any]:
    """subscribe / result / cancel: the ops that name a call."""
    return checked({"v": VERSION, "op": op.value, "ref": ref, "call_id": call_id, **extra})


def status_msg(ref: str) -> dict[str, Any]:
    return checked({"v": VERSION, "op": Op.STATUS.value, "ref": ref})


def usage_msg(ref: str, by: Sequence[str] | None, since: str | None) -> dict[str, Any]:
    msg: dict[str, Any] = {"v": VERSION, "op": Op.USAGE.value, "ref": ref}
    if by is not None:
        msg["by"] = list(by)
    if since:
        msg["since"] = since
    return checked(msg)


def calls_msg(ref: str, **fields: Any) -> dict[str, Any]:
    """`calls`: the fields that are set (None: not sent)."""
    return checked({"v": VERSION, "op": Op.CALLS.value, "ref": ref,
                    **{key: value for key, value in fields.items() if value is not None}})


def listen_msg() -> dict[str, Any]:
    """What the events socket takes first (answered `listening`); then only `ack`
    (client_router.Router.ack_due)."""
    return {"v": VERSION, "op": Op.LISTEN.value}


def raw_ref(msg: Mapping[str, Any]) -> str | None:
    """The ref the daemon will echo for `msg`, or None if it cannot echo one."""
    ref = msg.get("ref")
    return ref if isinstance(ref, str) and len(ref) <= MAX_REF_LEN else None


# ---- replies -------------------------------------------------------------------

def expect_reply(reply: dict[str, Any], ops: tuple[Op, ...], what: str) -> dict[str, Any]:
    """Return `reply` if its op is one of `ops`; raise ClientError otherwise."""
    op = reply.get("op")
    if op == Op.ERROR:
        raise ClientError(str(reply.get("code")), str(reply.get("message")), reply)
    if op not in ops:
        raise ClientError(BAD_REPLY, f"unexpected reply op {op!r} to {what}", reply)
    return reply


def accepted_call_id(reply: dict[str, Any]) -> str:
    """The call_id of a submit's reply."""
    call_id = expect_reply(reply, (Op.ACCEPTED,), "submit").get("call_id")
    if not isinstance(call_id, str):
        raise ClientError(BAD_REPLY, f"accepted without a call_id: {reply!r}", reply)
    return call_id


def text_piece(event: Mapping[str, Any], markers: bool) -> str | None:
    """What `stream_text` yields for one event: text deltas, and with `markers`
    a bracketed line for a reset or a notice; None for everything else."""
    op = event.get("op")
    if op == Op.DELTA:
        kind, data = event.get("kind"), event.get("data")
        if kind == "text" and isinstance(data, str):
            return data
        if markers and kind == "notice":
            text = data.get("message", data) if isinstance(data, dict) else data
            return f"\n[notice: {text}]\n"
    elif op == Op.RESET and markers:
        return f"\n[reset: the text above is void; attempt {event.get('attempt')} follows]\n"
    return None


def finished_ok(done: Mapping[str, Any]) -> dict[str, Any]:
    """The done event if the call ended completed or partial; CallFailed otherwise."""
    if done.get("status") not in ("completed", "partial"):
        raise CallFailed(done)
    return dict(done)
