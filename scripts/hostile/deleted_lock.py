"""Deleted lock: `daemon.lock` deleted under the running daemon, then a
second `streamfence serve` on the same config, again and again; and one on
another state dir with the same ipc endpoint. Each must exit at once,
refused, naming the running daemon's pid, and take nothing from it (issue
29, item 4: a second daemon once ran on the same state dir and rebound the
first one's internal sockets)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.hostile import Attack
from streamfence.protocol.client import ClientError

NAME = "deleted lock"
ABOUT = "daemon.lock deleted, then second daemons on the same state dir and endpoint"
PACE_S = 2.0  # one second daemon every 2 s: each is a whole interpreter's start
REFUSED_WITHIN_S = 10.0


def _second_serve(a: Attack, config: Path, holder: int, what: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFENCE_")}
    proc = subprocess.Popen([sys.executable, "-m", "streamfence.cli", "serve", "--config",
                             str(config)], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=REFUSED_WITHIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()  # it ran: the bug this scenario is for
        proc.communicate()
        a.count(f"{what}: second daemon ran")
        return
    if proc.returncode != 0 and f"pid {holder}" in err:
        a.count(f"{what}: refused naming pid {holder}")
    else:
        a.count(f"{what}: exit {proc.returncode} without naming the holder")


def attack(a: Attack) -> None:
    assert a.daemon.proc is not None
    holder = a.daemon.proc.pid
    lock = a.state_dir / "daemon.lock"
    with tempfile.TemporaryDirectory(prefix="sf-other-") as tmp:
        other = Path(tmp) / "streamfence.toml"
        other.write_text(f'[daemon]\nstate_dir = "{tmp}/state"\n'
                         f'endpoint = "{a.endpoint}"\nlog_level = "WARNING"\n')
        n = 0
        while not a.stop.is_set():
            if n % 2 == 0:
                lock.unlink(missing_ok=True)
                a.count("daemon.lock deleted")
                _second_serve(a, a.daemon.config_path, holder, "same state dir")
            else:
                _second_serve(a, other, holder, "same endpoint")
            n += 1
            a.stop.wait(PACE_S)


def checks(a: Attack) -> list[tuple[str, bool]]:
    bad = {k: v for k, v in a.counts.items() if "ran" in k or "without" in k}
    refused = sum(v for k, v in a.counts.items() if "refused" in k)
    assert a.daemon.proc is not None
    supervisor: object = None
    with a.daemon.client() as admin:
        try:
            supervisor = admin.status()["processes"]["supervisor"]
        except (TimeoutError, ClientError) as exc:  # its endpoint taken from under it
            supervisor = f"no answer ({exc})"[:120]
    return [(f"every second daemon refused at once, naming the holder: {refused} refused, "
             f"{bad or 'none otherwise'}", refused > 0 and not bad),
            (f"the first daemon still serves (status says supervisor pid {supervisor})",
             supervisor == a.daemon.proc.pid)]
