"""`streamfence reload` and `streamfence stop`: SIGHUP or SIGTERM to the
daemon that holds the state dir of `--config` (its pid: the process holding
the state dir's lock, supervisor/statedir.py), on this machine, as systemd's
ExecReload and `kill` do. `stop` waits for the daemon to exit (its drain:
stop_grace_s, then its children's stop), bounded by `--timeout`.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import click

from streamfence.cli.common import config_option, config_path_of, load

STOP_MARGIN_S = 15.0  # past stop_grace_s: the children's stop (up to 6 s) and the last commit
POLL_S = 0.1


def _daemon_pid(config_path: str | None) -> tuple[int, Path]:
    """The pid of the daemon on the config's state dir, and the dir; a
    ClickException naming the state dir if none runs there."""
    from streamfence.supervisor.statedir import lock_holder

    cfg = load(config_path)
    state_dir = Path(cfg.state_dir).resolve()
    where = f"{state_dir} (daemon.state_dir of {config_path_of(config_path) or 'the defaults'})"
    try:
        holder = lock_holder(state_dir) if state_dir.is_dir() else None
    except OSError as exc:
        raise click.ClickException(f"{where}: cannot read its lock ({exc.strerror})") from None
    if holder is None:
        raise click.ClickException(f"no streamfence daemon is running on {where}")
    if not holder.isdigit():
        raise click.ClickException(f"a process holds the lock of {where}, but its pid is "
                                   f"unknown (no /proc/locks entry, no daemon.lock)")
    return int(holder), state_dir


def _signal(pid: int, signum: signal.Signals) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        raise click.ClickException(f"the daemon (pid {pid}) exited meanwhile") from None
    except PermissionError:
        raise click.ClickException(f"not allowed to signal the daemon (pid {pid}): run this "
                                   f"as its user") from None


@click.command()
@config_option
def reload(config_path: str | None) -> None:
    """Make the running daemon read its config file again (SIGHUP): profiles,
    identities and the log level change for new calls; running calls are not
    touched. The daemon's log says what changed, or why the file was refused."""
    pid, state_dir = _daemon_pid(config_path)
    _signal(pid, signal.SIGHUP)
    click.echo(f"sent SIGHUP to the daemon (pid {pid}) on {state_dir}: its log says what "
               f"changed, or why the new config was refused")


@click.command()
@config_option
@click.option("--timeout", type=float, default=None,
              help=f"Give up waiting after this many seconds (default: the config's "
                   f"stop_grace_s + {STOP_MARGIN_S:g}).")
def stop(config_path: str | None, timeout: float | None) -> None:
    """Stop the running daemon (SIGTERM) and wait for it to exit: it takes no
    new calls and lets the running attempts finish within stop_grace_s."""
    from streamfence.supervisor.statedir import lock_holder

    pid, state_dir = _daemon_pid(config_path)
    limit = load(config_path).stop_grace_s + STOP_MARGIN_S if timeout is None else timeout
    _signal(pid, signal.SIGTERM)
    click.echo(f"sent SIGTERM to the daemon (pid {pid}) on {state_dir}; waiting up to "
               f"{limit:g} s for it to exit", err=True)
    until = time.monotonic() + limit
    while lock_holder(state_dir) == str(pid):  # released as its last step
        if time.monotonic() >= until:
            raise click.ClickException(f"the daemon (pid {pid}) is still running after "
                                       f"{limit:g} s (its drain: stop_grace_s); it goes on "
                                       f"stopping")
        time.sleep(POLL_S)
    click.echo(f"stopped (pid {pid})", err=True)
