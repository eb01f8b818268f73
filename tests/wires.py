"""The provider wires a process-level test can run on: the profile that
points a daemon at the emulator, and a minimal request, per wire."""

from __future__ import annotations

from typing import Any

from emulator.control import EmulatorProcess

WIRES = ("openai", "anthropic", "bedrock")


def profile_for(wire: str, emulator: EmulatorProcess) -> dict[str, Any]:
    if wire == "openai":
        return {"kind": "openai", "base_url": emulator.openai_base_url}
    if wire == "anthropic":
        return {"kind": "anthropic", "base_url": emulator.anthropic_base_url}
    if wire == "bedrock":
        return {"kind": "bedrock", "endpoint_url": emulator.base_url, "region": "us-east-1",
                "aws_credentials": "dummy"}
    raise ValueError(wire)


def request_for(wire: str, key: str, text: str = "hi") -> dict[str, Any]:
    model = f"emu-model#{key}"
    if wire == "openai":
        return {"model": model, "messages": [{"role": "user", "content": text}]}
    if wire == "anthropic":
        return {"model": model, "max_tokens": 256,
                "messages": [{"role": "user", "content": text}]}
    if wire == "bedrock":
        return {"modelId": model, "messages": [{"role": "user", "content": [{"text": text}]}]}
    raise ValueError(wire)
