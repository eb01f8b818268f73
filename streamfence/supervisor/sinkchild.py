"""The supervisor's side of the sink process (the only writer of the
transcript): starting it with what it must know, telling when a new one
serves (its first answer), and its counters for `status` while it is down.
The control connection to it is the SinkLink's (streamfence.supervisor.
sinklink); the daemon makes a new one per sink process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from streamfence.config.model import DaemonConfig
from streamfence.protocol.lifecycle import ExitCode
from streamfence.sink.process import run_sink
from streamfence.supervisor.restarts import RestartedChild, RestartPolicy
from streamfence.supervisor.sinklink import SinkLink
from streamfence.supervisor.startup import cluster_settings


class SinkChild(RestartedChild):
    """Owns the sink process and its restart policy. `control_identity`: the
    only identity the sink obeys (passed to it at spawn, never sent)."""

    def __init__(self, mp: Any, config: DaemonConfig, runtime_dir: str, transcript_path: str,
                 events_endpoint: str, keys_dir: str | None, control_identity: bytes) -> None:
        self._mp = mp
        self._config = config
        self._args = (runtime_dir, transcript_path, events_endpoint, keys_dir,
                      config.log_level, control_identity, True, config.retention_days,
                      cluster_settings(config))
        self.process: Any = None
        self.restarts = RestartPolicy("sink", time.monotonic, {ExitCode.CANNOT_BIND: (
            f"the events endpoint {events_endpoint} cannot be bound (the client "
            f"endpoint's port + 1, or its path + '.events': docs/PROTOCOL.md §1)")})

    def start(self, link: SinkLink) -> None:
        """A new sink; `link` asks it for its counters: its answer shows that it serves."""
        self.process = self._mp.Process(target=run_sink, name="sink", args=self._args)
        self.process.start()
        self.restarts.started()
        started = self.process

        def answered(_stats: dict[str, Any]) -> None:
            # The link answers from its last counters when the sink died first.
            if self.process is started and not self.restarts.down:
                self.restarts.ready()

        link.read_stats(answered)

    def stats(self, link: SinkLink, reply: Callable[[dict[str, Any]], None]) -> None:
        """The sink's counters for `status`: asked for, or the last ones known, at
        once, while the sink is down or not yet serving (status must not wait
        for its back-off or its start)."""
        if self.restarts.serving:
            link.read_stats(reply)
        else:
            reply(dict(link.stats))
