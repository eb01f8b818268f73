"""Terminal rendering of `status` replies (rich tables)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

CLUSTER_COUNTS = {"calls_owned": "calls owned here", "calls_accepted": "calls accepted here",
                  "takes_won": "takes won (calls of a host whose lease lapsed)",
                  "takes_lost": "takes lost (another host was first)",
                  "calls_moved": "calls moved to another host",
                  "appends_refused": "appends refused by the engine"}


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
    cluster = reply.get("cluster")
    return [workers, calls, counters, *(cluster_tables(cluster) if cluster else [])]


def _age(seconds: Any) -> str:
    return "never" if seconds is None else f"{seconds:.1f} s ago"


def cluster_tables(cluster: dict[str, Any]) -> list[Table]:
    """This host and each host it has seen beat; then its cluster counts."""
    hosts = Table(title=f"cluster (lease {cluster.get('lease_s', 0):g} s, NATS "
                        f"{'connected' if cluster.get('connected') else 'DISCONNECTED'})")
    for col in ("host", "last beat", "lease"):
        hosts.add_column(col)
    hosts.add_row(f"{cluster.get('host')} (this host)", _age(cluster.get("lease_age_s")), "held")
    for host, seen in sorted((cluster.get("hosts") or {}).items()):
        hosts.add_row(host, _age(seen.get("beat_age_s")),
                      "lost: its calls taken over" if seen.get("lease_lost") else "held")
    counts = Table(title="cluster counts")
    counts.add_column("what")
    counts.add_column("count", justify="right")
    for key, what in CLUSTER_COUNTS.items():
        counts.add_row(what, str(cluster.get(key, 0)))
    return [hosts, counts]


def render_status(reply: dict[str, Any]) -> None:
    console = Console()
    for table in status_tables(reply):
        console.print(table)
