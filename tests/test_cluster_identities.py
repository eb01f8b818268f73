"""Identities shared through the cluster (ARCHITECTURE §4.17, docs/SECURITY.md),
on two real daemons and a real 3-node NATS JetStream cluster: a client key
registered on host A is accepted by host B (a real client with that key
submits to B and gets its answer), a revocation on A is refused by B within
a lease, a host that starts learns the others' keys, and the bucket holds
public keys only."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import nats as nats_py
import pytest
from click.testing import CliRunner
from zmq.utils import z85

from streamfence.cli import main
from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.devtools.nats_cluster import NatsCluster
from streamfence.protocol.client import Client
from streamfence.protocol.credentials import Credentials, load_credentials
from streamfence.protocol.keys import KeyStore
from tests.harness import DaemonProcess, stopped, tree_of, wait_until
from tests.wires import profile_for

pytestmark = pytest.mark.slow
LEASE_S = 3.0
PROBE_S = 0.5  # a refused key gets no answer: a probe's wait for one


def _host(tmp_path: Path, emulator: EmulatorProcess, nats: NatsCluster,
          name: str) -> DaemonProcess:
    return DaemonProcess(tmp_path / name, {"emu": profile_for("openai", emulator)},
                         tables={"cluster": {"urls": nats.urls, "host": name, "replicas": 3,
                                             "lease_s": LEASE_S}})


def _keys(host: DaemonProcess) -> KeyStore:
    return KeyStore(host.state_dir / "keys")


def _for(creds: Credentials, host: DaemonProcess) -> Credentials:
    """`creds`' key pair, speaking to `host`: its endpoint and its server's
    public key (each host has its own server key pair)."""
    server_public, _ = _keys(host).server_keys()
    return replace(creds, endpoint=host.endpoint, server_key=server_public)


def _accepted(host: DaemonProcess, creds: Credentials) -> bool:
    """Whether `host` answers a client with these credentials (a revoked or
    unknown key gets no answer at all)."""
    with Client(host.endpoint, timeout_s=PROBE_S, credentials=creds) as client:
        try:
            client.status()
        except TimeoutError:
            return False
    return True


def _request(key: str) -> dict[str, Any]:
    return {"model": f"gpt-emu#{key}", "messages": [{"role": "user", "content": "hi"}]}


def _bucket(nats: NatsCluster) -> list[tuple[str, bytes, dict[str, str]]]:
    """Every message the identities' bucket stream holds, raw: (subject,
    data, headers), in order."""
    async def read() -> list[tuple[str, bytes, dict[str, str]]]:
        nc = await nats_py.connect(servers=nats.urls)
        try:
            js = nc.jetstream()
            state = (await js.stream_info("KV_sf_identities")).state
            out = []
            for seq in range(state.first_seq, state.last_seq + 1):
                try:
                    msg = await js.get_msg("KV_sf_identities", seq)
                except nats_py.js.errors.NotFoundError:
                    continue  # replaced since the stream's info (the bucket keeps the last)
                out.append((str(msg.subject), bytes(msg.data or b""),
                            {str(k): str(v) for k, v in (msg.headers or {}).items()}))
            return out
        finally:
            await nc.close()
    return asyncio.run(read())


def _published(nats: NatsCluster, public_key: bytes) -> bool:
    """Whether the bucket's last word on `public_key` is a value (not a deletion)."""
    last: dict[str, bool] = {}
    for subject, data, headers in _bucket(nats):
        if public_key in data or subject in last:
            last[subject] = "KV-Operation" not in headers
    return any(last.values())


def test_a_key_registered_on_one_host_is_accepted_on_another_until_revoked(
        tmp_path: Path, emulator: EmulatorProcess, emu: EmulatorClient,
        nats: NatsCluster) -> None:
    emu.script("shared", [{"fault": "ok", "chunks": 3, "text": "hello from b"}])
    a = _host(tmp_path, emulator, nats, "host-a").start()
    b = _host(tmp_path, emulator, nats, "host-b").start()
    try:
        runner = CliRunner()  # as an operator would: `keys new` on a, `keys for-host` for b
        made = runner.invoke(main, ["keys", "new", "alice", "--config", str(a.config_path)])
        assert made.exit_code == 0, made.output
        alice = load_credentials(_keys(a).credentials_path("alice"))
        made = runner.invoke(main, ["keys", "for-host", str(_keys(a).credentials_path("alice")),
                                    "--config", str(b.config_path),
                                    "--out", str(tmp_path / "alice-b.credentials")])
        assert made.exit_code == 0, made.output
        on_b = load_credentials(tmp_path / "alice-b.credentials")
        assert on_b == _for(alice, b)
        wait_until(lambda: _accepted(b, on_b), 15, "host b to accept alice's key from host a")
        with Client(b.endpoint, timeout_s=10.0, credentials=on_b) as client:
            stream = client.stream_text("emu", _request("shared"))
            assert "".join(stream) == "hello from b"
            done = client.result(stream.call_id or "", wait_s=5.0)
        assert done is not None and done["status"] == "completed", done

        values = [data + repr(headers).encode() for _, data, headers in _bucket(nats)]
        assert any(alice.public_key in v for v in values), values  # not vacuous
        secrets = [alice.secret_key, z85.decode(alice.secret_key),
                   *(s for h in (a, b) for s in [_keys(h).server_keys()[1]])]
        for value in values:
            for secret in secrets:
                assert secret not in value, "a secret key is in the cluster's bucket"

        _keys(a).revoke("alice")
        wait_until(lambda: not _accepted(b, on_b), LEASE_S,
                   "host b to refuse alice's revoked key within a lease")
        with b.client() as admin:
            assert admin.status()["counters"]["auth_refused"] >= 1
        assert not _accepted(a, alice)
    finally:
        for proc in (a, b):
            proc.cleanup()


def test_a_host_that_starts_or_wakes_sees_the_cluster_s_keys_as_they_are_now(
        tmp_path: Path, emulator: EmulatorProcess, nats: NatsCluster) -> None:
    """Host B down while bob is registered on A: B accepts bob from its start.
    Host B frozen (SIGSTOP) while bob is revoked on A and that is published: B, woken,
    refuses bob (the revocation wins, nothing of B brings the key back), and
    goes on accepting carol, registered meanwhile."""
    a = _host(tmp_path, emulator, nats, "host-a").start()
    b = _host(tmp_path, emulator, nats, "host-b")
    try:
        bob = _keys(a).register("bob", a.endpoint)
        b.start()
        wait_until(lambda: _accepted(b, _for(bob, b)), LEASE_S, "host b to accept bob at start")

        with stopped(tree_of(b)):
            _keys(a).revoke("bob")
            carol = _keys(a).register("carol", a.endpoint)
            wait_until(lambda: not _published(nats, bob.public_key)
                       and _published(nats, carol.public_key), LEASE_S,
                       "host a to publish bob's revocation and carol's key")
        wait_until(lambda: not _accepted(b, _for(bob, b)), LEASE_S,
                   "woken host b to refuse bob within a lease")
        wait_until(lambda: _accepted(b, _for(carol, b)), LEASE_S,
                   "woken host b to accept carol")
    finally:
        for proc in (a, b):
            proc.cleanup()


def test_a_host_cut_off_from_the_cluster_refuses_the_other_hosts_keys_within_a_lease(
        tmp_path: Path, emulator: EmulatorProcess, nats: NatsCluster) -> None:
    """Fail closed: every NATS node frozen (SIGSTOP), host B cannot hear of a
    revocation, so within a lease it refuses the keys of other hosts (not its
    own); the cluster back, it accepts them again."""
    a = _host(tmp_path, emulator, nats, "host-a").start()
    b = _host(tmp_path, emulator, nats, "host-b").start()
    nodes: list[int] = []
    try:
        dave = _keys(a).register("dave", a.endpoint)
        erin = _keys(b).register("erin", b.endpoint)
        wait_until(lambda: _accepted(b, _for(dave, b)), LEASE_S, "host b to accept dave")

        nodes = [nats.pid(i) for i in range(3)]
        for pid in nodes:
            os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: not _accepted(b, _for(dave, b)), LEASE_S + PROBE_S,
                   "host b, cut off, to refuse host a's key within a lease")
        assert _accepted(b, erin) and _accepted(a, dave)  # each host's own keys stand
        assert any("no read of the shared identities" in r.get("message", "")
                   for r in b.log_records())

        for pid in nodes:
            os.kill(pid, signal.SIGCONT)
        nodes = []
        wait_until(lambda: _accepted(b, _for(dave, b)), 30,
                   "host b to accept dave again once the cluster is back")
    finally:
        for pid in nodes:
            os.kill(pid, signal.SIGCONT)
        for proc in (a, b):
            proc.cleanup()
