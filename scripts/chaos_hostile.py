"""Chaos: one hostile client at a time, each attack a scenario with its verdict.

    python -m scripts.chaos_hostile [--only NAME,...] [--duration 15] [--seed N]

For each scenario (scripts/hostile/: one module per attack of issue 29) a
fresh daemon runs on the emulator, with the scenario's settings and
descriptor limit (set on the supervisor once it runs). A well-behaved identity, "probe", times `status` every
20 ms and runs a fresh call (submit to done, 20 chunks) every 0.25 s, from
1 s before the attack until `RECOVERY_S` after it. The attack runs for
--duration seconds.

Verdict of a scenario, from what the probe saw and the process table:
- during the attack, every fresh call completes with the emulator's exact
  text, each within `CALL_BOUND_S`, and `status` p99 is at most
  `STATUS_P99_BOUND_S` (a timeout counts as what it took);
- the RSS of each daemon process stays under its bound (`RSS_BOUND`,
  docs/SECURITY.md "Limits");
- after the attack ends (its sockets closed), the first fresh call started
  after `RECOVERED_WITHIN_S` completes within `CALL_BOUND_S`, and so does
  every one after it ("recovers within a second");
- the attack happened (its counts), and the scenario's own checks hold.
The daemon's own log is summed up (ERROR lines, tracebacks) for a failed
scenario. Loopback only; every loop ends with --duration.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from types import ModuleType

import psutil

from scripts.hostile import PROFILES, Attack, request, scenarios
from streamfence.devtools.emulator.control import EmulatorProcess, emulator_profile
from streamfence.devtools.launcher import DaemonProcess
from streamfence.protocol.client import Client, ClientError

MIB = 1 << 20
RSS_BOUND = {"supervisor": 512 * MIB, "sink": 512 * MIB, "zygote": 256 * MIB,
             "gateway": 256 * MIB, "worker": 256 * MIB}
CALL_BOUND_S = 1.0
STATUS_P99_BOUND_S = 0.050
RECOVERED_WITHIN_S = 1.0
RECOVERY_S = 4.0  # the probe goes on this long after the attack
LEAD_S = 1.0  # ... and starts this long before it


class Probe:
    """The well-behaved identity: timed `status` and fresh calls, each
    stamped with when it started (monotonic)."""

    def __init__(self, attack: Attack) -> None:
        self.attack = attack
        self.creds = attack.register("probe")
        self.run = uuid.uuid4().hex[:8]
        self.status: list[tuple[float, float]] = []  # (started, took)
        self.calls: list[tuple[float, float, bool]] = []  # (started, took, exact)
        self.stop = threading.Event()
        self._threads = [threading.Thread(target=self._statuses, daemon=True),
                         threading.Thread(target=self._calls, daemon=True)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=30)

    def _statuses(self) -> None:
        with Client(self.attack.endpoint, 5.0, credentials=self.creds) as c:
            c.status()  # connected and authenticated before timing
            while not self.stop.wait(0.02):
                t0 = time.monotonic()
                with contextlib.suppress(TimeoutError, ClientError):
                    c.status()
                self.status.append((t0, time.monotonic() - t0))

    def _calls(self) -> None:
        n = 0
        with Client(self.attack.endpoint, 10.0, credentials=self.creds) as c:
            while not self.stop.wait(0.25):
                n += 1
                key = f"probe-{self.run}-{n}"  # the emulator outlives a scenario
                self.attack.script(key, 20)
                t0 = time.monotonic()
                exact = False
                with contextlib.suppress(TimeoutError, ClientError):
                    done = c.run("emu", request(key), timeout_s=10.0)
                    sent = self.attack.emu.log(key)
                    exact = (done.get("status") == "completed" and len(sent) == 1
                             and done["response"]["content"] == sent[0]["text"])
                self.calls.append((t0, time.monotonic() - t0, exact))


class Sampler:
    """The peak RSS of each daemon process, by role, every 0.25 s."""

    def __init__(self, daemon: DaemonProcess) -> None:
        self.daemon = daemon
        self.peak: dict[str, int] = {}
        self.stop = threading.Event()
        with daemon.client() as admin:
            self.roles = {pid: role for role, pid in admin.status()["processes"].items()
                          if isinstance(pid, int)}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        proc = self.daemon.proc
        while proc is not None and not self.stop.wait(0.25):
            try:
                procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(True)]
            except psutil.NoSuchProcess:
                return
            for p in procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    role = "supervisor" if p.pid == proc.pid else self.roles.get(p.pid, "worker")
                    self.peak[role] = max(self.peak.get(role, 0), p.memory_info().rss)

    def join(self) -> None:
        self.stop.set()
        self._thread.join(timeout=5)


def p99(values: list[float]) -> float:
    if not values:
        return float("inf")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def run_scenario(module: ModuleType, args: argparse.Namespace, rng: random.Random,
                 emulator: EmulatorProcess) -> bool:
    print(f"\n== {module.NAME}: {module.ABOUT}", flush=True)
    nofile = getattr(module, "NOFILE", None)
    settings = {"workers_spare": 4, "workers_max": 32, "log_level": "WARNING"}
    settings.update(getattr(module, "DAEMON", {}))
    with tempfile.TemporaryDirectory(prefix="streamfence-hostile-") as tmp:
        profiles = {name: dict(emulator_profile(wire, emulator.base_url), stale_timeout_s=5.0)
                    for name, wire in PROFILES.items()}
        daemon = DaemonProcess(Path(tmp) / "state", profiles, daemon=settings, log_json=False)
        daemon.log_path = Path(tmp) / "daemon.log"
        daemon.start()
        if nofile and daemon.proc is not None:  # soft and hard: it cannot raise it again
            psutil.Process(daemon.proc.pid).rlimit(psutil.RLIMIT_NOFILE, (nofile, nofile))
        try:
            return _judge(module, daemon, emulator, args, rng)
        finally:
            daemon.cleanup()


def _judge(module: ModuleType, daemon: DaemonProcess, emulator: EmulatorProcess,
           args: argparse.Namespace, rng: random.Random) -> bool:
    attack = Attack(daemon=daemon, emu=emulator.client(), rng=random.Random(rng.random()))
    sampler = Sampler(daemon)
    probe = Probe(attack)
    probe.start()
    time.sleep(LEAD_S)  # the probe's figures before the attack, as a baseline
    errors: list[str] = []

    def run_attack() -> None:
        try:
            module.attack(attack)
        except Exception as exc:  # an attacker's failure is reported, never hidden
            errors.append(f"{type(exc).__name__}: {exc}"[:300])

    attacker = threading.Thread(target=run_attack, daemon=True)
    began = time.monotonic()
    attacker.start()
    attack.stop.wait(args.duration)
    attack.stop.set()
    attacker.join(timeout=60)
    ended = time.monotonic()
    time.sleep(RECOVERY_S)
    probe.join()
    sampler.join()
    try:
        own = list(getattr(module, "checks", lambda a: [])(attack))
    except Exception as exc:  # a check that cannot look is a failed check
        own = [(f"the scenario's own checks: {type(exc).__name__}: {exc}"[:300], False)]
    return _verdict(module, attack, probe, sampler, (began, ended), errors, own,
                    attacker.is_alive())


def _verdict(module: ModuleType, attack: Attack, probe: Probe, sampler: Sampler,
             window: tuple[float, float], errors: list[str], own: list[tuple[str, bool]],
             stuck: bool) -> bool:
    began, ended = window
    checks: list[bool] = []

    def check(what: str, good: bool) -> None:
        checks.append(good)
        print(f"  {'ok  ' if good else 'FAIL'} {what}", flush=True)

    during = [(took, exact) for t0, took, exact in probe.calls if began <= t0 < ended]
    slow = [took for took, _ in during if took > CALL_BOUND_S]
    check(f"fresh calls during the attack: {sum(e for _, e in during)} of {len(during)} exact, "
          f"slowest {max((t for t, _ in during), default=0) * 1000:.0f} ms "
          f"(bound {CALL_BOUND_S * 1000:.0f} ms each)",
          bool(during) and all(e for _, e in during) and not slow)
    status = [took for t0, took in probe.status if began <= t0 < ended]
    check(f"status during the attack: p99 {p99(status) * 1000:.1f} ms over {len(status)} "
          f"(bound {STATUS_P99_BOUND_S * 1000:.0f} ms)", p99(status) <= STATUS_P99_BOUND_S)
    for role, got in sorted(sampler.peak.items()):
        check(f"peak RSS of the {role}: {got / MIB:.0f} MiB (bound {RSS_BOUND[role] // MIB} MiB)",
              got <= RSS_BOUND[role])
    after = [(took, exact) for t0, took, exact in probe.calls
             if t0 >= ended + RECOVERED_WITHIN_S]
    check(f"after the attack (from {RECOVERED_WITHIN_S:g} s on): {sum(e for _, e in after)} of "
          f"{len(after)} fresh calls exact, slowest "
          f"{max((t for t, _ in after), default=0) * 1000:.0f} ms",
          bool(after) and all(e and t <= CALL_BOUND_S for t, e in after))
    check(f"the attack happened and ended: {attack.counts or 'nothing counted'}"
          f"{'; errors: ' + '; '.join(errors) if errors else ''}"
          f"{'; still running after stop' if stuck else ''}",
          bool(attack.counts) and not errors and not stuck)
    for what, good in own:
        check(what, good)
    if not all(checks):
        lines = attack.daemon.log_text().splitlines()
        bad = [ln for ln in lines if " ERROR " in ln or " CRITICAL " in ln or "Traceback" in ln]
        print(f"  daemon log: {len(lines)} lines, {len(bad)} ERROR/CRITICAL/traceback")
        for line in bad[:10]:
            print(f"    {line[:240]}")
    print(f"  verdict ({module.NAME}): {'PASS' if all(checks) else 'FAIL'}", flush=True)
    return all(checks)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="scenarios to run, comma separated (default all)")
    p.add_argument("--duration", type=float, default=15.0, help="seconds of each attack")
    p.add_argument("--seed", type=int, default=None, help="random seed (printed)")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    print(f"seed: {seed}  (rerun with --seed {seed})", flush=True)
    rng = random.Random(seed)
    modules = scenarios()
    wanted = {w.strip().replace("-", " ") for w in args.only.split(",") if w.strip()}
    unknown = wanted - {m.NAME for m in modules}
    if unknown:
        print(f"no scenario {sorted(unknown)}; there are: {[m.NAME for m in modules]}")
        return 2
    results = {}
    with EmulatorProcess() as emulator:
        for module in modules:
            if not wanted or module.NAME in wanted:
                results[module.NAME] = run_scenario(module, args, rng, emulator)
    print("\n" + "\n".join(f"  {'PASS' if ok else 'FAIL'}  {name}" for name, ok in results.items()))
    ok = bool(results) and all(results.values())
    print(f"verdict: {'PASS' if ok else 'FAIL'} ({len(results)} scenarios)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
