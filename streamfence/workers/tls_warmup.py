"""One TLS handshake of the process with itself, over a socketpair, in a new
spare's warm-up (workers/warmup.py): a forked worker's first
handshake touches OpenSSL's state and its own pages for the first time, and
a retry lands on a never-used spare, so that cost sat on the retry's path
to its provider (measured in the daemon's workers: the first handshake with
the emulator's TLS port 2.25 ms of CPU, 1.3-1.5 after this; kill -> the
retry's request over TLS 7.90 -> 6.76 ms; docs/PERFORMANCE.md, "Issue 32:
TLS"). In the zygote before it forks it gained nothing measurable: its own
warm-up already sets OpenSSL up.

warmup.pem holds the certificate and key the handshake's server side uses.
They are not a secret: they protect nothing, and only this handshake of a
process with itself trusts them (the client side is given the certificate,
not the system's store). ECDSA P-256, as the providers' fronts serve, valid
2000-2999 so that no clock makes them fail."""

from __future__ import annotations

import socket
import ssl
import threading
from pathlib import Path

NAME = "streamfence-warm-up"  # the certificate's subject and its only name
TIMEOUT_S = 5.0
PEM = Path(__file__).with_name("warmup.pem")  # a file: load_cert_chain reads no memory


def handshake_with_itself(timeout_s: float = TIMEOUT_S) -> None:
    """A full handshake, a server thread against this thread's client; raises
    what either side met (OSError, ssl.SSLError)."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(PEM)
    client = ssl.create_default_context(cafile=PEM)  # takes the certificate, skips the key
    failed: list[BaseException] = []
    ours, theirs = socket.socketpair()
    for end in (ours, theirs):
        end.settimeout(timeout_s)

    def serve() -> None:
        try:
            with server.wrap_socket(theirs, server_side=True):
                pass
        except (OSError, ssl.SSLError) as exc:
            failed.append(exc)
        finally:
            theirs.close()

    thread = threading.Thread(target=serve, name="tls-warm-up", daemon=True)
    thread.start()
    try:
        with client.wrap_socket(ours, server_hostname=NAME):
            pass
    finally:
        ours.close()
        thread.join(timeout_s)
    if failed:
        raise failed[0]
