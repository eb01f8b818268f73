"""The pure parts of connection errors and key-change logs: client_monitor.LinkWatch
fed the event sequences libzmq 4.3 reports (recorded against real sockets), and
keys.key_changes; then the two handshake refusals a daemon test cannot reach
cheaply (a daemon without CURVE, one at its connection cap), with real sockets
and pyzmq's real ZAP authenticator."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from time import monotonic

import pytest
import zmq

from streamfence.protocol.client import AsyncClient, Client
from streamfence.protocol.client_monitor import (
    DROPS_TO_TELL,
    KEY_REFUSED,
    NO_CREDENTIALS,
    NO_DAEMON,
    NO_DAEMON_AFTER_S,
    NOT_CURVE,
    WRONG_DAEMON,
    LinkWatch,
    NoConnection,
)
from streamfence.protocol.credentials import Credentials
from streamfence.protocol.keys import KeyStore, key_changes, make_curve_server, start_authenticator
from tests.harness import wait_until

EP = "tcp://127.0.0.1:7755"
KEY = b"x" * 40
ALICE = Credentials("alice", EP, KEY, KEY, KEY)
RETRY = (zmq.EVENT_CONNECT_RETRIED, 0)
CONNECTED = (zmq.EVENT_CONNECTED, 20)
UP = (zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)
MISMATCH = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
DROPPED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32)


def watched(creds: Credentials | None, *events: tuple[int, int]) -> LinkWatch:
    watch = LinkWatch(EP, creds)
    for event, value in events:
        watch.saw(event, value)
    return watch


def failure(watch: LinkWatch, waited_s: float = 10.0) -> NoConnection | None:
    try:
        watch.check(0.0, waited_s)
    except NoConnection as exc:
        return exc
    return None


def test_nothing_listening_fails_only_after_the_grace() -> None:
    watch = watched(None, RETRY, RETRY)
    assert failure(watch, NO_DAEMON_AFTER_S / 2) is None
    exc = failure(watch)
    assert exc is not None and exc.cause == NO_DAEMON and isinstance(exc, TimeoutError)
    assert str(exc).startswith(f"no daemon at {EP}: nothing accepts connections there")
    assert watch.wake_at(0.0, 10.0, 0.1) == NO_DAEMON_AFTER_S
    assert watch.wake_at(0.0, 10.0, NO_DAEMON_AFTER_S) == 10.0  # no spinning after it


def test_a_handshake_in_progress_is_waited_for_without_spinning() -> None:
    watch = watched(ALICE, CONNECTED)
    assert failure(watch) is None
    assert watch.wake_at(0.0, 10.0, 0.1) == NO_DAEMON_AFTER_S
    assert watch.wake_at(0.0, 10.0, 2.0) == 10.0


def test_a_daemon_that_comes_up_clears_no_daemon() -> None:
    assert failure(watched(None, RETRY, CONNECTED)) is None
    watch = watched(None, RETRY, CONNECTED, UP)
    assert watch.up and failure(watch) is None and watch.wake_at(0.0, 10.0, 0.1) == 10.0


@pytest.mark.parametrize(("creds", "events", "cause", "text"), [
    (ALICE, [CONNECTED, (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)], KEY_REFUSED,
     "refused the credentials of 'alice': their key is not registered"),
    (None, [CONNECTED, MISMATCH], NO_CREDENTIALS,
     "takes only CURVE clients, and this client has no credentials: pass credentials=PATH"),
    (ALICE, [CONNECTED, MISMATCH], NOT_CURVE, "does not use CURVE"),
    # a wrong server key: dropped without detail, then retried; a retry after a
    # connection is not "nothing listens"
    (ALICE, [CONNECTED, DROPPED, RETRY] * DROPS_TO_TELL, WRONG_DAEMON,
     "is not the one the credentials of 'alice' were made for"),
    # over ipc://, a mechanism mismatch is often first a drop, or two
    (ALICE, [CONNECTED, DROPPED, RETRY, CONNECTED, MISMATCH], NOT_CURVE, "does not use CURVE"),
    (None, [CONNECTED, DROPPED, RETRY, CONNECTED, MISMATCH], NO_CREDENTIALS,
     "this client has no credentials"),
    (None, [CONNECTED, DROPPED, RETRY] * 2, NO_CREDENTIALS, "this client has no credentials"),
])
def test_a_refused_handshake_fails_at_once(creds: Credentials | None,
                                           events: list[tuple[int, int]], cause: str,
                                           text: str) -> None:
    exc = failure(watched(creds, *events), waited_s=0.0)
    assert exc is not None and exc.cause == cause and text in str(exc), exc


def test_one_dropped_handshake_is_not_yet_a_verdict() -> None:
    assert failure(watched(ALICE, CONNECTED, DROPPED, RETRY)) is None


def test_credentials_of_another_endpoint_say_so() -> None:
    other = Credentials("alice", "tcp://10.0.0.1:7755", KEY, KEY, KEY)
    for events in ([RETRY], [CONNECTED, DROPPED, RETRY] * DROPS_TO_TELL):
        exc = failure(watched(other, *events))
        assert exc is not None and "made for tcp://10.0.0.1:7755" in str(exc), exc


def test_key_changes_name_identities_never_keys() -> None:
    before = {b"k1": "alice", b"k2": "bob", b"k3": "carol"}
    after = {b"k1": "alice", b"k4": "bob", b"k5": "dave"}
    assert key_changes(before, after) == [("bob", "rotated"), ("carol", "revoked"),
                                          ("dave", "added")]
    assert key_changes(after, after) == []


# ---- real sockets: a daemon without CURVE, a daemon at its cap, a late request ----------

@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def router(context: zmq.Context[zmq.Socket[bytes]]) -> Iterator[zmq.Socket[bytes]]:
    """A daemon's side: held here and closed at teardown (a socket a test
    leaves to the garbage collector warns in whichever test comes next)."""
    sock = context.socket(zmq.ROUTER)
    sock.linger = 0
    yield sock
    sock.close()


def _status_failure(client: Client) -> NoConnection:
    t0 = monotonic()
    with client, pytest.raises(NoConnection) as caught:
        client.status()
    took = monotonic() - t0
    print(f"{caught.value.cause} after {took:.3f} s: {caught.value}")
    assert took < 3.0, f"{caught.value.cause} took {took:.2f} s"
    return caught.value


def test_credentials_for_a_daemon_without_curve(context: zmq.Context[zmq.Socket[bytes]],
                                                router: zmq.Socket[bytes],
                                                tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    creds = KeyStore(tmp_path / "keys").register("alice", endpoint)
    exc = _status_failure(Client(endpoint, 10.0, credentials=creds, context=context))
    assert exc.cause == NOT_CURVE and "connect without them" in str(exc)


def test_a_daemon_at_its_connection_cap_says_so(context: zmq.Context[zmq.Socket[bytes]],
                                                router: zmq.Socket[bytes],
                                                tmp_path: Path) -> None:
    store = KeyStore(tmp_path / "keys")
    auth = start_authenticator(context, store)
    try:
        server = router
        make_curve_server(server, store)
        endpoint = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
        creds = store.register("alice", endpoint)
        auth.full = True
        exc = _status_failure(Client(endpoint, 10.0, credentials=creds, context=context))
        assert exc.cause == KEY_REFUSED and "connection cap (max_connections)" in str(exc)
        assert auth.refused_full == 1 and auth.refused == 0
    finally:
        auth.stop()


def test_a_store_that_logs_changes_names_each_once(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    store = KeyStore(tmp_path / "keys", log_changes=True)
    alice = store.register("alice", EP)
    caplog.set_level("INFO", logger="streamfence.auth")
    store.allow_list()
    store.register("bob", EP)
    store.allow_list()
    store.register("alice", EP, replace=True)
    store.revoke("bob")
    store.allow_list()
    store.allow_list()  # nothing new: nothing logged
    assert [r.getMessage() for r in caplog.records] == [
        "client keys: registered identities: alice",
        "client keys: identity 'bob' added (applies from its next handshake and message)",
        "client keys: identity 'alice' rotated (applies from its next handshake and message)",
        "client keys: identity 'bob' revoked (applies from its next handshake and message)"]
    assert alice.public_key.decode() not in caplog.text


def test_a_request_made_after_the_refusal_fails_at_once_too(
        context: zmq.Context[zmq.Socket[bytes]], router: zmq.Socket[bytes],
        tmp_path: Path) -> None:
    """libzmq drops the queue of a refused connection: a send after that would
    block for timeout_s (the sync client's SNDTIMEO; the async one retries)."""
    store = KeyStore(tmp_path / "keys")
    auth = start_authenticator(context, store)
    try:
        server = router
        make_curve_server(server, store)
        endpoint = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
        creds = store.register("alice", endpoint)
        store.revoke("alice")
        client = Client(endpoint, 10.0, credentials=creds, context=context)
        wait_until(lambda: auth.refused >= 1, 10, "the daemon to refuse alice's handshake")
        assert _status_failure(client).cause == KEY_REFUSED

        async def main() -> None:
            aclient = AsyncClient(endpoint, 10.0, credentials=creds, context=context)
            wait_until(lambda: auth.refused >= 2, 10, "the daemon to refuse it again")
            t0 = monotonic()
            with aclient, pytest.raises(NoConnection) as caught:
                await aclient.status()
            assert caught.value.cause == KEY_REFUSED and monotonic() - t0 < 3.0
        asyncio.run(main())
    finally:
        auth.stop()
