"""Bedrock Converse adapter: boto3 ``converse_stream`` events -> protocol deltas + AttemptOutcome.

Contract:
- `ADAPTER`: this wire's `Adapter` (workers/adapter.py) for profile kind "bedrock"; its
  `classify` is `classify_bedrock`.
- `make_client(profile)`: a ``bedrock-runtime`` client from one shared botocore session per
  `aws_profile` (the session's first client costs ~75 ms, later ones ~2.5 ms). Profile
  keys: `region`, `endpoint_url`, `aws_credentials` ("chain", the default: the AWS
  credential chain; "dummy": static test credentials, only with an `endpoint_url`),
  `aws_profile`, `connect_timeout_s` (30), `read_timeout_s` (120). SDK retries are off:
  `total_max_attempts: 1` (botocore's `max_attempts: 1` means one *retry*; measured).
  botocore has no hook for a prebuilt SSLContext, so the shared one is not used.
- `ConverseStreamAssembler(out)`: `feed(event)` per parsed event dict, `finish()` -> the
  AttemptOutcome. Pure dict lookups; slot bookkeeping and the outcome come from
  `streamfence.workers.assembly.ToolSlots`.
- `stream_converse(client, request, out)`: every event is a real chunk (`out.chunk`). Errors
  opening the stream (ClientError) propagate untouched; an in-stream exception message
  (EventStreamError) ends the attempt as a classified error; transport errors mid-stream
  (urllib3 ReadTimeoutError/ProtocolError, botocore's eventstream ParserError) are
  classified into the returned outcome, with the partial state kept.
- `complete_converse`: the non-streaming fall-back, fed to the same assembler as synthesized
  events. `is_streaming_denied(exc)`: AccessDeniedException from ConverseStream (IAM lacks
  bedrock:InvokeModelWithResponseStream). `run` streams and falls back on that denial (or
  skips streaming when `settings.streaming` is False); its outcome then says
  `streaming_denied` so the supervisor can remember.
- Liveness: botocore's read timeout is a per-recv socket timeout, so it *does* fire inside
  the event loop on a silent socket (measured); but frames boto3 parses to nothing (unknown
  event types) keep the socket busy while no event reaches us. The supervisor's stale
  watchdog plus the process kill is the only guard that always ends a wedged stream.

Rules (docs/ARCHITECTURE.md §4.6): text -> `text`; reasoningContent.text -> `reasoning`
(signatures, redacted content: no delta); contentBlockStart toolUse opens a slot (0, 1, 2 …
by opening order) with id+name, each input piece is a fragment. `messageStop` is required:
without it the attempt is incomplete (`no_finish_reason`; `empty_stream` with no content)
and every tool call is dropped. With it, a call without a name or with non-JSON input is
dropped and the finish becomes "length" (unless content_filter).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

import botocore.session
import orjson
from botocore.config import Config
from botocore.eventstream import ParserError
from botocore.exceptions import ClientError, EventStreamError

from streamfence.protocol.internal.outcome import AttemptError, AttemptOutcome, ErrorClass
from streamfence.protocol.internal.workers import AttemptSettings
from streamfence.workers.adapter import Adapter
from streamfence.workers.assembly import ToolSlots, raised_here
from streamfence.workers.errors import attempt_error, classify
from streamfence.workers.output import NOTICE, REASONING, TEXT, TOOL_CALL, AttemptOutput
from streamfence.workers.send_gate import wait_at_gate

log = logging.getLogger("streamfence.bedrock")

DUMMY_CREDENTIALS = ("test", "test")
_STOP_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
                 "model_context_window_exceeded": "length", "tool_use": "tool_calls",
                 "content_filtered": "content_filter", "guardrail_intervened": "content_filter"}
_MALFORMED_STOPS = frozenset({"malformed_model_output", "malformed_tool_use"})
_SERVICE_SIDE = frozenset({"internalserverexception", "serviceunavailableexception",
                           "modelstreamerrorexception", "modelnotreadyexception",
                           "modeltimeoutexception"})
_SHAPE_ERRORS = (AttributeError, TypeError, KeyError, ValueError)
_DENIED_NOTICE = ("AWS IAM denied bedrock:InvokeModelWithResponseStream for this profile: "
                  "the answer comes from the non-streaming converse call instead.")

_sessions: dict[str | None, Any] = {}


def _session(aws_profile: str | None) -> Any:
    if aws_profile not in _sessions:
        _sessions[aws_profile] = botocore.session.Session(profile=aws_profile)
    return _sessions[aws_profile]


def make_client(profile: dict[str, Any]) -> Any:
    """A bedrock-runtime client for `profile`; see the module docstring for its keys."""
    mode = profile.get("aws_credentials") or "chain"
    endpoint_url = profile.get("endpoint_url") or None
    session = _session(profile.get("aws_profile") or None)
    config = Config(retries={"total_max_attempts": 1, "mode": "standard"},
                    connect_timeout=float(profile.get("connect_timeout_s") or 30.0),
                    read_timeout=float(profile.get("read_timeout_s") or 120.0),
                    max_pool_connections=2, user_agent_extra="streamfence")
    kwargs: dict[str, Any] = {}
    if mode == "dummy":
        if not endpoint_url:
            raise ValueError(f"profile {profile.get('name')!r}: aws_credentials = \"dummy\" "
                             "needs an endpoint_url (it is for the local emulator)")
        kwargs["aws_access_key_id"], kwargs["aws_secret_access_key"] = DUMMY_CREDENTIALS
    elif mode != "chain":
        raise ValueError(f"profile {profile.get('name')!r}: aws_credentials must be "
                         f"\"chain\" or \"dummy\", got {mode!r}")
    region = profile.get("region") or session.get_config_variable("region") or "us-east-1"
    client = session.create_client("bedrock-runtime", region_name=region,
                                   endpoint_url=endpoint_url, config=config, **kwargs)
    client.meta.events.register("before-send.bedrock-runtime", wait_at_gate)
    return client


_USAGE_KEYS = (("inputTokens", "prompt_tokens"), ("outputTokens", "completion_tokens"),
               ("totalTokens", "total_tokens"), ("cacheReadInputTokens", "cache_read_input_tokens"),
               ("cacheWriteInputTokens", "cache_write_input_tokens"))


def _usage(raw: Any) -> dict[str, Any] | None:
    if not isinstance(raw, dict):
        return None
    usage = {dst: raw.get(src) for src, dst in _USAGE_KEYS[:3]}
    usage.update((dst, raw[src]) for src, dst in _USAGE_KEYS[3:] if raw.get(src) is not None)
    return usage


class ConverseStreamAssembler(ToolSlots):
    """Owns one ConverseStream's assembly: parsed event dicts in, deltas to `out`, and
    its stop reason and usage; see the module docstring."""

    __slots__ = (*ToolSlots.SLOTS, "events", "finish_reason", "stop_reason", "usage")

    def __init__(self, out: AttemptOutput) -> None:
        super().__init__(out)
        self.stop_reason: str | None = None  # as Bedrock sent it
        self.finish_reason: str | None = None  # normalized
        self.usage: dict[str, Any] | None = None
        self.events = 0

    def feed(self, event: dict[str, Any]) -> None:
        if self.done:
            return
        self.events += 1
        try:
            body = event.get("contentBlockDelta")
            if body is not None:
                self._block_delta(body)
            elif (body := event.get("contentBlockStart")) is not None:
                start = body["start"].get("toolUse")
                if start is not None:
                    self._open(body["contentBlockIndex"], start.get("toolUseId"),
                               start.get("name"))
            elif (body := event.get("messageStop")) is not None:
                reason = str(body.get("stopReason") or "")
                self.stop_reason = reason or None
                self.finish_reason = _STOP_REASONS.get(reason, reason or None)
            elif (body := event.get("metadata")) is not None:
                self.usage = _usage(body.get("usage")) or self.usage
            # messageStart, contentBlockStop and unknown members carry nothing we keep.
        except _SHAPE_ERRORS as exc:
            if not raised_here(exc, __file__):
                raise  # from `out`, not a bad event
            self.fail(_transient("malformed_stream", f"unexpected event shape "
                                 f"({type(exc).__name__}: {exc}): {str(event)[:200]}"))

    def _block_delta(self, body: dict[str, Any]) -> None:
        delta = body["delta"]
        text = delta.get("text")
        if text:
            self.saw_content = True
            self._delta(TEXT, text)
            return
        reasoning = delta.get("reasoningContent")
        if reasoning is not None:
            piece = reasoning.get("text")
            if piece:
                self.saw_content = True
                self._delta(REASONING, piece)
            return
        tool = delta.get("toolUse")
        if tool is not None:
            self.saw_content = True
            block = body["contentBlockIndex"]
            slot = self._slot_by.get(block)
            if slot is None:  # input before its start event: held until a name comes
                slot = self._new_slot(block)
            piece = tool.get("input")
            if piece is not None and type(piece) is not str:
                piece = orjson.dumps(piece).decode()
            if piece:
                self._args[slot].append(piece)
                if self._names[slot] is not None:
                    self._delta(TOOL_CALL, {"index": slot, "id": None, "name": None,
                                            "arguments": piece})

    def _open(self, block: Any, tool_id: Any, name: Any) -> None:
        self.saw_content = True
        slot = self._slot_by.get(block)
        tid = str(tool_id) if tool_id else None
        if slot is None or self._names[slot] is not None:
            slot = self._new_slot(block, tid)
        elif tid:
            self._ids[slot] = tid
        if name:
            self._name_slot(slot, name)

    def finish(self, error: AttemptError | None = None) -> AttemptOutcome:
        """The outcome. `error`: the classified exception that ended the attempt."""
        error = error or self.error
        finish = self.finish_reason
        if error is None and self.stop_reason in _MALFORMED_STOPS:
            error = _transient("malformed_model_output", "Bedrock ended the message "
                               f"with stopReason {self.stop_reason!r}")
        elif error is None and self.stop_reason is None:
            error = (_transient("no_finish_reason", "the stream ended without "
                                "messageStop (incomplete response)") if self.saw_content else
                     _transient("empty_stream", "Bedrock returned an empty stream "
                                "(no content, tool call or messageStop)"))
        dropped, finish = self._settle(error, finish, self._named_json)
        return self._final(error, finish, self.usage, dropped)


def _request_id(response: dict[str, Any]) -> str | None:
    rid = (response.get("ResponseMetadata") or {}).get("RequestId")
    return rid if isinstance(rid, str) and rid else None


def stream_converse(client: Any, request: dict[str, Any], out: AttemptOutput,
                    secrets: Sequence[str] = ()) -> AttemptOutcome:
    """Run one streaming attempt; return its outcome. See the module docstring."""
    asm = ConverseStreamAssembler(out)
    asm.model = request.get("modelId")
    response = client.converse_stream(**request)
    asm.response_id = _request_id(response)
    events = response["stream"]
    chunk, feed, dumps = out.chunk, asm.feed, orjson.dumps
    try:
        for event in events:
            chunk(len(dumps(event)))
            feed(event)
            if asm.done:
                break
    except EventStreamError as exc:  # an exception message inside the stream
        chunk(1)
        asm.fail(classify_bedrock(exc, secrets))
    except Exception as exc:
        error = classify_bedrock(exc, secrets)
        if asm.stop_reason is not None and asm.error is None \
                and error.error_class is ErrorClass.TRANSIENT:
            return asm.finish()  # messageStop is proof enough; only the metadata was lost
        return asm.raised(exc, error)
    finally:
        events.close()
    return asm.finish()


def _events_of(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A converse response as the ConverseStream events that would have carried it."""
    message = (response.get("output") or {}).get("message") or {}
    content = message.get("content")
    if not isinstance(content, list):
        return []
    events: list[dict[str, Any]] = [{"messageStart": {"role": message.get("role")}}]
    tools = False
    for index, block in enumerate(content):
        if not isinstance(block, dict):
            continue
        if isinstance(block.get("text"), str):
            events.append({"contentBlockDelta": {"contentBlockIndex": index,
                                                 "delta": {"text": block["text"]}}})
        elif isinstance(block.get("reasoningContent"), dict):
            text = (block["reasoningContent"].get("reasoningText") or {}).get("text")
            if isinstance(text, str):
                events.append({"contentBlockDelta": {"contentBlockIndex": index, "delta": {
                    "reasoningContent": {"text": text}}}})
        elif isinstance(block.get("toolUse"), dict):
            tools = True
            tool = block["toolUse"]
            events.append({"contentBlockStart": {"contentBlockIndex": index, "start": {
                "toolUse": {"toolUseId": tool.get("toolUseId"), "name": tool.get("name")}}}})
            raw = tool.get("input")
            if raw is not None and (piece := raw if isinstance(raw, str)
                                    else orjson.dumps(raw).decode()):
                events.append({"contentBlockDelta": {"contentBlockIndex": index, "delta": {
                    "toolUse": {"input": piece}}}})
    # A complete body is complete: a missing stopReason means the obvious one.
    stop = response.get("stopReason") or ("tool_use" if tools else "end_turn")
    events.append({"messageStop": {"stopReason": stop}})
    events.append({"metadata": {"usage": response.get("usage")}})
    return events


def complete_converse(client: Any, request: dict[str, Any], out: AttemptOutput) -> AttemptOutcome:
    """Non-streaming fall-back: one `converse` call, delivered as deltas; its outcome.
    An exception from the call itself propagates (nothing partial to keep)."""
    asm = ConverseStreamAssembler(out)
    asm.model = request.get("modelId")
    response = client.converse(**request)
    asm.response_id = _request_id(response)
    events = _events_of(response)
    if not events:
        # botocore turns an empty or undecodable 200 body into {} (measured).
        out.chunk(1)
        return asm.finish(_transient("empty_response", "Bedrock's converse answer "
                                     "held no output message"))
    out.chunk(len(orjson.dumps({k: v for k, v in response.items() if k != "ResponseMetadata"},
                               default=str)))
    for event in events:
        asm.feed(event)
    return asm.finish()


def is_streaming_denied(exc: BaseException) -> bool:
    """AccessDeniedException answering ConverseStream: IAM lacks the streaming action."""
    if not isinstance(exc, ClientError) or isinstance(exc, EventStreamError):
        return False
    code = (exc.response.get("Error") or {}).get("Code")
    return code == "AccessDeniedException" and exc.operation_name == "ConverseStream"


def run(client: Any, request: dict[str, Any], out: AttemptOutput, settings: AttemptSettings,
        secrets: Sequence[str]) -> AttemptOutcome:
    """One attempt: stream, or converse when `settings.streaming` is False or IAM denies it."""
    if not settings.streaming:
        return complete_converse(client, request, out)
    try:
        return stream_converse(client, request, out, secrets)
    except ClientError as exc:
        if not is_streaming_denied(exc):
            raise
        log.warning("converse_stream denied by IAM (%s); falling back to converse",
                    exc.response.get("Error", {}).get("Message", ""))
    out.delta(NOTICE, _DENIED_NOTICE)
    return replace(complete_converse(client, request, out), streaming_denied=True)


def classify_bedrock(exc: BaseException, extra_secrets: Iterable[str] = ()) -> AttemptError:
    """`errors.classify`, plus what it does not know about Bedrock:
    - botocore's event-stream decoding errors (a bad CRC or length) are malformed stream
      data: transient `malformed_stream`;
    - the service-side exception types are transient whatever their text says, and
      throttling is `rate_limited` (Bedrock's "Too many tokens, please wait before trying
      again." otherwise reads as a context overflow);
    - an in-stream exception of a type the service model does not name (EventStreamError
      with an empty code) is final."""
    if isinstance(exc, ParserError):
        return attempt_error(ErrorClass.TRANSIENT, "malformed_stream",
                             f"{type(exc).__name__}: {exc}", extra_secrets=extra_secrets)
    info = classify(exc, extra_secrets)
    if not isinstance(exc, ClientError):
        return info
    code = str((exc.response.get("Error") or {}).get("Code") or "").lower()
    if not code and isinstance(exc, EventStreamError):
        return attempt_error(ErrorClass.FINAL, "provider_error", "Bedrock sent an in-stream "
                             "exception of an unknown type", extra_secrets=extra_secrets)
    if code == "throttlingexception":
        return replace(info, error_class=ErrorClass.TRANSIENT, code="rate_limited")
    if code in _SERVICE_SIDE and info.error_class is not ErrorClass.TRANSIENT:
        return replace(info, error_class=ErrorClass.TRANSIENT, code="provider_error")
    return info


def _transient(code: str, message: str) -> AttemptError:
    return attempt_error(ErrorClass.TRANSIENT, code, message)


ADAPTER = Adapter(kind="bedrock", make_client=make_client, run=run, classify=classify_bedrock)
