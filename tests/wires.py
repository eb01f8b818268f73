"""The provider wires a process-level test can run on (streamfence.protocol.wires,
shaped for tests: the emulator process and a script key)."""

from __future__ import annotations

from typing import Any

from streamfence.devtools.emulator.control import EmulatorProcess, emulator_profile
from streamfence.protocol.wires import WIRES, sample_request

__all__ = ["WIRES", "profile_for", "request_for"]


def profile_for(wire: str, emulator: EmulatorProcess) -> dict[str, Any]:
    return emulator_profile(wire, emulator.base_url)


def request_for(wire: str, key: str, text: str = "hi") -> dict[str, Any]:
    return sample_request(wire, f"emu-model#{key}", text)
