"""The three provider wires, as the CLI, the demo and the tests meet them:
a minimal provider-native request per wire, and the profile that points the
daemon at the bundled emulator."""

from __future__ import annotations

from typing import Any

WIRES = ("openai", "anthropic", "bedrock")


def sample_request(wire: str, model: str, text: str) -> dict[str, Any]:
    """The smallest native request body of `wire` asking `model` about `text`."""
    if wire == "openai":
        return {"model": model, "messages": [{"role": "user", "content": text}]}
    if wire == "anthropic":
        return {"model": model, "max_tokens": 1024,
                "messages": [{"role": "user", "content": text}]}
    if wire == "bedrock":
        return {"modelId": model, "messages": [{"role": "user", "content": [{"text": text}]}]}
    raise ValueError(f"unknown wire {wire!r} (one of {', '.join(WIRES)})")


def emulator_profile(wire: str, base_url: str) -> dict[str, Any]:
    """A provider profile of kind `wire` for the emulator at `base_url` (no /v1)."""
    if wire == "openai":
        return {"kind": "openai", "base_url": base_url + "/v1"}
    if wire == "anthropic":
        return {"kind": "anthropic", "base_url": base_url}
    if wire == "bedrock":
        return {"kind": "bedrock", "endpoint_url": base_url, "region": "us-east-1",
                "aws_credentials": "dummy"}
    raise ValueError(f"unknown wire {wire!r} (one of {', '.join(WIRES)})")
