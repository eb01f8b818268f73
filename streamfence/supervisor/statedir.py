"""The state directory: private to the daemon's user, and one daemon at a time.

As PostgreSQL treats its data directory: the daemon creates it 0700, refuses
to start on one that others can read (the journal holds prompts, the
transcript answers, `keys/` the daemon's secret key), and makes its own files
and directories there private again when others could read them (a copy
restored with loose modes, say: `make_private`, once it holds the lock).

One daemon per state dir: it holds an exclusive `flock` on the state
directory itself for its whole life. A lock on a file can be deleted from
under its holder (one on `daemon.lock` was, and a second daemon then ran on
the same state); the directory cannot while it holds the state. A second
`serve` on the same directory stops at once naming the holder's pid: the
kernel's (/proc/locks), else the one `daemon.lock` holds (written there for
people and `streamfence check`; not a lock). The process umask is set to
0077 before anything is created, so every file the daemon and its children
write (databases and their -wal/-shm, keys, the liveness file, sockets) is
0600 or 0700.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from pathlib import Path

LOCK_NAME = "daemon.lock"  # the holder's pid, for people; the lock is the directory's
# What the daemon keeps in the state dir (supervisor/storepair.py, request_files.py, keys).
_OWN_PREFIXES = ("journal.db", "transcript.db")
_OWN_DIRS = ("keys", "run", "requests")
_OWN_NAMES = (LOCK_NAME, *_OWN_DIRS)
_SYSTEM_TREES = ("/proc", "/sys", "/dev")

log = logging.getLogger("streamfence.supervisor")


class StateDirError(Exception):
    """A state directory the daemon cannot or must not use (one line, with the fix)."""


class StateDirBusy(StateDirError):
    """Another process holds the state directory's lock (`holder`: its pid, or "unknown")."""

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


def _own_entries(root: Path) -> list[str]:
    """The daemon's files and directories under `root`, each directory's
    contents after it (not the files others keep there, say a config)."""
    found = []
    for entry in sorted(os.listdir(root)):
        if entry.startswith(_OWN_PREFIXES) or entry in _OWN_NAMES:
            found.append(os.path.join(root, entry))
            if entry in _OWN_DIRS and os.path.isdir(found[-1]) and not os.path.islink(found[-1]):
                for dirpath, dirnames, filenames in os.walk(found[-1]):
                    found += [os.path.join(dirpath, n) for n in (*dirnames, *filenames)]
    return found


def make_private(root: Path) -> None:
    """Take the group's and others' bits off each of the daemon's files and
    directories in the state dir that has any (a copy restored with loose
    modes, say), with one WARNING naming them. Symbolic links are left alone
    (chmod would follow them out); one that cannot be changed stops the start."""
    changed: list[str] = []
    for path in _own_entries(root):
        st = os.lstat(path)
        old = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode) or not old & 0o077:
            continue
        try:
            os.chmod(path, old & 0o700)
        except OSError as exc:
            raise StateDirError(f"{path}: others may read it (mode {old:o}) and it cannot be "
                                f"made private ({exc.strerror}): chmod go= {path}") from None
        changed.append(f"{os.path.relpath(path, root)} {old:o} -> {old & 0o700:o}")
    if changed:
        log.warning("state dir %s: %d file(s) others could read are private now: %s%s", root,
                    len(changed), ", ".join(changed[:5]), ", …" if len(changed) > 5 else "")


def _kernel_holder(fd: int) -> str | None:
    """The pid holding a flock on the file open at `fd`, as /proc/locks says."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == key:
                    return fields[4]
    except OSError:
        pass
    return None


def _written_holder(state_dir: Path) -> str | None:
    try:
        return (state_dir / LOCK_NAME).read_text(errors="replace").strip()[:32] or None
    except OSError:
        return None


def lock_holder(state_dir: Path) -> str | None:
    """The pid of the daemon holding `state_dir`'s lock (as StateLock finds
    it; "unknown" if neither the kernel nor `daemon.lock` says), None if no
    process holds it; the lock is only tried, never kept, and nothing written."""
    fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
            raise
        return _kernel_holder(fd) or _written_holder(state_dir) or "unknown"
    finally:
        os.close(fd)  # and with it the lock, if it was taken
    return None


class StateLock:
    """An exclusive flock on the state directory itself (opened O_DIRECTORY),
    held until `release` (or the process's death: the kernel drops it); the
    holder's pid is written to `daemon.lock`."""

    def __init__(self, state_dir: Path) -> None:
        try:
            self._fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise StateDirError(f"{state_dir}: cannot open it to lock it ({exc.strerror})") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _kernel_holder(self._fd) or _written_holder(state_dir) or "unknown"
            os.close(self._fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise StateDirBusy(f"another streamfence daemon (pid {holder}) is using "
                                   f"{state_dir}; stop it first, or give this one another "
                                   f"daemon.state_dir", holder) from None
            raise StateDirError(f"{state_dir}: cannot lock it ({exc.strerror})") from None
        try:
            pid_fd = os.open(state_dir / LOCK_NAME, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(pid_fd, f"{os.getpid()}\n".encode())
            finally:
                os.close(pid_fd)
        except OSError as exc:  # the note is for people; the lock holds without it
            log.warning("%s: cannot write this daemon's pid there (%s)", state_dir / LOCK_NAME,
                        exc.strerror)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
