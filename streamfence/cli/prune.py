"""`streamfence prune --older-than 3d`: retention by hand.

Deletes the finished calls older than the given age from the journal (with
their attempts) and from the transcript (with their events) of the state dir
of `--config`; never a call that has not finished. It works with or without a
running daemon: each file is changed in small transactions with a busy
timeout, so a running supervisor and sink wait a few milliseconds at most.
The daemon does the same on its own with `[daemon] retention_days`.
"""

from __future__ import annotations

import os
import re
import sqlite3
import time

import click

from streamfence.cli.common import config_option, load

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_AGE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd])\s*$")


def parse_age(text: str) -> float:
    """'3d', '12h', '30m', '90s' (decimals allowed) -> seconds; ValueError otherwise."""
    m = _AGE.match(text.lower())
    if m is None:
        raise ValueError(f"{text!r} is not an age: give a number and a unit s, m, h or d "
                         f"(e.g. 3d, 12h, 30m, 90s)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _age_option(ctx: click.Context, param: click.Parameter, value: str) -> float:
    try:
        return parse_age(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


@click.command()
@config_option
@click.option("--older-than", "age_s", required=True, callback=_age_option,
              help="Remove the calls that finished longer ago than this (3d, 12h, 30m, 90s).")
def prune(config_path: str | None, age_s: float) -> None:
    """Remove finished calls older than --older-than from the journal and the transcript."""
    from streamfence.sink.transcript import prune_transcript
    from streamfence.supervisor.journal_file import prune_journal

    cfg = load(config_path)
    if not os.path.isdir(cfg.state_dir):
        raise click.ClickException(f"no state dir {cfg.state_dir!r} (daemon.state_dir of the "
                                   f"configuration): nothing to prune")
    older_than = time.time() - age_s
    # The journal first: a call it still knows keeps its events.
    for name, prune_file in (("journal.db", prune_journal),
                             ("transcript.db", prune_transcript)):
        path = os.path.join(cfg.state_dir, name)
        if not os.path.exists(path):
            click.echo(f"{name}: absent, nothing to prune")
            continue
        try:
            removed = prune_file(path, older_than)
        except sqlite3.Error as exc:
            raise click.ClickException(f"{path}: {exc}") from None
        click.echo(f"{name}: removed {removed} finished call{'' if removed == 1 else 's'}")
