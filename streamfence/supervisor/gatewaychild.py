"""The supervisor's side of the HTTP gateway process, an ordinary client of
the daemon run when `[http] listen` is set: starting it, its pid for
`status`, reaping it, and its restart policy. Its entry (gateway/process.py
`run_gateway`) is handed in by the command line, so that the supervisor
never imports the gateway.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from streamfence.config.model import DaemonConfig
from streamfence.protocol.lifecycle import ExitCode
from streamfence.supervisor.restarts import RestartedChild, RestartPolicy

GatewayEntry = Callable[[DaemonConfig, str], None]  # (config, runtime dir)


class GatewayChild(RestartedChild):
    """Owns the gateway process (None until it starts, and without an entry)
    and its restart policy."""

    def __init__(self, mp: Any, config: DaemonConfig, runtime_dir: str,
                 entry: GatewayEntry | None) -> None:
        self._mp = mp
        self._args = (config, runtime_dir)
        self._entry = entry
        self.process: Any = None
        self.restarts = RestartPolicy("gateway", time.monotonic, {
            ExitCode.CANNOT_BIND: f"the gateway cannot listen on {config.http.listen}"})

    def start(self) -> int:
        """Start the gateway, if the daemon has one; its sentinel, or -1."""
        if self._entry is None:
            return -1
        self.process = self._mp.Process(target=self._entry, name="gateway", args=self._args)
        self.process.start()
        self.restarts.started()
        return int(self.process.sentinel)
