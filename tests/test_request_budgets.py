"""Byte budgets on the requests the supervisor holds for accepted calls (issue
12, item 2): `[daemon] in_flight_bytes_max` over every call accepted and not
done (refused `overloaded`), `[identities.NAME] max_in_flight_bytes` per
identity (refused `too_many_calls`), both released when a call is done,
recovered calls counted, and the figures in `status`.

One real daemon serves the module, against the real emulator; a call stays in
flight because its emulator script stalls after the first chunk. Each test
cancels its calls and waits for their `done`, so the next starts from an empty
budget. Recovery and the config checks are tested in process."""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path
from typing import Any, cast

import msgpack
import pytest
import zmq

from streamfence.config.model import (
    ConfigError,
    DaemonConfig,
    ProviderProfile,
    apply_env,
    parse_config,
)
from streamfence.devtools.emulator.control import EmulatorClient
from streamfence.protocol.client import Client, ClientError
from streamfence.protocol.codec import encode
from streamfence.protocol.credentials import Credentials
from streamfence.protocol.keys import KeyStore
from streamfence.supervisor.attempts import AttemptDriver
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.recovery import recover_calls
from streamfence.supervisor.sinklink import Finished
from tests.harness import DaemonProcess
from tests.wires import DaemonFactory, request_for

PAD = 10_000  # a request's text: ~10 KB on the wire
BUDGET = 25_000  # in_flight_bytes_max: two such requests fit, a third does not
HEAVY_MAX = 15_000  # heavy's max_in_flight_bytes: one fits, two do not
TRICKLE_RATE = 5_000  # trickle's submit_bytes_per_s: one ~10 KB request, then a wait
STALL = {"fault": "stall", "after": 1, "stall_s": 60.0}
IDENTITIES = f"""
[identities.heavy]
max_in_flight_bytes = {HEAVY_MAX}

[identities.light]

[identities.trickle]
submit_bytes_per_s = {TRICKLE_RATE}
"""


@pytest.fixture(scope="module")
def daemon(module_daemon: DaemonFactory) -> DaemonProcess:
    return module_daemon(daemon={"in_flight_bytes_max": BUDGET}, config_tail=IDENTITIES)


def _request(key: str, size: int = PAD) -> dict[str, Any]:
    return request_for("openai", key, "x" * size)


def _held(client: Client) -> Any:
    return client.status()["calls"]


def _submit_stalled(client: Client, emu: EmulatorClient, key: str) -> str:
    """A call that stays running: its stream stalls after one chunk."""
    emu.script(key, [STALL])
    call_id: str = client.submit("emu", _request(key), subscribe=False)
    return call_id


def _refusal(client: Client, request: dict[str, Any]) -> ClientError:
    with pytest.raises(ClientError) as info:
        client.submit("emu", request, subscribe=False)
    return info.value


def _end(client: Client, *call_ids: str) -> None:
    """Cancel the calls and wait for each one's done."""
    for call_id in call_ids:
        client.cancel(call_id)
    for call_id in call_ids:
        done = client.result(call_id, wait_s=10.0)
        assert done is not None and done["status"] == "cancelled", \
            f"call {call_id} not cancelled within 10 s: {done}"


def _register(daemon: DaemonProcess, name: str) -> Credentials:
    return KeyStore(daemon.state_dir / "keys").register(name, daemon.endpoint, replace=True)


def _counter(daemon: DaemonProcess, name: str) -> int:
    with daemon.client() as admin:
        return int(admin.status()["counters"].get(name, 0))


def test_daemon_budget_refuses_overloaded_then_is_released(daemon: DaemonProcess,
                                                            emu: EmulatorClient) -> None:
    one = len(encode(_request("a-1")))  # the request's encoding; the frame adds an envelope
    refused_before = _counter(daemon, "refused_bytes.in_flight_bytes_max")
    with daemon.client() as client:
        first = _submit_stalled(client, emu, "a-1")
        second = _submit_stalled(client, emu, "a-2")
        calls = _held(client)  # the admin's view
        assert 2 * one <= calls["in_flight_bytes"] <= 2 * (one + 500), calls
        assert calls["in_flight_bytes_max"] == BUDGET, calls
        assert calls["in_flight_bytes_by_owner"] == {"local": calls["in_flight_bytes"]}, calls

        exc = _refusal(client, _request("a-never"))
        assert exc.code == "overloaded", exc
        assert exc.message.startswith("accepted calls hold 19."), exc.message
        assert "(in_flight_bytes_max 24.4 KiB); retry later" in exc.message, exc.message
        exc = _refusal(client, _request("a-never", size=BUDGET))  # it could never fit
        assert exc.code == "overloaded", exc
        assert "more than in_flight_bytes_max (24.4 KiB)" in exc.message, exc.message
        assert "can never be accepted" in exc.message, exc.message

        _end(client, first, second)
        assert _held(client)["in_flight_bytes"] == 0  # released with the done
        again = client.submit("emu", _request("a-after"), subscribe=False)
        done = client.result(again, wait_s=10.0)
        assert done is not None and done["status"] == "completed", done
        calls = _held(client)
        assert calls["in_flight_bytes"] == 0 and calls["in_flight_bytes_by_owner"] == {}, calls
    assert emu.log("a-never") == []  # refused before the provider
    assert _counter(daemon, "refused_bytes.in_flight_bytes_max") == refused_before + 2


def test_identity_budget_refuses_too_many_calls_others_go_on(daemon: DaemonProcess,
                                                             emu: EmulatorClient) -> None:
    refused_before = _counter(daemon, "refused_bytes.max_in_flight_bytes")
    heavy, light = _register(daemon, "heavy"), _register(daemon, "light")
    with Client(daemon.endpoint, credentials=heavy, timeout_s=10.0) as h, \
            Client(daemon.endpoint, credentials=light, timeout_s=10.0) as lt:
        held = _submit_stalled(h, emu, "b-heavy")
        exc = _refusal(h, _request("b-never"))
        assert exc.code == "too_many_calls", exc
        assert exc.message.startswith("calls of 'heavy' not done yet hold 9."), exc.message
        assert "(max_in_flight_bytes 14.6 KiB); submit again when one ends" in exc.message, \
            exc.message
        other = _submit_stalled(lt, emu, "b-light")  # another identity is still accepted

        mine = _held(h)  # a client sees its own figures only
        assert mine["max_in_flight_bytes"] == HEAVY_MAX, mine
        assert len(encode(_request("b-heavy"))) <= mine["in_flight_bytes"] < HEAVY_MAX, mine
        assert "in_flight_bytes_by_owner" not in mine, mine
        with daemon.client() as admin:
            calls = admin.status()["calls"]
        owners = calls["in_flight_bytes_by_owner"]
        assert set(owners) == {"heavy", "light"}, calls
        assert owners["heavy"] == mine["in_flight_bytes"], calls
        assert calls["in_flight_bytes"] == sum(owners.values()), calls

        _end(h, held)
        _end(lt, other)
        again = h.submit("emu", _request("b-after"), subscribe=False)  # heavy's budget is back
        done = h.result(again, wait_s=10.0)
        assert done is not None and done["status"] == "completed", done
    assert emu.log("b-never") == []
    assert _counter(daemon, "refused_bytes.max_in_flight_bytes") == refused_before + 1


def test_identity_byte_rate_refuses_rate_limited_with_the_wait(daemon: DaemonProcess,
                                                               emu: EmulatorClient) -> None:
    """`submit_bytes_per_s`: a burst of one request, then `rate_limited` naming
    the wait, answered when the wait is over; another identity is not slowed."""
    refused_before = _counter(daemon, "refused_bytes.submit_bytes_per_s")
    trickle = _register(daemon, "trickle")
    with Client(daemon.endpoint, credentials=trickle, timeout_s=10.0) as t:
        emu.script("c-first", [{"fault": "ok", "chunks": 2}])
        first = t.submit("emu", _request("c-first"), subscribe=False)
        asked = time.monotonic()
        exc = _refusal(t, _request("c-never"))
        # Throttled as Kafka does: the refusal comes when the wait is over (at
        # most 1 s), so a client that waits for replies keeps to its quota.
        assert time.monotonic() - asked >= 0.9, "the rate refusal was not held back"
        assert exc.code == "rate_limited", exc
        assert exc.message.startswith("'trickle' may submit 4.8 KiB of requests per second "
                                      "(submit_bytes_per_s); retry in "), exc.message
        wait_s = float(exc.message.rsplit("retry in ", 1)[1].rstrip("s"))
        assert 1.0 < wait_s <= 2.5, exc.message  # ~10 KB at 5 KB/s
        done = t.result(first, wait_s=10.0)
        assert done is not None and done["status"] == "completed", done
    with daemon.client() as admin:  # the local identity's default rate is 4 MiB/s
        emu.script("c-other", [{"fault": "ok", "chunks": 2}])
        admin.submit("emu", _request("c-other"), subscribe=False)
    assert emu.log("c-never") == []
    assert _counter(daemon, "refused_bytes.submit_bytes_per_s") == refused_before + 1


def test_a_large_submit_over_a_limit_is_refused_before_it_is_read(daemon: DaemonProcess) -> None:
    """A frame of 100 KB whose body after its first bytes is not even msgpack:
    decoded, it would be `bad_frame`; it is refused `overloaded` with its ref,
    from its size and its first bytes alone."""
    prefix = encode({"v": 1, "op": "submit", "ref": "early-1"})[1:]  # the map's pairs
    frame = b"\x84" + prefix + encode("call") + b"\xc1" * 100_000  # 0xc1: never valid
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = daemon.socket(ctx)
    try:
        sock.send(frame)
        assert sock.poll(10_000), "no reply to a 100 KB submit over the budget within 10 s"
        reply = msgpack.unpackb(sock.recv())
    finally:
        sock.close(linger=0)
    assert (reply["op"], reply["ref"], reply["code"]) == ("error", "early-1", "overloaded"), reply
    assert "can never be accepted" in reply["message"], reply


class _Sink:
    """The sink's side of `finish`: stores the done at once."""

    def finish(self, call_id: str, status: Any, error: Any, attempts: int, meta: Any,
               reply: Any) -> None:
        reply(Finished({"v": 1, "op": "done", "call_id": call_id, "status": status.value}, {}))


class _Clients:
    def on_call_done(self, call_id: str, done: Any, diagnostics: Any) -> None:
        pass


def test_recovered_calls_count_until_done(tmp_path: Path) -> None:
    """A call recovered from the journal at start (the path `Daemon._build`
    takes: recover_calls, then enqueue) holds its request's bytes, measured
    as its encoding, until it is done; in process, to spare a daemon restart."""
    journal = Journal(str(tmp_path / "journal.db"))
    request = _request("c-survivor")
    for call_id, owner in (("c1", "alice"), ("c2", "alice"), ("c3", "bob")):
        journal.add_call(call_id, owner, None, None, "emu", request, {})
    journal.commit()
    profiles = {"emu": ProviderProfile(name="emu", kind="openai")}
    driver = AttemptDriver(DaemonConfig(providers=profiles), journal, cast(Any, None),
                           cast(Any, _Sink()), cast(Any, _Clients()), cast(Any, None), Counter(),
                           time.monotonic, random.Random(0), str(tmp_path / "transcript.db"))
    for call in recover_calls(journal, profiles, {}, str(tmp_path / "transcript.db")):
        driver.enqueue(call)
    one = len(encode(request))
    assert (driver.calls.in_flight_bytes(), driver.calls.in_flight_bytes("alice"),
            driver.calls.in_flight_bytes("bob")) == (3 * one, 2 * one, one)
    assert driver.calls.status()["in_flight_bytes_by_owner"] == {"alice": 2 * one, "bob": one}
    driver.cancel("c1")  # a queued call: finished at once
    assert (driver.calls.in_flight_bytes(), driver.calls.in_flight_bytes("alice")) == (2 * one, one)
    driver.cancel("c2")
    driver.cancel("c3")
    assert driver.calls.in_flight_bytes() == 0
    assert driver.calls.status()["in_flight_bytes_by_owner"] == {}
    journal.close()


# ---- configuration --------------------------------------------------------------------


def test_defaults() -> None:
    cfg = parse_config({"identities": {"alice": {}}})
    assert cfg.in_flight_bytes_max == 256 * 1024 * 1024
    assert cfg.identities["alice"].max_in_flight_bytes == 64 * 1024 * 1024
    cfg = parse_config({"daemon": {"in_flight_bytes_max": 0},
                        "identities": {"alice": {"max_in_flight_bytes": 0}}})
    assert cfg.in_flight_bytes_max == 0 and cfg.identities["alice"].max_in_flight_bytes == 0


@pytest.mark.parametrize(("value", "error"), [
    (-1, "f.toml: daemon.in_flight_bytes_max: must not be negative"),
    (1.5, "f.toml: daemon.in_flight_bytes_max: expected int, got float"),
    (True, "f.toml: daemon.in_flight_bytes_max: expected int, got a boolean"),
    ("1", "f.toml: daemon.in_flight_bytes_max: expected int, got str"),
])
def test_daemon_key_is_checked(value: Any, error: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"daemon": {"in_flight_bytes_max": value}}, "f.toml")
    assert str(info.value) == error


@pytest.mark.parametrize(("value", "error"), [
    (-1, "f.toml: identities.alice.max_in_flight_bytes: must be a number >= 0, got -1"),
    (1.5, "f.toml: identities.alice.max_in_flight_bytes: must be a whole number, got 1.5"),
    (True, "f.toml: identities.alice.max_in_flight_bytes: must be a number >= 0, got True"),
    ("1", "f.toml: identities.alice.max_in_flight_bytes: must be a number >= 0, got '1'"),
])
def test_identity_key_is_checked(value: Any, error: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"identities": {"alice": {"max_in_flight_bytes": value}}}, "f.toml")
    assert str(info.value) == error


def test_environment_override() -> None:
    cfg = apply_env(parse_config({}), {"STREAMFENCE_IN_FLIGHT_BYTES_MAX": "1000"})
    assert cfg.in_flight_bytes_max == 1000
    for raw, error in (("-5", "must not be negative"), ("lots", "expected int")):
        with pytest.raises(ConfigError) as info:
            apply_env(parse_config({}), {"STREAMFENCE_IN_FLIGHT_BYTES_MAX": raw})
        assert str(info.value).startswith("environment STREAMFENCE_IN_FLIGHT_BYTES_MAX: ")
        assert error in str(info.value), info.value
