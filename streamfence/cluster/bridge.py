"""The ledger for a process whose loop is not asyncio (the supervisor's and
the sink's, which poll ZeroMQ sockets): `LedgerBridge` runs a `Ledger` on an
event loop in a thread of its own.

The owning thread either waits for an operation (`call`: a start-up, a
rare read) or hands one over with a callback (`submit`) and goes on; the callback then runs in
the owning thread, from `run_done`, which the owner calls when the bridge's
descriptor (`fd`, the read end of a pipe the ledger's thread writes a byte
to) is readable. So every piece of the owner's state is still touched by
its own thread only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from streamfence.cluster.ledger import Ledger
from streamfence.cluster.settings import ClusterSettings

T = TypeVar("T")
Done = Callable[[Any], None]  # gets the result, or the exception the operation raised
CONNECT_TIMEOUTS = 8  # the most a connect may take, in timeout_s (see __init__)


class LedgerBridge:
    """Owns the ledger's thread, its loop and the pipe (module docstring)."""

    def __init__(self, settings: ClusterSettings) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cluster",
                                        daemon=True)
        self._thread.start()
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._done: deque[tuple[Done, concurrent.futures.Future[Any]]] = deque()
        self._timeout_s = settings.timeout_s * 2  # a call's wait: its requests' own timeouts first
        # Ledger.connect ends itself: a connect within timeout_s, then the
        # streams made within 6 of them (ledger.CONNECTING); this wait is a backstop.
        wait_s = settings.timeout_s * CONNECT_TIMEOUTS
        try:
            self.ledger: Ledger = self.call(Ledger.connect(settings), wait_s)
        except BaseException:
            self._stop_loop()
            raise

    @property
    def fd(self) -> int:
        return self._read

    def call(self, op: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run `op` on the ledger's loop and wait for its result (or exception)."""
        return asyncio.run_coroutine_threadsafe(op, self._loop).result(
            self._timeout_s if timeout_s is None else timeout_s)

    def submit(self, op: Coroutine[Any, Any, Any], then: Done) -> None:
        """Run `op`; `then(result or exception)` runs in the owner's thread, from
        `run_done`."""
        future = asyncio.run_coroutine_threadsafe(op, self._loop)
        future.add_done_callback(lambda f: self._finished(then, f))

    def post(self, then: Callable[[], None]) -> None:
        """From the ledger's thread: run `then()` in the owner's thread (something
        the cluster asked of it), from `run_done`."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_result(None)
        self._finished(lambda _: then(), future)

    def _finished(self, then: Done, future: concurrent.futures.Future[Any]) -> None:
        self._done.append((then, future))  # deque appends are atomic
        self.wake()

    def wake(self) -> None:
        """Make `fd` readable (from the ledger's thread: something for the owner)."""
        with contextlib.suppress(BlockingIOError, OSError):  # a byte is already there
            os.write(self._write, b"!")

    def run_done(self) -> None:
        """Run the callbacks of the operations finished since last asked."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._read, 4096)
        while self._done:
            then, future = self._done.popleft()
            if future.cancelled():
                then(concurrent.futures.CancelledError())
            else:
                error = future.exception()
                then(error if error is not None else future.result())

    def close(self) -> None:
        if hasattr(self, "ledger"):
            with contextlib.suppress(Exception):
                self.call(self.ledger.close(), 5.0)
        with contextlib.suppress(Exception):
            self.call(_cancel_the_rest(), 5.0)
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)


async def _cancel_the_rest() -> None:
    """The client's own tasks (a consumer's activity checks) end before the
    loop does, instead of being destroyed pending (a logged error each)."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
