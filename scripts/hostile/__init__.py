"""Scenarios of `scripts/chaos_hostile.py`: one hostile client each.

A scenario is a module here (every module of this package is one, in the
order of their names), that defines:

    NAME = "rogue listeners"        # what `--only` takes (spaces or dashes)
    ABOUT = "300 events connections of one identity, none reading"
    DAEMON: dict = {}               # optional: [daemon] settings for its daemon
    NOFILE: int | None = None       # optional: the daemon's descriptor limit
                                    # (soft and hard: it cannot raise it)

    def attack(a: Attack) -> None:  # runs until a.stop is set, then cleans up
        ...
    def checks(a: Attack) -> list[tuple[str, bool]]:   # optional: after the run
        ...

`attack` runs on its own thread beside the frame's well-behaved probe; it
must return soon after `a.stop` is set, with every socket it opened closed,
and it says what it did with `a.count("what", n)` (the verdict requires a
count: an attack that did nothing fails). Every loop in it is bounded by
`a.stop` (the frame sets it after --duration seconds).
"""

from __future__ import annotations

import importlib
import pkgutil
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from streamfence.devtools.emulator.control import EmulatorClient
from streamfence.devtools.launcher import DaemonProcess
from streamfence.protocol.credentials import Credentials
from streamfence.protocol.keys import KeyStore
from streamfence.protocol.messages import events_endpoint

# The daemon's provider profiles (on the emulator): name -> wire.
PROFILES = {"emu": "openai", "an": "anthropic", "br": "bedrock"}


def scenarios() -> list[ModuleType]:
    """Every scenario module, by file name."""
    return [importlib.import_module(f"{__name__}.{m.name}")
            for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name)]


@dataclass
class Attack:
    """What a scenario's `attack` works with."""

    daemon: DaemonProcess
    emu: EmulatorClient
    rng: random.Random
    stop: threading.Event = field(default_factory=threading.Event)
    counts: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        return self.daemon.endpoint

    @property
    def events_endpoint(self) -> str:
        return events_endpoint(self.daemon.endpoint)

    @property
    def state_dir(self) -> Path:
        return self.daemon.state_dir

    def register(self, name: str) -> Credentials:
        """A new client identity (not an admin) of this daemon."""
        return KeyStore(self.state_dir / "keys").register(name, self.endpoint)

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] = self.counts.get(what, 0) + n

    def script(self, key: str, chunks: int, delay_s: float = 0.0,
               text: str | None = None) -> None:
        """The emulator answers model `gpt-emu#<key>` with `chunks` chunks (of
        `text` if given: its size sets the answer's)."""
        step: dict[str, Any] = {"fault": "ok", "chunks": chunks, "chunk_delay_s": delay_s}
        if text is not None:
            step["text"] = text
        self.emu.script(key, [step])


def request(key: str, content: str = "hi") -> dict[str, Any]:
    """An OpenAI chat request for the emulator's script `key`."""
    return {"model": f"gpt-emu#{key}", "messages": [{"role": "user", "content": content}]}
