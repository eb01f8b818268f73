"""Section 11: the idle daemon's memory, the whole process tree.

Two daemons side by side, each with one openai and one anthropic profile on
the emulator and the pool's keys as given:

- `default`     the pool at its defaults (`workers_spare`, `workers_max`,
                `workers_refill_wait_s` of config/model.py);
- `old policy`  what the defaults were before issue 32: `workers_spare` 32,
                spares forked at once (`workers_refill_wait_s` 0).

Each serves one call, then sits idle until its pool is down to its floor
(`workers_spare` idle workers, no call: the peak of the one call decays in
~30 s, then the extra worker retires), and is quiet (the spares' warm-ups
done). Then every process of the tree is read with psutil
(`memory_full_info`: USS, the pages only that process maps; PSS, shared
pages divided among their mappers), by role (`status` names the supervisor,
sink, zygote and workers; anything else by its command line).

Target (issue 31, item 6): the whole tree of an idle daemon with the
default config ≤ 100 MiB USS.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import psutil

from scripts.bench.common import (
    MiB,
    Section,
    daemon,
    daemon_roles,
    emulator,
    log,
    providers_for,
    realistic_text,
    tree,
    wait_quiet,
)
from scripts.bench.ttft import _script, _sf_burst
from streamfence.config.model import DaemonConfig
from streamfence.devtools.emulator.control import EmulatorProcess
from streamfence.devtools.launcher import DaemonProcess, wait_until

USS_TARGET_MIB = 100.0
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DaemonConfig)}
POLICIES: dict[str, dict[str, Any]] = {
    "default": {k: _DEFAULTS[k] for k in ("workers_spare", "workers_max", "workers_refill_wait_s")},
    "old policy": {"workers_spare": 32, "workers_max": 64, "workers_refill_wait_s": 0.0},
}
FLOOR_TIMEOUT_S = 180.0


def measure_tree(proc: DaemonProcess) -> dict[str, Any]:
    """USS and PSS (MiB) of the daemon's whole tree, totals and by role."""
    with proc.client(timeout_s=30.0) as client:
        roles = daemon_roles(client.status())
    assert proc.proc is not None
    by_role: dict[str, list[float]] = {}
    uss = pss = 0.0
    count = 0
    for pid in tree(proc.proc.pid):
        try:
            p = psutil.Process(pid)
            mem = p.memory_full_info()
            role = roles.get(pid) or "other: " + " ".join(p.cmdline())[:50]
        except psutil.Error:
            continue
        count += 1
        uss += mem.uss / MiB
        pss += mem.pss / MiB
        by_role.setdefault(role, []).append(mem.uss / MiB)
    return {"uss": uss, "pss": pss, "processes": count, "by_role": by_role}


def wait_floor(proc: DaemonProcess, spare: int, timeout_s: float = FLOOR_TIMEOUT_S) -> float:
    """Wait until the pool holds only its `spare` idle workers and the tree is
    quiet; returns the wait (s)."""
    t0 = time.monotonic()
    with proc.client(timeout_s=30.0) as client:
        def at_floor() -> bool:
            workers = client.status()["workers"]
            return len(workers) == spare and all(w["state"] == "idle" for w in workers)

        wait_until(at_floor, timeout_s, f"the pool down to its {spare} spares", interval=0.2)
    wait_quiet(proc)
    return time.monotonic() - t0


def _one_call(emu: EmulatorProcess, proc: DaemonProcess) -> None:
    _sf_burst(proc, _script(emu.client(), 1, 4, realistic_text(4)))


def run(quick: bool, rounds: int) -> Section:
    sec = Section("footprint", "11 idle footprint")
    sec.params = {"policies": "; ".join(f"{name}: " + ", ".join(f"{k} {v}" for k, v in p.items())
                                        for name, p in POLICIES.items()),
                  "idle": "one call served, then down to the pool's floor and quiet"}
    results: dict[str, dict[str, Any]] = {}
    with emulator() as emu:
        providers = providers_for(emu, stale_timeout_s=120.0)
        with daemon(providers, POLICIES["default"], ready_timeout=180.0) as new, \
                daemon(providers, POLICIES["old policy"], ready_timeout=180.0) as old:
            procs = {"default": new, "old policy": old}
            for proc in procs.values():
                _one_call(emu, proc)
            for name, proc in procs.items():
                waited = wait_floor(proc, int(POLICIES[name]["workers_spare"]))
                log(f"  footprint: {name} at its floor after {waited:.0f} s")
            wait_quiet(new, old)
            for name, proc in procs.items():
                results[name] = measure_tree(proc)
    for name, res in results.items():
        met = res["uss"] <= USS_TARGET_MIB if name == "default" else None
        sec.row(f"idle tree, {name}: USS (PSS)",
                f"{res['uss']:.1f} MiB ({res['pss']:.1f} MiB), {res['processes']} processes",
                f"≤ {USS_TARGET_MIB:.0f} MiB USS" if name == "default" else "", "", met)
        sec.note(f"- {name}: USS by role (MiB): " + ", ".join(
            f"{role} {sum(v):.1f}" + (f" ({len(v)} × {sum(v) / len(v):.1f})" if len(v) > 1 else "")
            for role, v in sorted(res["by_role"].items())))
    return sec
