"""When the sink looks at the allow-list for revoked keys (sink/subscribers.py).

The allow-list changes only when `keys/clients/` does (a file made, replaced
or removed there: protocol/keys.py re-reads it on the directory's mtime), so
the sink watches that directory with inotify and looks as soon as the kernel
says it changed. A timer every `RECHECK_S` covers what the kernel does not
report (a state dir on a network file system changed from another host, a
`clients/` directory replaced: its watch is made again then). Without
inotify (no instance left: `fs.inotify.max_user_instances`) the timer runs
every `CHECK_S`, as it always did.

Why not just the timer: each look wakes the sink's loop, ~300 µs of CPU
on the benchmark VM (docs/PERFORMANCE.md "Issue 32: the sink's timers"):
at 10 looks a second, 3 ms of CPU a second for as long as any listener
was connected, idle or not.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from inotify_simple import INotify
from inotify_simple import flags as inotify_flags

from streamfence.protocol.keys import KeyStore

log = logging.getLogger("streamfence.sink")

CHECK_S = 0.1  # how often the allow-list is looked at without a watch
RECHECK_S = 1.0  # ... and with one (what the kernel does not report)
_CHANGES = (inotify_flags.CREATE | inotify_flags.DELETE | inotify_flags.MOVED_FROM
            | inotify_flags.MOVED_TO | inotify_flags.DELETE_SELF | inotify_flags.MOVE_SELF
            | inotify_flags.ONLYDIR)


class KeyChecks:
    """Owns the watch on `clients/`, when the next look is due (`due`) and
    the allow-list seen at the last one."""

    def __init__(self, keys: KeyStore, now: float) -> None:
        self._keys = keys
        self._allowed: Mapping[bytes, str] | None = None
        self._watching = False
        try:
            self._inotify: INotify | None = INotify(nonblocking=True)
        except OSError as exc:
            log.warning("sink: no inotify instance (%s): the allow-list is looked at every "
                        "%.1f s instead", exc, CHECK_S)
            self._inotify = None
        self._watch()
        self.due = now + self.every

    @property
    def every(self) -> float:
        return RECHECK_S if self._watching else CHECK_S

    def fileno(self) -> int | None:
        """The descriptor that turns readable when `clients/` changed (None: no inotify)."""
        return self._inotify.fileno() if self._inotify is not None else None

    def on_readable(self) -> None:
        """The kernel reported a change: the next look is due now."""
        assert self._inotify is not None
        for event in self._inotify.read(timeout=0):
            if event.mask & inotify_flags.IGNORED:  # the directory went: watch it again
                self._watching = False
        self.due = 0.0

    def allowed(self, key: bytes) -> bool:
        return key in self._keys.allow_list()

    def changed(self, now: float) -> Mapping[bytes, str] | None:
        """The allow-list, if it is not the one seen at the last look; the
        next look is due `every` from `now`."""
        if not self._watching:
            self._watch()
        self.due = now + self.every
        allowed = self._keys.allow_list()
        if allowed is self._allowed:
            return None
        self._allowed = allowed
        return allowed

    def _watch(self) -> None:
        if self._inotify is None:
            return
        try:
            self._inotify.add_watch(self._keys.clients_dir, _CHANGES)
        except OSError:  # not there (yet): the timer looks, and tries again
            return
        self._watching = True

    def close(self) -> None:
        if self._inotify is not None:
            self._inotify.close()
