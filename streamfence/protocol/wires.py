"""The three provider wires (a profile's `kind`) and the smallest
provider-native request of each, as the CLI, the demo and the tests build it."""

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
