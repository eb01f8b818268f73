"""`streamfence demo`: the embedded default. Starts the bundled provider
emulator and the daemon, runs a batch of calls with injected faults (zombie
streams, disconnects, 429 with Retry-After, malformed chunks, cut-offs), shows
a live table while they run, and ends with a verdict computed from the
transcript and the emulator's own record of what it sent.

Its output fits 80 columns: a legend of the scenarios, then one row per
scenario and one column per wire. The work dir (the daemon's state dir and
log, the emulator's log and request record) is removed after a PASS and
kept, with its path printed, after a FAIL or with `keep`. A first Ctrl-C
stops the run and lets the daemon drain; a second one kills the daemon and
the emulator at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
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
FINAL = ("completed", "partial", "failed", "cancelled")


def _for_wire(wire: str, steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`after` counts a wire's events: Anthropic and Bedrock open a stream with
    two framing events (message start, block start) before the first text."""
    if wire == "openai":
        return steps
    return [dict(s, after=s["after"] + 2) if s.get("after") else s for s in steps]


def legend(wires: list[str]) -> Table:
    """What each scenario does, and how to read a cell of the table."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True, style="bold")
    grid.add_column()
    for scenario in SCENARIOS:
        grid.add_row(scenario.name, scenario.what)
    grid.add_row("", "")
    grid.add_row("cells", f"one call per scenario on each wire ({', '.join(wires)}): #N is "
                          f"its attempt (#2: the first retry), then its state, or the "
                          f"characters received while it streams")
    return grid


class Board:
    """What the live table shows (a row per scenario, a column per wire),
    updated from the calls' threads."""

    def __init__(self, wires: list[str]) -> None:
        self.wires = wires
        self.lock = threading.Lock()
        self.rows: dict[str, dict[str, Any]] = {}  # row label -> expect, and a cell per wire
        self.cells: dict[str, dict[str, Any]] = {}  # call key -> its cell's fields

    def add(self, key: str, row: str, wire: str, expect: str) -> None:
        with self.lock:
            cell: dict[str, Any] = {"state": "queued", "expect": expect}
            self.cells[key] = cell
            self.rows.setdefault(row, {"expect": expect})[wire] = cell

    def update(self, key: str, **fields: Any) -> None:
        with self.lock:
            self.cells[key].update(fields)

    @staticmethod
    def cell(cell: dict[str, Any] | None) -> str:
        if cell is None:
            return ""
        state = cell["state"]
        if state == "queued":
            return "[dim]queued[/]"
        attempt = f"#{cell.get('attempt', 1)}"
        if state == "streaming":
            return f"{attempt} {cell.get('chars', 0)} chars"
        if state in FINAL:
            style = "green" if state == cell["expect"] else "bold red"
            return f"{attempt} [{style}]{state}[/]"
        return f"{attempt} {state}"

    def table(self) -> Table:
        table = Table(title="streamfence demo: calls")
        table.add_column("scenario", no_wrap=True)
        table.add_column("expected", no_wrap=True)
        for wire in self.wires:
            table.add_column(wire, no_wrap=True)
        with self.lock:
            for label, row in self.rows.items():
                table.add_row(label, row["expect"], *(self.cell(row.get(w)) for w in self.wires))
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


class CtrlC:
    """SIGINT while the demo runs. The first raises KeyboardInterrupt, so the
    run unwinds and stops the daemon gracefully (it drains); the second kills
    what `kill_now` lists at once, then raises again."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.presses = 0
        self.kill_now: list[Callable[[], None]] = []

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.presses += 1
        if self.presses == 1:
            self.console.print("\n[yellow]Ctrl-C: stopping; the daemon drains its running "
                               "calls (Ctrl-C again: at once)[/]")
        else:
            self.console.print("[yellow]second Ctrl-C: killing the daemon and the emulator "
                               "now[/]")
            for kill in self.kill_now:
                with contextlib.suppress(Exception):
                    kill()
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self) -> Iterator[CtrlC]:
        previous = signal.signal(signal.SIGINT, self)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


def _kill_daemon(daemon: DaemonProcess) -> Callable[[], None]:
    def kill() -> None:
        proc = daemon.proc
        if proc is None:
            return
        # SIGKILL to every process of the daemon, not waiting for its children
        # to die of their parent's death: reaping them is init's business.
        for pid in sorted(daemon.remember_descendants()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=5)
        daemon.descendants.clear()  # killed above: nothing for cleanup to wait on
        daemon.cleanup()

    return kill


def _kill_emulator(emu: EmulatorProcess) -> Callable[[], None]:
    def kill() -> None:
        if emu.pid is not None and emu.returncode is None:
            os.kill(emu.pid, signal.SIGKILL)

    return kill


def _save_emulator_log(emu: EmulatorProcess, workdir: Path) -> None:
    with contextlib.suppress(OSError):
        (workdir / "emulator.log").write_text(emu.stderr_tail(limit=50 * 1024 * 1024))


def run_demo(rounds: int = 1, wires: list[str] | None = None,
             console: Console | None = None, keep: bool = False) -> bool:
    """Run the demo; True on PASS. The work dir is kept after a FAIL or with
    `keep`, and its path printed. A Ctrl-C raises KeyboardInterrupt after the
    clean-up (see CtrlC)."""
    wires = wires or list(WIRES)
    console = console or Console()
    workdir = Path(tempfile.mkdtemp(prefix="streamfence-demo-"))
    ok = False
    interrupted = False
    try:
        with CtrlC(console).installed() as ctrl_c:
            ok = _run(rounds, wires, console, workdir, ctrl_c)
    except KeyboardInterrupt:
        interrupted = True
    if keep or (not ok and not interrupted):
        console.print(f"kept for a look: {workdir}/", soft_wrap=True)
        console.print("  state/daemon.log, emulator.log, emulator-requests.json, and the "
                      "daemon's state (state/journal.db, state/transcript.db)")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    if interrupted:
        console.print("interrupted: no verdict")
        raise KeyboardInterrupt
    return ok


def _run(rounds: int, wires: list[str], console: Console, workdir: Path,
         ctrl_c: CtrlC) -> bool:
    board = Board(wires)
    records: list[tuple[CallRecord, Scenario]] = []
    console.print(f"streamfence demo: the daemon against the bundled provider emulator,\n"
                  f"{len(SCENARIOS)} fault scenarios on each wire:")
    console.print(legend(wires))
    console.print()
    with contextlib.ExitStack() as running:
        emu = running.enter_context(EmulatorProcess())
        ctrl_c.kill_now.append(_kill_emulator(emu))
        running.callback(_save_emulator_log, emu, workdir)
        emu_client = emu.client()
        profiles = {wire: dict(emulator_profile(wire, emu.base_url), stale_timeout_s=30.0)
                    for wire in wires}
        daemon = DaemonProcess(workdir / "state", profiles,
                               daemon={"workers_spare": 4, "backoff_base_s": 0.2,
                                       "backoff_max_s": 1.0})
        ctrl_c.kill_now.insert(0, _kill_daemon(daemon))
        running.callback(daemon.cleanup)
        console.print(f"emulator: {emu.base_url}")
        console.print(f"daemon log: {daemon.log_path}", soft_wrap=True)
        started = time.monotonic()
        try:
            daemon.start()
        except (TimeoutError, DaemonExited) as exc:
            console.print("[bold red]the daemon did not start:[/]")
            console.print(str(exc), markup=False, highlight=False)
            console.print("[bold red]FAIL[/]")
            return False
        console.print(f"daemon ready in {time.monotonic() - started:.1f} s (workers forked "
                      f"from a warm zygote)")
        threads = []
        for r in range(rounds):
            for scenario in SCENARIOS:
                row = scenario.name + (f" {r + 1}" if rounds > 1 else "")
                for wire in wires:
                    key = f"{wire}-{scenario.name}" + (f"-{r}" if rounds > 1 else "")
                    emu_client.script(key, _for_wire(wire, scenario.steps))
                    record = CallRecord(call_id="", key=key)
                    records.append((record, scenario))
                    board.add(key, row, wire, scenario.expect)
                    threads.append(threading.Thread(
                        target=_run_call, args=(daemon, wire, key, scenario, board, record),
                        daemon=True))
        try:
            with Live(board.table(), console=console, refresh_per_second=8) as live:
                for t in threads:
                    t.start()
                while any(t.is_alive() for t in threads):
                    live.update(board.table())
                    time.sleep(0.1)
                live.update(board.table())
        finally:
            console.print()  # Live leaves the cursor at the end of the table's last line
        for t in threads:
            t.join()
        outcomes = [judge(rec, emu_client.log(rec.key)) for rec, _ in records]
        with contextlib.suppress(OSError):
            (workdir / "emulator-requests.json").write_text(
                json.dumps(emu_client.log(), indent=1, default=str))
    return _verdict(console, records, outcomes)


def _verdict(console: Console, records: list[tuple[CallRecord, Scenario]],
             outcomes: list[list[str]]) -> bool:
    counts = tally(outcomes)
    unexpected = [(rec.key, sc.expect, labels[0])
                  for (rec, sc), labels in zip(records, outcomes, strict=True)
                  if labels[0] != sc.expect]
    console.print("verdict, from the transcript and the emulator's own record:")
    verdict = Table()
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
