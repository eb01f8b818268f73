"""Process-level test harness: the daemon as the tests run it (streamfence.devtools.launcher's,
which the demo and the chaos scripts share, with a short drain), and checks the
end-to-end tests share."""

import contextlib
import os
import signal
import socket
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import psutil

from streamfence.devtools import launcher
from streamfence.devtools.launcher import wait_until

if TYPE_CHECKING:  # cluster mode's tests only: it brings nats
    from streamfence.cluster.ledger import Ledger
    from streamfence.devtools.nats_cluster import NatsCluster

__all__ = ["DaemonProcess", "as_host", "assert_one_exact_answer", "free_port", "healthy",
           "process_state", "stopped", "tree_of", "wait_until"]

T = TypeVar("T")

STOP_GRACE_S = 1.0  # the tests' drain at a stop (stop_grace_s; the daemon's default is 30 s)


class DaemonProcess(launcher.DaemonProcess):
    """The launcher's daemon, whose drain at a stop (stop_grace_s) lasts
    STOP_GRACE_S unless the test's `daemon` settings give their own: a test
    that leaves a call stalled would otherwise sit out the launcher's 20 s
    wait for the SIGTERM at its teardown. A test of the drain sets its own."""

    def __init__(self, state_dir: Path, providers: dict[str, dict[str, Any]],
                 daemon: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(state_dir, providers, {"stop_grace_s": STOP_GRACE_S, **(daemon or {})},
                         **kwargs)


def tree_of(proc: launcher.DaemonProcess) -> list[int]:
    """The daemon's supervisor and every process under it."""
    assert proc.proc is not None, "the daemon is not running"
    root = psutil.Process(proc.proc.pid)
    return [root.pid, *(c.pid for c in root.children(recursive=True))]


@contextlib.contextmanager
def stopped(pids: list[int]) -> Iterator[list[int]]:
    """The processes stopped (SIGSTOP) for the block and continued (SIGCONT)
    after it, whatever the block raised: a frozen host, a zombie."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def is_listening(msg: Any) -> bool:
    """`listening`, with or without the sink's offer of a plain link (PROTOCOL §5)."""
    return isinstance(msg, dict) and \
        {k: v for k, v in msg.items() if k != "link"} == {"v": 1, "op": "listening"}


def process_state(pid: int) -> str:
    """The process's state letter in /proc (`T`: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def assert_one_exact_answer(events: list[dict[str, Any]], sent: list[dict[str, Any]]) -> None:
    """The call's events, as a subscriber received them, are one completed
    answer: seqs 1, 2, 3 ... with no reset, whose text is exactly what the
    emulator sent for its one request (`sent`: the emulator's log of the key)."""
    done = events[-1]
    assert done["status"] == "completed", done
    assert len(sent) == 1, f"the provider was asked {len(sent)} times"
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert not any(e["op"] == "reset" for e in events)
    text = "".join(e["data"] for e in events if e["op"] == "delta" and e["kind"] == "text")
    assert done["response"]["content"] == text == sent[0]["text"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for [http] listen)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(url: str) -> bool:
    """The gateway at `url` (http://host:port) answers /healthz with 200."""
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=1.0) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def as_host(nats: "NatsCluster", host: str, body: "Callable[[Ledger], Awaitable[T]]") -> T:
    """Run `body(ledger)` with a ledger of its own, as cluster host `host`
    (a second host, or a reader); its result."""
    import asyncio

    from streamfence.cluster.ledger import Ledger
    from streamfence.cluster.settings import ClusterSettings

    async def main() -> T:
        ledger = await Ledger.connect(ClusterSettings(tuple(nats.urls), host))
        try:
            return await body(ledger)
        finally:
            await ledger.close()
    return asyncio.run(main())
