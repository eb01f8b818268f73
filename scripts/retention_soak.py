"""Retention soak: do the database files stay flat under steady load?

Starts the bundled emulator and a daemon with a short retention
(`--retention-s`, default 60 s, given to the daemon as `retention_days`),
runs a steady load of calls (`--rate` calls/s of `--deltas` text deltas each)
for `--duration` seconds (default 1800), and prints every `--every` seconds
(default 60): elapsed time, calls done, the client-seen latency, the sizes of
journal.db / -wal and transcript.db / -wal, the rows each holds, and what the
daemon pruned. At the end, the verdict: after the warm-up (the retention, its
grace at the sink, and a minute), the files are flat if the largest size of
each in the second half is at most `--tolerance` (default 1.1) times its
largest in the first half.

Loopback only (ipc:// and the emulator on 127.0.0.1); bounded: it stops by
itself after the duration plus a bounded drain.

    .venv/bin/python -m scripts.retention_soak --duration 1800
"""

from __future__ import annotations

import argparse
import queue
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.devtools.launcher import DaemonProcess
from streamfence.protocol.client import ClientError
from streamfence.sink.retention import prune_grace_s

FILES = ("journal.db", "journal.db-wal", "transcript.db", "transcript.db-wal")
SAMPLE_EVERY_S = 5.0
SLACK_BYTES = 64 * 1024  # a WAL of a few pages may grow by a few pages: not growth


@dataclass
class Load:
    """What the load threads record (under `lock`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    done: int = 0
    failed: int = 0
    skipped: int = 0  # ticks dropped because every load thread was busy
    errors: list[str] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)  # since the last report


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _mib(n: float) -> str:
    return f"{n / 1048576:7.2f}"


def _db_facts(path: Path, table: str) -> tuple[int, int, int]:
    """(rows in `table`, page_count, freelist_count), read-only."""
    if not path.exists():
        return 0, 0, 0
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    try:
        rows = db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        free = db.execute("PRAGMA freelist_count").fetchone()[0]
        return int(rows), int(pages), int(free)
    finally:
        db.close()


def _script_minute(emu: EmulatorClient, minute: int, rate: float, deltas: int) -> str:
    """A key whose queue holds this minute's calls (each `deltas` text chunks)."""
    key = f"soak-{minute}"
    emu.script(key, [{"chunks": deltas}] * int(rate * 60 * 1.5 + 10))
    return key


def _load_thread(daemon: DaemonProcess, ticks: queue.Queue[str | None], load: Load) -> None:
    with daemon.client(timeout_s=10.0) as client:
        while True:
            key = ticks.get()
            if key is None:
                return
            request = {"model": f"gpt-emu#{key}",
                       "messages": [{"role": "user", "content": "retention soak"}]}
            started = time.monotonic()
            try:
                call_id = client.submit("emu", request, subscribe=False)
                done = client.result(call_id, wait_s=60.0)
                ok = done is not None and done.get("status") == "completed"
                why = "" if ok else f"{call_id}: {done and done.get('status')}"
            except (TimeoutError, ClientError, OSError) as exc:
                ok, why = False, f"{type(exc).__name__}: {exc}"[:200]
            with load.lock:
                if ok:
                    load.done += 1
                    load.latencies_ms.append((time.monotonic() - started) * 1000)
                else:
                    load.failed += 1
                    if len(load.errors) < 20:
                        load.errors.append(why)


def _verdict(samples: list[tuple[float, dict[str, int]]], warmup_s: float,
             tolerance: float) -> bool:
    kept = [(t, s) for t, s in samples if t >= warmup_s]
    if len(kept) < 4:
        print(f"\nverdict: TOO SHORT (only {len(kept)} samples after the {warmup_s:.0f} s "
              f"warm-up; run longer)")
        return False
    half = len(kept) // 2
    first, second = kept[:half], kept[half:]
    print(f"\nafter the warm-up ({warmup_s:.0f} s): first half {first[0][0]:.0f}-"
          f"{first[-1][0]:.0f} s, second half {second[0][0]:.0f}-{second[-1][0]:.0f} s")
    print(f"  {'file':<18} {'max 1st half':>14} {'max 2nd half':>14} {'ratio':>7}")
    ok = True
    for name in (*FILES, "journal total", "transcript total"):
        a = max(s[name] for _, s in first)
        b = max(s[name] for _, s in second)
        ratio = b / a if a else (1.0 if b == 0 else float("inf"))
        flat = b <= a * tolerance or b - a <= SLACK_BYTES
        ok &= flat
        print(f"  {name:<18} {_mib(a):>10} MiB {_mib(b):>10} MiB {ratio:7.3f}"
              f"{'' if flat else '  GREW'}")
    print(f"verdict: {'FLAT' if ok else 'GROWING'} (tolerance {tolerance:g}x, "
          f"or {SLACK_BYTES // 1024} KiB)")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    p.add_argument("--rate", type=float, default=10.0, help="calls started per second")
    p.add_argument("--deltas", type=int, default=50, help="text deltas per call")
    p.add_argument("--retention-s", type=float, default=60.0,
                   help="the daemon's retention, in seconds")
    p.add_argument("--threads", type=int, default=16, help="load threads (calls in flight)")
    p.add_argument("--every", type=float, default=60.0, help="seconds between report lines")
    p.add_argument("--tolerance", type=float, default=1.1)
    p.add_argument("--state-dir", default=None,
                   help="keep the state here (default: a temporary directory, removed)")
    args = p.parse_args(argv)
    warmup_s = args.retention_s + prune_grace_s(args.retention_s) + 60.0

    with tempfile.TemporaryDirectory(prefix="streamfence-soak-") as tmp, \
            EmulatorProcess() as emulator:
        state_dir = Path(args.state_dir) if args.state_dir else Path(tmp) / "state"
        daemon = DaemonProcess(
            state_dir,
            {"emu": {"kind": "openai", "base_url": emulator.openai_base_url,
                     "stale_timeout_s": 30.0}},
            daemon={"retention_days": args.retention_s / 86400.0, "workers_max": 16,
                    "workers_spare": 4, "log_level": "WARNING"},
            log_json=False)
        emu = emulator.client()
        load = Load()
        ticks: queue.Queue[str | None] = queue.Queue(maxsize=args.threads)
        samples: list[tuple[float, dict[str, int]]] = []
        try:
            daemon.start()
            threads = [threading.Thread(target=_load_thread, args=(daemon, ticks, load),
                                        daemon=True) for _ in range(args.threads)]
            for t in threads:
                t.start()
            print(f"retention soak: {args.rate:g} calls/s x {args.deltas} deltas for "
                  f"{args.duration:.0f} s, retention {args.retention_s:g} s "
                  f"(retention_days={args.retention_s / 86400.0:.6g}), warm-up "
                  f"{warmup_s:.0f} s; state {state_dir}", flush=True)
            print(f"{'elapsed':>7} {'done':>7} {'fail':>4} {'/s':>5} {'p50ms':>6} {'p99ms':>6} "
                  f"| {'journal':>7} {'-wal':>7} {'calls':>6} {'free%':>5} "
                  f"| {'transcr':>7} {'-wal':>7} {'calls':>6} {'free%':>5} "
                  f"| {'pruned j':>8} {'pruned t':>8}   (sizes in MiB)", flush=True)
            start = time.monotonic()
            end = start + args.duration
            next_tick = start
            next_sample = start
            next_report = start + args.every
            minute, key = 0, _script_minute(emu, 0, args.rate, args.deltas)
            last_done = 0
            while True:
                now = time.monotonic()
                if now >= end:
                    break
                if now - start >= (minute + 1) * 60:
                    minute += 1
                    key = _script_minute(emu, minute, args.rate, args.deltas)
                while next_tick <= now:
                    next_tick += 1.0 / args.rate
                    try:
                        ticks.put_nowait(key)
                    except queue.Full:
                        with load.lock:
                            load.skipped += 1
                if now >= next_sample:
                    next_sample += SAMPLE_EVERY_S
                    sizes = {f: _size(state_dir / f) for f in FILES}
                    sizes["journal total"] = sizes["journal.db"] + sizes["journal.db-wal"]
                    sizes["transcript total"] = (sizes["transcript.db"]
                                                 + sizes["transcript.db-wal"])
                    samples.append((now - start, sizes))
                if now >= next_report:
                    next_report += args.every
                    sizes = samples[-1][1]
                    with load.lock:
                        lat, load.latencies_ms = sorted(load.latencies_ms), []
                        done, failed = load.done, load.failed
                    jrows, jpages, jfree = _db_facts(state_dir / "journal.db", "calls")
                    trows, tpages, tfree = _db_facts(state_dir / "transcript.db", "calls")
                    try:
                        with daemon.client(timeout_s=5.0) as c:
                            st = c.status()
                        pj = st["counters"].get("journal_pruned", 0)
                        pt = (st.get("sink") or {}).get("calls_pruned", "-")
                    except (TimeoutError, ClientError) as exc:
                        pj = pt = f"? {exc}"[:8]
                    p50 = statistics.median(lat) if lat else 0.0
                    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else 0.0
                    print(f"{now - start:7.0f} {done:7d} {failed:4d} "
                          f"{(done - last_done) / args.every:5.1f} {p50:6.0f} {p99:6.0f} "
                          f"| {_mib(sizes['journal.db'])} {_mib(sizes['journal.db-wal'])} "
                          f"{jrows:6d} {100 * jfree / max(jpages, 1):5.1f} "
                          f"| {_mib(sizes['transcript.db'])} "
                          f"{_mib(sizes['transcript.db-wal'])} {trows:6d} "
                          f"{100 * tfree / max(tpages, 1):5.1f} "
                          f"| {pj!s:>8} {pt!s:>8}", flush=True)
                    last_done = done
                time.sleep(min(0.01, max(0.0, next_tick - time.monotonic())))
            for _ in threads:
                ticks.put(None, timeout=90.0)  # after the calls queued before it
            for t in threads:
                t.join(timeout=90.0)
        finally:
            daemon.cleanup()
        print(f"\ncalls done {load.done}, failed {load.failed}, ticks skipped (all threads "
              f"busy) {load.skipped}")
        for err in load.errors[:10]:
            print(f"  failure: {err}")
        if daemon.survivors:
            print(f"PROCESSES OUTLIVED THE DAEMON: {daemon.survivors}")
        flat = _verdict(samples, warmup_s, args.tolerance)
        return 0 if flat and load.failed == 0 and not daemon.survivors else 1


if __name__ == "__main__":
    sys.exit(main())
