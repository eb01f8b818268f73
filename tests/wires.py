"""The provider wires a process-level test can run on (streamfence.protocol.wires,
shaped for tests: the emulator process and a script key), and the signature
of conftest's `module_daemon` factory, which starts a daemon with them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from streamfence.devtools.emulator.control import EmulatorProcess, emulator_profile
from streamfence.protocol.wires import WIRES, sample_request
from tests.harness import DaemonProcess

__all__ = ["WIRES", "DaemonFactory", "profile_for", "profiles_for", "request_for"]

STALE_S = 30.0  # the profiles' stale timeout: longer than any test's pauses


def profile_for(wire: str, emulator: EmulatorProcess) -> dict[str, Any]:
    return emulator_profile(wire, emulator.base_url)


def request_for(wire: str, key: str, text: str = "hi") -> dict[str, Any]:
    return sample_request(wire, f"emu-model#{key}", text)


def profiles_for(emulator: EmulatorProcess,
                 providers: Mapping[str, str | Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Provider profiles by name: a wire's name stands for its emulator profile
    (with the tests' stale timeout); a table is taken as it is."""
    return {name: dict(profile_for(wire_or_table, emulator), stale_timeout_s=STALE_S)
            if isinstance(wire_or_table, str) else dict(wire_or_table)
            for name, wire_or_table in providers.items()}


class DaemonFactory(Protocol):
    """conftest's `module_daemon`: a started daemon that a module's tests share,
    with these providers (`profiles_for`; default: `emu` on the openai wire),
    these `[daemon]` settings, and `config_tail` appended to its config file
    (e.g. `[identities.*]` tables)."""

    def __call__(self, providers: Mapping[str, str | Mapping[str, Any]] | None = None, *,
                 daemon: dict[str, Any] | None = None, config_tail: str = "") -> DaemonProcess:
        ...
