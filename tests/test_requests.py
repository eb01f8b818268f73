"""The supervisor's admission check of a call's request body
(streamfence.supervisor.requests): provider fields only, caps per identity."""

from __future__ import annotations

from typing import Any

import pytest

from streamfence.protocol.errors import ErrorCode, ProtocolError
from streamfence.protocol.wires import WIRES, sample_request
from streamfence.supervisor.requests import check_request

SDK_TRANSPORT_OPTIONS = ("extra_headers", "extra_query", "extra_body", "timeout")


def _refused(kind: str, request: dict[str, Any], caps: dict[str, int] | None = None) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        check_request(kind, request, caps)
    return info.value


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("option", [*SDK_TRANSPORT_OPTIONS, "stream", "stream_options",
                                    "api_key", "base_url"])
def test_sdk_options_and_unknown_fields_are_refused_naming_the_field(wire: str, option: str) -> None:
    request = sample_request(wire, "m", "hi") | {option: {"Authorization": "Bearer x"}}
    err = _refused(wire, request)
    assert err.code == ErrorCode.BAD_MESSAGE
    assert f"call.request.{option}" in err.message


@pytest.mark.parametrize("wire", WIRES)
def test_a_plain_request_passes_unchanged_and_is_not_mutated(wire: str) -> None:
    request = sample_request(wire, "m", "hi")
    before = repr(request)
    assert check_request(wire, request) == request
    assert repr(request) == before


@pytest.mark.parametrize(("wire", "missing"), [("openai", "messages"), ("anthropic", "max_tokens"),
                                               ("bedrock", "modelId")])
def test_required_fields(wire: str, missing: str) -> None:
    request = sample_request(wire, "m", "hi")
    del request[missing]
    err = _refused(wire, request)
    assert (err.code, f"call.request.{missing}" in err.message) == (ErrorCode.BAD_MESSAGE, True)


def test_max_tokens_cap_refuses_over_and_fills_in_when_absent() -> None:
    caps = {"max_tokens": 100}
    err = _refused("openai", sample_request("openai", "m", "hi") | {"max_tokens": 101}, caps)
    assert err.code == ErrorCode.LIMIT_EXCEEDED and "max_tokens is 101" in err.message
    err = _refused("anthropic", sample_request("anthropic", "m", "hi") | {"max_tokens": 500}, caps)
    assert err.code == ErrorCode.LIMIT_EXCEEDED
    err = _refused("bedrock", sample_request("bedrock", "m", "hi")
                   | {"inferenceConfig": {"maxTokens": 200}}, caps)
    assert err.code == ErrorCode.LIMIT_EXCEEDED and "inferenceConfig.maxTokens" in err.message
    assert check_request("openai", sample_request("openai", "m", "hi"), caps)[
        "max_completion_tokens"] == 100
    assert check_request("bedrock", sample_request("bedrock", "m", "hi"), caps)[
        "inferenceConfig"] == {"maxTokens": 100}
    assert check_request("openai", sample_request("openai", "m", "hi") | {"max_tokens": 100},
                         caps)["max_tokens"] == 100


def test_n_cap_and_mistyped_capped_fields() -> None:
    err = _refused("openai", sample_request("openai", "m", "hi") | {"n": 4}, {"n": 1})
    assert err.code == ErrorCode.LIMIT_EXCEEDED
    err = _refused("openai", sample_request("openai", "m", "hi") | {"max_tokens": "9"},
                   {"max_tokens": 10})
    assert err.code == ErrorCode.BAD_MESSAGE
