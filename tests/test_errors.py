"""workers/errors.py: classification of real exceptions from the real SDKs
(openai, anthropic, botocore) against a real HTTP server on 127.0.0.1 and a
closed port, plus constructed transport exceptions, and secret scrubbing."""

from __future__ import annotations

import email.utils
import socket
import ssl
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import botocore.exceptions
import httpx2
import openai
import orjson
import pytest

from streamfence.protocol.internal.outcome import AttemptError, ErrorClass
from streamfence.workers.error_text import retry_after_from_headers
from streamfence.workers.errors import (
    MalformedStreamError,
    classify,
    classify_payload,
    scrub,
)
from tests.http_stub import Reply as StubReply
from tests.http_stub import StubServer, stub_server

MESSAGES: Any = [{"role": "user", "content": "hi"}]


def Reply(body: bytes = b"", status: int = 200, headers: dict[str, str] | None = None,
          ctype: str = "application/json", parts: list[bytes] | None = None,
          end: str = "ok") -> StubReply:
    """A whole body (default) or, with `parts`, a chunked SSE body."""
    return StubReply(parts=[body] if parts is None else parts, status=status,
                     headers=headers or {}, ctype=ctype, end=end)


@pytest.fixture
def server() -> Iterator[StubServer]:
    with stub_server(StubServer) as s:
        yield s


@pytest.fixture
def oai(server: StubServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test-abcdefghijkl", max_retries=0) as c:
        yield c


@pytest.fixture
def claude(server: StubServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.url, api_key="test", max_retries=0) as c:
        yield c


def openai_error(oai: openai.OpenAI, server: StubServer, reply: StubReply, **kwargs: Any) -> BaseException:
    server.reply = reply
    with pytest.raises(openai.OpenAIError) as info:
        oai.chat.completions.create(model="m", messages=MESSAGES, **kwargs)
    return info.value


def err_body(message: str, type_: str = "invalid_request_error", code: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}})


def cc(info: AttemptError) -> tuple[str, str]:
    return info.error_class, info.code


# ---- openai status errors from a real server -------------------------------

def test_429_with_retry_after(oai: openai.OpenAI, server: StubServer) -> None:
    exc = openai_error(oai, server, Reply(err_body("Rate limit reached", "requests", "rate_limit_exceeded"),
                                          429, {"Retry-After": "3"}))
    assert isinstance(exc, openai.RateLimitError)
    info = classify(exc)
    assert cc(info) == ("transient", "rate_limited") and info.status == 429 and info.retry_after_s == 3.0


def test_retry_after_ms_and_http_date(oai: openai.OpenAI, server: StubServer) -> None:
    exc = openai_error(oai, server, Reply(err_body("slow down"), 503, {"retry-after-ms": "1500"}))
    assert classify(exc).retry_after_s == 1.5
    assert cc(classify(exc)) == ("transient", "unavailable")
    when = email.utils.formatdate(1_000_000 + 120, usegmt=True)
    assert retry_after_from_headers({"retry-after": when}, now=1_000_000) == 120.0
    assert retry_after_from_headers({"retry-after": "soon"}) is None
    assert retry_after_from_headers(None) is None


def test_context_overflow_400(oai: openai.OpenAI, server: StubServer) -> None:
    exc = openai_error(oai, server, Reply(err_body(
        "This model's maximum context length is 8192 tokens. However, your messages resulted in 9001 "
        "tokens.", code="context_length_exceeded"), 400))
    assert cc(classify(exc)) == ("context_overflow", "context_overflow")


def test_stream_options_400_is_final_with_its_own_code(oai: openai.OpenAI, server: StubServer) -> None:
    exc = openai_error(oai, server, Reply(err_body("Extra inputs are not permitted: stream_options"), 422))
    assert cc(classify(exc)) == ("final", "stream_options_rejected")


def test_streaming_unsupported(oai: openai.OpenAI, server: StubServer) -> None:
    exc = openai_error(oai, server, Reply(err_body("Streaming is not supported for this model"), 400))
    assert cc(classify(exc)) == ("final", "streaming_unsupported")


@pytest.mark.parametrize(("status", "expected"), [
    (400, ("final", "bad_request")), (401, ("final", "auth_failed")), (403, ("final", "permission_denied")),
    (404, ("final", "not_found")), (408, ("transient", "request_timeout")), (409, ("transient", "conflict")),
    (413, ("final", "payload_too_large")), (418, ("final", "http_418")), (500, ("transient", "server_error")),
    (502, ("transient", "server_error")), (529, ("transient", "overloaded"))])
def test_status_classes(oai: openai.OpenAI, server: StubServer, status: int, expected: tuple[str, str]) -> None:
    exc = openai_error(oai, server, Reply(err_body("something"), status))
    assert cc(classify(exc)) == expected and classify(exc).status == status


def test_insufficient_quota_429_is_final(oai: openai.OpenAI, server: StubServer) -> None:
    exc = openai_error(oai, server, Reply(err_body("You exceeded your current quota", "insufficient_quota",
                                                   "insufficient_quota"), 429))
    assert cc(classify(exc)) == ("final", "quota_exhausted")


def test_auth_error_message_is_scrubbed(oai: openai.OpenAI, server: StubServer) -> None:
    exc = openai_error(oai, server, Reply(err_body(
        "Incorrect API key provided: sk-proj-AbCdEf1234567890XyZ. Header was Authorization: Bearer "
        "sk-proj-AbCdEf1234567890XyZ"), 401))
    info = classify(exc, extra_secrets=["sk-test-abcdefghijkl"])
    assert "AbCdEf1234567890" not in info.message and "Incorrect API key" in info.message


# ---- openai transport errors -----------------------------------------------

def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _openai_to(port: int) -> None:
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="t", max_retries=0) as c:
        c.chat.completions.create(model="m", messages=MESSAGES)


def _anthropic_to(port: int) -> None:
    with anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="t", max_retries=0) as c:
        c.messages.create(model="c", max_tokens=5, messages=MESSAGES)


@pytest.mark.parametrize(("call", "refused"), [
    (_openai_to, openai.APIConnectionError), (_anthropic_to, anthropic.APIConnectionError)],
    ids=["openai", "anthropic"])
def test_refused_connection(call: Callable[[int], None], refused: type[Exception]) -> None:
    """Each SDK's own error for a closed port is a transient connect_error."""
    with pytest.raises(refused) as info:
        call(closed_port())
    result = classify(info.value)
    assert cc(result) == ("transient", "connect_error") and "ConnectError" in result.message


def sse(*objs: Any) -> list[bytes]:
    return [b"data: " + orjson.dumps(o) + b"\n\n" for o in objs]


CHUNK = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}


def test_sdk_stream_drop_mid_body_is_wrapped_and_transient(oai: openai.OpenAI, server: StubServer) -> None:
    # Measured: the SDK's own Stream wraps the raw httpx2.RemoteProtocolError.
    server.reply = Reply(parts=sse(CHUNK), ctype="text/event-stream", end="drop")
    with pytest.raises(openai.APIConnectionError) as info, \
            oai.chat.completions.create(model="m", messages=MESSAGES, stream=True) as stream:
        for _ in stream:
            pass
    assert isinstance(info.value.__cause__, httpx2.RemoteProtocolError)
    result = classify(info.value)
    assert cc(result) == ("transient", "connection_error") and "incomplete chunked read" in result.message


def test_sdk_stream_read_timeout(oai: openai.OpenAI, server: StubServer) -> None:
    server.reply = Reply(parts=sse(CHUNK), ctype="text/event-stream", end="hang")
    with pytest.raises(openai.APITimeoutError) as info, oai.chat.completions.create(
            model="m", messages=MESSAGES, stream=True, timeout=httpx2.Timeout(5.0, read=0.3)) as stream:
        for _ in stream:
            pass
    assert cc(classify(info.value)) == ("transient", "timeout")


@pytest.mark.parametrize(("error", "expected"), [
    ({"message": "Network connection lost."}, ("transient", "provider_error")),
    ({"message": "The server is overloaded", "type": "server_error"}, ("transient", "provider_error")),
    ({"message": "Invalid schema for function", "type": "invalid_request_error"}, ("final", "provider_error")),
])
def test_sdk_in_stream_error_event(oai: openai.OpenAI, server: StubServer, error: dict[str, Any],
                                   expected: tuple[str, str]) -> None:
    server.reply = Reply(parts=[*sse(CHUNK), *sse({"error": error})], ctype="text/event-stream")
    with pytest.raises(openai.APIError) as info, \
            oai.chat.completions.create(model="m", messages=MESSAGES, stream=True) as stream:
        for _ in stream:
            pass
    assert not isinstance(info.value, openai.APIStatusError)
    assert cc(classify(info.value)) == expected


# ---- anthropic, from a real server -----------------------------------------

def anthropic_error(claude: anthropic.Anthropic, server: StubServer, reply: StubReply, stream: bool = False) -> BaseException:
    server.reply = reply
    with pytest.raises(anthropic.AnthropicError) as info:
        if stream:
            with claude.messages.create(model="c", max_tokens=5, messages=MESSAGES, stream=True) as s:
                for _ in s:
                    pass
        else:
            claude.messages.create(model="c", max_tokens=5, messages=MESSAGES)
    return info.value


def a_err(type_: str, message: str) -> bytes:
    return orjson.dumps({"type": "error", "error": {"type": type_, "message": message}})


def test_anthropic_status_errors(claude: anthropic.Anthropic, server: StubServer) -> None:
    exc = anthropic_error(claude, server, Reply(a_err("overloaded_error", "Overloaded"), 529, {"retry-after": "2"}))
    assert cc(classify(exc)) == ("transient", "overloaded") and classify(exc).retry_after_s == 2.0
    exc = anthropic_error(claude, server, Reply(a_err("invalid_request_error",
                                                      "prompt is too long: 210000 tokens > 200000 maximum"), 400))
    assert cc(classify(exc)) == ("context_overflow", "context_overflow")
    exc = anthropic_error(claude, server, Reply(a_err("authentication_error", "invalid x-api-key"), 401))
    assert cc(classify(exc)) == ("final", "auth_failed")


def test_anthropic_in_stream_error_event(claude: anthropic.Anthropic, server: StubServer) -> None:
    start = {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "c", "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 0}}}
    parts = [b"event: message_start\ndata: " + orjson.dumps(start) + b"\n\n",
             b"event: error\ndata: " + a_err("overloaded_error", "Overloaded") + b"\n\n"]
    exc = anthropic_error(claude, server, Reply(parts=parts, ctype="text/event-stream"), stream=True)
    assert isinstance(exc, anthropic.APIStatusError) and exc.status_code == 200  # measured
    assert classify(exc).error_class == "transient"


# ---- botocore ----------------------------------------------------------------

def test_botocore_refused_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    import boto3
    from botocore.config import Config

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAABCDEFGHIJKLMNOP")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x" * 40)
    client = boto3.client("bedrock-runtime", region_name="us-east-1",
                          endpoint_url=f"http://127.0.0.1:{closed_port()}",
                          config=Config(retries={"max_attempts": 1, "mode": "standard"}, connect_timeout=2))
    try:
        with pytest.raises(botocore.exceptions.EndpointConnectionError) as info:
            client.converse(modelId="m", messages=[{"role": "user", "content": [{"text": "hi"}]}])
    finally:
        client.close()
    assert cc(classify(info.value)) == ("transient", "connection_error")


def client_error(code: str, message: str, status: int | None = None,
                 cls: type[botocore.exceptions.ClientError] = botocore.exceptions.EventStreamError) -> BaseException:
    response: dict[str, Any] = {"Error": {"Code": code, "Message": message}}
    if status is not None:
        response["ResponseMetadata"] = {"HTTPStatusCode": status, "HTTPHeaders": {"retry-after": "4"}}
    exc: BaseException = cls(response, "ConverseStream")
    return exc


@pytest.mark.parametrize(("exc", "expected"), [
    (client_error("modelStreamErrorException", "Model stream error"), ("transient", "provider_error")),
    (client_error("internalServerException", "boom"), ("transient", "provider_error")),
    (client_error("ThrottlingException", "Too many requests", 429, botocore.exceptions.ClientError),
     ("transient", "provider_error")),
    (client_error("ValidationException", "Input is too long for requested model.", 400,
                  botocore.exceptions.ClientError), ("context_overflow", "context_overflow")),
    (client_error("ValidationException", "Malformed input request", 400, botocore.exceptions.ClientError),
     ("final", "bad_request")),
    (client_error("AccessDeniedException", "not authorized to perform: bedrock:InvokeModelWithResponseStream",
                  403, botocore.exceptions.ClientError), ("final", "streaming_unsupported")),
    (botocore.exceptions.ReadTimeoutError(endpoint_url="http://x"), ("transient", "read_timeout")),
    (botocore.exceptions.ConnectTimeoutError(endpoint_url="http://x"), ("transient", "connect_timeout")),
    (botocore.exceptions.ResponseStreamingError(error="Connection broken"), ("transient", "connection_error")),
])
def test_botocore_errors(exc: BaseException, expected: tuple[str, str]) -> None:
    assert cc(classify(exc)) == expected


def test_botocore_throttling_keeps_status_and_retry_after() -> None:
    info = classify(client_error("ThrottlingException", "slow", 429, botocore.exceptions.ClientError))
    assert info.status == 429 and info.retry_after_s == 4.0


# ---- constructed transport exceptions and the rest --------------------------

REQ = httpx2.Request("POST", "http://127.0.0.1/v1/chat/completions")


@pytest.mark.parametrize(("exc", "expected"), [
    (httpx2.ConnectError("refused", request=REQ), ("transient", "connect_error")),
    (httpx2.ConnectTimeout("t", request=REQ), ("transient", "connect_timeout")),
    (httpx2.PoolTimeout("t", request=REQ), ("transient", "connect_timeout")),
    (httpx2.ReadTimeout("t", request=REQ), ("transient", "read_timeout")),
    (httpx2.WriteTimeout("t", request=REQ), ("transient", "timeout")),
    (httpx2.ReadError("reset", request=REQ), ("transient", "connection_error")),
    (httpx2.RemoteProtocolError("peer closed connection without sending complete message body "
                                "(incomplete chunked read)", request=REQ), ("transient", "connection_error")),
    (httpx2.LocalProtocolError("bad header", request=REQ), ("final", "unexpected_error")),
    (httpx2.UnsupportedProtocol("ftp", request=REQ), ("final", "unexpected_error")),
    (ConnectionResetError(104, "Connection reset by peer"), ("transient", "connection_error")),
    (BrokenPipeError(), ("transient", "connection_error")),
    (TimeoutError(), ("transient", "read_timeout")),
    (ssl.SSLCertVerificationError("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"),
     ("final", "tls_verify_failed")),
    (ssl.SSLError("record layer failure"), ("transient", "connection_error")),
    (RuntimeError("upstream said: Network connection lost"), ("transient", "connection_error")),
    (ValueError("bug"), ("final", "unexpected_error")),
    (MalformedStreamError("SSE data is not JSON"), ("transient", "malformed_stream")),
])
def test_constructed(exc: BaseException, expected: tuple[str, str]) -> None:
    info = classify(exc)
    assert isinstance(info, AttemptError) and isinstance(info.error_class, ErrorClass)
    assert cc(info) == expected
    assert info.status is None and info.retry_after_s is None


def test_classify_never_raises() -> None:
    class Evil(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    assert classify(Evil()).code == "unclassified"


def test_classify_payload_status_in_error_code() -> None:
    assert cc(classify_payload({"error": {"message": "x", "code": "HTTP_STATUS/429"}})) == ("transient", "rate_limited")
    assert cc(classify_payload({"error": "plain string error"})) == ("final", "provider_error")


@pytest.mark.parametrize("secret", [
    "sk-abcdefghijklmnopqrstuvwx", "sk-proj-AbCd_Ef-1234567890", "sk-ant-api03-abcdefghijkl",
    "Bearer eyJhbGciOiJIUzI1NiJ9.payloadpayload.sigsigsig", "Authorization: Basic dXNlcjpwYXNz",
    "x-api-key: 0123456789abcdef", "api_key=supersecretvalue", '"password": "hunter2hunter2"',
    "https://host/v1?key=AIzaSyA1234567890abcdefghijklmnopqrstu", "AKIAABCDEFGHIJKLMNOP",
    "ghp_abcdefghijklmnopqrstuvwxyz0123",
])
def test_scrub_removes_secrets(secret: str) -> None:
    text = f"request failed ({secret}) at step 3"
    cleaned = scrub(text)
    assert "request failed" in cleaned and "step 3" in cleaned
    for piece in ("abcdefghijkl", "AbCd_Ef", "dXNlcjpwYXNz", "0123456789abcdef", "supersecretvalue",
                  "hunter2hunter2", "AIzaSy", "ABCDEFGHIJKLMNOP", "sigsigsig", "qrstuvwxyz0123"):
        assert piece not in cleaned, cleaned


def test_scrub_keeps_ordinary_text_and_caps_length() -> None:
    text = "max_tokens: 4096 is too large; context length is 8192 tokens (risk-free)."
    assert scrub(text) == text
    assert len(scrub("x" * 10_000)) <= 2001
    assert scrub("my key is verysecret123", extra_secrets=["verysecret123"]) == "my key is [redacted]"
