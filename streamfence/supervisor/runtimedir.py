"""The runtime directory (the internal `ipc://` sockets and the liveness
file) and the unix sockets a start is about to bind.

`RuntimeDir(path, state_dir)` makes the directory (0700) or checks that the
one there is ours (a real directory, owned by this user, private: one under
the shared temp dir could have been made by anyone), and removes it at
`remove()` when it is not `run/` under the state dir, so a daemon whose
state dir path is long leaves nothing behind in the temp dir.

`claim_sockets(paths)`: ZeroMQ unlinks whatever is at an `ipc://` path when
it binds there, and so did the daemon before it bound its own: a second
daemon that got that far took the first one's sockets from under it (a call
it had accepted then never reached a done). A socket file that someone still
accepts on belongs to a live process: the start is refused, naming the path
and that process's pid (SO_PEERCRED); one that refuses connections is a
dead daemon's leftover and is removed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import stat
import struct
from collections.abc import Iterable

from streamfence.supervisor.statedir import StateDirError

# What the supervisor and the sink bind under the runtime dir (protocol.internal.Endpoints).
INTERNAL_SOCKETS = ("workers", "logs", "sink.in", "sink.ctl", "sink.stream")


class RuntimeDir:
    """Owns the runtime directory: made or checked here, removed by `remove`
    when it lives outside the state dir."""

    def __init__(self, path: str, state_dir: str) -> None:
        self.path = path
        self._temporary = os.path.dirname(path) != os.path.abspath(state_dir)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise StateDirError(f"runtime dir {path}: cannot create it ({exc.strerror})") from None
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise StateDirError(f"runtime dir {path}: not a directory of this user; remove it, "
                                f"or shorten daemon.state_dir so that the sockets fit under it")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(path, 0o700)  # only our user may reach the internal sockets

    def remove(self) -> None:
        """At the stop, once no child is left: a temp-dir runtime dir goes."""
        if self._temporary:
            shutil.rmtree(self.path, ignore_errors=True)


def _listener_pid(path: str) -> int | None:
    """The pid accepting on the unix socket at `path`, 0 if it cannot be told;
    None if nothing accepts there."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return None
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.ETIMEDOUT):  # a full backlog: someone is there
                return 0
            return None
        creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return int(struct.unpack("3i", creds)[0])


def claim_sockets(paths: Iterable[str], state_dir: str) -> None:
    """Remove the dead leftovers among `paths`; StateDirError if a live
    process accepts on one of them (`state_dir`: this start's, for the message)."""
    for path in paths:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISSOCK(st.st_mode):
            pid = _listener_pid(path)
            if pid is not None:
                who = f"pid {pid}" if pid else "a process"
                raise StateDirError(f"{path} is in use by a running process ({who}): another "
                                    f"streamfence daemon serves there; stop it first, or give "
                                    f"this one (state dir {state_dir}) a daemon.state_dir and "
                                    f"a daemon.endpoint of its own")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def bound_paths(runtime_dir: str, endpoint: str, events: str) -> list[str]:
    """The unix socket paths a start binds: the internal ones, and the client
    endpoints if ipc:// (what `claim_sockets` checks before they are bound)."""
    paths = [ep.removeprefix("ipc://") for ep in (endpoint, events) if ep.startswith("ipc://")]
    return paths + [os.path.join(runtime_dir, name) for name in INTERNAL_SOCKETS]
