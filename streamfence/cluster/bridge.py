"""The ledger for a process whose loop is not asyncio (the supervisor's and
the sink's, which poll ZeroMQ sockets): `LedgerBridge` runs a `Ledger` on an
event loop in a thread of its own.

The owning thread either waits for an operation (`call`: a start-up, a
rare read) or hands one over with a callback (`submit`) and goes on; the callback then runs in
the owning thread, from `run_done`, which the owner calls when the bridge's
descriptor (`fd`, the read end of a pipe the ledger's thread writes a byte
to) is readable. So every piece of the owner's state is still touched by
its own thread only.

Each crossing between the threads is a system call and a wake-up (100-300
µs each on a loaded 2-core VM, more than the ledger's own work for an
append), so they are shared: the operations submitted inside `batch()` (a
group commit's appends) go over in one hand-off, and one submitted while a
hand-off is on its way joins it; started in one turn of the ledger's loop,
their requests leave in one write to NATS. The pipe gets a byte only when
the owner has none to read yet: the answers that land before the owner
looks wake it once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from streamfence.cluster.ledger import Ledger
from streamfence.cluster.settings import ClusterSettings

T = TypeVar("T")
Done = Callable[[Any], None]  # gets the result, or the exception the operation raised
Op = tuple[Coroutine[Any, Any, Any], Done]
Finished = asyncio.Future[Any] | concurrent.futures.Future[Any]
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
        self._done: deque[tuple[Done, Finished]] = deque()
        self._woken = False  # a byte is in the pipe that the owner has not read yet
        self._batched: list[Op] | None = None  # inside `batch()`: the ops submitted
        self._outgoing: deque[Op] = deque()  # handed over, not started yet
        self._handing = False  # a `_start` is on its way that has not taken them yet
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
        `run_done`. Inside `batch()`, it starts at the batch's end."""
        if self._batched is not None:
            self._batched.append((op, then))
        else:
            self._hand_over((op, then))

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """The ops submitted meanwhile go to the ledger's loop in one hand-off, at
        the end (module docstring); nested, at the outermost end."""
        if self._batched is not None:
            yield
            return
        ops: list[Op] = []
        self._batched = ops
        try:
            yield
        finally:
            self._batched = None
            self._hand_over(*ops)

    def _hand_over(self, *ops: Op) -> None:
        """`ops` to the ledger's loop; the loop is woken unless a wake is on its
        way that has not taken the queue yet (`_start` clears `_handing` first)."""
        if not ops:
            return
        self._outgoing.extend(ops)  # deque operations are atomic
        if not self._handing:
            self._handing = True
            self._loop.call_soon_threadsafe(self._start)

    def _start(self) -> None:
        """In the ledger's loop: each op handed over a task, all in this turn (so
        their requests leave in one write)."""
        self._handing = False
        outgoing, loop = self._outgoing, self._loop
        while outgoing:
            op, then = outgoing.popleft()
            loop.create_task(op).add_done_callback(
                lambda task, then=then: self._finished(then, task))  # type: ignore[misc]

    def post(self, then: Callable[[], None]) -> None:
        """From the ledger's thread: run `then()` in the owner's thread (something
        the cluster asked of it), from `run_done`."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_result(None)
        self._finished(lambda _: then(), future)

    def _finished(self, then: Done, future: Finished) -> None:
        self._done.append((then, future))  # deque appends are atomic
        self.wake()

    def wake(self) -> None:
        """Make `fd` readable (from the ledger's thread: something for the owner),
        unless it is already: `_woken` is set before the byte is written and
        cleared by `run_done` only after it read the pipe, before it looks at
        the queue; so while `_woken` is set a byte is in the pipe (or on its
        way), and what is queued after the owner looked wakes it again."""
        if self._woken:
            return
        self._woken = True
        with contextlib.suppress(BlockingIOError, OSError):  # a byte is already there
            os.write(self._write, b"!")

    def run_done(self) -> None:
        """Run the callbacks of the operations finished since last asked."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._read, 4096)
        self._woken = False  # after the read: a byte written meanwhile is not lost
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
