"""The calls of a schedule of scripts/chaos_schedules.py: how each is made
and followed to its end across the schedule's faults, and the judge of one
call from what its subscriber got and the emulator's record.

A call is followed through a `Daemons` (the schedule's run): its current
daemon, which a supervisor's crash replaces, and the gateway's port. Every
follower is bounded by a deadline and reconnects as a client would after a
restart: ZeroMQ calls resubmit with their idempotency key and resubscribe
from their last seq; HTTP calls re-POST with their Idempotency-Key and
Last-Event-ID.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from scripts.chaos_common import sse_ends, sse_frames, sse_text
from streamfence.devtools.launcher import DaemonProcess
from streamfence.devtools.verdict import CallRecord, judge
from streamfence.gateway.keys import http_key
from streamfence.protocol.client import ClientError
from streamfence.protocol.credentials import load_credentials
from streamfence.protocol.wires import sample_request

# An HTTP client gives up on a silent stream after this long and re-POSTs it
# with Last-Event-ID (longer than any pause a schedule arms).
HTTP_READ_S = 20.0


class Daemons(Protocol):
    """The schedule's run, as the followers see it."""

    port: int  # the gateway's

    def current(self) -> DaemonProcess: ...


@dataclass(frozen=True)
class Plan:
    """One call of the mix: how it is made and followed."""
    name: str
    kind: str  # zmq | zmq-resume | zmq-cancel | http | http-resume
    wire: str
    policy: str
    chunks: int
    back: int = 0  # zmq-resume / http-resume: resubscribe this many seqs back

    def show(self) -> str:
        back = f" back {self.back}" if self.back else ""
        return f"{self.kind}/{self.wire}/{self.policy}/{self.chunks} chunks{back}"



@dataclass
class Followed:
    plan: Plan
    key: str
    record: CallRecord
    labels: list[str] = field(default_factory=list)
    http_text: str = ""
    http_error: str = ""  # the error frame an HTTP stream ended with
    ids: list[tuple[int, int]] = field(default_factory=list)  # HTTP: (Last-Event-ID, first id)
    heard: float = field(default_factory=time.monotonic)  # the last event's time
    silence: float = 0.0  # the longest wait for the next event

    def hear(self) -> None:
        now = time.monotonic()
        self.silence = max(self.silence, now - self.heard)
        self.heard = now


def _keep(f: Followed, event: dict[str, Any], seen: dict[int, dict[str, Any]]) -> bool:
    """Record a ZeroMQ event once; a replay must equal what came live, and
    no seq may be skipped. True when it is the call's done."""
    seq = event["seq"]
    f.hear()
    if seq in seen:
        if seen[seq] != event:
            f.labels.append("interleaved")  # a replay that differs from the live event
        return False
    if seq != len(seen) + 1:
        f.labels.append("skipped")
    seen[seq] = event
    f.record.events.append(event)
    return bool(event["op"] == "done")


def follow_zmq(run: Daemons, f: Followed, deadline: float) -> None:
    """Submit (idempotently) and follow to the done across restarts; a
    zmq-resume call leaves after 5 events and comes back `back` seqs earlier,
    a zmq-cancel call cancels after 3."""
    p = f.plan
    f.heard = time.monotonic()
    request = sample_request(p.wire, f"emu-model#{f.key}", f"schedule call {f.key}")
    seen: dict[int, dict[str, Any]] = {}
    resumed, cancelled = p.kind != "zmq-resume", p.kind != "zmq-cancel"
    while time.monotonic() < deadline:
        try:
            with run.current().client(timeout_s=3.0) as client:
                if not f.record.call_id:
                    f.record.call_id = client.submit(
                        p.wire, request, options={"on_partial": p.policy},
                        idempotency_key=f.key, session_id=f"sched-{f.key}")
                else:
                    client.subscribe(f.record.call_id, from_seq=max(0, len(seen) - (
                        0 if resumed else p.back)))
                    resumed = True
                # No silence limit: the library probes the daemon each timeout_s
                # of silence and raises when a dead one does not answer.
                for event in client.events(f.record.call_id, timeout_s=None):
                    if _keep(f, event, seen):
                        return
                    if not cancelled and len(seen) >= 3:
                        cancelled = True
                        client.cancel(f.record.call_id)
                    if not resumed and len(seen) >= 5:
                        break  # leave; the loop comes back from an earlier seq
        except (TimeoutError, ClientError, OSError) as exc:
            f.record.errors.append(f"{type(exc).__name__}: {exc}"[:300])
            time.sleep(0.2)


def _http_body(f: Followed) -> tuple[str, str]:
    text = f"schedule call {f.key}"
    if f.plan.wire == "openai":
        return "/v1/chat/completions", json.dumps({
            "model": f"openai/emu-model#{f.key}", "stream": True,
            "messages": [{"role": "user", "content": text}]})
    return "/v1/messages", json.dumps({
        "model": f"anthropic/emu-model#{f.key}", "stream": True, "max_tokens": 1024,
        "messages": [{"role": "user", "content": text}]})


def follow_http(run: Daemons, f: Followed, deadline: float) -> None:
    """POST with an Idempotency-Key; a dropped connection re-POSTs with
    Last-Event-ID naming the event before the last one got (whose frames
    may have come in part). An http-resume call leaves after 5 ids on
    purpose and names one `back` ids earlier: it must get exactly the rest."""
    path, body = _http_body(f)
    f.heard = time.monotonic()
    texts: dict[int, str] = {}  # id -> the text of its frames (one event, maybe many frames)
    resumed = f.plan.kind != "http-resume"
    while time.monotonic() < deadline:
        named, left, got = max(texts, default=0), False, False
        try:
            key = http_key(load_credentials(run.current().credentials_path))
            conn = http.client.HTTPConnection("127.0.0.1", run.port, timeout=HTTP_READ_S)
            headers = {"Authorization": f"Bearer {key}", "x-api-key": key,
                       "Content-Type": "application/json", "Idempotency-Key": f.key,
                       **({"Last-Event-ID": str(named)} if named else {})}
            conn.request("POST", path, body, headers)
            reply = conn.getresponse()
            f.record.call_id = reply.getheader("X-Streamfence-Call-Id") or f.record.call_id
            if reply.status != 200:
                f.record.errors.append(f"HTTP {reply.status}: {reply.read()[:200]!r}")
                conn.close()
                if 400 <= reply.status < 500 and reply.status != 429:
                    return  # the call's own answer (failed, cancelled): the judge reads it
                time.sleep(0.3)
                continue
            first = True
            for frame in sse_frames(reply):
                seq = frame.id or 0
                got = True
                f.hear()
                if first:
                    f.ids.append((named, seq))
                    first = False
                if seq <= named and not sse_ends(frame):
                    f.labels.append("duplicated")  # at or before Last-Event-ID again
                    continue
                texts[seq] = texts.get(seq, "") + sse_text(frame)
                if sse_ends(frame):
                    conn.close()
                    f.http_text = "".join(texts[s] for s in sorted(texts))
                    if frame.event == "error" or frame.data.startswith('{"error"'):
                        f.http_error = frame.data[:200]
                    return
                if not resumed and len(texts) >= 5:
                    resumed = left = True
                    for s in sorted(texts)[-f.plan.back:]:
                        del texts[s]
                    break
            conn.close()
        except (OSError, http.client.HTTPException, ValueError) as exc:
            f.record.errors.append(f"{type(exc).__name__}: {exc}"[:300])
            time.sleep(0.3)
        if got and not left:
            del texts[max(texts)]  # a drop: the last event's frames may have come in part


def transcript(run: Daemons, f: Followed, deadline: float) -> None:
    """An HTTP call's events, read over ZeroMQ once it ended (the judge's input)."""
    while f.record.call_id and f.record.done is None and time.monotonic() < deadline:
        try:
            with run.current().client(timeout_s=3.0) as client:
                client.subscribe(f.record.call_id, from_seq=0)
                f.record.events = list(client.events(f.record.call_id, timeout_s=10.0))
        except (TimeoutError, ClientError, OSError) as exc:
            f.record.errors.append(f"{type(exc).__name__}: {exc}"[:300])
            time.sleep(0.3)



# ---- the judge of one call --------------------------------------------------

def judge_call(f: Followed, sent: list[dict[str, Any]], free: bool) -> list[str]:
    labels = list(f.labels)
    outcome = judge(f.record, sent)
    labels += outcome if outcome == ["lost"] else outcome[1:]  # [status, labels...]
    if f.http_error and free:
        labels.append(f"http_error ({f.http_error})")  # a free fault cost an HTTP answer
    if f.plan.kind.startswith("http") and f.record.done is not None and not f.http_error:
        answer = (f.record.done.get("response") or {}).get("content") or ""
        if f.record.done.get("status") in ("completed", "partial") and f.http_text != answer:
            at = next((i for i, (a, b) in enumerate(zip(f.http_text, answer, strict=False))
                       if a != b), min(len(f.http_text), len(answer)))
            # the HTTP stream is not the call's answer
            labels.append(f"skipped (HTTP text differs at char {at}: {len(f.http_text)} "
                          f"chars of {len(answer)}; ids {f.ids})")
    if any(r.get("ended") is None for r in sent):
        labels.append("open_request")
    if free and len(sent) > 1:
        labels.append("extra_request")
    return sorted(set(labels))
