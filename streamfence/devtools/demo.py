"""`streamfence demo`: the embedded default. Starts the bundled provider
emulator and the daemon, runs a batch of calls with injected faults (zombie
streams, disconnects, 429 with Retry-After, malformed chunks, cut-offs), shows
a live table while they run, and ends with a verdict computed from the
transcript and the emulator's own record of what it sent."""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from streamfence.devtools.emulator.control import EmulatorProcess, emulator_profile
from streamfence.devtools.launcher import DaemonExited, DaemonProcess
from streamfence.devtools.verdict import BAD, CallRecord, judge, tally, verdict_ok
from streamfence.protocol.wires import WIRES, sample_request


@dataclass(frozen=True)
class Scenario:
    name: str
    steps: list[dict[str, Any]]
    options: dict[str, Any]
    expect: str
    what: str


SCENARIOS = [
    Scenario("clean", [], {}, "completed", "a normal stream"),
    Scenario("slow", [{"fault": "ok", "chunks": 24, "chunk_delay_s": 0.08}], {}, "completed",
             "a slow but live stream is never killed"),
    Scenario("zombie", [{"fault": "stall", "after": 0, "stall_s": 5}],
             {"stale_timeout_s": 1.0}, "completed",
             "silent before its first chunk: fenced, killed, retried"),
    Scenario("zombie-restart", [{"fault": "stall", "after": 4, "stall_s": 5,
                                 "chunk_delay_s": 0.05}],
             {"stale_timeout_s": 1.0, "on_partial": "restart"}, "completed",
             "stalls mid-text: fenced, reset, retried; one answer survives"),
    Scenario("disconnect", [{"fault": "disconnect", "after": 0}], {}, "completed",
             "connection dropped before any text: retried"),
    Scenario("rate-limited", [{"fault": "status", "status": 429, "retry_after": 1}], {},
             "completed", "429 with Retry-After: 1: retried no sooner"),
    Scenario("malformed", [{"fault": "malformed", "after": 0}], {}, "completed",
             "a malformed chunk: retried"),
    Scenario("cut-mid-text", [{"fault": "disconnect", "after": 4}], {}, "partial",
             "cut after text was delivered: partial, never duplicated"),
    Scenario("no-finish", [{"fault": "no_finish"}], {}, "partial",
             "ends without a finish reason: partial, not 'stop'"),
    Scenario("bad-request", [{"fault": "status", "status": 400,
                              "message": "demo: this request is invalid"}], {}, "failed",
             "a 4xx is final: failed with a clear error, no retry"),
]


def _for_wire(wire: str, steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`after` counts a wire's events: Anthropic and Bedrock open a stream with
    two framing events (message start, block start) before the first text."""
    if wire == "openai":
        return steps
    return [dict(s, after=s["after"] + 2) if s.get("after") else s for s in steps]


class Board:
    """What the live table shows, updated from the calls' threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: dict[str, dict[str, Any]] = {}

    def update(self, key: str, **fields: Any) -> None:
        with self.lock:
            self.rows.setdefault(key, {}).update(fields)

    def table(self) -> Table:
        table = Table(title="streamfence demo: calls")
        for col in ("call", "scenario", "state", "attempt", "chars", "expected"):
            table.add_column(col, no_wrap=True)
        with self.lock:
            for key, row in self.rows.items():
                state = row.get("state", "queued")
                style = {"completed": "green", "partial": "yellow", "failed": "red"}.get(state, "")
                table.add_row(key, row.get("scenario", ""), f"[{style}]{state}[/]" if style
                              else state, str(row.get("attempt", "-")), str(row.get("chars", 0)),
                              row.get("expect", ""))
        return table


def _run_call(daemon: DaemonProcess, wire: str, key: str, scenario: Scenario, board: Board,
              record: CallRecord) -> None:
    request = sample_request(wire, f"emu-model#{key}", f"demo call {key}")
    with daemon.client(timeout_s=10.0) as client:
        call_id = client.submit(wire, request, session_id=f"demo-{key}",
                                options=scenario.options or None)
        record.call_id = call_id
        chars = 0
        for event in client.events(call_id, timeout_s=60.0):
            record.events.append(event)
            if event["op"] == "delta":
                if event["kind"] == "text":
                    chars += len(event["data"])
                board.update(key, state="streaming", attempt=event["attempt"], chars=chars)
            elif event["op"] == "reset":
                chars = 0
                board.update(key, state="reset", attempt=event["attempt"], chars=0)
            elif event["op"] == "done":
                board.update(key, state=event["status"], attempt=event["attempts"])


def run_demo(rounds: int = 1, wires: list[str] | None = None,
             console: Console | None = None) -> bool:
    wires = wires or list(WIRES)
    console = console or Console()
    board = Board()
    records: list[tuple[CallRecord, Scenario]] = []
    with tempfile.TemporaryDirectory(prefix="streamfence-demo-") as tmp, \
            EmulatorProcess() as emu:
        emu_client = emu.client()
        profiles = {wire: dict(emulator_profile(wire, emu.base_url), stale_timeout_s=30.0)
                    for wire in wires}
        daemon = DaemonProcess(Path(tmp) / "state", profiles,
                               daemon={"workers_spare": 4, "backoff_base_s": 0.2,
                                       "backoff_max_s": 1.0})
        console.print(f"emulator at {emu.base_url}; starting the daemon "
                      f"(log: {daemon.log_path}) ...")
        started = time.monotonic()
        try:
            daemon.start()
        except (TimeoutError, DaemonExited) as exc:
            daemon.cleanup()
            console.print("[bold red]the daemon did not start:[/]")
            console.print(str(exc), markup=False, highlight=False)
            console.print("[bold red]FAIL[/]")
            return False
        with contextlib.ExitStack() as running:
            running.callback(daemon.cleanup)
            console.print(f"daemon ready in {time.monotonic() - started:.1f}s "
                          f"(workers forked from a warm zygote)")
            threads = []
            for r in range(rounds):
                for wire in wires:
                    for scenario in SCENARIOS:
                        key = f"{wire}-{scenario.name}" + (f"-{r}" if rounds > 1 else "")
                        emu_client.script(key, _for_wire(wire, scenario.steps))
                        record = CallRecord(call_id="", key=key)
                        records.append((record, scenario))
                        board.update(key, scenario=scenario.name, expect=scenario.expect)
                        threads.append(threading.Thread(
                            target=_run_call, args=(daemon, wire, key, scenario, board, record),
                            daemon=True))
            with Live(board.table(), console=console, refresh_per_second=8) as live:
                for t in threads:
                    t.start()
                while any(t.is_alive() for t in threads):
                    live.update(board.table())
                    time.sleep(0.1)
                live.update(board.table())
            for t in threads:
                t.join()
            outcomes = [judge(rec, emu_client.log(rec.key)) for rec, _ in records]
    counts = tally(outcomes)
    unexpected = [(rec.key, sc.expect, labels[0])
                  for (rec, sc), labels in zip(records, outcomes, strict=True)
                  if labels[0] != sc.expect]
    console.print()
    verdict = Table(title="verdict (from the transcript and the emulator's record)")
    verdict.add_column("outcome")
    verdict.add_column("calls", justify="right")
    for key in ("submitted", "completed", "partial", "failed"):
        verdict.add_row(key, str(counts[key]))
    for key in BAD:
        verdict.add_row(f"{key} (must be 0)", str(counts[key]))
    verdict.add_row("not as expected", str(len(unexpected)))
    console.print(verdict)
    for key, expected, got in unexpected:
        console.print(f"[red]{key}: expected {expected}, got {got}[/]")
    ok = verdict_ok(counts) and not unexpected
    console.print("[bold green]PASS[/]" if ok else "[bold red]FAIL[/]")
    return ok
