"""CURVE + ZAP with real sockets: the key store's allow-list decides who may
speak, and names the identity of every message (streamfence.protocol.keys)."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from streamfence.protocol.credentials import (
    Credentials,
    CredentialsError,
    load_credentials,
)
from streamfence.protocol.keys import (
    KeyStore,
    KeyStoreError,
    make_curve_server,
    start_authenticator,
)

WAIT_MS = 2000


@pytest.fixture
def store(tmp_path: Path) -> KeyStore:
    return KeyStore(tmp_path / "keys")


@pytest.fixture
def server(store: KeyStore) -> Iterator[tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes], str]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    auth = start_authenticator(ctx, store)
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    make_curve_server(sock, store)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield ctx, sock, f"tcp://127.0.0.1:{port}"
    finally:
        auth.stop()
        ctx.destroy(linger=0)


def _client(ctx: zmq.Context[zmq.Socket[bytes]], creds: Credentials, endpoint: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    creds.apply(sock)
    sock.connect(endpoint)
    return sock


def _identity_of_next(sock: zmq.Socket[bytes], store: KeyStore) -> str | None:
    """The identity of the next message's key, or None if none arrives in time."""
    if not sock.poll(WAIT_MS):
        return None
    frames = sock.recv_multipart(copy=False)
    return store.identity_of(str(frames[-1].get("User-Id")).encode()) or "unregistered key"


def test_registered_client_is_heard_and_named(server, store: KeyStore) -> None:  # type: ignore[no-untyped-def]
    ctx, sock, endpoint = server
    alice = _client(ctx, store.register("alice", endpoint), endpoint)
    alice.send(b"hello")
    assert _identity_of_next(sock, store) == "alice"
    alice.close()


@pytest.mark.slow
def test_unregistered_forged_and_revoked_keys_are_refused(server, store: KeyStore) -> None:  # type: ignore[no-untyped-def]
    ctx, sock, endpoint = server
    bob = store.register("bob", endpoint)
    stranger_pub, stranger_sec = zmq.curve_keypair()
    stranger = Credentials("stranger", endpoint, bob.server_key, stranger_pub, stranger_sec)
    forged = Credentials("bob", endpoint, bob.server_key, bob.public_key, stranger_sec)
    for creds in (stranger, forged):
        client = _client(ctx, creds, endpoint)
        with contextlib.suppress(zmq.Again):  # a refused DEALER may never connect
            client.send(b"let me in", zmq.NOBLOCK)
        assert _identity_of_next(sock, store) is None, f"{creds.name}'s message got through"
        client.close()
    store.revoke("bob")
    client = _client(ctx, bob, endpoint)
    with contextlib.suppress(zmq.Again):
        client.send(b"still me", zmq.NOBLOCK)
    assert _identity_of_next(sock, store) is None, "a revoked key got through"
    client.close()


def test_files_are_private_and_credentials_round_trip(store: KeyStore, tmp_path: Path) -> None:
    creds = store.register("carol", "tcp://127.0.0.1:1")
    assert load_credentials(store.credentials_path("carol")) == creds
    assert "secret" not in repr(creds) and creds.secret_key.decode() not in repr(creds)
    for path in [store.dir, store.clients_dir, *store.dir.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o077 == 0, f"{path} is {mode:o}"
    os.chmod(store.credentials_path("carol"), 0o644)
    with pytest.raises(CredentialsError, match="chmod 600"):
        load_credentials(store.credentials_path("carol"))


@pytest.mark.parametrize("bad", ["~" * 40, "," * 40, "0" * 39 + "_"])
def test_a_key_that_is_not_z85_is_a_credentials_error(store: KeyStore, bad: str) -> None:
    """Not a KeyError from the decoder: a character outside Z85's alphabet."""
    path = store.credentials_path("dave")
    store.register("dave", "tcp://127.0.0.1:1")
    text = path.read_text()
    secret = load_credentials(path).secret_key.decode()
    path.write_text(text.replace(secret, bad))
    with pytest.raises(CredentialsError, match="secret_key is not Z85"):
        load_credentials(path)


def test_names_are_checked_and_not_replaced_by_accident(store: KeyStore) -> None:
    with pytest.raises(KeyStoreError, match="identity name"):
        store.register('x"; evil', "tcp://127.0.0.1:1")
    first = store.register("dave", "tcp://127.0.0.1:1")
    with pytest.raises(KeyStoreError, match="already has a key"):
        store.register("dave", "tcp://127.0.0.1:1")
    rotated = store.register("dave", "tcp://127.0.0.1:1", replace=True)
    assert rotated.public_key != first.public_key
    assert store.identity_of(first.public_key) is None
    assert store.identity_of(rotated.public_key) == "dave"
    assert store.names() == ["dave"]
