"""Issue 31, item 4 (HTTP): the gateway's access log, one line per HTTP
request (method, path, status, identity, call id, bytes out, duration),
through a real daemon with JSON logs, as the operator's log holds it; and
the text line and the JSON keys of one record, through the daemon's own
formatters."""

from __future__ import annotations

import http.client
import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp.test_utils import make_mocked_request

from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess, emulator_profile
from streamfence.gateway import access
from streamfence.gateway.app import CALL_HEADER
from streamfence.gateway.keys import http_key
from streamfence.protocol.credentials import load_credentials
from streamfence.supervisor.logs import JsonFormatter, TextFormatter
from tests.harness import DaemonProcess, free_port, healthy, wait_until

ACCESS = "streamfence.gateway.access"
QUESTION: Any = [{"role": "user", "content": "hello"}]


class Gateway:
    def __init__(self, daemon: DaemonProcess, port: int, key: str) -> None:
        self.daemon, self.port, self.key = daemon, port, key
        self.url = f"http://127.0.0.1:{port}"

    def access_lines(self, count: int, what: str, **match: Any) -> list[dict[str, Any]]:
        """The log's access records with the fields in `match`, once there are `count`."""
        def found() -> list[dict[str, Any]] | None:
            lines = [r for r in self.daemon.log_records() if r.get("logger") == ACCESS
                     and all(r.get(k) == v for k, v in match.items())]
            return lines if len(lines) >= count else None
        lines = wait_until(found, 10.0, f"the access line of {what}")
        assert lines is not None
        return lines


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory,
            emulator: EmulatorProcess) -> Iterator[Gateway]:
    port = free_port()
    daemon = DaemonProcess(
        Path(tmp_path_factory.mktemp("gateway_access")) / "state",
        {"oa": emulator_profile("openai", emulator.base_url)},
        daemon={"workers_spare": 2}, tables={"http": {"listen": f"127.0.0.1:{port}"}})
    daemon.start()
    try:
        wait_until(lambda: healthy(f"http://127.0.0.1:{port}"), 30.0, "the gateway to answer")
        yield Gateway(daemon, port, http_key(load_credentials(daemon.credentials_path)))
    finally:
        daemon.cleanup()


def _post(gateway: Gateway, body: dict[str, Any], key: str | None = None
          ) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=30.0)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {
            "Authorization": f"Bearer {key or gateway.key}",
            "Content-Type": "application/json"})
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        conn.close()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_call_has_one_access_line_with_its_fields(gateway: Gateway, emu: EmulatorClient,
                                                    stream: bool) -> None:
    emu.script("ok", [{"fault": "ok", "chunks": 5}])
    status, headers, body = _post(gateway, {"model": "oa/gpt-emu#ok", "messages": QUESTION,
                                            "stream": stream})
    assert status == 200, body
    call_id = headers[CALL_HEADER]
    [line] = gateway.access_lines(1, f"call {call_id}", call_id=call_id)
    assert line["level"] == "INFO" and line["process_name"] == "gateway", line
    assert (line["method"], line["path"], line["status"], line["identity"]) == \
        ("POST", "/v1/chat/completions", 200, "local")
    assert line["bytes_out"] > len(body), (line, len(body))  # the body and its headers
    assert isinstance(line["duration_ms"], float) and line["duration_ms"] > 0.0
    assert line["message"] == (f"POST /v1/chat/completions 200 identity=local "
                               f"bytes={line['bytes_out']} duration_ms={line['duration_ms']:.1f}")


def test_a_refused_request_is_logged_without_identity_or_call(gateway: Gateway) -> None:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="sf-local." + "0" * 64,
                       max_retries=0) as client, pytest.raises(openai.AuthenticationError):
        client.models.list()  # closed after: not left to the garbage collector
    [line] = gateway.access_lines(1, "a refused /v1/models", path="/v1/models", status=401)
    assert line["identity"] is None and "call_id" not in line, line
    assert " 401 identity=- " in line["message"], line


def test_a_client_gone_mid_stream_is_logged_499(gateway: Gateway, emu: EmulatorClient) -> None:
    emu.script("gone", [{"fault": "ok", "chunks": 200, "chunk_delay_s": 0.05}])
    conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=30.0)
    conn.request("POST", "/v1/chat/completions",
                 json.dumps({"model": "oa/gpt-emu#gone", "messages": QUESTION, "stream": True}),
                 {"Authorization": f"Bearer {gateway.key}", "Content-Type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 200
    call_id = reply.getheader(CALL_HEADER)
    assert reply.readline().startswith(b"id: ")  # the answer is streaming
    reply.close()  # the response holds the socket too: both closed, none left to the GC
    conn.close()
    [line] = gateway.access_lines(1, "the abandoned stream", call_id=call_id)
    assert (line["status"], line["identity"]) == (access.CLIENT_CLOSED, "local"), line
    assert line["bytes_out"] > 0, line


def test_probes_are_debug_only(gateway: Gateway) -> None:
    assert healthy(gateway.url)
    refused = _post(gateway, {"model": "oa/gpt-emu", "messages": QUESTION}, key="sf-none.0")
    assert refused[0] == 401
    # After the probe, in the gateway's order: once its line is in, the probe's would be.
    gateway.access_lines(1, "the request after the probe", path="/v1/chat/completions",
                         status=401)
    assert not [r for r in gateway.daemon.log_records()
                if r.get("logger") == ACCESS and r.get("path") == "/healthz"]


# ---- the record through the daemon's formatters (pure) ------------------------------

def _formatted(formatter: logging.Formatter) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    access.log.addHandler(handler)
    old = access.log.level
    access.log.setLevel(logging.INFO)
    try:
        request = make_mocked_request("POST", "/v1/messages")
        request[access.IDENTITY] = "alice"
        request[access.CALL_ID] = "c1"
        access.log_request(request, 529, 321, 0.01234)
    finally:
        access.log.removeHandler(handler)
        access.log.setLevel(old)
    return stream.getvalue()


def test_the_text_line_and_the_json_keys() -> None:
    text = _formatted(TextFormatter())
    assert text.rstrip("\n").endswith(
        " streamfence.gateway.access call=c1: POST /v1/messages 529 identity=alice "
        "bytes=321 duration_ms=12.3"), text
    record = json.loads(_formatted(JsonFormatter()))
    assert {k: record[k] for k in ("method", "path", "status", "identity", "call_id",
                                   "bytes_out", "duration_ms", "logger")} == {
        "method": "POST", "path": "/v1/messages", "status": 529, "identity": "alice",
        "call_id": "c1", "bytes_out": 321, "duration_ms": 12.3, "logger": ACCESS}
