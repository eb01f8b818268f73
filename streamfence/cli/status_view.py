"""Terminal rendering of `status` replies (rich tables)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def status_tables(reply: dict[str, Any]) -> list[Table]:
    workers = Table(title="workers")
    for col in ("id", "pid", "state", "call", "attempt", "for (s)"):
        workers.add_column(col)
    for w in reply.get("workers", []):
        workers.add_row(str(w["worker_id"]), str(w["pid"]), w["state"],
                        (w.get("call_id") or "-")[:12], str(w.get("attempt") or "-"),
                        f"{w.get('for_s', 0):.1f}")
    calls = Table(title="calls")
    calls.add_column("state")
    calls.add_column("count", justify="right")
    for state, n in sorted(reply.get("calls", {}).get("by_state", {}).items()):
        calls.add_row(state, str(n))
    calls.add_row("queued", str(reply.get("calls", {}).get("queued", 0)))
    counters = Table(title="counters")
    counters.add_column("counter")
    counters.add_column("value", justify="right")
    for key, value in sorted(reply.get("counters", {}).items()):
        counters.add_row(key, str(value))
    sink = reply.get("sink") or {}
    for key in sorted(sink):
        if isinstance(sink[key], int | float):
            counters.add_row("sink." + key, str(sink[key]))
    return [workers, calls, counters]


def render_status(reply: dict[str, Any]) -> None:
    console = Console()
    for table in status_tables(reply):
        console.print(table)
