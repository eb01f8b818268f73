"""Translation between wires: a request on one HTTP endpoint served by a
profile of another kind (docs/ARCHITECTURE.md §4.16).

Contract: `translate(body, source, target, model)` -> the request body in
the `target` wire ("openai", "anthropic", "bedrock") for a `body` in the
`source` wire ("openai": POST /v1/chat/completions, "anthropic": POST
/v1/messages), naming `model`; or Untranslatable (gateway/neutral.py),
whose message names the caller's field. Pure, per request, never per
delta: the answer needs no translation of its own, since the workers turn
every wire into the same normalized events (PROTOCOL §6) and the
endpoint's renderer writes them in the caller's wire.

Why here: the ZeroMQ protocol stays provider-native (a call's request is
data for its profile's wire, supervisor/requests.py admits it as such),
so the daemon, its journal and its workers never see a second format;
the gateway, which alone knows the caller's wire, converts at its edge. It
runs only when the kinds differ: a request to a profile of the endpoint's
kind goes as it came.

The steps are a reader of the caller's wire into the neutral form
(gateway/from_wire.py) and a writer of the target's (gateway/to_wire.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from streamfence.gateway.from_wire import read_anthropic, read_openai
from streamfence.gateway.neutral import Chat, Untranslatable
from streamfence.gateway.to_wire import write_anthropic, write_bedrock, write_openai

READERS: dict[str, Callable[[dict[str, Any], str], Chat]] = {
    "openai": read_openai, "anthropic": read_anthropic}
WRITERS: dict[str, Callable[[Chat, str], dict[str, Any]]] = {
    "openai": write_openai, "anthropic": write_anthropic, "bedrock": write_bedrock}


def translate(body: dict[str, Any], source: str, target: str, model: str) -> dict[str, Any]:
    """See the module docstring."""
    writer = WRITERS.get(target)
    if writer is None:
        raise Untranslatable(f"model: a {target} profile cannot be reached over HTTP")
    return writer(READERS[source](body, target), model)
