"""The state directory: private to the daemon's user, and one daemon at a time.

As PostgreSQL treats its data directory: the daemon creates it 0700, refuses
to start on one that others can read (the journal holds prompts, the
transcript answers, `keys/` the daemon's secret key), and holds an exclusive
`flock` on `daemon.lock` for its whole life, so a second `serve` on the same
directory stops at once naming the holder's pid. The process umask is set to
0077 before anything is created, so every file the daemon and its children
write (databases and their -wal/-shm, keys, the liveness file, sockets) is
0600 or 0700.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

LOCK_NAME = "daemon.lock"
_SYSTEM_TREES = ("/proc", "/sys", "/dev")


class StateDirError(Exception):
    """A state directory the daemon cannot or must not use (one line, with the fix)."""


class StateDirBusy(StateDirError):
    """Another process holds the state directory's lock (`holder`: its pid as written)."""

    def __init__(self, message: str, holder: str) -> None:
        super().__init__(message)
        self.holder = holder


def _check_path(path: Path, key: str) -> None:
    resolved = path.resolve()
    for tree in _SYSTEM_TREES:
        if resolved == Path(tree) or Path(tree) in resolved.parents:
            raise StateDirError(f"{key} = {str(path)!r}: {tree} is a system tree, not storage; "
                                f"choose a directory you own")
    if resolved.exists() and not resolved.is_dir():
        raise StateDirError(f"{key} = {str(path)!r}: exists and is not a directory")


def prepare(path: str | os.PathLike[str], key: str = "daemon.state_dir") -> Path:
    """Create `path` (0700) if needed and check it is a private, writable
    directory; StateDirError otherwise. Sets the umask to 0077."""
    os.umask(0o077)
    p = Path(path)
    _check_path(p, key)
    try:
        p.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise StateDirError(f"{key} = {str(p)!r}: cannot create it ({exc.strerror})") from None
    mode = stat.S_IMODE(p.stat().st_mode)
    if mode & 0o077:
        raise StateDirError(f"{key} = {str(p)!r}: others may read it (mode {mode:o}); the "
                            f"daemon keeps prompts, answers and keys there: chmod 700 {p}")
    if not os.access(p, os.W_OK | os.X_OK):
        if os.statvfs(p).f_flag & os.ST_RDONLY:
            raise StateDirError(f"{key} = {str(p)!r}: on a read-only file system; choose a "
                                f"writable directory")
        raise StateDirError(f"{key} = {str(p)!r}: not writable by this user")
    return p


class StateLock:
    """An exclusive flock on `<state_dir>/daemon.lock`, held until `release`
    (or the process's death: the kernel drops it)."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LOCK_NAME
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StateDirError(f"{self.path}: cannot open the lock file ({exc.strerror})") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise StateDirBusy(f"another streamfence daemon (pid {holder}) is using "
                                   f"{state_dir}; stop it first, or give this one another "
                                   f"daemon.state_dir", holder) from None
            raise StateDirError(f"{self.path}: cannot lock ({exc.strerror})") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
