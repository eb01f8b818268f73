"""The provider adapters by profile kind, and the one call a worker makes per attempt.

`ADAPTERS` maps a profile's `kind` to its wire's `Adapter` (workers/adapter.py).
`run_attempt(profile, request, out, settings)` builds (once per profile and
settings, for the life of the worker process: a reload may change a profile's
settings under its name) the profile's client and runs the attempt on it. It
never raises: whatever the adapter could not turn into an outcome itself (an
unknown kind, a missing credential, an error opening the request) becomes
`failed_outcome` of the adapter's classification, reported to `out.failed`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from streamfence.protocol.internal.outcome import AttemptError, AttemptOutcome
from streamfence.protocol.internal.workers import AttemptSettings
from streamfence.workers import anthropic_messages, bedrock_converse, openai_chat
from streamfence.workers.adapter import Adapter, Profile, secrets_of
from streamfence.workers.assembly import failed_outcome
from streamfence.workers.errors import classify
from streamfence.workers.output import AttemptOutput

ADAPTERS: Mapping[str, Adapter] = {
    a.kind: a for a in (openai_chat.ADAPTER, anthropic_messages.ADAPTER, bedrock_converse.ADAPTER)}

_clients: dict[str, tuple[Profile, Any]] = {}  # profile name -> (its settings, client)


def adapter_for(profile: Profile) -> Adapter:
    kind = profile.get("kind")
    adapter = ADAPTERS.get(kind) if isinstance(kind, str) else None
    if adapter is None:
        raise ValueError(f"provider kind {kind!r} is not supported yet")
    return adapter


def client_for(profile: Profile) -> Any:
    name = str(profile["name"])
    cached = _clients.get(name)
    if cached is not None and cached[0] == profile:
        return cached[1]
    client = adapter_for(profile).make_client(profile)
    _clients[name] = (profile, client)
    return client


def run_attempt(profile: Profile, request: dict[str, Any], out: AttemptOutput,
                settings: AttemptSettings) -> AttemptOutcome:
    """One attempt of `request` on `profile`; its outcome, also when it failed."""
    secrets = secrets_of(profile)
    classify_error: Callable[[BaseException, Iterable[str]], AttemptError] = classify
    try:
        adapter = adapter_for(profile)
        classify_error = adapter.classify
        return adapter.run(client_for(profile), request, out, settings, secrets)
    except Exception as exc:
        out.failed(exc)
        return failed_outcome(classify_error(exc, secrets))
