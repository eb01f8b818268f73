"""Die with the parent: the Linux parent-death signal, set from the child.

`die_with_parent(expected_ppid)` asks the kernel to send SIGKILL to this
process when its parent dies (prctl PR_SET_PDEATHSIG), then checks the parent
is still `expected_ppid`: if the parent died before the prctl, the signal
will never come, so the caller must exit itself.

Caveat for whoever starts the child: on Linux the signal fires when the
parent *thread* that forked the child exits, not the parent process. Start
children from the main thread or a thread that lives as long as the daemon.

Not specific to the sink; the lead may move it to a shared module.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Returns False where the platform has no parent-death signal."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    return True


def die_with_parent(expected_ppid: int, sig: int = signal.SIGKILL) -> bool:
    """Arm the parent-death signal. Returns False if the parent is already gone."""
    set_parent_death_signal(sig)
    return os.getppid() == expected_ppid


def expected_parent_pid() -> int:
    """The pid of the process that started us: the multiprocessing parent when
    there is one (it is known even if it already died), else getppid()."""
    for modname in ("multiprocess", "multiprocessing"):
        mod = sys.modules.get(modname)
        parent = getattr(mod, "parent_process", None) if mod else None
        proc = parent() if parent else None
        if proc is not None and proc.pid:
            return int(proc.pid)
    return os.getppid()
