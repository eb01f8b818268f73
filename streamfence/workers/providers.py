"""Provider adapters by profile kind: how a worker builds an SDK client for a
profile and runs one attempt on it.

Clients are cached per profile for the life of the worker process and share
one SSL context built in the zygote (building a context costs ~50 ms; reusing
it makes a client ~0.1 ms). SDK-level retries are off: retrying is the
supervisor's job, under the fence.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable
from typing import Any

import httpx2
import openai

from streamfence.workers.output import AttemptOutput

Final = dict[str, Any]
Runner = Callable[[Any, dict[str, Any], AttemptOutput, dict[str, Any]], Final]


class CredentialsMissing(Exception):
    """The profile names an environment variable that is not set."""


_ssl_context: ssl.SSLContext | None = None
_clients: dict[str, Any] = {}


def shared_ssl_context() -> ssl.SSLContext:
    global _ssl_context
    if _ssl_context is None:
        _ssl_context = httpx2.create_ssl_context()
    return _ssl_context


def api_key_of(profile: dict[str, Any]) -> str:
    env = profile.get("api_key_env")
    if not env:
        return "unused"  # e.g. a local endpoint without auth
    key = os.environ.get(env)
    if not key:
        # Name the variable, never a value.
        raise CredentialsMissing(f"environment variable {env} (api_key_env of profile "
                                 f"{profile.get('name')!r}) is not set")
    return key


def _openai_client(profile: dict[str, Any]) -> openai.OpenAI:
    http = httpx2.Client(verify=shared_ssl_context(), trust_env=False,
                         limits=httpx2.Limits(max_connections=8, max_keepalive_connections=2))
    return openai.OpenAI(base_url=profile.get("base_url") or None, api_key=api_key_of(profile),
                         http_client=http, max_retries=0)


def _run_openai(client: Any, request: dict[str, Any], out: AttemptOutput,
                settings: dict[str, Any]) -> Final:
    from streamfence.workers.openai_chat import is_stream_options_rejection, stream_chat

    timeout = openai.Timeout(connect=settings["connect_timeout_s"],
                                    read=settings["read_timeout_s"],
                                    write=settings.get("write_timeout_s", 600.0),
                                    pool=settings["connect_timeout_s"])
    if settings.get("streaming") is False:
        from streamfence.workers.openai_chat import complete_chat

        return complete_chat(client, request, out, timeout=timeout)
    include_usage = settings.get("include_usage", True)
    try:
        return stream_chat(client, request, out, include_usage=include_usage, timeout=timeout)
    except openai.APIStatusError as exc:
        # A provider that refuses stream_options: retry once without it, inside
        # the same attempt (it does not spend the retry budget), and tell the
        # supervisor so the profile remembers.
        if include_usage and is_stream_options_rejection(exc):
            final = stream_chat(client, request, out, include_usage=False, timeout=timeout)
            final["stream_options_rejected"] = True
            return final
        raise


def _anthropic_client(profile: dict[str, Any]) -> Any:
    from streamfence.workers.anthropic_messages import make_client

    return make_client(profile, shared_ssl_context())


def _run_anthropic(client: Any, request: dict[str, Any], out: AttemptOutput,
                   settings: dict[str, Any]) -> Final:
    from streamfence.workers.anthropic_messages import run_messages

    return run_messages(client, request, out, settings)


def _bedrock_client(profile: dict[str, Any]) -> Any:
    from streamfence.workers.bedrock_converse import make_client

    return make_client(profile, shared_ssl_context())


def _run_bedrock(client: Any, request: dict[str, Any], out: AttemptOutput,
                 settings: dict[str, Any]) -> Final:
    from streamfence.workers.bedrock_converse import run_converse

    return run_converse(client, request, out, settings)


_BUILDERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "openai": _openai_client, "anthropic": _anthropic_client, "bedrock": _bedrock_client}
_RUNNERS: dict[str, Runner] = {
    "openai": _run_openai, "anthropic": _run_anthropic, "bedrock": _run_bedrock}


def final_from_exception(profile: dict[str, Any], exc: BaseException) -> Final:
    """The attempt's FinalInfo after `exc`, classified the way its provider needs."""
    from streamfence.workers import errors

    secrets = secrets_of(profile)
    if profile.get("kind") == "bedrock":
        from streamfence.workers.bedrock_converse import final_from_exception as bedrock_final

        return bedrock_final(exc, secrets)
    return errors.final_from_exception(exc, secrets)


def secrets_of(profile: dict[str, Any]) -> list[str]:
    """Literal secrets to scrub from any error message of this profile."""
    env = profile.get("api_key_env")
    key = os.environ.get(env) if env else None
    return [key] if key else []


def client_for(profile: dict[str, Any]) -> Any:
    name = str(profile["name"])
    client = _clients.get(name)
    if client is None:
        client = _BUILDERS[profile["kind"]](profile)
        _clients[name] = client
    return client


def run_attempt(profile: dict[str, Any], request: dict[str, Any], out: AttemptOutput,
                settings: dict[str, Any]) -> Final:
    kind = profile["kind"]
    if kind not in _RUNNERS:
        raise ValueError(f"provider kind {kind!r} is not supported yet")
    return _RUNNERS[kind](client_for(profile), request, out, settings)
