"""The daemon's CURVE keys and the registry of client keys it accepts.

Layout, all under `<state_dir>/keys/` (0700; every file 0600):

    server.key, server.key_secret      the daemon's key pair (ZeroMQ cert files)
    clients/NAME.key                   a registered client's public key: the allow-list
    clients/cluster.identities         the keys other hosts of the cluster registered
                                       (public keys and names, JSON; cluster mode only)
    NAME.credentials                   that client's credentials file, to hand over

`KeyStore` owns that directory: it creates the daemon's pair on first use,
registers and revokes clients (`streamfence keys new|revoke|list`, with or
without a running daemon), and answers "which identity has this public key?"
from the allow-list, re-read whenever the `clients/` folder changes, so a
revocation takes effect on the next handshake and on the next message
(docs/SECURITY.md). In cluster mode the supervisor keeps `cluster.identities`
to the cluster's word (`share`, supervisor/shared_keys.py): being in
`clients/`, it is read with the allow-list, by the supervisor and the sink
alike, at no cost per message; `names` and `revoke` know this host's own
identities only.

`start_authenticator` runs pyzmq's own ZAP authenticator thread, asked to
accept a CURVE client only if its key is registered. The connection's User-Id
is the client's public key (Z85); the supervisor maps it to the identity on
every message through `identity_of`, so a revoked or rotated key stops at
once, also on a connection made before.

With `log_changes` (the supervisor's store: one process logs them), every
change of the allow-list the store applies is logged, one line per identity
(`key_changes`: added, rotated, revoked; names only, never a key), and a
thread looks at the folder every KEY_WATCH_S, so a change is logged (and
applied) within a second even when no client speaks.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from streamfence.protocol.credentials import Credentials, write_credentials

log = logging.getLogger("streamfence.auth")

ZAP_DOMAIN = "streamfence"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# A directory's mtime may have the kernel's coarse clock tick (a few ms): a change
# in the same tick as a read leaves it unchanged. A read this close to the last
# change is not trusted (read again next time), as git treats "racy" entries.
_RACY_NS = 100_000_000
REFUSED_LOG_EVERY_S = 10.0  # refused-handshake warnings, at most one this often
SHARED_FILE = "cluster.identities"  # in clients/: not a `*.key`, so no identity's name
KEY_WATCH_S = 1.0  # how often a store that logs its changes looks at clients/


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

    def __init__(self, keys_dir: str | os.PathLike[str], *, log_changes: bool = False) -> None:
        self.dir = Path(keys_dir)
        self.clients_dir = self.dir / "clients"
        self.log_changes = log_changes  # module docstring
        self._lock = threading.Lock()  # the ZAP thread reads, the loop may reload
        self._seen_mtime_ns = -1
        self._by_key: dict[bytes, str] = {}
        self._read_once = False  # the allow-list was read: later reads are changes

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
        return self.allow_list().get(public_key_z85)

    def allow_list(self) -> Mapping[bytes, str]:
        """The registered public keys (Z85) and their names, re-read when
        `clients/` changed since the last look: the same mapping object until
        then, so a caller can tell a change by identity (the sink's events
        socket cuts the connections of revoked keys: sink/subscribers.py)."""
        with self._lock:
            try:
                mtime = self.clients_dir.stat().st_mtime_ns
            except FileNotFoundError:
                self._by_key, self._seen_mtime_ns = {}, -1
                return self._by_key
            if mtime != self._seen_mtime_ns:
                racy = 0 <= time.time_ns() - mtime < _RACY_NS
                before, self._by_key = self._by_key, self._read_allow_list()
                self._seen_mtime_ns = -1 if racy else mtime
                if self.log_changes:
                    self._log_changes(before, self._by_key)
            return self._by_key

    def _log_changes(self, before: Mapping[bytes, str], after: Mapping[bytes, str]) -> None:
        if not self._read_once:
            self._read_once = True
            log.info("client keys: registered identities: %s",
                     ", ".join(sorted(after.values())) or "none")
            return
        for name, what in key_changes(before, after):
            log.info("client keys: identity %r %s (applies from its next handshake and "
                     "message)", name, what)

    def _read_allow_list(self) -> dict[bytes, str]:
        return {**self._read_shared(), **self.local_keys()}  # this host's own first

    def local_keys(self) -> dict[bytes, str]:
        """This host's registered public keys (Z85) and their names, read now."""
        by_key: dict[bytes, str] = {}
        for path in sorted(self.clients_dir.glob("*.key")):
            try:
                public, _ = zmq.auth.load_certificate(str(path))
            except (OSError, ValueError) as exc:
                log.warning("unreadable client key %s (%s); ignored", path, exc)
                continue
            by_key[public] = path.stem
        return by_key

    # ---- the keys the cluster's other hosts registered ----------------------------

    def share(self, keys: Mapping[bytes, str]) -> None:
        """Accept `keys` (public key, Z85 -> identity name) besides this host's
        own, in place of those shared before (replaced atomically)."""
        _private_dir(self.clients_dir)
        tmp = self.clients_dir / f".{SHARED_FILE}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            json.dump({key.decode("ascii"): name for key, name in sorted(keys.items())}, f)
        os.replace(tmp, self.clients_dir / SHARED_FILE)

    def forget_shared(self) -> None:
        """Accept this host's own keys only (at a start: what the cluster shares
        is known from the cluster, never from a previous run's file)."""
        (self.clients_dir / SHARED_FILE).unlink(missing_ok=True)

    def _read_shared(self) -> dict[bytes, str]:
        path = self.clients_dir / SHARED_FILE
        try:
            data = json.loads(path.read_text(encoding="ascii"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("unreadable %s (%s); the cluster's keys are refused", path, exc)
            return {}
        if not isinstance(data, dict):
            return {}
        return {key.encode("ascii"): name for key, name in data.items()
                if valid_key(key) and isinstance(name, str) and NAME_RE.match(name)}


def valid_key(key: object) -> bool:
    """Whether `key` is a CURVE public key in Z85 (40 characters)."""
    if not isinstance(key, str) or len(key) != 40 or not key.isascii():
        return False
    try:
        z85.decode(key)
    except (ValueError, KeyError):  # pyzmq raises KeyError for a character not of Z85
        return False
    return True


def key_changes(before: Mapping[bytes, str], after: Mapping[bytes, str]) -> list[tuple[str, str]]:
    """(name, "added" | "rotated" | "revoked") for each identity whose key differs
    between two allow-lists (key -> name), by name."""
    old = {name: key for key, name in before.items()}
    new = {name: key for key, name in after.items()}
    changes = []
    for name in sorted(old.keys() | new.keys()):
        if name not in old:
            changes.append((name, "added"))
        elif name not in new:
            changes.append((name, "revoked"))
        elif old[name] != new[name]:
            changes.append((name, "rotated"))
    return changes


class _KeyWatch(threading.Thread):
    """Looks at a store's allow-list every KEY_WATCH_S (module docstring)."""

    def __init__(self, store: KeyStore) -> None:
        super().__init__(name="streamfence-key-watch", daemon=True)
        self._store = store
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(KEY_WATCH_S):
            self._store.allow_list()


class _Authenticator(ThreadAuthenticator):
    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], store: KeyStore) -> None:
        super().__init__(context, log=logging.getLogger("streamfence.auth.zap"))
        self._store = store
        self.refused = 0  # handshakes refused for their key (read by the loop for `status`)
        # Set by the owner's loop while its connection cap is reached: new
        # handshakes are refused (counted in `refused_full`), whatever the key.
        self.full = False
        self.refused_full = 0
        self._refused_logged = 0  # `refused` when the last warning was written
        self._refused_log_at = -REFUSED_LOG_EVERY_S
        self._watch: _KeyWatch | None = None

    def start(self) -> None:
        super().start()
        if self._store.log_changes:
            self._store.allow_list()  # the first read: logged now, not at the first look
            self._watch = _KeyWatch(self._store)
            self._watch.start()

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.stopping.set()
            self._watch.join()
            self._watch = None
        super().stop()

    # pyzmq calls this with the Z85 key: the credentials-provider protocol.
    def callback(self, domain: str, key: bytes) -> bool:
        if self.full:
            self.refused_full += 1
            return False
        if self._store.identity_of(key) is not None:
            return True
        self.refused += 1
        self._log_refused()
        return False

    def _log_refused(self) -> None:
        """One warning per REFUSED_LOG_EVERY_S at most, with the count since the
        last one: a client retrying with a bad key cannot flood the log."""
        now = time.monotonic()
        if now - self._refused_log_at < REFUSED_LOG_EVERY_S:
            return
        self._refused_log_at = now
        log.warning("refused %d CURVE handshake(s) with an unregistered key (%d in all; at "
                    "most one such line per %.0fs)", self.refused - self._refused_logged,
                    self.refused, REFUSED_LOG_EVERY_S)
        self._refused_logged = self.refused


def start_authenticator(context: zmq.Context[zmq.Socket[bytes]],
                        store: KeyStore) -> _Authenticator:
    """Start ZAP for `context`: CURVE clients of ZAP_DOMAIN are accepted only
    with a registered key. Stop it with `.stop()`."""
    auth = _Authenticator(context, store)
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
