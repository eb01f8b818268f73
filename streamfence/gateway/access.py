"""The gateway's access log: one INFO line per HTTP request, on the logger
`streamfence.gateway.access`, as an operator reads nginx's.

Contract:
- `AccessLog` is the AppRunner's `access_log_class`: aiohttp calls it once a
  response is sent, with its status and the bytes written (headers
  included, as nginx's `$bytes_sent`).
- `abandoned` is the app's middleware for the one request aiohttp does not
  log: a handler cancelled because its client went away (or because a
  request with the same Idempotency-Key took its call over), logged with
  nginx's 499 ("client closed request") and the bytes sent until then.
- The handlers name who asked and the call: `request[IDENTITY]` (the
  identity's name, unset for a request without a valid key) and
  `request[CALL_ID]`, once the call is submitted.
- The line: `METHOD PATH STATUS identity=NAME bytes=N duration_ms=D`, the
  call id as the record's `call_id` (`call=` in the text log); in JSON logs
  the record's `fields` (protocol/logs.py) add `method`, `path`, `status`,
  `identity`, `bytes_out` and `duration_ms` as keys. The probes (`/healthz`,
  `/readyz`, `/metrics`), which a load balancer or Prometheus polls every
  few seconds, are logged at DEBUG.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

IDENTITY = web.RequestKey("identity", str)
CALL_ID = web.RequestKey("call_id", str)
PROBES = frozenset({"/healthz", "/readyz", "/metrics"})
CLIENT_CLOSED = 499  # nginx's status for a request whose client went away

log = logging.getLogger("streamfence.gateway.access")


def log_request(request: web.BaseRequest, status: int, bytes_out: int,
                duration_s: float) -> None:
    """The access line of one request."""
    level = logging.DEBUG if request.path in PROBES and status < 400 else logging.INFO
    if not log.isEnabledFor(level):
        return
    identity = request.get(IDENTITY)
    duration_ms = round(duration_s * 1000.0, 1)
    log.log(level, "%s %s %d identity=%s bytes=%d duration_ms=%.1f", request.method,
            request.path, status, identity or "-", bytes_out, duration_ms,
            extra={"call_id": request.get(CALL_ID), "fields": {
                "method": request.method, "path": request.path, "status": status,
                "identity": identity, "bytes_out": bytes_out, "duration_ms": duration_ms}})


class AccessLog(AbstractAccessLogger):
    """aiohttp's access logger, called once a response is sent."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse,
            time: float) -> None:
        log_request(request, response.status, response.body_length, time)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def abandoned(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Log a request whose handler is cancelled (aiohttp logs no line for it)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        return await handler(request)
    except asyncio.CancelledError:
        log_request(request, CLIENT_CLOSED, request.writer.output_size, loop.time() - start)
        raise
