"""The emulator's shared state: the request log and the scripts.

Contract
--------
* Every provider request gets one :class:`RequestRecord`, created when the
  request arrives and updated in place as its response is written, so a
  test polling ``GET /_emu/log`` sees the stream progress ("has request 2
  arrived?", "did request 1 write more chunks after its stall?").
* The log is the ground truth chaos verdicts are computed from, so its
  fields mean exactly this:

  ``n``             global request number, 1, 2, 3 ... never reused, not even
                    after ``/_emu/reset`` (texts stay distinct across resets)
  ``key``           script key (``None`` without one)
  ``path``, ``peer`` request path; client ``host:port`` (same port = same
                    connection)
  ``model``         requested model with the ``#KEY`` suffix removed
  ``stream``        whether the request asked for a stream
  ``fault``, ``step``  the step the request consumed (``step`` in full)
  ``status``        the HTTP status answered
  ``auth_present``  whether an ``Authorization: Bearer`` header was sent (the
                    key itself is never stored or logged)
  ``stream_options``, ``has_stream_options``  as sent in the request body
  ``request``       the request body as sent; a body over 64 KiB is kept
                    without its messages (``message_count``, ``roles``,
                    ``messages_sha256`` (`messages_digest`) and
                    ``messages_dropped: true`` instead)
  ``started``, ``ended``, ``last_write``  wall-clock ``time.time()`` stamps
  ``text``, ``reasoning_text``, ``refusal``, ``tool_call``  the full
                    response as scripted
  ``usage``         the token usage the answer carries, in the wire's own
                    fields (OpenAI's prompt/completion/total_tokens,
                    Anthropic's input/output_tokens, Bedrock's
                    inputTokens/outputTokens/totalTokens)
  ``sent_text``     the response text written to the socket so far (for a
                    non-streaming answer: its whole text once answered)
  ``chunks_sent``   data chunks written so far (not comments, not [DONE],
                    not the malformed or error lines; 0 when not streaming)
  ``keepalives_sent`` SSE comment lines written
  ``completed``     the response reached its end ([DONE] / the full body)
  ``aborted``       the client went away, or the fault cut the connection

* The log keeps the last ``limit`` records (default 100 000).

No I/O here; the asyncio server is single-threaded, so no locks.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from .script import ScriptBook, Step


@dataclass(slots=True, eq=False)
class RequestRecord:
    n: int
    key: str | None
    path: str
    peer: str
    model: str
    stream: bool
    step: Step
    auth_present: bool
    stream_options: Any = None
    has_stream_options: bool = False
    request: dict[str, Any] = field(default_factory=dict)
    status: int = 200
    started: float = field(default_factory=time.time)
    ended: float | None = None
    last_write: float | None = None
    text: str = ""
    reasoning_text: str = ""
    refusal: str = ""
    tool_call: dict[str, str] | None = None
    usage: dict[str, int] | None = None
    sent_parts: list[str] = field(default_factory=list)
    chunks_sent: int = 0
    keepalives_sent: int = 0
    completed: bool = False
    aborted: bool = False

    @property
    def fault(self) -> str:
        return self.step.fault.value

    @property
    def sent_text(self) -> str:
        return "".join(self.sent_parts)

    def end(self, *, completed: bool = False, aborted: bool = False) -> None:
        """Mark the response finished; the first call wins."""
        if self.ended is not None:
            return
        self.ended = time.time()
        self.completed = completed
        self.aborted = aborted

    def to_json(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "key": self.key,
            "path": self.path,
            "peer": self.peer,
            "model": self.model,
            "stream": self.stream,
            "fault": self.fault,
            "step": self.step.to_json(),
            "status": self.status,
            "auth_present": self.auth_present,
            "stream_options": self.stream_options,
            "has_stream_options": self.has_stream_options,
            "request": self.request,
            "started": self.started,
            "ended": self.ended,
            "last_write": self.last_write,
            "text": self.text,
            "reasoning_text": self.reasoning_text,
            "refusal": self.refusal,
            "tool_call": self.tool_call,
            "usage": self.usage,
            "sent_text": self.sent_text,
            "chunks_sent": self.chunks_sent,
            "keepalives_sent": self.keepalives_sent,
            "completed": self.completed,
            "aborted": self.aborted,
        }


class RequestLog:
    """Bounded, ordered log of request records."""

    def __init__(self, limit: int = 100_000) -> None:
        self._records: deque[RequestRecord] = deque(maxlen=limit)
        self._next_n = 1

    def next_number(self) -> int:
        n = self._next_n
        self._next_n += 1
        return n

    def add(self, record: RequestRecord) -> None:
        self._records.append(record)

    def select(self, key: str | None = None, since: int = 0) -> Iterator[RequestRecord]:
        for record in self._records:
            if record.n > since and (key is None or record.key == key):
                yield record

    def __len__(self) -> int:
        return len(self._records)

    @property
    def total(self) -> int:
        """Requests seen since start (not reset by :meth:`clear`)."""
        return self._next_n - 1

    def clear(self) -> None:
        self._records.clear()


@dataclass(slots=True)
class EmulatorState:
    scripts: ScriptBook = field(default_factory=ScriptBook)
    log: RequestLog = field(default_factory=RequestLog)
    require_auth: bool = False

    def reset(self) -> None:
        self.scripts.clear()
        self.log.clear()


STATE_KEY: web.AppKey[EmulatorState] = web.AppKey("emulator_state", EmulatorState)


_KEEP_BODY_BYTES = 64 * 1024


def summarize_request(body: dict[str, Any], size: int) -> dict[str, Any]:
    """The request body for the log; a large body loses its messages."""
    if size <= _KEEP_BODY_BYTES:
        return body
    out = {k: v for k, v in body.items() if k != "messages"}
    messages = body.get("messages")
    if isinstance(messages, list):
        out["message_count"] = len(messages)
        out["roles"] = [m.get("role") if isinstance(m, dict) else None for m in messages]
        out["messages_dropped"] = True
        # What a test compares instead: the messages, as canonical JSON.
        out["messages_sha256"] = messages_digest(messages)
    return out


def messages_digest(messages: Any) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()
