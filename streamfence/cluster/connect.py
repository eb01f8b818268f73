"""Opening a process's NATS connection as `[cluster]` says (ARCHITECTURE
§4.17), the one place nats-py's `connect` is called:

- its credentials and TLS (`client_options`): the files `[cluster.auth]` and
  `[cluster.tls]` name are read here, and one that cannot be used (or a
  password variable that is not set) is an `AccessError` naming its key;
- a first connect that ends within `timeout_s`, or as soon as the servers
  refuse in a way trying again cannot mend (credentials, a certificate),
  with `Unreachable`: one line naming the servers (never a password) and
  the reason (`reason`: refused, timed out, DNS, authorization, TLS); a
  try the server resets is asked again verbose (`_verbose_try`) so that a
  refusal is not lost to a reset;
- nats-py's reports of a connection that drops later, as log lines with no
  traceback, at most one per REPORT_EVERY_S (its default callback logs each
  failed try with a traceback: five a second while the cluster is away).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

import nats.errors
from nats.aio.client import Client as NatsClient

from streamfence.cluster.settings import ClusterSettings, NatsTls

log = logging.getLogger("streamfence.cluster")
REPORT_EVERY_S = 10.0
RECONNECT_WAIT_S = 0.2  # between two tries of one server


class AccessError(Exception):
    """A file or variable `[cluster.auth]` or `[cluster.tls]` names cannot be
    used; the message names the key."""


class Unreachable(Exception):
    """The first connect failed; the message is one line (module docstring)."""


def _load(key: str, path: str, load: Callable[[], object]) -> None:
    try:
        load()
    except ssl.SSLError as exc:  # an OSError too
        raise AccessError(f"{key}: {path} is not usable: {exc.reason or exc}") from None
    except OSError as exc:
        raise AccessError(f"{key}: cannot read {path}: {exc.strerror or exc}") from None


def tls_context(tls: NatsTls, where: str = "cluster.tls") -> ssl.SSLContext:
    """The context that checks the servers (and shows them this host's certificate)."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if tls.ca:
        ca = tls.ca
        _load(f"{where}.ca", ca, lambda: context.load_verify_locations(cafile=ca))
    if tls.cert and tls.key:
        cert, key = tls.cert, tls.key
        _load(f"{where}.cert", cert, lambda: context.load_cert_chain(cert, key))
    if not tls.verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def client_options(settings: ClusterSettings) -> dict[str, Any]:
    """nats-py's `connect` options for the credentials and TLS of `settings`."""
    options: dict[str, Any] = {}
    auth = settings.auth
    if auth.creds:
        _load("cluster.auth.creds", auth.creds, lambda: open(auth.creds or "").close())
        options["user_credentials"] = auth.creds
    elif auth.nkey_seed:
        _load("cluster.auth.nkey_seed", auth.nkey_seed,
              lambda: open(auth.nkey_seed or "").close())
        options["nkeys_seed"] = auth.nkey_seed
    elif auth.user and auth.password_env:
        password = os.environ.get(auth.password_env)
        if not password:
            raise AccessError(f"cluster.auth.password_env: the environment variable "
                              f"{auth.password_env} is not set")
        options["user"], options["password"] = auth.user, password
    if settings.tls.configured:
        options["tls"] = tls_context(settings.tls)
        if settings.tls.server_name:
            options["tls_hostname"] = settings.tls.server_name
    return options


def _refused(failure: BaseException) -> bool:
    """A refusal that the next try would meet again."""
    return isinstance(failure, ssl.SSLError | nats.errors.AuthorizationError) or (
        "authorization violation" in str(failure).lower())


def reason(failure: BaseException) -> str:
    """Why a connect failed, in a few words."""
    if isinstance(failure, ssl.SSLCertVerificationError):
        return f"TLS: the server's certificate is not trusted ({failure.verify_message})"
    if isinstance(failure, ssl.SSLError):
        return f"TLS: {failure.reason or failure}"
    if _refused(failure):
        return "authorization refused (wrong credentials?)"
    if isinstance(failure, socket.gaierror):
        return f"DNS: {failure.strerror}"
    if isinstance(failure, ConnectionRefusedError):
        return "connection refused"
    if isinstance(failure, TimeoutError):  # nats-py's too, and asyncio's (often no text)
        return str(failure).strip() or "timed out"
    if isinstance(failure, OSError):
        return str(failure.strerror or failure)
    return str(failure).strip() or type(failure).__name__


class _Reports:
    """nats-py's callbacks: before the first connect, the last failure and
    whether it is a refusal; after it, log lines (module docstring)."""

    def __init__(self, nc: NatsClient, settings: ClusterSettings,
                 options: dict[str, Any]) -> None:
        self._nc = nc
        self._settings, self._options = settings, options
        self.last: BaseException | None = None
        self.tries = 0
        self.refused = asyncio.Event()
        self.connected = False
        self._logged_at = -math.inf

    async def error(self, failure: Exception) -> None:
        if not self.connected:
            if isinstance(failure, ConnectionResetError | BrokenPipeError):
                failure = await _verbose_try(self._settings, self._options) or failure
            self.last, self.tries = failure, self.tries + 1
            if _refused(failure):
                self.refused.set()
            return
        now = time.monotonic()
        if now - self._logged_at >= REPORT_EVERY_S:
            self._logged_at = now
            log.warning("NATS: %s (at most one such line per %g s)", reason(failure),
                        REPORT_EVERY_S)

    async def disconnected(self) -> None:
        if self.connected and not self._nc.is_closed:
            log.warning("NATS: disconnected; reconnecting")

    async def reconnected(self) -> None:
        log.info("NATS: reconnected")


async def connect(settings: ClusterSettings) -> NatsClient:
    """This process's connection (module docstring); `AccessError` or
    `Unreachable` if there is none within `settings.timeout_s`."""
    options = client_options(settings)
    nc = NatsClient()
    reports = _Reports(nc, settings, options)
    options.update(  # nats-py annotates its two waits int, takes floats
        connect_timeout=settings.timeout_s, reconnect_time_wait=RECONNECT_WAIT_S,
        max_reconnect_attempts=-1, allow_reconnect=True, error_cb=reports.error,
        disconnected_cb=reports.disconnected, reconnected_cb=reports.reconnected)
    connecting = asyncio.ensure_future(nc.connect(
        servers=list(settings.urls), name=f"streamfence {settings.host}", **options))
    refused = asyncio.ensure_future(reports.refused.wait())
    try:
        await asyncio.wait((connecting, refused), timeout=settings.timeout_s,
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        refused.cancel()
    if connecting.done() and not connecting.cancelled() and connecting.exception() is None:
        reports.connected = True
        return nc
    if connecting.done() and not connecting.cancelled():
        reports.last = connecting.exception()
    connecting.cancel()
    with contextlib.suppress(BaseException):
        await connecting
    with contextlib.suppress(Exception):
        await nc.close()
    raise Unreachable(f"cannot reach the NATS cluster at {settings.shown_urls}: "
                      f"{_why(reports, settings, options)}")


async def _verbose_try(settings: ClusterSettings, options: dict[str, Any]) -> Exception | None:
    """What one verbose connect meets. A server that refuses the credentials
    answers CONNECT with -ERR and closes; nats-py, unless verbose, writes PING
    before it reads that answer, and a PING meeting the closed socket resets
    the connection, so the refusal is lost (one try in eight here). Verbose,
    it reads the answer first. Not kept on: the server would then answer
    every publish with +OK."""
    probe = NatsClient()
    quiet = {key: value for key, value in options.items() if not key.endswith("_cb")}

    async def ignore(_: Exception) -> None:
        return None
    try:
        await asyncio.wait_for(probe.connect(
            servers=list(settings.urls), **{**quiet, "verbose": True, "allow_reconnect": False,
                                             "error_cb": ignore}), settings.timeout_s)
    except Exception as exc:  # any failure is the answer
        return exc
    with contextlib.suppress(Exception):
        await probe.close()
    return None


def _why(reports: _Reports, settings: ClusterSettings, options: dict[str, Any]) -> str:
    if reports.last is None:
        return f"no answer within {settings.timeout_s:g} s"
    why = reason(reports.last)
    if _refused(reports.last):
        return why
    why += f" ({reports.tries} tries in {settings.timeout_s:g} s)"
    password = options.get("password")
    return why.replace(password, "***") if password else why
