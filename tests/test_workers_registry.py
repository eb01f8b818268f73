"""workers/registry.py (kind -> adapter, the catch-all of run_attempt), the zygote
pipe's messages (protocol/internal/workers.py), the worker's SinkOutput and the child
processes' lifecycle (protocol/lifecycle.py)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import msgpack
import pytest

from streamfence.protocol.internal import T_DELTA, T_REBIND
from streamfence.protocol.internal.outcome import ErrorClass
from streamfence.protocol.internal.workers import (
    AttemptSettings,
    SpawnWorker,
    StopZygote,
    WorkerExited,
    WorkerSpawned,
    ZygoteLog,
    ZygoteReady,
    ZygoteTag,
    decode_zygote_command,
    decode_zygote_event,
    encode_zygote,
)
from streamfence.protocol.lifecycle import ExitCode
from streamfence.protocol.wires import WIRES
from streamfence.workers import registry
from streamfence.workers.errors import CredentialsMissing
from streamfence.workers.output import RecordingOutput
from streamfence.workers.worker import SinkOutput


def test_every_wire_has_one_adapter() -> None:
    assert sorted(registry.ADAPTER_MODULES) == sorted(WIRES)
    for kind in WIRES:
        assert registry.adapter_of(kind).kind == kind
        assert kind in registry.imported_kinds()


@pytest.mark.parametrize(("profile", "exc_type", "code"), [
    ({"name": "x", "kind": "gemini"}, ValueError, "unexpected_error"),
    ({"name": "y", "kind": "openai", "api_key_env": "SF_TEST_UNSET_KEY"}, CredentialsMissing,
     "credentials_missing"),
])
def test_run_attempt_never_raises(profile: dict[str, Any], exc_type: type[Exception], code: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SF_TEST_UNSET_KEY", raising=False)
    out = RecordingOutput()
    final = registry.run_attempt(profile, {"model": "m"}, out, AttemptSettings())
    assert isinstance(out.exc, exc_type) and out.deltas == []
    assert final.ok is False and final.error is not None
    assert (final.error.error_class, final.error.code) == (ErrorClass.FINAL, code)


def test_clients_are_cached_per_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_clients", {})
    profile = {"name": "cached", "kind": "openai", "base_url": "http://127.0.0.1:9/v1"}
    client = registry.client_for(profile)
    try:
        assert registry.client_for(profile) is client and client.max_retries == 0
    finally:
        client.close()


def test_a_profile_changed_under_its_name_gets_a_new_client(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reload may change a profile's settings (supervisor/reload.py): the
    next attempt on it must not run on the client of the old ones."""
    monkeypatch.setattr(registry, "_clients", {})
    old = {"name": "moved", "kind": "openai", "base_url": "http://127.0.0.1:9/v1"}
    new = dict(old, base_url="http://127.0.0.1:10/v1")
    first = registry.client_for(old)
    second = registry.client_for(new)
    try:
        assert second is not first and str(second.base_url) == "http://127.0.0.1:10/v1/"
        assert registry.client_for(dict(new)) is second
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("msg", [SpawnWorker(3, 1), StopZygote()])
def test_zygote_commands_round_trip(msg: Any) -> None:
    assert decode_zygote_command(encode_zygote(msg)) == msg
    with pytest.raises(ValueError):
        decode_zygote_event(encode_zygote(msg))


@pytest.mark.parametrize("msg", [ZygoteReady(7), WorkerSpawned(3, 99), WorkerExited(3, 99, -9),
                                 WorkerExited(-1, 98, ExitCode.SINK_UNREACHABLE),
                                 ZygoteLog({"msg": "hi", "levelno": 20})])
def test_zygote_events_round_trip(msg: Any) -> None:
    assert decode_zygote_event(encode_zygote(msg)) == msg
    with pytest.raises(ValueError):
        decode_zygote_command(encode_zygote(msg))


def test_zygote_frames_keep_the_pipes_string_tags() -> None:
    assert msgpack.unpackb(encode_zygote(SpawnWorker(3, 1))) == ["spawn", 3, 1, False]
    assert decode_zygote_command(msgpack.packb(["spawn", 3, 1, True])) == SpawnWorker(3, 1, True)
    assert msgpack.unpackb(encode_zygote(WorkerExited(3, 9, 5))) == ["exited", 3, 9, 5]
    assert decode_zygote_command(msgpack.packb(["stop"])) == StopZygote()
    assert {t.value for t in ZygoteTag} == {"spawn", "stop", "ready", "spawned", "exited", "log"}
    for bad in (["spawn", 1], ["nope"], [], 3, {"a": 1}):
        with pytest.raises(ValueError):
            decode_zygote_command(msgpack.packb(bad))


def test_exit_codes_are_distinct() -> None:
    values = [code.value for code in ExitCode]
    assert len(values) == len(set(values)) and 1 not in values  # 1: an uncaught exception


def test_die_with_parent_in_a_child() -> None:
    code = ("import os, sys; from streamfence.protocol.lifecycle import die_with_parent as d; "
            "sys.exit(0 if d(os.getppid()) and not d(os.getppid() + 1) else 9)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


class _Live:
    def touch(self, slot: int, nbytes: int) -> None:
        self.touched = (slot, nbytes)


class _Sink:
    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.lost = False  # the connection never breaks here

    def send(self, frame: bytes) -> None:
        self.frames.append(frame)

    def wait_reply(self, timeout_s: float) -> list[Any] | None:
        """The sink's answer to the attempt's hello: write as yourself."""
        hello = msgpack.unpackb(self.frames[0])
        return [T_REBIND, hello[1], hello[2], hello[2], 0]


def test_sink_output_numbers_deltas_and_notices_visible_text() -> None:
    sink = _Sink()
    out = SinkOutput(sink, "c1", 2, 7, _Live(), 0)  # type: ignore[arg-type]
    out.begin()
    out.delta("reasoning", "thinking")
    out.delta("text", "  \n")
    assert not out.visible
    out.chunk(10)
    out.delta("text", " hi")
    assert out.visible and out.seq == 3 and out.first_chunk_ns > 0
    assert [msgpack.unpackb(f) for f in sink.frames][-1] == [T_DELTA, "c1", 2, 3, "text", " hi"]
