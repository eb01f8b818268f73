"""Chaos: SIGKILL the whole daemon and restart it, again and again, under load.

    python -m scripts.chaos_daemon [--seed N] [--calls 2000] [--duration 60]

Calls are submitted with an idempotency key and followed across restarts
(resubscribe from the last seq received). Every accepted call must resume
from the journal under a new epoch and end with exactly one answer.
"""

from __future__ import annotations

import random
import sys
import threading
import traceback
from typing import Any

from scripts.chaos_common import ChaosState, chaos_run, parser, run_load, seeded, verdict
from streamfence.devtools.launcher import DaemonExited


def steps(rng: random.Random) -> list[dict[str, Any]]:
    return [{"fault": "ok", "chunks": rng.randint(20, 60),
             "chunk_delay_s": rng.uniform(0.01, 0.04)}] * 12


def options(rng: random.Random) -> dict[str, Any]:
    # After a crash the transcript may hold text of the dead attempt: restart
    # (reset, then the new attempt) is the policy that keeps the call alive.
    return {"on_partial": "restart"}


def restarter(state: ChaosState, rng: random.Random, mean_interval_s: float) -> None:
    try:
        _restart_loop(state, rng, mean_interval_s)
    except Exception:
        traceback.print_exc()
        state.count("restarter crashed")


def _restart_loop(state: ChaosState, rng: random.Random, mean_interval_s: float) -> None:
    while not state.stop.wait(rng.uniform(0.5, 1.5) * mean_interval_s):
        state.daemon.kill()
        state.daemon.stop()  # reap; report stragglers
        if state.daemon.survivors:
            state.count("children that outlived the daemon", len(state.daemon.survivors))
        try:
            state.daemon.start()
        except (TimeoutError, DaemonExited) as exc:  # did not come up: that is a finding, say so
            print(f"the daemon did not come back after a restart: {exc}", flush=True)
            state.count("restarts that did not come up")
            return
        state.count("daemon SIGKILL + restart")


def main() -> int:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--restart-every", type=float, default=8.0, help="mean seconds between kills")
    args = p.parse_args()
    rng = seeded(args)
    with chaos_run({"workers_max": args.workers_max}, {"max_attempts": 20}) as state:
        t = threading.Thread(target=restarter, args=(state, random.Random(rng.random()),
                                                     args.restart_every), daemon=True)
        t.start()
        run_load(state, args, rng, steps, options)
        state.stop.set()
        t.join(timeout=60)
        ok = verdict(state, "chaos_daemon: SIGKILL and restart the whole daemon")
        ok = ok and "children that outlived the daemon" not in state.faults \
            and "restarts that did not come up" not in state.faults
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
