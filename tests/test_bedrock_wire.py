"""The Bedrock wire of the emulator, parsed by botocore's own code.

The encoder's frames are decoded with ``botocore.eventstream.EventStreamBuffer``;
the routes are driven over real HTTP by a real boto3 ``bedrock-runtime``
client (dummy credentials, ``endpoint_url`` on 127.0.0.1, SDK retries off).
One emulator serves the module (the ``emulator`` fixture of conftest); each
test resets it. Waiting polls the log with deadlines; stalls are short.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from typing import Any

import boto3
import botocore.eventstream
import botocore.exceptions
import pytest
import urllib3.exceptions
from botocore.config import Config

from streamfence.devtools.emulator import eventstream
from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess

MESSAGES: list[Any] = [{"role": "user", "content": [{"text": "Say something deterministic."}]}]
MODEL = "anthropic.claude-3-5-sonnet-20240620-v1:0"  # a ':' too, as real ids have


def make_bedrock(url: str, read_timeout: float = 10.0) -> Any:
    return boto3.client(
        "bedrock-runtime", region_name="us-east-1", endpoint_url=url,
        aws_access_key_id="test", aws_secret_access_key="test",
        config=Config(retries={"total_max_attempts": 1, "mode": "standard"},
                      connect_timeout=5, read_timeout=read_timeout))


@pytest.fixture
def bedrock(emulator: EmulatorProcess) -> Iterator[Any]:
    client = make_bedrock(emulator.base_url)
    yield client
    client.close()


def events(bedrock: Any, key: str) -> list[dict[str, Any]]:
    response = bedrock.converse_stream(modelId=f"{MODEL}#{key}", messages=MESSAGES)
    stream = response["stream"]
    try:
        return list(stream)
    finally:
        stream.close()


def texts(evs: list[dict[str, Any]], kind: str = "text") -> list[str]:
    out = []
    for e in evs:
        delta = e.get("contentBlockDelta", {}).get("delta", {})
        if kind == "text" and "text" in delta:
            out.append(delta["text"])
        elif kind == "reasoning" and "text" in delta.get("reasoningContent", {}):
            out.append(delta["reasoningContent"]["text"])
        elif kind == "tool" and "toolUse" in delta:
            out.append(delta["toolUse"]["input"])
    return out


def names(evs: list[dict[str, Any]]) -> list[str]:
    return [next(iter(e)) for e in evs]


def only(emu: EmulatorClient, key: str) -> dict[str, Any]:
    records = emu.log(key)
    assert len(records) == 1, records
    return records[0]


# --- the encoder, decoded by botocore ------------------------------------------


def test_frames_decode_with_botocores_parser() -> None:
    payload = json.dumps({"contentBlockIndex": 0, "delta": {"text": "héllo 🙂"}}).encode()
    frames = [eventstream.event("contentBlockDelta", payload),
              eventstream.exception("throttlingException", b'{"message":"slow down"}'),
              eventstream.event("messageStop", b"")]
    buf = botocore.eventstream.EventStreamBuffer()
    joined = b"".join(frames)
    for i in range(0, len(joined), 7):  # fed in pieces, as a socket would
        buf.add_data(joined[i : i + 7])
    messages = list(buf)
    assert [m.payload for m in messages] == [payload, b'{"message":"slow down"}', b""]
    assert messages[0].headers == {":event-type": "contentBlockDelta",
                                   ":content-type": "application/json", ":message-type": "event"}
    assert messages[1].headers[":exception-type"] == "throttlingException"
    assert messages[1].to_response_dict()["status_code"] == 400  # botocore's mark of an error
    frame = frames[0]
    assert int.from_bytes(frame[:4], "big") == len(frame)
    assert int.from_bytes(frame[8:12], "big") == zlib.crc32(frame[:8])


def test_corrupt_frame_fails_botocores_crc_check() -> None:
    buf = botocore.eventstream.EventStreamBuffer()
    buf.add_data(eventstream.corrupt(eventstream.event("messageStart", b'{"role":"assistant"}')))
    with pytest.raises(botocore.eventstream.ChecksumMismatch):
        list(buf)


def test_header_limits_are_checked() -> None:
    with pytest.raises(eventstream.EncodeError):
        eventstream.encode_headers([("x" * 256, "v")])
    with pytest.raises(eventstream.EncodeError):
        eventstream.encode_headers([("n", "v" * 70_000)])


# --- normal responses, through boto3 -------------------------------------------


def test_ok_stream_parses_and_matches_the_log(emu: EmulatorClient, bedrock: Any) -> None:
    evs = events(bedrock, "ok")
    record = only(emu, "ok")
    assert names(evs) == ["messageStart", *["contentBlockDelta"] * 8, "contentBlockStop",
                          "messageStop", "metadata"]
    assert evs[0]["messageStart"] == {"role": "assistant"}
    text = "".join(texts(evs))
    assert text == record["text"] == record["sent_text"]
    assert text.startswith(f"Answer {record['n']} for ok: ")
    assert evs[-2]["messageStop"]["stopReason"] == "end_turn"
    usage = evs[-1]["metadata"]["usage"]
    assert usage["outputTokens"] == 8
    assert usage["totalTokens"] == usage["inputTokens"] + usage["outputTokens"]
    assert evs[-1]["metadata"]["metrics"]["latencyMs"] >= 1
    assert record["chunks_sent"] == 12 and record["completed"] and not record["aborted"]
    assert record["model"] == MODEL and record["stream"] is True  # '#ok' decoded off the path
    assert record["auth_present"] is True  # a SigV4 Authorization header
    assert record["request"]["messages"] == MESSAGES


def test_tool_use_block_streams_partial_json(emu: EmulatorClient, bedrock: Any) -> None:
    emu.script("tool", [{"tool_call": {"name": "get_weather", "arguments": {"city": "Zürich"}},
                         "text": "Let me look.", "chunks": 4}])
    evs = events(bedrock, "tool")
    starts = [e["contentBlockStart"] for e in evs if "contentBlockStart" in e]
    assert len(starts) == 1 and starts[0]["contentBlockIndex"] == 1
    tool = starts[0]["start"]["toolUse"]
    assert tool["name"] == "get_weather" and tool["toolUseId"].startswith("tooluse_")
    pieces = texts(evs, "tool")
    assert len(pieces) == 4 and json.loads("".join(pieces)) == {"city": "Zürich"}
    assert evs[-2]["messageStop"]["stopReason"] == "tool_use"
    record = only(emu, "tool")
    assert record["tool_call"] == {"id": tool["toolUseId"], "name": "get_weather",
                                   "arguments": "".join(pieces)}
    assert record["sent_text"] == "Let me look."


def test_reasoning_block_comes_first_with_a_signature(emu: EmulatorClient, bedrock: Any) -> None:
    emu.script("think", [{"reasoning": True, "chunks": 4}])
    evs = events(bedrock, "think")
    record = only(emu, "think")
    assert "".join(texts(evs, "reasoning")) == record["reasoning_text"]
    sig = [e for e in evs
           if "signature" in e.get("contentBlockDelta", {}).get("delta", {}).get("reasoningContent", {})]
    assert len(sig) == 1 and sig[0]["contentBlockDelta"]["contentBlockIndex"] == 0
    assert {e["contentBlockDelta"]["contentBlockIndex"] for e in evs
            if "text" in e.get("contentBlockDelta", {}).get("delta", {})} == {1}
    assert "".join(texts(evs)) == record["text"] == record["sent_text"]


def test_finish_reason_accepts_openai_names(emu: EmulatorClient, bedrock: Any) -> None:
    emu.script("len", [{"finish_reason": "length"}, {"refusal": "I can't help with that."}])
    assert events(bedrock, "len")[-2]["messageStop"]["stopReason"] == "max_tokens"
    evs = events(bedrock, "len")
    assert evs[-2]["messageStop"]["stopReason"] == "guardrail_intervened"
    assert "".join(texts(evs)).endswith("I can't help with that.")


def test_non_streaming_converse(emu: EmulatorClient, bedrock: Any) -> None:
    emu.script("whole", [{"reasoning": "hm", "tool_call": {"name": "f", "arguments": {"a": 1}},
                          "text": "ok"}])
    result = bedrock.converse(modelId=f"{MODEL}#whole", messages=MESSAGES)
    content = result["output"]["message"]["content"]
    assert content[0]["reasoningContent"]["reasoningText"]["text"] == "hm"
    assert content[1] == {"text": "ok"}
    assert content[2]["toolUse"]["input"] == {"a": 1} and content[2]["toolUse"]["name"] == "f"
    assert result["stopReason"] == "tool_use" and result["usage"]["outputTokens"] > 0
    record = only(emu, "whole")
    assert record["stream"] is False and record["sent_text"] == "ok" and record["completed"]
    assert record["path"].endswith("/converse")


def test_header_key_when_the_model_id_has_none(emu: EmulatorClient, bedrock: Any) -> None:
    emu.script("hdr", [{"text": "via header"}])

    def add_key(request: Any, **_: Any) -> None:
        request.headers["X-Emu-Key"] = "hdr"

    bedrock.meta.events.register("before-sign.bedrock-runtime.ConverseStream", add_key)
    response = bedrock.converse_stream(modelId=MODEL, messages=MESSAGES)
    assert "".join(texts(list(response["stream"]))) == "via header"
    assert only(emu, "hdr")["model"] == MODEL


# --- faults ---------------------------------------------------------------------------


@pytest.mark.parametrize(("status", "code"), [
    (429, "ThrottlingException"), (503, "ServiceUnavailableException"),
    (400, "ValidationException"), (500, "InternalServerException"),
])
def test_status_fault_raises_the_modelled_error_once(
    emu: EmulatorClient, bedrock: Any, status: int, code: str
) -> None:
    emu.script("status", [{"fault": "status", "status": status, "retry_after": 2}])
    with pytest.raises(botocore.exceptions.ClientError) as info:
        events(bedrock, "status")
    err = info.value.response
    assert err["Error"]["Code"] == code and "(emulated)" in err["Error"]["Message"]
    assert err["ResponseMetadata"]["HTTPStatusCode"] == status
    assert err["ResponseMetadata"]["HTTPHeaders"]["retry-after"] == "2"
    assert len(emu.log("status")) == 1  # total_max_attempts=1: botocore did not retry


def test_botocore_max_attempts_1_means_one_retry(emu: EmulatorClient, emulator: EmulatorProcess) -> None:
    # Measured, and why the adapter uses total_max_attempts: legacy-named max_attempts
    # counts retries, so {"max_attempts": 1} sends the request twice.
    client = boto3.client("bedrock-runtime", region_name="us-east-1",
                          endpoint_url=emulator.base_url, aws_access_key_id="test",
                          aws_secret_access_key="test",
                          config=Config(retries={"max_attempts": 1, "mode": "standard"}))
    try:
        emu.script("twice", [{"fault": "status", "status": 500}, {"fault": "status", "status": 500}])
        with pytest.raises(botocore.exceptions.ClientError):
            client.converse(modelId="m#twice", messages=MESSAGES)
    finally:
        client.close()
    assert len(emu.log("twice")) == 2


def test_access_denied_on_stream_only(emu: EmulatorClient, bedrock: Any) -> None:
    emu.script("iam", [{"fault": "access_denied"}, {"fault": "access_denied", "text": "fine"}])
    with pytest.raises(botocore.exceptions.ClientError) as info:
        events(bedrock, "iam")
    err = info.value
    assert err.operation_name == "ConverseStream"
    assert err.response["Error"]["Code"] == "AccessDeniedException"
    assert "bedrock:InvokeModelWithResponseStream" in err.response["Error"]["Message"]
    headers = err.response["ResponseMetadata"]["HTTPHeaders"]
    assert headers["x-amzn-errortype"].startswith("AccessDeniedException:")
    result = bedrock.converse(modelId=f"{MODEL}#iam", messages=MESSAGES)
    assert result["output"]["message"]["content"] == [{"text": "fine"}]
    assert [r["status"] for r in emu.log("iam")] == [403, 200]


def test_disconnect_raises_protocol_error_after_the_scripted_events(
    emu: EmulatorClient, bedrock: Any
) -> None:
    emu.script("cut", [{"fault": "disconnect", "after": 3}])
    received: list[dict[str, Any]] = []
    stream = bedrock.converse_stream(modelId=f"{MODEL}#cut", messages=MESSAGES)["stream"]
    with pytest.raises(urllib3.exceptions.ProtocolError):  # raw, not wrapped by botocore
        for event in stream:
            received.append(event)
    stream.close()
    record = only(emu, "cut")
    assert len(received) == record["chunks_sent"] == 3
    assert "".join(texts(received)) == record["sent_text"]
    assert record["aborted"] and not record["completed"]


def test_malformed_frame_raises_checksum_mismatch(emu: EmulatorClient, bedrock: Any) -> None:
    emu.script("bad", [{"fault": "malformed", "after": 2}])
    with pytest.raises(botocore.eventstream.ChecksumMismatch):
        events(bedrock, "bad")
    assert only(emu, "bad")["chunks_sent"] == 2


@pytest.mark.parametrize("exc_type", ["modelStreamErrorException", "throttlingException",
                                      "validationException"])
def test_error_event_raises_event_stream_error(
    emu: EmulatorClient, bedrock: Any, exc_type: str
) -> None:
    emu.script("evt", [{"fault": "error_event", "after": 1, "error_type": exc_type,
                        "message": "stream broke"}])
    with pytest.raises(botocore.exceptions.EventStreamError) as info:
        events(bedrock, "evt")
    assert info.value.response["Error"] == {"Code": exc_type, "Message": "stream broke"}
    record = only(emu, "evt")
    assert record["chunks_sent"] == 1 and not record["completed"]


def test_empty_and_no_finish(emu: EmulatorClient, bedrock: Any) -> None:
    emu.script("e", [{"fault": "empty"}, {"fault": "no_finish", "chunks": 3}])
    assert events(bedrock, "e") == []
    evs = events(bedrock, "e")
    assert names(evs) == ["messageStart", *["contentBlockDelta"] * 3, "contentBlockStop"]
    first, second = emu.log("e")
    assert first["chunks_sent"] == 0 and first["completed"]
    assert second["sent_text"] == second["text"] and not second["completed"]


def test_whole_body_faults(emu: EmulatorClient, bedrock: Any) -> None:
    emu.script("w", [{"fault": "malformed"}, {"fault": "empty"}, {"fault": "no_finish"},
                     {"fault": "error_event", "error_type": "throttlingException"}])
    assert bedrock.converse(modelId="m#w", messages=MESSAGES).keys() == {"ResponseMetadata"}
    assert bedrock.converse(modelId="m#w", messages=MESSAGES).keys() == {"ResponseMetadata"}
    assert "stopReason" not in bedrock.converse(modelId="m#w", messages=MESSAGES)
    with pytest.raises(botocore.exceptions.ClientError, match="ThrottlingException"):
        bedrock.converse(modelId="m#w", messages=MESSAGES)


def test_invalid_body_is_a_validation_exception(emu: EmulatorClient) -> None:
    request = urllib.request.Request(
        emu.base_url + "/model/m%23raw/converse-stream", data=b'{"nomessages": 1}',
        headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=5)
    with info.value as err:
        assert err.code == 400 and err.headers["x-amzn-ErrorType"].startswith("ValidationException")
    record = only(emu, "raw")
    assert record["status"] == 400 and record["auth_present"] is False


def test_stall_holds_the_stream_then_resumes(emu: EmulatorClient, bedrock: Any) -> None:
    emu.script("zombie", [{"fault": "stall", "after": 2, "stall_s": 0.6, "chunks": 3}])
    start = time.monotonic()
    stream = bedrock.converse_stream(modelId=f"{MODEL}#zombie", messages=MESSAGES)["stream"]
    arrivals: list[float] = []
    received: list[dict[str, Any]] = []
    for event in stream:
        arrivals.append(time.monotonic())
        received.append(event)
        if len(received) == 2:
            assert emu.wait_for(
                lambda rs: rs and rs[0]["chunks_sent"] == 2 and not rs[0]["completed"],
                timeout=0.5, what="the stalled stream to show 2 events sent", key="zombie")
    stream.close()
    # The 3rd event cannot arrive sooner after the start than the stall (a gap between
    # arrivals shrinks if the 2nd is read late; this bound holds under any load).
    assert arrivals[2] - start >= 0.6
    record = only(emu, "zombie")  # one request: the stream resumed on its connection
    assert len(received) == record["chunks_sent"] == 7
    assert record["completed"] and record["sent_text"] == record["text"]
