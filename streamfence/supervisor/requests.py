"""A call's `request` is data for the provider, never options for the SDK.

`check_request(kind, request, caps)` is the supervisor's admission check of a
submit's request body, run before the call is journaled:

- Only the provider's documented request *body* fields of the wire are
  accepted (`FIELDS`); anything else, the SDKs' transport options above all
  (`extra_headers`, `extra_query`, `extra_body`, `timeout`), is refused with
  `bad_message` naming the field. The SDK parameters that it sends as HTTP
  headers (`HEADER_FIELDS`: Anthropic's `workspace_id` and `user_profile_id`
  become `anthropic-workspace-id` / `anthropic-user-profile-id`) are not body
  fields: a call does not choose the headers of the daemon's requests. The
  one field that goes in the URL, Bedrock's `modelId` (`/model/{modelId}/…`,
  percent-encoded by botocore), must be a model name, not a dot segment.
  The daemon owns `stream` and `stream_options`, so a client may not set
  them either. Nothing of a refused request reaches a worker.
- `caps` (from the submitter's identity, see docs/SECURITY.md) bound costly
  fields: `max_tokens` caps the wire's output-token limit and is filled in
  when the request leaves it out; `n` caps OpenAI's choice count. A request
  over a cap is refused with `limit_exceeded`, never silently clamped.

The field sets are the SDKs' own (the body of openai's and anthropic's
`create`, botocore's ConverseStream input shape), written out here so the
supervisor need not import the SDKs; tests/test_request_fields.py checks them
against the installed SDKs: each accepted field is sent in the body, none as
a header or a query parameter, and only `modelId` in the path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from streamfence.protocol.errors import ErrorCode, ProtocolError

_DAEMON_OWNED = frozenset({"stream", "stream_options"})

FIELDS: Mapping[str, frozenset[str]] = {
    "openai": frozenset({
        "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
        "max_completion_tokens", "max_tokens", "messages", "metadata", "modalities", "model",
        "moderation", "n", "parallel_tool_calls", "prediction", "presence_penalty",
        "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
        "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier",
        "stop", "store", "temperature", "tool_choice", "tools", "top_logprobs", "top_p",
        "user", "verbosity", "web_search_options"}),
    "anthropic": frozenset({
        "cache_control", "container", "diagnostics", "inference_geo", "max_tokens",
        "messages", "metadata", "model", "output_config", "service_tier", "speed",
        "stop_sequences", "system", "thinking", "tool_choice", "tools"}),
    "bedrock": frozenset({
        "additionalModelRequestFields", "additionalModelResponseFieldPaths",
        "guardrailConfig", "inferenceConfig", "messages", "modelId", "outputConfig",
        "performanceConfig", "projectIdentifier", "promptVariables", "requestMetadata",
        "serviceTier", "system", "toolConfig"}),
}

# SDK parameters it sends as HTTP headers (parameter -> header): refused.
HEADER_FIELDS: Mapping[str, Mapping[str, str]] = {
    "openai": {},
    "anthropic": {"user_profile_id": "anthropic-user-profile-id",
                  "workspace_id": "anthropic-workspace-id"},
    "bedrock": {},
}
# Accepted fields that the SDK puts in the request's path.
PATH_FIELDS: Mapping[str, frozenset[str]] = {
    "openai": frozenset(), "anthropic": frozenset(), "bedrock": frozenset({"modelId"})}

# The fields a wire needs before a provider can answer at all.
REQUIRED: Mapping[str, tuple[str, ...]] = {
    "openai": ("model", "messages"),
    "anthropic": ("model", "messages", "max_tokens"),
    "bedrock": ("modelId", "messages"),
}

CAP_NAMES = frozenset({"max_tokens", "n"})


def _refuse(code: ErrorCode, message: str) -> ProtocolError:
    return ProtocolError(code, message)


def _int_field(path: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _refuse(ErrorCode.BAD_MESSAGE, f"field 'call.request.{path}' must be an integer")
    return value


def _path_segment(key: str, value: Any) -> None:
    """A field the SDK puts in the URL: a string it percent-encodes, but
    never `.` or `..` (a dot segment, which an HTTP client resolves)."""
    if not isinstance(value, str) or not value:
        raise _refuse(ErrorCode.BAD_MESSAGE, f"field 'call.request.{key}' must be a non-empty string")
    if value in (".", ".."):
        raise _refuse(ErrorCode.BAD_MESSAGE,
                      f"field 'call.request.{key}' is {value!r}: a path segment, not a model")


def _cap(path: str, value: int, cap: int) -> None:
    if value > cap:
        raise _refuse(ErrorCode.LIMIT_EXCEEDED,
                      f"call.request.{path} is {value}; this identity may ask for at most {cap}")


def _cap_max_tokens(kind: str, request: dict[str, Any], cap: int) -> None:
    if kind == "bedrock":
        config = request.get("inferenceConfig")
        if config is None:
            request["inferenceConfig"] = {"maxTokens": cap}
            return
        if not isinstance(config, dict):
            raise _refuse(ErrorCode.BAD_MESSAGE, "field 'call.request.inferenceConfig' must be a map")
        if "maxTokens" not in config:
            request["inferenceConfig"] = {**config, "maxTokens": cap}
            return
        path = "inferenceConfig.maxTokens"
        _cap(path, _int_field(path, config["maxTokens"]), cap)
        return
    names = ("max_tokens", "max_completion_tokens") if kind == "openai" else ("max_tokens",)
    present = [name for name in names if name in request]
    for name in present:
        _cap(name, _int_field(name, request[name]), cap)
    if not present:
        request[names[-1]] = cap


def check_request(kind: str, request: Mapping[str, Any],
                  caps: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The request to journal for a call on wire `kind`, or ProtocolError.

    Returns a copy (with capped fields filled in); never changes `request`."""
    allowed = FIELDS[kind]
    for key in request:
        if key in _DAEMON_OWNED:
            raise _refuse(ErrorCode.BAD_MESSAGE,
                          f"field 'call.request.{key}' is set by the daemon, not by a call")
        if key in HEADER_FIELDS[kind]:
            raise _refuse(ErrorCode.BAD_MESSAGE,
                          f"field 'call.request.{key}' is sent as the HTTP header "
                          f"{HEADER_FIELDS[kind][key]}, not in the body; a call sets body "
                          f"fields only")
        if key not in allowed:
            raise _refuse(ErrorCode.BAD_MESSAGE,
                          f"field 'call.request.{key}' is not a {kind} request field")
        if key in PATH_FIELDS[kind]:
            _path_segment(key, request[key])
    for key in REQUIRED[kind]:
        if key not in request:
            raise _refuse(ErrorCode.BAD_MESSAGE, f"field 'call.request.{key}' is required")
    checked = dict(request)
    if caps:
        if "max_tokens" in caps:
            _cap_max_tokens(kind, checked, caps["max_tokens"])
        if "n" in caps and kind == "openai" and "n" in checked:
            _cap("n", _int_field("n", checked["n"]), caps["n"])
    return checked
