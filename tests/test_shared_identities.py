"""The pieces of the cluster's shared identities that need no cluster: the key
store's file of the other hosts' keys (read with the allow-list, never a
local identity) and the bucket's entries as read (anything not written by
`IdentityBucket.publish` is ignored). End to end: test_cluster_identities.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import msgpack
import pytest
import zmq

from streamfence.cluster.identities import SharedKey, bucket_key, parse_entry
from streamfence.protocol.keys import SHARED_FILE, KeyStore, KeyStoreError


def _public() -> bytes:
    return zmq.curve_keypair()[0]


def test_the_other_hosts_keys_are_accepted_beside_this_host_s_own(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / "keys")
    alice = store.register("alice", "ipc:///x")
    remote = _public()
    store.share({remote: "bob", alice.public_key: "mallory"})
    assert store.identity_of(remote) == "bob"
    assert store.identity_of(alice.public_key) == "alice"  # this host's own name wins
    assert store.names() == ["alice"]  # `keys list`: this host's identities
    assert store.local_keys() == {alice.public_key: "alice"}
    with pytest.raises(KeyStoreError):
        store.revoke("bob")  # revoked on the host that registered it
    store.share({})
    assert store.identity_of(remote) is None
    store.share({remote: "bob"})
    store.forget_shared()
    assert store.identity_of(remote) is None


def test_a_damaged_file_of_shared_keys_accepts_none_of_its_bad_entries(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = KeyStore(tmp_path / "keys")
    store.server_keys()
    shared = store.clients_dir / SHARED_FILE
    good = _public()
    shared.write_text(json.dumps({good.decode(): "bob", "not a key": "eve",
                                  _public().decode(): "../x", "~" * 40: "eve"}))
    assert dict(store.allow_list()) == {good: "bob"}
    shared.write_text("{not json")
    with caplog.at_level(logging.WARNING, "streamfence.auth"):
        assert KeyStore(tmp_path / "keys").identity_of(good) is None
    assert "the cluster's keys are refused" in caplog.text


def test_an_entry_is_read_only_as_this_module_writes_it() -> None:
    public = _public()
    key = bucket_key("host-a", public)
    value = msgpack.packb({"name": "alice", "public_key": public.decode()})
    assert parse_entry(key, value) == SharedKey("host-a", "alice", public)
    assert parse_entry(bucket_key("host-a", _public()), value) is None  # another key's value
    for bad in (b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"name": "alice"}),
                msgpack.packb({"name": "../x", "public_key": public.decode()}),
                msgpack.packb({"name": "alice", "public_key": " " * 40})):
        assert parse_entry(key, bad) is None, bad
