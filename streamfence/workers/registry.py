"""The provider adapters by profile kind, and the one call a worker makes per attempt.

`adapter_of(kind)` is a profile's wire's `Adapter` (workers/adapter.py). Its
module, and so its SDK (openai ~1 s, anthropic ~2 s of imports on this class
of machine, more under load), is imported on the first use of that kind in
this process: the zygote imports only the kinds configured when it starts
(workers/warmup.py), and a worker forked from it imports a kind a reload
added on that kind's first attempt (docs/PERFORMANCE.md, "Issue 32: start-up").
`run_attempt(profile, request, out, settings)` builds (once per profile and
settings, for the life of the worker process: a reload may change a profile's
settings under its name) the profile's client and runs the attempt on it. It
never raises: whatever the adapter could not turn into an outcome itself (an
unknown kind, a missing credential, an error opening the request) becomes
`failed_outcome` of the adapter's classification, reported to `out.failed`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from streamfence.protocol.internal.outcome import AttemptError, AttemptOutcome
from streamfence.protocol.internal.workers import AttemptSettings
from streamfence.workers.adapter import Adapter, Profile, secrets_of
from streamfence.workers.assembly import failed_outcome
from streamfence.workers.errors import classify
from streamfence.workers.output import AttemptOutput

# kind -> the module whose ADAPTER speaks that wire (protocol/wires.py WIRES).
ADAPTER_MODULES: Mapping[str, str] = {
    "openai": "streamfence.workers.openai_chat",
    "anthropic": "streamfence.workers.anthropic_messages",
    "bedrock": "streamfence.workers.bedrock_converse",
}
_adapters: dict[str, Adapter] = {}  # the kinds imported so far in this process
_clients: dict[str, tuple[Profile, Any]] = {}  # profile name -> (its settings, client)


def adapter_of(kind: object) -> Adapter:
    """The adapter of `kind`, its module imported if this is its first use;
    ValueError for a kind no adapter speaks."""
    adapter = _adapters.get(kind) if isinstance(kind, str) else None
    if adapter is not None:
        return adapter
    module = ADAPTER_MODULES.get(kind) if isinstance(kind, str) else None
    if module is None:
        raise ValueError(f"provider kind {kind!r} is not supported yet")
    loaded: Adapter = importlib.import_module(module).ADAPTER
    _adapters[loaded.kind] = loaded
    return loaded


def imported_kinds() -> tuple[str, ...]:
    """The kinds whose adapter (and SDK) this process has imported."""
    return tuple(_adapters)


def client_for(profile: Profile) -> Any:
    name = str(profile["name"])
    cached = _clients.get(name)
    if cached is not None and cached[0] == profile:
        return cached[1]
    client = adapter_of(profile.get("kind")).make_client(profile)
    _clients[name] = (profile, client)
    return client


def run_attempt(profile: Profile, request: dict[str, Any], out: AttemptOutput,
                settings: AttemptSettings) -> AttemptOutcome:
    """One attempt of `request` on `profile`; its outcome, also when it failed."""
    secrets = secrets_of(profile)
    classify_error: Callable[[BaseException, Iterable[str]], AttemptError] = classify
    try:
        adapter = adapter_of(profile.get("kind"))
        classify_error = adapter.classify
        return adapter.run(client_for(profile), request, out, settings, secrets)
    except Exception as exc:
        out.failed(exc)
        return failed_outcome(classify_error(exc, secrets))
