"""CPU per delta of two source trees of streamfence, side by side in one run.

    python -m scripts.bench_ab TREE_A TREE_B [--rounds 8] [--chunks 20000] [--paced 2000]

Each tree runs its own daemon (`python -m streamfence.cli serve` started in
that directory, so it imports that tree's package; the workers fork from its
zygote), both on one emulator. Each round streams the same text once through
each daemon, in rotated order, one shape at a time: `burst` (`--chunks`
chunks as fast as the emulator writes them) and `paced` (`--paced` chunks,
one per write, 1 ms apart). CPU is the daemon's whole process tree plus the
subscriber (this process), per delta; the ratio B/A is the median of the
per-round ratios, with their spread, so the machine's noise shows beside it.
Used for the failpoints' cost (docs/PERFORMANCE.md): TREE_B is the same
commit with every failpoint call site removed.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

from scripts.bench.common import (
    CpuMeter,
    emulator,
    median,
    ratio_spread,
    realistic_text,
    wait_idle,
)
from streamfence.devtools.emulator.control import EmulatorProcess
from streamfence.devtools.launcher import DaemonProcess


def _stream(proc: DaemonProcess, emu: EmulatorProcess, text: str, chunks: int,
            delay: float) -> float:
    """CPU seconds per delta of one call streamed through `proc`."""
    key = f"ab-{uuid.uuid4().hex[:10]}"
    emu.client().script(key, [{"fault": "ok", "chunks": chunks, "chunk_delay_s": delay,
                               "text": text}])
    assert proc.proc is not None
    meter = CpuMeter([proc.proc.pid])
    with proc.client(timeout_s=60.0) as client:
        gc.collect()
        meter.start()
        own0 = time.process_time()
        call_id = client.submit("oa", {"model": f"emu-model#{key}",
                                       "messages": [{"role": "user", "content": "hi"}]})
        parts = [e["data"] for e in client.events(call_id, timeout_s=120.0)
                 if e["op"] == "delta" and e["kind"] == "text"]
        own = time.process_time() - own0
        time.sleep(0.03)  # the worker's last steps after the done
        meter.stop()
    if "".join(parts) != text:
        raise RuntimeError(f"{proc.state_dir}: the answer is not the scripted text")
    return (meter.total() + own) / chunks


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trees", nargs=2, type=Path, help="TREE_A TREE_B")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--chunks", type=int, default=20_000, help="chunks of the burst stream")
    p.add_argument("--paced", type=int, default=2_000, help="chunks of the paced stream")
    args = p.parse_args()
    shapes = {"burst": (args.chunks, 0.0), "paced": (args.paced, 0.001)}
    texts = {name: realistic_text(n) for name, (n, _) in shapes.items()}
    with ExitStack() as stack:
        emu = stack.enter_context(emulator())
        daemons = []
        for tree in args.trees:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sfab-")))
            proc = DaemonProcess(tmp / "state", {"oa": {"kind": "openai",
                                                        "base_url": emu.openai_base_url}},
                                 daemon={"log_level": "WARNING", "workers_spare": 2},
                                 cwd=tree.resolve())
            stack.callback(proc.cleanup)
            proc.start(ready_timeout=120.0)
            wait_idle(proc, 2)
            daemons.append(proc)
        for proc in daemons:  # once unmeasured: the first call's imports and caches
            for name, (n, delay) in shapes.items():
                _stream(proc, emu, texts[name], n, delay)
        per: dict[str, list[list[float]]] = {name: [[], []] for name in shapes}
        for r in range(args.rounds):
            order = [0, 1] if r % 2 == 0 else [1, 0]
            for name, (n, delay) in shapes.items():
                for i in order:
                    per[name][i].append(_stream(daemons[i], emu, texts[name], n, delay))
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    print(f"\nA = {args.trees[0]}\nB = {args.trees[1]}")
    print(f"{'shape':<8} {'A µs/delta':>11} {'B µs/delta':>11} {'B/A median':>11} "
          f"{'B/A per round (min..max)':>26}")
    for name, (a, b) in per.items():
        mid, low, high = ratio_spread(a, b)
        print(f"{name:<8} {median(a) * 1e6:>11.2f} {median(b) * 1e6:>11.2f} "
              f"{mid:>11.3f} {low:>12.3f} .. {high:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

