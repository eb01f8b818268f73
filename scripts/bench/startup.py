"""Section 6: start-up, daemon start to ready, and a warm pool of N workers.

Each round starts the real daemon (`streamfence serve --log-json`, INFO) in a
fresh state directory, alternating a pool of `workers_spare` 2 and of N.
Instants, from t0 = just before the process is started (wall clock):

- supervisor up   its "supervisor up" log record (sockets bound, sink and
                  zygote started);
- zygote ready    the zygote's "zygote ready" record (imports, SSL context,
                  each SDK's streaming path run once, gc.freeze);
- ready           the "ready:" record: the first worker's hello after the
                  zygote is ready (the daemon can run a call);
- pool ready      the last of the N workers idle, from `status` polled every
                  10 ms (`for_s` of the most recent idle worker, ±1 ms).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.bench.common import Section, emulator, log, median, providers_for, rotated
from streamfence.devtools.emulator.control import EmulatorProcess
from streamfence.devtools.launcher import DaemonProcess


def _first_ts(proc: DaemonProcess, prefix: str) -> float:
    for record in proc.log_records():
        if str(record.get("message", "")).startswith(prefix):
            return float(record["ts"])
    return float("nan")


def _one(emu: EmulatorProcess, pool: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="sfbench-") as tmp:
        proc = DaemonProcess(Path(tmp) / "state", providers_for(emu),
                             daemon={"workers_spare": pool, "workers_max": pool + 4,
                                     "log_level": "INFO"})
        try:
            t0 = time.time()
            proc.start(ready_timeout=120.0)
            pool_at = float("nan")
            with proc.client(timeout_s=10.0) as client:
                deadline = time.monotonic() + 120.0
                while time.monotonic() < deadline:
                    sent = time.time()
                    status = client.status()
                    at = (sent + time.time()) / 2
                    idle = [w for w in status["workers"] if w["state"] == "idle"]
                    if len(idle) >= pool:
                        pool_at = at - min(w["for_s"] for w in idle)
                        break
                    time.sleep(0.01)
            return {"up": _first_ts(proc, "supervisor up") - t0,
                    "zygote": _first_ts(proc, "zygote ready") - t0,
                    "ready": _first_ts(proc, "ready:") - t0,
                    "pool": pool_at - t0}
        finally:
            proc.cleanup()


def run(quick: bool, rounds: int) -> Section:
    sec = Section("startup", "6 start-up")
    big = 8 if quick else 50
    variants = [str(big)] if quick else ["2", str(big)]
    sec.params = {"rounds": rounds, "pools": variants}
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    with emulator() as emu:
        for r in range(rounds):
            for variant in rotated(variants, r):
                results[variant].append(_one(emu, int(variant)))
            log(f"  startup round {r + 1}/{rounds}: " + "; ".join(
                f"pool {v}: " + ", ".join(f"{k} {x:.2f} s" for k, x in results[v][-1].items())
                for v in variants))
    _report(sec, results)
    return sec


def _report(sec: Section, results: dict[str, list[dict[str, Any]]]) -> None:
    for variant, runs in results.items():
        def med(key: str, runs: list[dict[str, Any]] = runs) -> float:
            return median([r[key] for r in runs])

        sec.row(f"start → ready (first warm worker), pool {variant}", f"{med('ready'):.2f} s",
                "", "ref: imports ~1.9 s per process")
        sec.row(f"start → warm pool of {variant} ready", f"{med('pool'):.2f} s", "",
                "ref: 50 spawned workers ~52 s" if variant == "50" else "")
        sec.note(f"- pool {variant}: supervisor up {med('up'):.2f} s, zygote ready "
                 f"{med('zygote'):.2f} s, first worker ready {med('ready'):.2f} s, all "
                 f"{variant} ready {med('pool'):.2f} s after start (medians of {len(runs)}); "
                 f"zygote ready → pool ready {(med('pool') - med('zygote')) * 1e3:.0f} ms.")
