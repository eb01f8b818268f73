"""What section 9 (scripts/bench/gateway.py) runs beside the SDKs: LiteLLM's
proxy (`sdk-litellm`, when a `litellm` executable is found) and the minimal
HTTP client of the gateway (`sse-gateway`: raw sockets, one kept-alive
connection per stream, SSE parsed by hand). See that module's docstring
for what each variant measures."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from scripts.bench.ttft import Call
from streamfence.devtools.emulator.control import EmulatorProcess
from streamfence.devtools.launcher import wait_until

LITELLM_ENV = "SF_BENCH_LITELLM"
PROMPT = [{"role": "user", "content": "Write a short paragraph."}]


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def litellm_executable() -> tuple[str | None, str]:
    """(path, how it was found) or (None, why not)."""
    given = os.environ.get(LITELLM_ENV)
    if given:
        if os.access(given, os.X_OK):
            return given, f"${LITELLM_ENV}"
        return None, f"${LITELLM_ENV}={given} is not an executable"
    found = shutil.which("litellm")
    if found:
        return found, "PATH"
    return None, (f"no `litellm` executable: not on the PATH and ${LITELLM_ENV} unset "
                  "(pip install 'litellm[proxy]' in a venv of its own, then "
                  f"{LITELLM_ENV}=VENV/bin/litellm)")


@contextlib.contextmanager
def litellm_proxy(exe: str, emu: EmulatorProcess, port: int, key: str
             ) -> Iterator[subprocess.Popen[bytes]]:
    """LiteLLM's proxy on 127.0.0.1:`port`, every model routed to the emulator's
    OpenAI wire (`openai/*`) but `anthropic/*`, routed to its Anthropic wire
    (the translated variant: LiteLLM turns the OpenAI request into Anthropic's
    and the answer back; its most specific pattern wins), `key` its master
    key (it refuses to start without one), no database, quiet."""
    with tempfile.TemporaryDirectory(prefix="sfbench-litellm-") as tmp:
        config = Path(tmp) / "litellm.yaml"
        config.write_text(
            "model_list:\n"
            "  - model_name: \"*\"\n"
            "    litellm_params:\n"
            "      model: \"openai/*\"\n"
            f"      api_base: \"{emu.openai_base_url}\"\n"
            "      api_key: \"bench\"\n"
            "  - model_name: \"anthropic/*\"\n"
            "    litellm_params:\n"
            "      model: \"anthropic/*\"\n"
            f"      api_base: \"{emu.anthropic_base_url}\"\n"
            "      api_key: \"bench\"\n"
            "litellm_settings:\n"
            "  telemetry: false\n"
            "  drop_params: true\n"
            "general_settings:\n"
            f"  master_key: \"{key}\"\n")
        logf = open(Path(tmp) / "litellm.log", "wb")  # noqa: SIM115 (closed below)
        env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
               "LITELLM_TELEMETRY": "False", "NO_PROXY": "*", "no_proxy": "*"}
        proc = subprocess.Popen([exe, "--config", str(config), "--host", "127.0.0.1",
                                 "--port", str(port), "--num_workers", "1"],
                                stdout=logf, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}/health/liveliness"

            def up() -> bool:
                if proc.poll() is not None:
                    raise RuntimeError(f"litellm exited {proc.returncode}: "
                                       + (Path(tmp) / "litellm.log").read_text()[-2000:])
                return answers(url)

            wait_until(up, 180.0, "LiteLLM's proxy to answer /health/liveliness")
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            logf.close()


# ---- the variants ------------------------------------------------------------------

class SseClient:
    """A minimal HTTP/1.1 client of the gateway's chat completions on raw sockets
    (module docstring, `sse-gateway`): a pool of kept-alive connections, one per
    concurrent stream, opened once; each response de-chunked and its SSE
    frames parsed by hand."""

    def __init__(self, port: int, key: str, streams: int) -> None:
        self.port, self.key = port, key
        self.conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
        for sock in self.conns:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def request(self, model: str) -> bytes:
        body = json.dumps({"model": model, "messages": PROMPT, "stream": True}).encode()
        return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
                f"Authorization: Bearer {self.key}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode() + body

    def close(self) -> None:
        for sock in self.conns:
            sock.close()


class SseResponse:
    """One streaming response: head, then chunked body, then SSE frames."""

    def __init__(self, call: Call) -> None:
        self.call = call
        self.raw = bytearray()  # received, not yet de-chunked
        self.body = bytearray()  # de-chunked, not yet a whole SSE frame
        self.head = False
        self.parts: list[str] = []
        self.ended = False

    def feed(self, data: bytes) -> None:
        self.raw += data
        if not self.head:
            end = self.raw.find(b"\r\n\r\n")
            if end < 0:
                return
            status = bytes(self.raw[:end]).split(b"\r\n", 1)[0]
            if b" 200 " not in status:
                raise RuntimeError(f"the gateway answered {status!r}")
            del self.raw[:end + 4]
            self.head = True
        while (eol := self.raw.find(b"\r\n")) >= 0:
            size = int(bytes(self.raw[:eol]).split(b";")[0], 16)
            if len(self.raw) < eol + 2 + size + 2:
                break
            self.body += self.raw[eol + 2:eol + 2 + size]
            del self.raw[:eol + 2 + size + 2]
            if size == 0:
                self.ended = True
        while (end := self.body.find(b"\n\n")) >= 0:
            frame = bytes(self.body[:end])
            del self.body[:end + 2]
            for line in frame.split(b"\n"):
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    choices = json.loads(line[6:])["choices"]
                    content = choices[0]["delta"].get("content") if choices else None
                    if content:
                        call = self.call
                        call.last = time.perf_counter()
                        if not call.first:
                            call.first, call.wfirst = call.last, time.time()
                        call.pieces += 1
                        self.parts.append(content)


def sse_streams(client: SseClient, calls: list[Call]) -> None:
    """Send every request back to back, each on a connection of its own, then
    read every response in one loop (the HTTP twin of ttft.zmq_streams)."""
    sel = selectors.DefaultSelector()
    for sock, call in zip(client.conns, calls, strict=False):
        frame = client.request(call.model)
        call.t0, call.w0 = time.perf_counter(), time.time()
        sock.sendall(frame)
        sel.register(sock, selectors.EVENT_READ, SseResponse(call))
    open_ = len(calls)
    deadline = time.monotonic() + 120.0
    while open_ and time.monotonic() < deadline:
        for key, _ in sel.select(0.2):
            resp: SseResponse = key.data
            data = key.fileobj.recv(65536)  # type: ignore[union-attr]
            if not data:
                raise RuntimeError("the gateway closed a kept-alive connection")
            resp.feed(data)
            if resp.ended:
                resp.call.text = "".join(resp.parts)
                sel.unregister(key.fileobj)
                open_ -= 1
    sel.close()
    for call in calls:
        if not call.text and not call.error:
            call.error = "no end of the response within 120 s"
