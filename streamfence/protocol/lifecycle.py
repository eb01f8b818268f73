"""What every process of the daemon shares about living and dying: its
exit codes, dying with its parent, and its title.

`die_with_parent(expected_parent)` asks the kernel to SIGKILL this process
when its parent dies (Linux prctl PR_SET_PDEATHSIG), which is how "no
orphans" holds even for a SIGKILL of the parent (nothing in the parent gets
to run then). It returns False when the parent is already gone (it died
before the prctl, so the signal will never come): the caller then exits with
`ExitCode.PARENT_GONE`.

`set_process_title(role)` makes `ps` show `streamfence[NAME]: ROLE`
(`supervisor`, `sink`, `zygote`, `worker 3 (idle)`, `worker 3 (call
1a2b3c4d…, attempt 2)`), NAME being the daemon's endpoint (`name_processes`,
at `serve`; two daemons on one machine have two), instead of the
interpreter's command line, which for every child is the same
`python -c from multiprocess.spawn import spawn_main…` or the zygote's.
setproctitle rewrites the argv area, so /proc/PID/cmdline shows it too; a
worker sets it twice per attempt (~4 µs each).

Caveat for whoever starts a child: the signal fires when the parent *thread*
that started the child exits, not the parent process. Start children from the
main thread or a thread that lives as long as the daemon.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from enum import IntEnum

import setproctitle

_PR_SET_PDEATHSIG = 1


class ExitCode(IntEnum):
    """The exit codes of the daemon's children (sink, zygote, workers), one meaning
    each. A Python exception that escapes a process exits 1; a signal shows as a
    negative return code."""

    OK = 0
    BOOT_FAILED = 3  # zygote or worker: could not import, warm up or connect
    PARENT_GONE = 4  # any child: the parent died before the death signal was armed
    SINK_UNREACHABLE = 5  # worker: no ack from the sink for its final message
    CRASHED = 6  # worker: an unexpected exception ended its loop
    CANNOT_BIND = 7  # sink: the events endpoint is in use or not bindable


def die_with_parent(expected_parent: int) -> bool:
    """Arm the parent-death signal (SIGKILL). False: the parent is already gone."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    return os.getppid() == expected_parent


def expected_parent_pid() -> int:
    """The pid of the process that started us: the multiprocessing parent when
    there is one (known even if it already died), else getppid()."""
    for modname in ("multiprocess", "multiprocessing"):
        mod = sys.modules.get(modname)
        parent = getattr(mod, "parent_process", None) if mod else None
        proc = parent() if parent else None
        if proc is not None and proc.pid:
            return int(proc.pid)
    return os.getppid()


# The daemon's name in its processes' titles: set by `serve`, inherited by every child.
TITLE_ENV = "STREAMFENCE_TITLE"


def name_processes(endpoint: str) -> None:
    """This process and every child started from now on carry `endpoint` in
    their titles (`tcp://127.0.0.1:7755` as `127.0.0.1:7755`, an ipc one as
    its path)."""
    os.environ[TITLE_ENV] = endpoint.split("://", 1)[-1]


def set_process_title(role: str) -> None:
    """`ps` shows this process as `streamfence[NAME]: {role}` (`streamfence:
    {role}` before `name_processes`)."""
    name = os.environ.get(TITLE_ENV)
    setproctitle.setproctitle(f"streamfence[{name}]: {role}" if name else f"streamfence: {role}")
