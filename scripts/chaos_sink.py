"""Chaos: SIGKILL the sink again and again under a load of concurrent calls.

    python -m scripts.chaos_sink [--seed N] [--calls 2000] [--duration 60]

The supervisor restarts the sink on the same store, with back-off
(docs/ARCHITECTURE.md §4.14), and fences the attempts in flight. No accepted
delta may be lost or duplicated in the transcript, and every call must end
with one answer (or partial / failed clearly).
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
from typing import Any

from scripts.chaos_common import ChaosState, chaos_run, parser, run_load, seeded, verdict


def steps(rng: random.Random) -> list[dict[str, Any]]:
    return [{"fault": "ok", "chunks": rng.randint(20, 60),
             "chunk_delay_s": rng.uniform(0.01, 0.03)}] * 12


def options(rng: random.Random) -> dict[str, Any]:
    return {"on_partial": rng.choice(["continue", "restart"])}


def killer(state: ChaosState, rng: random.Random, mean_interval_s: float) -> None:
    with state.daemon.client(timeout_s=5.0) as client:
        while not state.stop.wait(rng.uniform(0.8, 1.2) * mean_interval_s):
            try:
                pid = client.status()["processes"]["sink"]
                if pid is None:
                    continue  # down, awaiting its restart
                os.kill(pid, signal.SIGKILL)
                state.count("sink SIGKILLs")
            except (TimeoutError, ProcessLookupError):
                continue


def main() -> int:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--kill-every", type=float, default=15.0,
                   help="mean seconds between kills (the daemon restarts the sink with "
                        "back-off: 0.1 s doubling while it keeps dying within 30 s of its start)")
    args = p.parse_args()
    rng = seeded(args)
    with chaos_run({"workers_max": args.workers_max}, {"max_attempts": 10}) as state:
        t = threading.Thread(target=killer, args=(state, random.Random(rng.random()),
                                                  args.kill_every), daemon=True)
        t.start()
        run_load(state, args, rng, steps, options)
        state.stop.set()
        t.join(timeout=10)
        with state.daemon.client(timeout_s=5.0) as client:
            restarts = client.status()["counters"].get("sink_restarts", 0)
        state.count("sink restarts seen by the supervisor", restarts)
        ok = verdict(state, "chaos_sink: SIGKILL the sink repeatedly")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
