"""Measure what a warm worker costs: unique (USS) and proportional (PSS)
memory of each worker after real work, beside the zygote and the daemon.

    python -m scripts.worker_memory [--calls 40] [--chunks 200]

Starts the bundled emulator and the daemon, runs the calls (each streams
`--chunks` chunks through a worker), then reads /proc/PID/smaps_rollup of
every process via psutil. Loopback only; bounded by --calls.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import psutil

from streamfence.devtools.emulator.control import EmulatorProcess
from streamfence.devtools.launcher import DaemonProcess

MiB = 1024 * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--chunks", type=int, default=200)
    parser.add_argument("--workers", type=int, default=4, help="warm spares to keep")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmulatorProcess() as emu:
        emu.client().script("mem", [{"fault": "ok", "chunks": args.chunks}] * args.calls)
        daemon = DaemonProcess(Path(tmp) / "state",
                               {"emu": {"kind": "openai", "base_url": emu.openai_base_url}},
                               daemon={"workers_spare": args.workers})
        with daemon, daemon.client(timeout_s=30) as client:
            ids = [client.submit("emu", {"model": "gpt-emu#mem", "messages": []})
                   for _ in range(args.calls)]
            for call_id in ids:
                for event in client.events(call_id, timeout_s=60):
                    if event["op"] == "done":
                        assert event["status"] == "completed", event
            status = client.status()
            assert daemon.proc is not None
            rows = []
            for w in status["workers"]:
                info = psutil.Process(w["pid"]).memory_full_info()
                rows.append(("worker", w["pid"], info.uss / MiB, info.pss / MiB, info.rss / MiB))
            for role, pid in status["processes"].items():
                info = psutil.Process(pid).memory_full_info()
                rows.append((role, pid, info.uss / MiB, info.pss / MiB, info.rss / MiB))
    print(f"{'process':<11} {'pid':>7} {'USS MiB':>8} {'PSS MiB':>8} {'RSS MiB':>8}")
    for label, pid, uss, pss, rss in rows:
        print(f"{label:<11} {pid:>7} {uss:>8.1f} {pss:>8.1f} {rss:>8.1f}")
    workers = [r for r in rows if r[0] == "worker"]
    print(f"\nworkers after {args.calls} calls x {args.chunks} chunks: "
          f"median USS {statistics.median(r[2] for r in workers):.1f} MiB, "
          f"median PSS {statistics.median(r[3] for r in workers):.1f} MiB "
          f"(n={len(workers)})")


if __name__ == "__main__":
    main()
