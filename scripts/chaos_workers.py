"""Chaos: SIGKILL random busy workers under a load of concurrent calls.

    python -m scripts.chaos_workers [--seed N] [--calls 200] [--duration 60]

Every call streams a slow answer from the emulator; a killer thread picks a
busy worker from `status` at random intervals and SIGKILLs it. Each call must
end completed (retried), partial (text already delivered under
on_partial=continue) or failed with a clear error; none lost, interleaved,
duplicated, or with a superseded attempt's delta accepted.
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
    return [{"fault": "ok", "chunks": rng.randint(20, 80),
             "chunk_delay_s": rng.uniform(0.01, 0.04)}] * 8


def options(rng: random.Random) -> dict[str, Any]:
    return {"on_partial": rng.choice(["continue", "restart"])}


def killer(state: ChaosState, rng: random.Random, mean_interval_s: float) -> None:
    with state.daemon.client(timeout_s=5.0) as client:
        while not state.stop.wait(rng.uniform(0.2, 2 * mean_interval_s)):
            try:
                busy = [w for w in client.status()["workers"] if w["state"] == "busy"]
            except TimeoutError:
                continue
            if busy:
                victim = rng.choice(busy)
                try:
                    os.kill(victim["pid"], signal.SIGKILL)
                    state.count("worker SIGKILLs")
                except ProcessLookupError:
                    pass


def main() -> int:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--kill-every", type=float, default=0.3, help="mean seconds between kills")
    args = p.parse_args()
    rng = seeded(args)
    with chaos_run({"workers_max": args.workers_max}) as state:
        t = threading.Thread(target=killer, args=(state, random.Random(rng.random()),
                                                  args.kill_every), daemon=True)
        t.start()
        run_load(state, args, rng, steps, options)
        state.stop.set()
        t.join(timeout=10)
        ok = verdict(state, "chaos_workers: SIGKILL random workers")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
