"""What every section shares: result rows, statistics, CPU accounting of a
process tree, the machine's description, and the emulator and daemon set-ups.

CPU is read per thread from /proc/PID/task/*/schedstat (ns resolution;
psutil's 10 ms ticks are too coarse for one stream) before and after a
measured window; a thread that appears during the window counts from zero,
one that ends in it is not seen (a new spare's warm-up stub threads:
`wait_quiet` lets them finish before a measurement). A section's own
process is read with `time.process_time()`.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import psutil
import zmq

from streamfence.devtools.emulator.control import EmulatorProcess
from streamfence.devtools.launcher import DaemonProcess
from streamfence.protocol.client_base import new_ref, status_msg, submit_msg
from streamfence.protocol.codec import encode
from streamfence.protocol.credentials import load_credentials
from streamfence.protocol.messages import events_endpoint

MiB = 1024 * 1024


# ---- results -------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Row:
    """One line of the results table."""

    section: str
    item: str
    result: str
    target: str = ""
    reference: str = ""
    met: bool | None = None  # None: no target on this line


@dataclass
class Section:
    name: str
    title: str
    rows: list[Row] = field(default_factory=list)
    details: list[str] = field(default_factory=list)  # markdown lines under the table
    params: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def row(self, item: str, result: str, target: str = "", reference: str = "",
            met: bool | None = None) -> None:
        self.rows.append(Row(self.title, item, result, target, reference, met))

    def note(self, line: str) -> None:
        self.details.append(line)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in [0, 100])."""
    if not sorted_values:
        return float("nan")
    rank = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[rank]


def ratio_spread(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """The per-round ratios b/a (rounds paired in order): median, min, max."""
    ratios = sorted(y / x for x, y in zip(a, b, strict=True))
    return median(ratios), ratios[0], ratios[-1]


def rotated(variants: Sequence[str], round_no: int) -> list[str]:
    """A B C, then B C A, ...: each variant runs at each position over the rounds."""
    k = round_no % len(variants)
    return list(variants[k:]) + list(variants[:k])


def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} µs"


def fmt_rate(per_s: float) -> str:
    return f"{per_s:,.0f}/s"


# ---- the machine -----------------------------------------------------------------

def machine() -> dict[str, str]:
    model = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = psutil.virtual_memory().total / MiB / 1024
    return {"nproc": str(os.cpu_count()), "cpu": model,
            "python": f"{platform.python_implementation()} {platform.python_version()}",
            "os": f"{platform.system()} {platform.release()}", "memory": f"{mem:.1f} GiB"}


# ---- CPU of processes ---------------------------------------------------------------

def tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    try:
        return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU time of each live thread of `pid` (tid -> seconds), from
    /proc/PID/task/*/schedstat (ns) rather than psutil's cpu_times, whose clock
    tick (10 ms) is coarser than a short stream's cost in one process; {} if
    the process is gone."""
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
    return out


class CpuMeter:
    """CPU seconds used by a set of process trees between `start()` and `stop()`,
    thread by thread: a thread that ends in between (a new worker's warm-up)
    counts with what it had used at `start` subtracted from nothing, so it can
    never make a total negative; its last moments are not seen."""

    def __init__(self, roots: Sequence[int]) -> None:
        self.roots = list(roots)
        self._before: dict[tuple[int, int], float] = {}
        self.used: dict[int, float] = {}

    def _read(self) -> dict[tuple[int, int], float]:
        out: dict[tuple[int, int], float] = {}
        for root in self.roots:
            for pid in tree(root):
                for tid, value in thread_cpu_seconds(pid).items():
                    out[(pid, tid)] = value
        return out

    def start(self) -> None:
        self._before = self._read()

    def stop(self) -> dict[int, float]:
        after = self._read()
        used: dict[int, float] = {}
        for (pid, tid), value in after.items():
            used[pid] = used.get(pid, 0.0) + value - self._before.get((pid, tid), 0.0)
        self.used = used
        return self.used

    def total(self) -> float:
        return sum(self.used.values())


# ---- emulator and daemon ----------------------------------------------------------------

@contextlib.contextmanager
def emulator(tls: tuple[str, str] | None = None) -> Iterator[EmulatorProcess]:
    """The bundled emulator on 127.0.0.1, quiet (WARNING) so its log costs nothing;
    with `tls` (certificate, key), over TLS too (`tls_base_url`)."""
    with EmulatorProcess(extra_args=["--log-level", "WARNING"], ready_timeout=30.0,
                         tls=tls) as emu:
        yield emu


@contextlib.contextmanager
def tls_files() -> Iterator[tuple[str, str]]:
    """A throwaway certificate for 127.0.0.1 (streamfence.devtools.certs):
    yields (the certificate, its key); a client trusts the certificate itself."""
    from streamfence.devtools.certs import self_signed

    with tempfile.TemporaryDirectory(prefix="sfbench-tls-") as tmp:
        cert, key = self_signed(Path(tmp))
        yield str(cert), str(key)


def providers_for(emu: EmulatorProcess, **profile: Any) -> dict[str, dict[str, Any]]:
    """One openai and one anthropic profile, both pointing at the emulator."""
    return {"oa": {"kind": "openai", "base_url": emu.openai_base_url, **profile},
            "an": {"kind": "anthropic", "base_url": emu.anthropic_base_url, **profile}}


@contextlib.contextmanager
def daemon(providers: dict[str, dict[str, Any]], settings: dict[str, Any] | None = None,
           ready_timeout: float = 120.0,
           env: dict[str, str] | None = None) -> Iterator[DaemonProcess]:
    """The real daemon (`streamfence serve --log-json`) in a short temp dir;
    `env`: variables set for it, beside ours."""
    with tempfile.TemporaryDirectory(prefix="sfbench-") as tmp:
        base = {"log_level": "WARNING"}
        base.update(settings or {})
        proc = DaemonProcess(Path(tmp) / "state", providers, daemon=base, env=env)
        try:
            proc.start(ready_timeout=ready_timeout)
            yield proc
        finally:
            proc.cleanup()


def wait_quiet(*procs: DaemonProcess, window_s: float = 0.5, below: float = 0.1,
               timeout_s: float = 60.0) -> None:
    """Wait until the daemons' process trees used under `below` of a core each
    over a whole `window_s` (new spares warm up after their hello)."""
    roots = [p.proc.pid for p in procs if p.proc is not None]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        meter = CpuMeter(roots)
        meter.start()
        time.sleep(window_s)
        meter.stop()
        if meter.total() < below * window_s * len(procs):
            return
    raise TimeoutError(f"the daemons did not go quiet within {timeout_s:.0f} s")


def wait_idle(proc: DaemonProcess, count: int, timeout_s: float = 300.0) -> float:
    """Wait until `count` workers are idle (the warm pool is complete); returns the wait."""
    from streamfence.devtools.launcher import wait_until

    t0 = time.monotonic()
    with proc.client(timeout_s=30.0) as client:
        def ready() -> bool:
            return sum(1 for w in client.status()["workers"] if w["state"] == "idle") >= count

        wait_until(ready, timeout_s, f"{count} idle workers", interval=0.05)
    wait_quiet(proc)
    return time.monotonic() - t0


def daemon_roles(status: dict[str, Any]) -> dict[int, str]:
    """pid -> role (supervisor, sink, zygote, worker) from a `status` reply."""
    roles = {pid: role for role, pid in status["processes"].items()}
    for w in status["workers"]:
        if w["pid"]:
            roles[w["pid"]] = "worker"
    return roles


def sink_in_endpoint(proc: DaemonProcess) -> str:
    """The daemon's worker wire: the sink's stream socket (streamfence.protocol.internal.Endpoints)."""
    from streamfence.config.model import load_config
    from streamfence.protocol.internal import Endpoints

    cfg = load_config(str(proc.config_path), env={})
    return Endpoints(cfg.runtime_dir()).sink_stream


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (children inherit it); returns it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


def realistic_text(chunks: int, seed: int = 0) -> str:
    """Text that the emulator splits into `chunks` pieces of ~4-5 characters
    (a token's worth, as providers stream it), multi-byte characters included."""
    words = ("the ", "model", " says", " hé", "llo,", " worl", "d —", " and", " then",
             " some", " more", " 日本", " tex", "t. ", " ok")
    out = [words[(i * 7 + seed) % len(words)] for i in range(chunks)]
    text = "".join(out)
    # split_text cuts len/chunks characters per piece; pad to a multiple.
    return text + "." * ((-len(text)) % chunks)


def wall() -> float:
    return time.time()


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class RawClient:
    """The client library's wire on raw sockets, for sections that submit many
    calls at once and read every event in one loop (one asyncio task per call
    would measure the subscriber): requests on the client endpoint, events
    on the events socket under one listener id (docs/PROTOCOL.md §1).
    `messages()` hands out replies before events, and holds back the events
    of a call until its `accepted` reply was handed out."""

    def __init__(self, proc: DaemonProcess) -> None:
        ctx: zmq.Context[Any] = zmq.Context.instance()
        creds = load_credentials(proc.credentials_path)
        self.listener = new_ref()
        self.req: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        self.events: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        self.events.setsockopt(zmq.ROUTING_ID, self.listener.encode())
        self.poller = zmq.Poller()
        for sock, where in ((self.req, proc.endpoint), (self.events, events_endpoint(proc.endpoint))):
            for name, value in (("LINGER", 0), ("RCVHWM", 0), ("SNDHWM", 0)):
                sock.setsockopt(getattr(zmq, name), value)
            creds.apply(sock)
            sock.connect(where)
            self.poller.register(sock, zmq.POLLIN)
        self.read = self._acked = 0  # bytes read on the events socket, and acknowledged
        self._known: set[str] = set()
        self._early: dict[str, list[dict[str, Any]]] = {}
        # Both handshakes (CURVE, and `listen` on the events socket) before any timing.
        self.req.send(encode(status_msg(new_ref())))
        self.events.send(encode({"v": 1, "op": "listen"}))
        for sock in (self.req, self.events):
            if not sock.poll(30_000):
                raise TimeoutError("the daemon did not answer a status / listen within 30 s")
            frame = sock.recv()
        self.read = len(frame)  # `listening`

    def submit_frame(self, ref: str, model: str, messages: list[dict[str, Any]]) -> bytes:
        """A submit whose events come to this client's listener."""
        return encode(submit_msg(ref, "oa", {"model": model, "messages": messages},
                                 session_id=None, idempotency_key=None, options=None,
                                 listener=self.listener))

    def messages(self, timeout_ms: int) -> list[dict[str, Any]]:
        """What arrived within `timeout_ms` (decoded), replies first."""
        out: list[dict[str, Any]] = []
        if not self.poller.poll(timeout_ms):
            return out
        for sock in (self.req, self.events):
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if sock is self.events:
                    self.read += len(frame)
                got = msgpack.unpackb(frame)
                for msg in got if isinstance(got, list) else [got]:  # a batch of events, or one
                    self._take(msg, out)
        if self.read - self._acked >= 64 << 10:  # flow control (PROTOCOL §5), as the library
            self._acked = self.read
            self.events.send(encode({"v": 1, "op": "ack", "read": self.read}))
        return out

    def _take(self, msg: dict[str, Any], out: list[dict[str, Any]]) -> None:
        call_id: str = msg.get("call_id", "")
        if msg.get("op") == "accepted":
            self._known.add(call_id)
            out.append(msg)
            out.extend(self._early.pop(call_id, []))
        elif "ref" not in msg and call_id not in self._known:
            self._early.setdefault(call_id, []).append(msg)
        else:
            out.append(msg)

    def close(self) -> None:
        self.req.close(linger=0)
        self.events.close(linger=0)
