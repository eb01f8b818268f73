"""Chaos: the emulator stalls and resumes streams at random (zombies).

    python -m scripts.chaos_zombies [--seed N] [--calls 2000] [--duration 60]

A share of the requests stall past the stale timeout and then resume on the
same connection. The daemon must fence and kill each one, retry, and never
let a zombie's late chunks into the transcript.
"""

from __future__ import annotations

import random
import sys
from typing import Any

from scripts.chaos_common import chaos_run, parser, run_load, seeded, verdict

STALE_S = 0.5


def steps(rng: random.Random) -> list[dict[str, Any]]:
    out = []
    for _ in range(6):
        chunks = rng.randint(10, 40)
        if rng.random() < 0.4:
            out.append({"fault": "stall", "after": rng.randint(0, chunks), "chunks": chunks,
                        "stall_s": rng.uniform(STALE_S * 1.5, STALE_S * 4),
                        "chunk_delay_s": rng.uniform(0.0, 0.02)})
        else:
            out.append({"fault": "ok", "chunks": chunks, "chunk_delay_s": rng.uniform(0.0, 0.02)})
    return out


def options(rng: random.Random) -> dict[str, Any]:
    return {"stale_timeout_s": STALE_S, "on_partial": rng.choice(["continue", "restart"])}


def main() -> int:
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    rng = seeded(args)
    with chaos_run({"workers_max": args.workers_max}) as state:
        run_load(state, args, rng, steps, options)
        stalls = sum(1 for r in state.emu.log() if r.get("fault") == "stall")
        state.count("requests scripted to stall", stalls)
        ok = verdict(state, "chaos_zombies: streams stall past the stale timeout and resume")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
