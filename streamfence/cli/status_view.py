"""Terminal rendering of `status` replies: a header line saying which
daemon answered (an admin's reply), then rich tables."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

CLUSTER_COUNTS = {"calls_owned": "calls owned here", "calls_accepted": "calls accepted here",
                  "takes_won": "takes won (calls of a host whose lease lapsed)",
                  "takes_lost": "takes lost (another host was first)",
                  "calls_moved": "calls moved to another host",
                  "appends_refused": "appends refused by the engine",
                  "runs_waiting": "runs waiting for the cluster"}


def uptime_text(seconds: float) -> str:
    """`3d 04h 05m`, `2h 03m 04s`, `5m 06s` or `7.2s`."""
    whole = int(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours:02d}h {minutes:02d}m"
    if hours:
        return f"{hours}h {minutes:02d}m {secs:02d}s"
    return f"{minutes}m {secs:02d}s" if minutes else f"{seconds:.1f}s"


def status_header(reply: dict[str, Any]) -> str | None:
    """`streamfence VERSION, up UPTIME, config PATH, state dir PATH`; None
    for a reply without them (not an admin's, or an older daemon's)."""
    if "version" not in reply:
        return None
    config = reply.get("config_path") or "none (the built-in defaults)"
    return (f"streamfence {reply['version']}, up {uptime_text(reply.get('uptime_s') or 0.0)}, "
            f"config {config}, state dir {reply.get('state_dir')}")


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
    header = status_header(reply)
    if header is not None:
        console.print(header, highlight=False, markup=False, soft_wrap=True)
    for table in status_tables(reply):
        console.print(table)
