"""A provider reached over TLS, as real ones are: the emulator's TLS port
(`--tls-cert`), a throwaway certificate (streamfence.devtools.certs), the
real daemon's workers on all three wires. The workers trust what the
process's environment says (README "Providers behind a private CA"):
`SSL_CERT_FILE` for the SSE wires, `AWS_CA_BUNDLE` for bedrock's botocore.
Untrusted, an attempt fails at once with `tls_verify_failed`, a final error
(a retry cannot help), and no request is ever made. A spare's TLS
warm-up (a handshake with itself) completes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from streamfence.devtools.certs import self_signed
from streamfence.devtools.emulator.control import EmulatorProcess, emulator_profile
from streamfence.workers.tls_warmup import handshake_with_itself
from tests.harness import DaemonProcess
from tests.wires import WIRES, request_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_emulator(cert: tuple[Path, Path]) -> Iterator[EmulatorProcess]:
    with EmulatorProcess(tls=(str(cert[0]), str(cert[1]))) as emu:
        yield emu


def test_the_emulator_serves_the_same_wire_over_tls(tls_emulator: EmulatorProcess,
                                                     cert: tuple[Path, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert tls_emulator.base_url.startswith("http://127.0.0.1:")
    assert tls_emulator.tls_base_url.startswith("https://127.0.0.1:")
    assert tls_emulator.tls_base_url != tls_emulator.base_url.replace("http:", "https:")
    monkeypatch.setenv("SSL_CERT_FILE", str(cert[0]))
    with openai.OpenAI(base_url=tls_emulator.tls_base_url + "/v1", api_key="sk-test",
                       max_retries=0, timeout=10.0) as sdk:
        stream = sdk.chat.completions.create(
            model="m#tls-direct", messages=[{"role": "user", "content": "hi"}], stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    sent = tls_emulator.client().log("tls-direct")
    assert len(sent) == 1 and text == sent[0]["text"]


def _run_each_wire(tls_emulator: EmulatorProcess, state_dir: Path, env: dict[str, str],
                   key: str) -> dict[str, tuple[dict[str, Any], list[tuple[Any, ...]]]]:
    """One call per wire through a daemon whose profiles point at the TLS port;
    by wire, the call's done event and its attempts' (error class, code)."""
    providers = {wire: dict(emulator_profile(wire, tls_emulator.tls_base_url),
                            stale_timeout_s=30.0) for wire in WIRES}
    done = {}
    with DaemonProcess(state_dir, providers, env=env) as daemon, daemon.client() as client:
        for wire in WIRES:
            call_id = client.submit(wire, request_for(wire, f"{key}-{wire}"))
            events = list(client.events(call_id, timeout_s=30.0))
            result = client.result(call_id)
            assert result is not None, wire
            done[wire] = (events[-1], [(a["error_class"], a["error_code"])
                                       for a in result["diagnostics"]])
    assert not daemon.survivors, f"processes outlived the daemon: {daemon.survivors}"
    return done


def test_the_daemons_workers_trust_what_the_environment_says(
        tls_emulator: EmulatorProcess, cert: tuple[Path, Path], tmp_path: Path) -> None:
    control = tls_emulator.client()
    trusted = {"SSL_CERT_FILE": str(cert[0]), "AWS_CA_BUNDLE": str(cert[0])}
    done = _run_each_wire(tls_emulator, tmp_path / "trusting", trusted, "tls-ok")
    for wire, (event, _) in done.items():
        sent = control.log(f"tls-ok-{wire}")
        assert event["status"] == "completed", (wire, event)
        assert len(sent) == 1 and event["response"]["content"] == sent[0]["text"], wire

    done = _run_each_wire(tls_emulator, tmp_path / "untrusting", {}, "tls-no")
    for wire, (event, attempts) in done.items():
        assert event["status"] == "failed", (wire, event)
        assert "certificate verify failed" in event["error"]["message"], (wire, event)
        assert attempts == [("final", "tls_verify_failed")], (wire, attempts)
        assert control.log(f"tls-no-{wire}") == [], wire


def test_a_spares_tls_warm_up_shakes_hands_with_itself() -> None:
    """workers/tls_warmup.py: the handshake completes (its certificate, valid
    2000-2999 for its one name, and key are in the package)."""
    handshake_with_itself()
