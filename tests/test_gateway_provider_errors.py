"""Issue 31, item 7: a provider's error comes out of the gateway once, as the
provider's own SDK shows it. The same scripted error (the emulator's) is
raised twice by the unmodified SDK: pointed at the emulator, and pointed at
the gateway of a real daemon in front of it; both exceptions must be of the
same class with the same status, type, code and message (no second "Error
code: 400 - " prefix, no Python repr of a body). The daemon's own wire
(`done.error`, PROTOCOL §6) carries the provider's message once, with its
status, type and code as fields."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from streamfence.devtools.emulator.control import (
    EmulatorClient,
    EmulatorProcess,
    emulator_profile,
)
from streamfence.gateway import http_errors
from streamfence.gateway.keys import http_key
from streamfence.protocol.credentials import load_credentials
from streamfence.protocol.internal.outcome import (
    AttemptError,
    AttemptOutcome,
    BadOutcome,
    ErrorClass,
    outcome_from_wire,
    outcome_to_wire,
)
from tests.harness import DaemonProcess, free_port, healthy, wait_until

QUESTION: Any = [{"role": "user", "content": "hello"}]
CONTEXT = "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens."


@dataclass(frozen=True)
class Gateway:
    daemon: DaemonProcess
    url: str
    key: str
    emulator_url: str


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory,
            emulator: EmulatorProcess) -> Iterator[Gateway]:
    port = free_port()
    daemon = DaemonProcess(
        Path(tmp_path_factory.mktemp("gateway_errors")) / "state",
        {"oa": emulator_profile("openai", emulator.base_url),
         "an": emulator_profile("anthropic", emulator.base_url),
         "bd": emulator_profile("bedrock", emulator.base_url)},
        daemon={"workers_spare": 2}, tables={"http": {"listen": f"127.0.0.1:{port}"}})
    daemon.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(url), 30.0, f"the gateway to answer {url}/healthz")
        yield Gateway(daemon, url, http_key(load_credentials(daemon.credentials_path)),
                      emulator.base_url)
    finally:
        daemon.cleanup()


def _raised(call: Callable[[], Any]) -> Any:
    """The exception `call` raises (it must raise one)."""
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, dict):
            for _ in result:  # a stream raises when it is read
                pass
    except (openai.APIError, anthropic.APIError) as exc:
        return exc
    raise AssertionError(f"no exception: {result!r}")


# ---- OpenAI ---------------------------------------------------------------------------

OPENAI_CASES = [
    pytest.param(400, "bad thing", "invalid_request_error", "invalid_value", id="400-code"),
    pytest.param(400, CONTEXT, "invalid_request_error", "context_length_exceeded",
                 id="400-context"),
    pytest.param(403, "You are not allowed to use this model", "invalid_request_error", None,
                 id="403-no-code"),
    pytest.param(404, "The model `gpt-9` does not exist", "invalid_request_error",
                 "model_not_found", id="404"),
    pytest.param(429, "You exceeded your current quota", "insufficient_quota",
                 "insufficient_quota", id="429-quota"),
]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize(("status", "message", "etype", "code"), OPENAI_CASES)
def test_openai_sdk_sees_the_providers_error(gateway: Gateway, emu: EmulatorClient,
                                             status: int, message: str, etype: str,
                                             code: str | None, stream: bool) -> None:
    step = {"fault": "status", "status": status, "message": message, "error_type": etype,
            **({"error_code": code} if code else {})}
    emu.script("err", [step, step])
    # Closed after use: an SDK client left to the garbage collector leaves its
    # sockets' ResourceWarning in whichever test comes next.
    with openai.OpenAI(base_url=gateway.emulator_url + "/v1", api_key="sk-emu",
                       max_retries=0) as direct, \
            openai.OpenAI(base_url=gateway.url + "/v1", api_key=gateway.key,
                          max_retries=0) as via:
        want = _raised(lambda: direct.chat.completions.create(
            model="gpt-emu#err", messages=QUESTION, stream=stream))
        got = _raised(lambda: via.chat.completions.create(
            model="oa/gpt-emu#err", messages=QUESTION, stream=stream))
    assert type(got) is type(want), (got, want)
    assert (got.status_code, got.type, got.code, got.param) == \
        (want.status_code, want.type, want.code, want.param) == (status, etype, code, None)
    assert got.message == want.message == f"Error code: {status} - {message}"
    assert got.body == want.body
    assert len(emu.log("err")) == 2  # final: the daemon did not retry it


# ---- Anthropic ------------------------------------------------------------------------

ANTHROPIC_CASES = [
    pytest.param(400, "bad thing", "invalid_request_error", id="400"),
    pytest.param(400, "prompt is too long: 210000 tokens > 200000 maximum",
                 "invalid_request_error", id="400-context"),
    pytest.param(403, "Your API key does not have permission to use the specified resource.",
                 "permission_error", id="403"),
    pytest.param(404, "model: claude-9", "not_found_error", id="404"),
]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize(("status", "message", "etype"), ANTHROPIC_CASES)
def test_anthropic_sdk_sees_the_providers_error(gateway: Gateway, emu: EmulatorClient,
                                                status: int, message: str, etype: str,
                                                stream: bool) -> None:
    step = {"fault": "status", "status": status, "message": message, "error_type": etype}
    emu.script("err", [step, step])
    with anthropic.Anthropic(base_url=gateway.emulator_url, api_key="sk-emu",
                             max_retries=0) as direct, \
            anthropic.Anthropic(base_url=gateway.url, api_key=gateway.key,
                                max_retries=0) as via:
        want = _raised(lambda: direct.messages.create(
            model="claude-emu#err", max_tokens=100, messages=QUESTION, stream=stream))
        got = _raised(lambda: via.messages.create(
            model="an/claude-emu#err", max_tokens=100, messages=QUESTION, stream=stream))
    assert type(got) is type(want), (got, want)
    assert (got.status_code, got.type, got.api_message, got.error_code) == \
        (want.status_code, want.type, want.api_message, want.error_code) == \
        (status, etype, message, None)
    assert got.body["error"] == want.body["error"] == {"type": etype, "message": message}
    # The SDK's own text (its form changed in anthropic 2.17): the status and
    # the provider's message, once (the gateway adds no wrapping of its own).
    assert got.message.startswith(f"Error code: {status} - ") or \
        got.message.startswith(f"{status} {message}"), got.message
    assert got.message.count(message) == 1, got.message
    assert len(emu.log("err")) == 2


# ---- the daemon's wire ------------------------------------------------------------------

@pytest.mark.parametrize(("provider", "request_", "step", "error"), [
    pytest.param("oa", {"model": "gpt-emu#err", "messages": QUESTION},
                 {"error_type": "invalid_request_error", "error_code": "invalid_value"},
                 {"provider_type": "invalid_request_error", "provider_code": "invalid_value"},
                 id="openai"),
    pytest.param("an", {"model": "claude-emu#err", "max_tokens": 100, "messages": QUESTION},
                 {"error_type": "invalid_request_error"},
                 {"provider_type": "invalid_request_error"}, id="anthropic"),
    pytest.param("bd", {"modelId": "anthropic.claude-emu#err",
                        "messages": [{"role": "user", "content": [{"text": "hello"}]}]},
                 {"error_type": "ValidationException"},
                 {"provider_type": "ValidationException"}, id="bedrock"),
])
def test_done_error_carries_the_providers_error_once(
        gateway: Gateway, emu: EmulatorClient, provider: str, request_: dict[str, Any],
        step: dict[str, Any], error: dict[str, Any]) -> None:
    emu.script("err", [{"fault": "status", "status": 400, "message": "bad thing", **step}])
    with gateway.daemon.client() as client:
        done = client.run(provider, request_)
    assert done["status"] == "failed", done
    assert done["error"] == {"code": "provider_error", "message": "bad thing",
                             "provider_status": 400, **error}


# ---- the pieces (pure) ------------------------------------------------------------------

def test_the_attempt_error_crosses_the_wire_with_the_providers_type_and_code() -> None:
    error = AttemptError(ErrorClass.FINAL, "bad_request", "bad thing", 400,
                         provider_type="invalid_request_error", provider_code="invalid_value")
    outcome = AttemptOutcome(ok=False, error=error)
    assert outcome_from_wire(outcome_to_wire(outcome)) == outcome
    wire = outcome_to_wire(outcome)
    wire[7][7] = 400  # a code that is not a text
    with pytest.raises(BadOutcome):
        outcome_from_wire(wire)


def test_the_log_still_shows_the_status_or_the_type() -> None:
    assert AttemptError(ErrorClass.FINAL, "c", "bad thing", 400).described == \
        "Error code: 400 - bad thing"
    assert AttemptError(ErrorClass.TRANSIENT, "c", "Network connection lost.",
                        provider_type="server_error").described == \
        "server_error: Network connection lost."
    assert AttemptError(ErrorClass.TRANSIENT, "c", "gone").described == "gone"


def test_the_gateway_renders_the_providers_error_as_the_provider_would() -> None:
    given = http_errors.ProviderError(403, "permission_error", "no_access")
    assert http_errors.openai_error("provider_error", "m", given) == (
        403, {"error": {"message": "m", "type": "permission_error", "param": None,
                        "code": "no_access"}})
    assert http_errors.anthropic_error("provider_error", "m", given) == (
        403, {"type": "error", "error": {"type": "permission_error", "message": "m",
                                         "details": {"error_code": "no_access"}}})
    # A type without a code: OpenAI's code is null, as the provider sent it.
    typed = http_errors.ProviderError(400, "invalid_request_error")
    assert http_errors.openai_error("provider_error", "m", typed)[1]["error"]["code"] is None
    # A context overflow keeps the provider's status; only the two codes pass it through.
    assert http_errors.openai_error("context_overflow", "m",
                                    http_errors.ProviderError(413))[0] == 413
    assert http_errors.openai_error("retries_exhausted", "m", given) == \
        http_errors.openai_error("retries_exhausted", "m")
    done = {"status": "failed", "error": {"code": "provider_error", "message": "m",
                                          "provider_status": 403,
                                          "provider_type": "permission_error",
                                          "provider_code": "no_access"}}
    assert http_errors.done_error(done) == ("provider_error", "m", given)
