"""`streamfence usage`: the usage sums and budgets the daemon keeps
(supervisor/usage.py), asked for with the `usage` request (PROTOCOL §4):
an admin sees every identity's, any other identity its own.
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from streamfence.cli.common import client_options, connect

BY = ("identity", "profile", "model", "day")
SUMS = ("calls", "failed", "attempts", "input_tokens", "output_tokens", "spend")


def since_day(since: str | None, now: float | None = None) -> str | None:
    """`--since`: a UTC day (YYYY-MM-DD), `today`, `month` (this UTC month's
    first day) or `Nd` (the last N days, today included); None: all."""
    if since is None:
        return None
    t = time.time() if now is None else now
    if since == "today":
        return time.strftime("%Y-%m-%d", time.gmtime(t))
    if since == "month":
        return time.strftime("%Y-%m-01", time.gmtime(t))
    if since.endswith("d") and since[:-1].isdigit() and int(since[:-1]) > 0:
        return time.strftime("%Y-%m-%d", time.gmtime(t - (int(since[:-1]) - 1) * 86400))
    try:
        time.strptime(since, "%Y-%m-%d")
    except ValueError:
        raise click.BadParameter("a UTC day YYYY-MM-DD, today, month or Nd (e.g. 7d)",
                                 param_hint="--since") from None
    return since


def render(reply: dict[str, Any]) -> list[str]:
    """The sums as a table, then the budgets, one a line."""
    by = [str(b) for b in reply.get("by") or []]
    rows = reply.get("rows") or []
    head = [*by, *SUMS]
    table = [head] + [[_cell(row.get(k)) for k in head] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i < len(by) else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
             for r in table]
    if not rows:
        lines.append("(no usage yet)")
    for b in reply.get("budgets") or []:
        lines.append(f"budget {b.get('identity')}: {b.get('budget')} {_cell(b.get('used'))} "
                     f"of {_cell(b.get('limit'))}, resets {b.get('resets')}")
    return lines


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}".rstrip("0").rstrip(".")
    return str(value)


@click.command()
@client_options
@click.option("--by", "by", type=click.Choice(BY), multiple=True,
              help="Group the sums by this (repeat for several; default: identity, "
                   "profile and model).")
@click.option("--since", default=None,
              help="From this UTC day on: YYYY-MM-DD, today, month or Nd (default: all).")
@click.option("--json", "as_json", is_flag=True, default=False)
def usage(endpoint: str | None, credentials: str | None, config_path: str | None,
          by: tuple[str, ...], since: str | None, as_json: bool) -> None:
    """Show the tokens, calls and spend used, summed per identity, profile
    and model, and the budgets (an admin sees every identity; another
    identity its own)."""
    day = since_day(since)
    with connect(endpoint, credentials, config_path, timeout_s=5.0) as client:
        reply = client.usage(by=list(by) or None, since=day)
    if as_json:
        click.echo(json.dumps(reply, indent=2, default=str))
        return
    for line in render(reply):
        click.echo(line)
