"""The HTTP gateway as the process-level tests run it: a daemon with one
emulator profile per wire (`oa` openai, `an` anthropic, `br` bedrock) and
its gateway on a loopback port, and the official SDKs pointed at it with
only `base_url` and the key changed (conftest's module-scoped `gateway`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai

from streamfence.devtools.emulator.control import EmulatorProcess, emulator_profile
from streamfence.gateway.keys import http_key
from streamfence.protocol.credentials import load_credentials
from tests.harness import DaemonProcess, free_port, healthy, wait_until

PROFILES = {"oa": "openai", "an": "anthropic", "br": "bedrock"}


class Gateway:
    def __init__(self, daemon: DaemonProcess, url: str, key: str) -> None:
        self.daemon, self.url, self.key = daemon, url, key

    def openai(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or self.key, max_retries=0)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=self.key, max_retries=0)


@contextlib.contextmanager
def gateway_daemon(state_dir: Path, emulator: EmulatorProcess) -> Iterator[Gateway]:
    """A started daemon with its gateway (the profiles retry fast: a stale
    timeout of 1 s, 3 attempts), stopped on the way out."""
    port = free_port()
    profile = {"stale_timeout_s": 1.0, "max_attempts": 3}
    daemon = DaemonProcess(
        state_dir, {name: dict(emulator_profile(wire, emulator.base_url), **profile)
                    for name, wire in PROFILES.items()},
        daemon={"backoff_base_s": 0.05, "backoff_max_s": 0.2, "workers_spare": 2},
        tables={"http": {"listen": f"127.0.0.1:{port}"}})
    daemon.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(url), 30.0, f"the gateway to answer {url}/healthz")
        yield Gateway(daemon, url, http_key(load_credentials(daemon.credentials_path)))
    finally:
        daemon.cleanup()
