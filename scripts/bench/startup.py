"""Section 6: start-up. Start → first call done, on a restart of a stopped
daemon (`streamfence serve --log-json`, INFO), with one openai profile (issue
32's figure, target ≤ 2 s) beside the same daemon with a profile of each of
the three wires: the zygote imports and warms the SDKs of the configured
kinds only, so "all wires" is what every start cost before (it imported and
warmed all three whatever the config had). One daemon per variant, each
started once untimed (its state dir, keys, and the bytecode cache), then
restarted every round, the variants alternating.

Instants, from t0 = just before the process is started (wall clock):

- supervisor up   its "supervisor up" record (sockets bound, children started);
- sink serving    the sink's "sink: serving" record;
- zygote ready    the "zygote ready" record (the configured SDKs imported,
                  their streaming path run once, gc.freeze);
- ready           the "ready:" record, sent with READY=1: a worker said hello
                  and the sink answered (a call can run);
- first call      a client that retried its submit from t0 until the
                  endpoint accepted it got the call's `done`;
- pool ready      `workers_spare` workers idle, from `status` polled every
                  10 ms (`for_s` of the most recent idle worker, ±1 ms).

The daemon writes its bytecode to a cache of this run (PYTHONPYCACHEPREFIX;
PYTHONDONTWRITEBYTECODE unset for it), as an installed package has its
.pyc files: compiling streamfence's sources costs each process ~0.3 s.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.bench.common import Section, emulator, log, median, rotated
from streamfence.devtools.emulator.control import EmulatorProcess, emulator_profile
from streamfence.devtools.launcher import DaemonProcess
from streamfence.protocol.client_monitor import NoConnection
from streamfence.protocol.wires import WIRES, sample_request

TARGET_S = 2.0
INSTANTS = {"up": "supervisor up", "sink": "sink: serving", "zygote": "zygote ready",
            "ready": "ready:"}


def _first_ts(proc: DaemonProcess, prefix: str, since: float) -> float:
    for record in proc.log_records():
        if float(record.get("ts", 0)) >= since and str(record.get("message", "")).startswith(
                prefix):
            return float(record["ts"])
    return float("nan")


def _first_call(proc: DaemonProcess) -> None:
    """Submit as soon as the endpoint accepts, and wait for the call's end."""
    while True:
        try:
            with proc.client(timeout_s=60.0) as client:
                call_id = client.submit("openai", sample_request("openai", "emu-model", "hi"),
                                        subscribe=False)
                done = client.result(call_id, wait_s=60.0)
        except NoConnection:
            time.sleep(0.005)
            continue
        if done is None or done.get("status") != "completed":
            raise RuntimeError(f"the first call did not complete: {done}")
        return


def _pool_ready(proc: DaemonProcess, pool: int) -> float:
    with proc.client(timeout_s=10.0) as client:
        deadline = time.monotonic() + 120.0
        while time.monotonic() < deadline:
            sent = time.time()
            status = client.status()
            at = (sent + time.time()) / 2
            idle = [w for w in status["workers"] if w["state"] == "idle"]
            if len(idle) >= pool:
                return at - float(min(w["for_s"] for w in idle))
            time.sleep(0.01)
    return float("nan")


def _restart(proc: DaemonProcess, env: dict[str, str], pool: int) -> dict[str, float]:
    """One timed start of the stopped daemon `proc`: its instants after t0."""
    with open(proc.log_path, "ab") as log_file:
        t0 = time.time()
        proc.proc = subprocess.Popen(
            [sys.executable, "-m", "streamfence.cli", "serve", "--config",
             str(proc.config_path), "--log-json"], stdout=log_file, stderr=log_file, env=env)
        try:
            _first_call(proc)
            done = time.time()
            pool_at = _pool_ready(proc, pool)
        finally:
            proc.stop()
    out = {key: _first_ts(proc, prefix, t0) - t0 for key, prefix in INSTANTS.items()}
    return {**out, "call": done - t0, "pool": pool_at - t0}


def _daemon(tmp: Path, emu: EmulatorProcess, wires: tuple[str, ...], pool: int,
            env: dict[str, str]) -> DaemonProcess:
    """A daemon with a profile of each of `wires` (named by its wire), started
    once untimed (its keys, its bytecode cache) and stopped."""
    proc = DaemonProcess(tmp / "state", {w: emulator_profile(w, emu.base_url) for w in wires},
                         daemon={"workers_spare": pool, "workers_max": pool + 4,
                                 "log_level": "INFO"}, env=env)
    proc.start(ready_timeout=120.0)
    proc.stop()
    return proc


def run(quick: bool, rounds: int) -> Section:
    sec = Section("startup", "6 start-up")
    pool = 8 if quick else 32
    variants = {"one wire": ("openai",), "all wires": WIRES}
    sec.params = {"rounds": rounds, "workers_spare": pool, "variants": list(variants)}
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    loads: list[str] = []
    with emulator() as emu, tempfile.TemporaryDirectory(prefix="sfbench-") as tmp:
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="", PYTHONPYCACHEPREFIX=f"{tmp}/pyc")
        procs = {v: _daemon(Path(tmp) / v.replace(" ", "-"), emu, wires, pool, env)
                 for v, wires in variants.items()}
        try:
            for r in range(rounds):
                loads.append(Path("/proc/loadavg").read_text().split()[0])
                for variant in rotated(list(variants), r):
                    results[variant].append(_restart(procs[variant], env, pool))
                log(f"  startup round {r + 1}/{rounds} (load {loads[-1]}): " + "; ".join(
                    f"{v}: " + ", ".join(f"{k} {x:.2f} s" for k, x in results[v][-1].items())
                    for v in variants))
        finally:
            for proc in procs.values():
                proc.cleanup()
    _report(sec, results, pool, loads)
    return sec


def _report(sec: Section, results: dict[str, list[dict[str, Any]]], pool: int,
            loads: list[str]) -> None:
    def med(variant: str, key: str) -> float:
        return median([r[key] for r in results[variant]])

    one, old = med("one wire", "call"), med("all wires", "call")
    sec.row("start → first call done (restart, one openai profile)", f"{one:.2f} s",
            f"≤ {TARGET_S:.0f} s", f"a profile of each wire (all SDKs, as every start "
            f"before): {old:.2f} s; ratio {one / old:.2f}", met=one <= TARGET_S)
    sec.row("start → ready (READY=1), one profile / all wires",
            f"{med('one wire', 'ready'):.2f} s / {med('all wires', 'ready'):.2f} s")
    sec.row(f"start → warm pool of {pool} ready, one profile / all wires",
            f"{med('one wire', 'pool'):.2f} s / {med('all wires', 'pool'):.2f} s")
    for variant, runs in results.items():
        sec.note(f"- {variant}: supervisor up {med(variant, 'up'):.2f} s, sink serving "
                 f"{med(variant, 'sink'):.2f} s, zygote ready {med(variant, 'zygote'):.2f} s, "
                 f"ready {med(variant, 'ready'):.2f} s, first call done "
                 f"{med(variant, 'call'):.2f} s, pool of {pool} ready "
                 f"{med(variant, 'pool'):.2f} s after start (medians of {len(runs)} restarts).")
    sec.note(f"- load average (1 min) at each round's start: {', '.join(loads)}.")
