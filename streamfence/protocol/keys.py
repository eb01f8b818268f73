"""The daemon's CURVE keys and the registry of client keys it accepts.

Layout, all under `<state_dir>/keys/` (0700; every file 0600):

    server.key, server.key_secret      the daemon's key pair (ZeroMQ cert files)
    clients/NAME.key                   a registered client's public key: the allow-list
    NAME.credentials                   that client's credentials file, to hand over

`KeyStore` owns that directory: it creates the daemon's pair on first use,
registers and revokes clients (`streamfence keys new|revoke|list`, with or
without a running daemon), and answers "which identity has this public key?"
from the allow-list, re-read whenever the `clients/` folder changes, so a
revocation takes effect on the next handshake and on the next message
(docs/SECURITY.md).

`start_authenticator` runs pyzmq's own ZAP authenticator thread, asked to
accept a CURVE client only if its key is registered. The connection's User-Id
is the client's public key (Z85); the supervisor maps it to the identity on
every message through `identity_of`, so a revoked or rotated key stops at
once, also on a connection made before.

`ConnectionCap` bounds the live connections of one socket (the supervisor's
client socket): the same ZAP thread reads that socket's monitor and refuses
the handshake of a connection beyond the cap (docs/SECURITY.md).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.base import Authenticator
from zmq.auth.thread import AuthenticationThread, ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from streamfence.protocol.credentials import Credentials, write_credentials

log = logging.getLogger("streamfence.auth")

ZAP_DOMAIN = "streamfence"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# A directory's mtime may have the kernel's coarse clock tick (a few ms): a change
# in the same tick as a read leaves it unchanged. A read this close to the last
# change is not trusted (read again next time), as git treats "racy" entries.
_RACY_NS = 100_000_000
CAP_WARN_EVERY_S = 10.0  # the "at the cap" WARNING: at most one line per this many seconds


class KeyStoreError(Exception):
    """A key operation that cannot be done (bad name, unknown or duplicate identity)."""


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def _private_files(*paths: Path) -> None:
    for p in paths:
        os.chmod(p, 0o600)


class KeyStore:
    """Owns `<state_dir>/keys/`: the daemon's key pair and the client allow-list."""

    def __init__(self, keys_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(keys_dir)
        self.clients_dir = self.dir / "clients"
        self._lock = threading.Lock()  # the ZAP thread reads, the loop may reload
        self._seen_mtime_ns = -1
        self._by_key: dict[bytes, str] = {}

    # ---- the daemon's pair ------------------------------------------------------

    def server_keys(self) -> tuple[bytes, bytes]:
        """(public, secret) of the daemon, created on first use."""
        _private_dir(self.dir)
        _private_dir(self.clients_dir)
        secret_file = self.dir / "server.key_secret"
        if not secret_file.exists():
            zmq.auth.create_certificates(str(self.dir), "server")
            _private_files(self.dir / "server.key", secret_file)
        public, secret = zmq.auth.load_certificate(str(secret_file))
        if secret is None:
            raise KeyStoreError(f"{secret_file} holds no secret key; remove both server.key "
                                f"files to make a new pair (every client then needs new credentials)")
        return public, secret

    # ---- clients --------------------------------------------------------------

    def credentials_path(self, name: str) -> Path:
        return self.dir / f"{name}.credentials"

    def register(self, name: str, endpoint: str, *, replace: bool = False) -> Credentials:
        """Create a key pair for identity `name`, add its public key to the
        allow-list and write its credentials file. `replace`: rotate an
        existing identity's key (the old key stops working)."""
        if not NAME_RE.match(name):
            raise KeyStoreError(f"identity name {name!r}: use letters, digits, '_', '.', '-' "
                            f"(at most 64, starting with a letter or digit)")
        public_file = self.clients_dir / f"{name}.key"
        if public_file.exists() and not replace:
            raise KeyStoreError(f"identity {name!r} already has a key ({public_file}); "
                            f"`streamfence keys rotate {name}` replaces it")
        server_public, _ = self.server_keys()
        client_public, client_secret = zmq.curve_keypair()
        creds = Credentials(name, endpoint, server_public, client_public, client_secret)
        write_credentials(self.credentials_path(name), creds)
        tmp = self.clients_dir / f".{name}.key.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(f"# streamfence client {name}\ncurve\n"
                    f'    public-key = "{client_public.decode()}"\n')
        os.replace(tmp, public_file)
        return creds

    def revoke(self, name: str) -> None:
        public_file = self.clients_dir / f"{name}.key"
        # A name that is not an identity name (say "../server") must not reach
        # outside clients/.
        if not NAME_RE.match(name) or not public_file.exists():
            raise KeyStoreError(f"no identity {name!r} in {self.clients_dir}")
        public_file.unlink()
        self.credentials_path(name).unlink(missing_ok=True)

    def names(self) -> list[str]:
        return sorted(p.stem for p in self.clients_dir.glob("*.key"))

    def identity_of(self, public_key_z85: bytes) -> str | None:
        """The registered identity with this public key, or None (re-reads the
        allow-list when `clients/` changed since the last look)."""
        with self._lock:
            try:
                mtime = self.clients_dir.stat().st_mtime_ns
            except FileNotFoundError:
                return None
            if mtime != self._seen_mtime_ns:
                racy = 0 <= time.time_ns() - mtime < _RACY_NS
                self._by_key = self._read_allow_list()
                self._seen_mtime_ns = -1 if racy else mtime
            return self._by_key.get(public_key_z85)

    def _read_allow_list(self) -> dict[bytes, str]:
        by_key: dict[bytes, str] = {}
        for path in sorted(self.clients_dir.glob("*.key")):
            try:
                public, _ = zmq.auth.load_certificate(str(path))
            except (OSError, ValueError) as exc:
                log.warning("unreadable client key %s (%s); ignored", path, exc)
                continue
            by_key[public] = path.stem
        return by_key


class ConnectionCap:
    """At most `limit` live connections on one bound socket (docs/SECURITY.md).

    The socket's monitor reports each connection it accepts (by its file
    descriptor) and each it drops; a connection counts from its accept to its
    close, handshake done or not, since what the cap guards is descriptors.
    The ZAP handler asks `admit` for every handshake of the socket's ZAP
    domain and refuses one that finds more than `limit` live (the connection
    asking counts): ZAP status 400, on which libzmq closes the connection at
    once, and the client does not retry on that socket. Not 300 ("try
    later"): libzmq keeps such a connection until the handshake timer ends
    it, and the client comes back 100 ms later, so each refused client would
    hold a descriptor nearly all the time. Connections still in their
    handshake count too, so a burst that crosses the cap may have a few
    refused that would have fit once the others settled.

    Owned by the ZAP thread once it runs (`open`, `drain`, `admit`, `close`);
    `live` and `refused` are ints that other threads only read."""

    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic) -> None:
        if limit < 1:
            raise ValueError(f"connection cap {limit}: must be at least 1")
        self.limit = limit
        self.live = 0  # connections accepted and not yet closed
        self.refused = 0  # handshakes refused at the cap
        self._clock = clock
        self._fds: set[int] = set()
        self._addr = f"inproc://streamfence.cap.{id(self):x}"
        self._monitor: zmq.Socket[bytes] | None = None
        self._warned_at: float | None = None

    def watch(self, sock: zmq.Socket[bytes]) -> None:
        """Monitor `sock`: call before it binds and before the ZAP thread starts."""
        sock.monitor(self._addr, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)

    def open(self, context: zmq.Context[Any]) -> zmq.Socket[bytes]:
        """(ZAP thread) Connect to the monitor; the thread polls what this returns."""
        monitor: zmq.Socket[bytes] = context.socket(zmq.PAIR, socket_class=zmq.Socket)
        monitor.linger = 0
        monitor.connect(self._addr)
        self._monitor = monitor
        return monitor

    def close(self) -> None:
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None

    def drain(self) -> None:
        """(ZAP thread) Apply every monitor event queued so far."""
        if self._monitor is None:
            return
        while True:
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            event = parse_monitor_message(frames)
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._fds.add(event["value"])
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                # A descriptor is closed only after this event, so its next
                # accept comes after it: a set keyed by descriptor is exact.
                self._fds.discard(event["value"])
        self.live = len(self._fds)

    def admit(self) -> bool:
        """(ZAP thread) May the connection now handshaking go on? libzmq
        reports a connection's accept before its handshake starts, so it is
        queued on the monitor before its ZAP request arrives here."""
        self.drain()
        if self.live <= self.limit:
            return True
        self.refused += 1
        now = self._clock()
        if self._warned_at is None or now - self._warned_at >= CAP_WARN_EVERY_S:
            self._warned_at = now
            log.warning("client connections at the cap (%d); refusing new connections "
                        "(%d refused so far)", self.limit, self.refused)
        return False


class _CappedThread(AuthenticationThread):
    """pyzmq's ZAP thread, also reading a `ConnectionCap`'s monitor (drained as
    soon as it has events, so the count is current and its queue never grows)."""

    def __init__(self, authenticator: Authenticator, pipe: zmq.Socket[bytes],
                 cap: ConnectionCap) -> None:
        super().__init__(authenticator, pipe)
        self._cap = cap

    async def _run(self) -> None:
        zap = self.authenticator.zap_socket
        monitor = self._cap.open(self.authenticator.context)
        try:
            self.poller = zmq.asyncio.Poller()
            for sock in (self.pipe, zap, monitor):
                self.poller.register(sock, zmq.POLLIN)
            self.started.set()
            while True:
                # Every socket is read until it is empty: a ZeroMQ socket's
                # descriptor signals edges, and a request left behind one would
                # wait for an unrelated wake-up (a handshake that never completes).
                await self.poller.poll()
                self._cap.drain()
                while True:
                    try:
                        command = self.pipe.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if self._handle_pipe_message(command):
                        return
                while True:
                    try:
                        request = zap.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    await self.authenticator.handle_zap_message(request)
        finally:
            self._cap.close()


class ZapAuthenticator(ThreadAuthenticator):
    """pyzmq's ZAP thread over the key store (and a `ConnectionCap`, if given)."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], store: KeyStore,
                 cap: ConnectionCap | None = None) -> None:
        super().__init__(context, log=logging.getLogger("streamfence.auth.zap"))
        self._store = store
        self._cap = cap
        self.refused = 0  # handshakes refused (read by the loop for `status`)

    def start(self) -> None:
        if self._cap is None:
            super().start()
            return
        # ThreadAuthenticator.start (pyzmq 27), with the thread that also
        # reads the cap's monitor.
        Authenticator.start(self)
        self.pipe = self.context.socket(zmq.PAIR, socket_class=zmq.Socket)
        self.pipe.linger = 1
        self.pipe.bind(self.pipe_endpoint)
        thread_pipe = self.context.socket(zmq.PAIR, socket_class=zmq.Socket)
        thread_pipe.linger = 1
        thread_pipe.connect(self.pipe_endpoint)
        self.thread = _CappedThread(self, thread_pipe, self._cap)
        self.thread.start()
        if not self.thread.started.wait(timeout=10):
            raise RuntimeError("the ZAP authenticator thread did not start")

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # [version, request id, domain, address, identity, mechanism, ...]
        if (self._cap is not None and len(msg) >= 3 and msg[2] == ZAP_DOMAIN.encode()
                and not self._cap.admit()):
            self._send_zap_reply(msg[1], b"400", b"connection cap reached")
            return
        await super().handle_zap_message(msg)

    # pyzmq calls this with the Z85 key: the credentials-provider protocol.
    def callback(self, domain: str, key: bytes) -> bool:
        if self._store.identity_of(key) is not None:
            return True
        self.refused += 1
        log.warning("refused a CURVE client with an unregistered key")
        return False


def start_authenticator(context: zmq.Context[zmq.Socket[bytes]], store: KeyStore,
                        cap: ConnectionCap | None = None) -> ZapAuthenticator:
    """Start ZAP for `context`: CURVE clients of ZAP_DOMAIN are accepted only
    with a registered key; with `cap` (already watching its socket), a
    handshake of ZAP_DOMAIN beyond the cap is refused, NULL ones included.
    Stop it with `.stop()`."""
    auth = ZapAuthenticator(context, store, cap)
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=auth)
    return auth


def make_curve_server(sock: zmq.Socket[bytes], store: KeyStore) -> None:
    """Make `sock` (before bind) a CURVE server authenticated through ZAP."""
    public, secret = store.server_keys()
    sock.curve_server = True
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.zap_domain = ZAP_DOMAIN.encode()
