"""Section 12: the console's list of calls with 10,000 finished calls in the
journal (issue 34: "a page load of the call list ... answers in under
200 ms on this machine").

The journal is filled by the daemon itself: 10,000 real calls (1,000 with
--quick) run to their end against the emulator, submitted by the raw
client with a window of calls in flight, so every row is one the daemon's
own journal code wrote. Then `GET /console/calls` (the page as a browser
loads it: the daemon's `calls` through the gateway, rendered) is timed
over loopback, with the admin's key, for the first page, one identity's
first page, a page deep in the list (by its cursor) and a search that
matches nothing (the worst case: every row looked at).
"""

from __future__ import annotations

import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

from scripts.bench.common import RawClient, Section, emulator, log, median, percentile
from streamfence.devtools.launcher import DaemonProcess, wait_until
from streamfence.gateway.keys import http_key
from streamfence.protocol.client import Client
from streamfence.protocol.client_base import new_ref
from streamfence.protocol.credentials import load_credentials

TARGET_MS = 200.0
WINDOW = 64  # calls in flight while the journal fills
LOADS = 30  # timed loads of each page


def run(quick: bool, rounds: int) -> Section:
    sec = Section("console", "12 console")
    calls = 1_000 if quick else 10_000
    sec.params = {"finished_calls": calls, "loads_per_page": LOADS, "window": WINDOW}
    with emulator() as emu, tempfile.TemporaryDirectory(prefix="sfbench-") as tmp:
        port = _free_port()
        proc = DaemonProcess(Path(tmp) / "state", {"oa": {
            "kind": "openai", "base_url": emu.openai_base_url}},
            daemon={"log_level": "WARNING", "workers_spare": 8},
            tables={"http": {"listen": f"127.0.0.1:{port}"}})
        try:
            proc.start(ready_timeout=120.0)
            url = f"http://127.0.0.1:{port}"
            wait_until(lambda: _answers(url), 30.0, "the gateway")
            took = _fill(proc, calls)
            log(f"  console: {calls} calls finished in {took:.1f} s")
            key = http_key(load_credentials(proc.credentials_path))
            deep = _cursor(proc, calls // 2)
            pages = {"first page (50 calls)": "/console/calls",
                     "one identity's first page": "/console/calls?identity=local",
                     f"a page {calls // 2:,} calls deep": f"/console/calls?before={deep}",
                     "a search that matches nothing": "/console/calls?search=nomatch"}
            for item, path in pages.items():
                times = _loads(url + path, key)
                p95 = percentile(sorted(times), 95)
                sec.row(f"GET {item}, {calls:,} finished calls",
                        f"median {median(times):.1f} ms, p95 {p95:.1f} ms",
                        f"< {TARGET_MS:.0f} ms", met=p95 < TARGET_MS)
        finally:
            proc.cleanup()
    sec.note(f"The journal was filled by {calls:,} real calls through the daemon "
             f"({WINDOW} in flight); each page was loaded {LOADS} times after one "
             "warm-up load, with the admin's key, over loopback; the verdict is on p95.")
    return sec


def _fill(proc: DaemonProcess, calls: int) -> float:
    """Run `calls` calls to their done, WINDOW at a time; the seconds it took."""
    client = RawClient(proc)
    started = time.monotonic()
    sent = done = 0
    messages = [{"role": "user", "content": "hi"}]
    try:
        while done < calls:
            while sent < calls and sent - done < WINDOW:
                client.req.send(client.submit_frame(new_ref(), "gpt#fill", messages))
                sent += 1
            for msg in client.messages(1000):
                if msg.get("op") == "error":
                    raise RuntimeError(f"a fill call was refused: {msg}")
                if msg.get("op") == "done" and "ref" not in msg:
                    done += 1
    finally:
        client.close()
    return time.monotonic() - started


def _get(url: str, key: str) -> bytes:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=30.0) as reply:
        body: bytes = reply.read()
        return body


def _loads(url: str, key: str) -> list[float]:
    _get(url, key)  # warm-up: the gateway's client for the identity, the page cache
    times = []
    for _ in range(LOADS):
        t = time.perf_counter()
        _get(url, key)
        times.append((time.perf_counter() - t) * 1000.0)
    return times


def _cursor(proc: DaemonProcess, deep: int) -> str:
    """The cursor (`before`) of the page `deep` calls down the list."""
    with Client(proc.endpoint, credentials=proc.credentials_path) as client:
        before = None
        for _ in range(deep // 500):
            before = client.calls(limit=500, before=before)["next"]
    return quote(before or "")


def _answers(url: str) -> Any:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=1.0) as reply:
            return reply.status == 200
    except OSError:
        return False


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
