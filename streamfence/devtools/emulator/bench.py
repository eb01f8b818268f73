"""Throughput self-check (run by hand, not a test): ``python -m streamfence.devtools.emulator.bench``.

Starts one emulator process, scripts a stream of ``--chunks`` text chunks with
``chunk_delay_s = 0`` and reads it with a raw ``httpx2`` client, counting SSE
events. Prints chunks/s and MB/s per run; the figure is bounded by whichever
of the two processes (emulator or reader) saturates its core first.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import httpx2

from .control import EmulatorProcess


def _one_run(client: httpx2.Client, url: str, key: str) -> tuple[int, int, float]:
    body: dict[str, Any] = {
        "model": f"gpt-emu#{key}",
        "messages": [{"role": "user", "content": "go"}],
        "stream": True,
    }
    events = 0
    size = 0
    start = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for data in response.iter_raw(1 << 20):
            size += len(data)
            events += data.count(b"\n\n")
    elapsed = time.perf_counter() - start
    return events, size, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m streamfence.devtools.emulator.bench")
    parser.add_argument("--chunks", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with EmulatorProcess(extra_args=["--log-level", "WARNING"]) as emu:
        control = emu.client()
        with httpx2.Client(timeout=60.0) as client:
            for run in range(args.runs):
                key = f"bench-{run}"
                control.script(key, [{"chunks": args.chunks, "text": "tok " * args.chunks}])
                events, size, elapsed = _one_run(client, emu.base_url, key)
                record = control.log(key)[-1]
                # events = text chunks + finish chunk + [DONE]
                print(
                    f"run {run}: {record['chunks_sent']} chunks ({events} SSE events, "
                    f"{size / 1e6:.1f} MB) in {elapsed:.3f}s = "
                    f"{record['chunks_sent'] / elapsed:,.0f} chunks/s, {size / 1e6 / elapsed:.1f} MB/s"
                    f", completed={record['completed']}"
                )


if __name__ == "__main__":
    main()
