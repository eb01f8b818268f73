"""What a provider adapter is, and the SDK plumbing every adapter shares.

Each wire module (openai_chat.py, anthropic_messages.py, bedrock_converse.py)
exports one `ADAPTER`; workers/registry.py maps a profile's `kind` to it.

Clients are cached per profile for the life of the worker process (by the
registry) and share one SSL context built in the zygote (building a context
costs ~50 ms; reusing it makes a client ~0.1 ms). SDK-level retries are off:
retrying is the supervisor's job, under the fence.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Self, TypeVar

import httpx2

from streamfence.protocol.internal.outcome import AttemptError, AttemptOutcome
from streamfence.protocol.internal.workers import AttemptSettings
from streamfence.workers.errors import CredentialsMissing
from streamfence.workers.http11 import Http11Transport
from streamfence.workers.output import AttemptOutput

Profile = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Adapter:
    """One provider wire: how a worker builds a profile's client, runs one attempt
    on it and classifies what that raised.

    - `make_client(profile)`: the SDK client (cached per profile by the registry);
      raises when the profile cannot work (e.g. CredentialsMissing).
    - `run(client, request, out, settings, secrets)`: one attempt, its deltas to `out`;
      returns its outcome, also when it failed. An exception once there is partial
      state to keep (model, usage, dropped tool calls) is classified (secrets
      scrubbed), reported to `out.failed` and returned in the outcome with that
      state; one before (opening the request) may propagate, and the registry turns
      it into `failed_outcome`. `diag` is left for the worker to fill.
    - `classify(exc, secrets)`: this wire's AttemptError for an exception.
    """

    kind: str
    make_client: Callable[[Profile], Any]
    run: Callable[[Any, dict[str, Any], AttemptOutput, AttemptSettings, Sequence[str]],
                  AttemptOutcome]
    classify: Callable[[BaseException, Iterable[str]], AttemptError]


_ssl_context: ssl.SSLContext | None = None


def shared_ssl_context() -> ssl.SSLContext:
    global _ssl_context
    if _ssl_context is None:
        _ssl_context = httpx2.create_ssl_context()
    return _ssl_context


def http_client() -> httpx2.Client:
    """The transport of an SSE adapter's SDK client: HTTP/1.1 parsed by llhttp
    (workers/http11.py) with the shared SSL context, no proxies from the
    environment, two idle connections kept per origin, and the attempt's send
    gate before each request, in the transport (workers/send_gate.py)."""
    return httpx2.Client(transport=Http11Transport(shared_ssl_context(), keepalive=2),
                         trust_env=False)


def api_key_of(profile: Profile) -> str:
    env = profile.get("api_key_env")
    if not env:
        return "unused"  # e.g. a local endpoint without auth
    key = os.environ.get(env)
    if not key:
        # Name the variable, never a value.
        raise CredentialsMissing(f"environment variable {env} (api_key_env of profile "
                                 f"{profile.get('name')!r}) is not set")
    return key


def secrets_of(profile: Profile) -> list[str]:
    """Literal secrets to scrub from any error message of this profile."""
    env = profile.get("api_key_env")
    key = os.environ.get(env) if env else None
    return [key] if key else []


class _SDKClient(Protocol):
    @property
    def max_retries(self) -> int: ...

    def with_options(self, *, max_retries: int) -> Self: ...


Client = TypeVar("Client", bound=_SDKClient)


def no_sdk_retries(client: Client) -> Client:
    # The supervisor owns retries and backoff; SDK retries would sleep inside an attempt.
    return client if client.max_retries == 0 else client.with_options(max_retries=0)
