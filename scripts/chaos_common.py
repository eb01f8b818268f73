"""Shared machinery of the chaos scripts: the emulator and the daemon, a
bounded load of concurrent calls that survive daemon restarts (idempotent
submits, resubscription from the last seq), and the verdict table.

The verdict is computed from what the calls' subscribers received and from
the emulator's own record of what it sent (streamfence.devtools.verdict), never from
the daemon's counters. Loopback only; every loop is bounded by a call count
and a duration, and the whole run by a final deadline.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import psutil

from streamfence.devtools import disks
from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.devtools.launcher import DaemonProcess
from streamfence.devtools.verdict import BAD, CallRecord, judge, tally, verdict_ok
from streamfence.protocol.client import ClientError

StepMaker = Callable[[random.Random], list[dict[str, Any]]]


def process_tree(proc: DaemonProcess) -> list[int]:
    """The daemon's pid and its descendants' (none once it exited)."""
    if proc.proc is None or proc.proc.poll() is not None:
        return []
    try:
        root = psutil.Process(proc.proc.pid)
        return [root.pid, *(c.pid for c in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def unpack_events(body: bytes) -> list[dict[str, Any]]:
    """The events a row of a call's log carries (msgpack maps, back to back)."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(body)
    return list(unpacker)


def parser(description: str, calls: int = 2000, duration: float = 60.0) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--seed", type=int, default=None, help="random seed (printed; default: random)")
    p.add_argument("--calls", type=int, default=calls, help="calls to submit (upper bound)")
    p.add_argument("--duration", type=float, default=duration,
                   help="seconds to keep submitting and injecting faults")
    p.add_argument("--concurrency", type=int, default=24, help="calls in flight at once")
    p.add_argument("--workers-max", type=int, default=48)
    return p


def seeded(args: argparse.Namespace) -> random.Random:
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    print(f"seed: {seed}  (rerun with --seed {seed})", flush=True)
    return random.Random(seed)


class NoSmallDisk(RuntimeError):
    """A run on a small disk where none can be mounted (the message says why)."""


@dataclass
class ChaosState:
    emulator: EmulatorProcess
    emu: EmulatorClient
    daemon: DaemonProcess
    stop: threading.Event = field(default_factory=threading.Event)
    records: list[CallRecord] = field(default_factory=list)
    faults: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.faults[what] = self.faults.get(what, 0) + n


@contextmanager
def chaos_run(daemon_settings: dict[str, Any] | None = None,
              profile: dict[str, Any] | None = None,
              state_disk: int | None = None) -> Iterator[ChaosState]:
    """A daemon on the emulator; `state_disk`: its state dir on a tmpfs of
    that many MiB (its log beside it, not on it)."""
    with tempfile.TemporaryDirectory(prefix="streamfence-chaos-") as tmp, \
            EmulatorProcess() as emulator, \
            (disks.small_disk(Path(tmp) / "state", state_disk) if state_disk
             else contextlib.nullcontext()) as no_disk:
        if no_disk:
            raise NoSmallDisk(no_disk)
        settings = {"workers_spare": 4, "workers_max": 48, "backoff_base_s": 0.05,
                    "backoff_max_s": 0.3, "log_level": "WARNING"}
        settings.update(daemon_settings or {})
        table = {"kind": "openai", "base_url": emulator.openai_base_url, "stale_timeout_s": 5.0,
                 "max_attempts": 6}
        table.update(profile or {})
        daemon = DaemonProcess(Path(tmp) / "state", {"emu": table}, daemon=settings,
                               log_json=False)
        daemon.log_path = Path(tmp) / "daemon.log"
        daemon.start()
        try:
            # The storms load the machine on purpose: the emulator's control calls
            # (a script per call) may wait longer than a test's usual 10 s.
            yield ChaosState(emulator=emulator, emu=EmulatorClient(emulator.base_url, timeout=30.0),
                             daemon=daemon)
        finally:
            daemon.cleanup()
            if daemon.survivors:
                print(f"PROCESSES OUTLIVED THE DAEMON: {daemon.survivors}")


def _follow(state: ChaosState, record: CallRecord, request: dict[str, Any],
            options: dict[str, Any], deadline: float) -> None:
    """Submit (idempotently) and follow one call to its done, across restarts."""
    last_seq = 0
    while time.monotonic() < deadline:
        try:
            with state.daemon.client(timeout_s=3.0) as client:
                if not record.call_id:
                    record.call_id = client.submit("emu", request, options=options,
                                                   idempotency_key=record.key,
                                                   session_id=f"chaos-{record.key}")
                else:
                    client.subscribe(record.call_id, from_seq=last_seq)
                for event in client.events(record.call_id, timeout_s=30.0):
                    if event["seq"] <= last_seq:
                        continue  # a replay overlapping what we have
                    record.events.append(event)
                    last_seq = event["seq"]
                    if event["op"] == "done":
                        return
        except (TimeoutError, ClientError, OSError) as exc:
            record.errors.append(f"{type(exc).__name__}: {exc}"[:300])
            time.sleep(0.2)  # the daemon is restarting: reconnect and resume


def run_load(state: ChaosState, args: argparse.Namespace, rng: random.Random,
             make_steps: StepMaker, options: Callable[[random.Random], dict[str, Any]],
             finish_timeout: float = 120.0) -> None:
    """Submit up to args.calls calls for args.duration seconds, at most
    args.concurrency at once, then wait for them (bounded)."""
    slots = threading.Semaphore(args.concurrency)
    threads: list[threading.Thread] = []
    started = time.monotonic()
    end = started + args.duration
    for i in range(args.calls):
        if time.monotonic() >= end:
            break
        while not slots.acquire(timeout=0.5):
            if time.monotonic() >= end:
                break
        else:
            key = f"c{i}-{rng.randrange(1 << 30):x}"
            state.emu.script(key, make_steps(rng))
            record = CallRecord(call_id="", key=key)
            state.records.append(record)
            request = {"model": f"gpt-emu#{key}",
                       "messages": [{"role": "user", "content": f"chaos call {i}"}]}
            hard_deadline = end + finish_timeout

            opts = options(rng)

            def body(r: CallRecord = record, q: dict[str, Any] = request,
                     o: dict[str, Any] = opts, d: float = hard_deadline) -> None:
                try:
                    _follow(state, r, q, o, d)
                finally:
                    slots.release()

            t = threading.Thread(target=body, daemon=True)
            threads.append(t)
            t.start()
            continue
        break
    state.stop.set()
    for t in threads:
        t.join(timeout=max(0.0, end + finish_timeout - time.monotonic()) + 1.0)


def _explain_lost(state: ChaosState, lost: list[CallRecord]) -> None:
    """For calls no subscriber saw end: what the daemon says of them."""
    try:
        with state.daemon.client(timeout_s=5.0) as client:
            for r in lost[:10]:
                answer: Any = "never accepted"
                if r.call_id:
                    try:
                        answer = client.result(r.call_id) or "pending"
                    except (TimeoutError, ClientError) as exc:
                        answer = f"{type(exc).__name__}: {exc}"
                if isinstance(answer, dict):
                    answer = {k: answer.get(k) for k in ("status", "error", "attempts")}
                print(f"  lost {r.key} call={r.call_id or '-'} events={len(r.events)} "
                      f"daemon says: {answer}; last client error: {r.errors[-1:]}")
    except Exception as exc:  # diagnostics must not hide the verdict
        print(f"  (could not ask the daemon about lost calls: {exc})")
    proc = state.daemon.proc
    print(f"  daemon process: {'running' if proc and proc.poll() is None else proc and proc.poll()}")
    print("  daemon log tail:\n    " + "\n    ".join(state.daemon.log_text().splitlines()[-25:]))


def verdict(state: ChaosState, title: str) -> bool:
    outcomes = [judge(r, state.emu.log(r.key)) for r in state.records]
    lost = [r for r, labels in zip(state.records, outcomes, strict=True) if labels == ["lost"]]
    if lost:
        _explain_lost(state, lost)
    counts = tally(outcomes)
    failed_unclear = sum(1 for r, labels in zip(state.records, outcomes, strict=True)
                         if labels[0] == "failed" and not ((r.done or {}).get("error") or {})
                         .get("code"))
    rows = [("submitted", counts["submitted"]), ("completed", counts["completed"]),
            ("partial", counts["partial"]),
            ("failed with a clear error", counts["failed"] - failed_unclear),
            ("failed without a clear error (must be 0)", failed_unclear),
            ("cancelled", counts["cancelled"])]
    rows += [(f"{k} (must be 0)", counts[k]) for k in BAD]
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}")
    for what, n in sorted(state.faults.items()):
        print(f"  injected: {what} = {n}")
    print("  " + "-" * (width + 10))
    for k, n in rows:
        print(f"  {k:<{width}} {n:>7}")
    ok = verdict_ok(counts) and failed_unclear == 0 and counts["submitted"] > 0
    print("  " + "-" * (width + 10))
    print(f"  verdict: {'PASS' if ok else 'FAIL'}")
    return ok


# ---- HTTP clients of the gateway (raw SSE: the ids a reconnect names) ------------

@dataclass
class SseFrame:
    id: int | None
    event: str | None
    data: str


def sse_frames(reply: Any) -> Iterator[SseFrame]:
    """The frames of an SSE response (an http.client response), as they come;
    ends at the end of the body (an error of the connection propagates)."""
    seq: int | None = None
    event: str | None = None
    data: str | None = None
    for raw in iter(reply.readline, b""):
        line = raw.decode().rstrip("\n")
        if line.startswith("id: "):
            seq = int(line[4:])
        elif line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
        elif line == "" and data is not None:
            yield SseFrame(seq, event, data)
            seq, event, data = None, None, None


def sse_text(frame: SseFrame) -> str:
    """The answer's text a frame of OpenAI's or Anthropic's stream carries."""
    if frame.data == "[DONE]":
        return ""
    body = json.loads(frame.data)
    if body.get("type") == "content_block_delta":  # Anthropic
        return str((body.get("delta") or {}).get("text") or "")
    return "".join(choice.get("delta", {}).get("content") or ""
                   for choice in body.get("choices") or ())


def sse_ends(frame: SseFrame) -> bool:
    """The frame ends its stream: [DONE], message_stop, or an error."""
    return frame.data == "[DONE]" or frame.event in ("message_stop", "error") \
        or frame.data.startswith('{"error"')
