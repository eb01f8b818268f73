"""The emulator's aiohttp application: provider routes plus the control API.

Contract
--------
Provider routes (one sibling module per wire):

  ``POST /v1/chat/completions``   :mod:`streamfence.devtools.emulator.openai_wire`
  ``POST /v1/messages``           :mod:`streamfence.devtools.emulator.anthropic_wire`
  ``POST /model/{modelId}/converse-stream``, ``.../converse``   :mod:`streamfence.devtools.emulator.bedrock_wire`

Control API (JSON in, JSON out; a bad request gets 400 ``{"error": str}``):

  ``POST /_emu/script``  ``{"key": str, "steps": [step, ...]}`` replaces the
                         key's script -> ``{"ok": true, "key", "steps": int}``
  ``GET  /_emu/log``     ``?key=K`` (only that key), ``?since=N`` (only
                         ``n > N``) -> ``{"requests": [record, ...]}``
  ``POST /_emu/reset``   clears scripts and log (request numbers go on)
  ``GET  /_emu/health``  ``{"ok": true, "pid", "requests", "pending_steps"}``
  ``GET  /_emu/steps``   the step fields and their meaning

Record fields are documented in :mod:`streamfence.devtools.emulator.state`, step fields in
:mod:`streamfence.devtools.emulator.script`. :func:`start` binds a site and returns the runner and
the bound port; the caller owns ``runner.cleanup()``.
"""

from __future__ import annotations

import os
import ssl

import orjson
from aiohttp import web

from . import anthropic_wire, bedrock_wire, openai_wire
from .script import STEP_FIELDS, ScriptError, parse_steps
from .state import STATE_KEY, EmulatorState, RequestLog

_MAX_BODY = 64 * 1024 * 1024


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


def _bad(message: str) -> web.Response:
    return _json({"error": message}, status=400)


async def _script(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as err:
        return _bad(f"body is not JSON: {err}")
    if not isinstance(body, dict) or set(body) != {"key", "steps"}:
        return _bad('body must be {"key": str, "steps": [step, ...]}')
    key = body["key"]
    if not isinstance(key, str) or not key or "#" in key:
        return _bad(f"'key' must be a non-empty string without '#', got {key!r}")
    try:
        steps = parse_steps(body["steps"])
    except ScriptError as err:
        return _bad(str(err))
    state.scripts.set(key, steps)
    return _json({"ok": True, "key": key, "steps": len(steps)})


async def _log(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    key = request.query.get("key")
    since_raw = request.query.get("since", "0")
    try:
        since = int(since_raw)
    except ValueError:
        return _bad(f"'since' must be an integer, got {since_raw!r}")
    records = [r.to_json() for r in state.log.select(key, since)]
    return _json({"requests": records})


async def _reset(request: web.Request) -> web.Response:
    request.app[STATE_KEY].reset()
    return _json({"ok": True})


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return _json(
        {
            "ok": True,
            "pid": os.getpid(),
            "requests": state.log.total,
            "pending_steps": state.scripts.pending(),
        }
    )


async def _steps(request: web.Request) -> web.Response:
    return _json(STEP_FIELDS)


def make_app(*, require_auth: bool = False, log_limit: int = 100_000) -> web.Application:
    app = web.Application(client_max_size=_MAX_BODY)
    app[STATE_KEY] = EmulatorState(log=RequestLog(log_limit), require_auth=require_auth)
    app.router.add_post("/v1/chat/completions", openai_wire.handle_chat_completions)
    app.router.add_post("/v1/messages", anthropic_wire.handle_messages)
    app.router.add_post("/model/{modelId}/converse-stream", bedrock_wire.handle_converse_stream)
    app.router.add_post("/model/{modelId}/converse", bedrock_wire.handle_converse)
    app.router.add_post("/_emu/script", _script)
    app.router.add_get("/_emu/log", _log)
    app.router.add_post("/_emu/reset", _reset)
    app.router.add_get("/_emu/health", _health)
    app.router.add_get("/_emu/steps", _steps)
    return app


async def start(app: web.Application, host: str, port: int,
                tls: ssl.SSLContext | None = None) -> tuple[web.AppRunner, list[int]]:
    """Serve ``app`` on ``host:port`` (0 = any free port), and with ``tls`` over
    TLS too, on a second free port; returns the bound ports (plain first)."""
    # No access log: our own line per request (at its end) says more.
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.25)
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=1024).start()
    if tls is not None:
        await web.TCPSite(runner, host, 0, backlog=1024, ssl_context=tls).start()
    bound = [int(address[1]) for address in runner.addresses
             if isinstance(address, tuple) and len(address) >= 2]
    return runner, bound or [port]
