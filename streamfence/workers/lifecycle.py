"""Process lifecycle helpers shared by every child of the daemon.

`die_with_parent` sets Linux's parent-death signal so that a child is killed
when its parent goes, which is how "no orphans" holds even for a SIGKILL of
the supervisor (nothing in the parent gets to run then).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from enum import IntEnum

_PR_SET_PDEATHSIG = 1


class ExitCode(IntEnum):
    """Named exit codes of the daemon's children (a reader of `status` sees these)."""

    OK = 0
    BOOT_FAILED = 3  # could not import or warm up: fatal, do not respawn in a loop
    PARENT_GONE = 4
    SINK_UNREACHABLE = 5  # a worker got no ack for its final message


def die_with_parent(expected_parent: int | None = None) -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The parent may have died before prctl: then we were already reparented.
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(ExitCode.PARENT_GONE)
