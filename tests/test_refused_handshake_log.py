"""Refused CURVE handshakes are counted, and logged at most once per
REFUSED_LOG_EVERY_S with the count since the last line: a client retrying with
an unregistered key cannot flood the log (issue 29 item 8: 648 lines for 648
handshakes). Real ZAP thread, real CURVE sockets."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import zmq

from streamfence.protocol.keys import KeyStore, make_curve_server, start_authenticator
from tests.harness import wait_until

HANDSHAKES = 40


def test_many_refused_handshakes_write_one_warning_with_their_count(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = KeyStore(tmp_path / "keys")
    server_public, _ = store.server_keys()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    auth = start_authenticator(ctx, store)
    server = ctx.socket(zmq.ROUTER)
    server.linger = 0
    make_curve_server(server, store)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    caplog.set_level(logging.WARNING, logger="streamfence.auth")
    clients = []
    try:
        for _ in range(HANDSHAKES):  # each a new client with a key nobody registered
            public, secret = zmq.curve_keypair()
            client = ctx.socket(zmq.DEALER)
            client.linger = 0
            client.curve_serverkey = server_public
            client.curve_publickey = public
            client.curve_secretkey = secret
            client.connect(f"tcp://127.0.0.1:{port}")
            client.send(b"hello")
            clients.append(client)
        wait_until(lambda: auth.refused >= HANDSHAKES, 30,
                   f"ZAP to refuse {HANDSHAKES} handshakes")
    finally:
        for client in clients:
            client.close(linger=0)
        server.close(linger=0)
        auth.stop()
        ctx.destroy(linger=0)
    lines = [r.getMessage() for r in caplog.records if "unregistered key" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("refused 1 CURVE handshake(s) with an unregistered key"), lines
