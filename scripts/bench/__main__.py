"""`python -m scripts.bench [--quick] [--only NAME ...] [--write-docs]`.

Runs the sections (see scripts/bench/__init__.py) in order (with `ttft`, a
daemon for its burst on a daemon idle 10 minutes is started first and left
idle while the other sections run: `--long-idle-s`), prints the table
of results beside their targets and the reference figures of docs/ARCHITECTURE.md §6, and with
`--write-docs` puts it into docs/PERFORMANCE.md with the command, the date,
the machine and the parameters. A section that fails is reported as such
and the others still run; the exit status is 1 if any failed (never because
of a figure). Loopback and ipc only; every load is bounded.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import streamfence
from scripts.bench import common, report

SECTIONS = ("cpu", "throughput", "latency", "failover", "scale", "startup", "ttft", "capacity",
            "gateway", "cluster", "footprint", "console")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "PERFORMANCE.md"


def _runner(name: str) -> Callable[..., common.Section]:
    from importlib import import_module

    module = import_module(f"scripts.bench.{name}")
    run: Callable[..., common.Section] = module.run
    return run


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.bench", description=__doc__)
    p.add_argument("--quick", action="store_true",
                   help="smaller runs and 3 rounds: about a minute in all")
    p.add_argument("--only", nargs="+", choices=SECTIONS, metavar="NAME",
                   help=f"run only these sections ({', '.join(SECTIONS)})")
    p.add_argument("--write-docs", action="store_true", help=f"write the table into {DOCS}")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds per comparison (default 5, 3 with --quick; fewer only "
                        "for a smoke test)")
    p.add_argument("--levels", type=int, nargs="+", default=None,
                   help="scale: concurrent streams per level (default 50 200 500; 20 quick)")
    p.add_argument("--seed", type=int, default=1234, help="scale: seed of the stream paces")
    p.add_argument("--long-idle-s", type=float, default=None,
                   help="ttft: the burst on a daemon idle this long, started before the "
                        "first section (default 600; 0 with --quick: none)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    rounds = args.rounds or (3 if args.quick else 5)
    names = [n for n in SECTIONS if not args.only or n in args.only]
    command = "python -m scripts.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    started = time.monotonic()
    sections: list[common.Section] = []
    failed = False
    long_idle_s = args.long_idle_s if args.long_idle_s is not None else (
        0.0 if args.quick else 600.0)
    long_idle = None
    if "ttft" in names and long_idle_s > 0:
        from scripts.bench.long_idle import LongIdle

        long_idle = LongIdle(long_idle_s)
    # The daemons run the tree this process imports (same working directory and
    # PYTHONPATH; `python -m` puts the working directory first): say which.
    common.log(f"[bench] streamfence from {Path(streamfence.__file__).resolve().parent}")
    for name in names:
        common.log(f"[bench] {name} ...")
        t = time.monotonic()
        try:
            if name == "scale":
                sec = _runner(name)(args.quick, rounds, args.levels, args.seed)
            elif name == "ttft":
                sec = _runner(name)(args.quick, rounds, long_idle=long_idle)
            else:
                sec = _runner(name)(args.quick, rounds)
        except Exception as exc:
            failed = True
            traceback.print_exc()
            sec = common.Section(name, name)
            sec.row("section failed", f"{type(exc).__name__}: {exc}"[:200], met=False)
        sec.seconds = time.monotonic() - t
        common.log(f"[bench] {name} done in {sec.seconds:.0f} s")
        sections.append(sec)
    if long_idle is not None:
        long_idle.close()  # ttft closed it, unless it did not run
    meta = {"command": command.strip(), "seconds": time.monotonic() - started,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": common.machine(), "rounds": rounds, "seed": args.seed}
    print(report.console(sections, meta), flush=True)
    if args.write_docs:
        report.write_docs(DOCS, sections, meta)
        common.log(f"[bench] wrote {DOCS}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
