"""The gateway's HTTP endpoints (aiohttp): the providers' own wire in front of
the daemon, so an app keeps its SDK and changes only `base_url` and its key.

- `POST /v1/chat/completions`: OpenAI's chat completions (openai profiles);
- `POST /v1/messages`: Anthropic's messages (anthropic profiles);
- `GET /v1/models`: the models an identity may call;
- `GET /healthz`: the gateway serves;
- `GET /readyz`, `GET /metrics`: gateway/metrics.py (docs/METRICS.md).
- `/console`: the web console, gateway/console.py (README "Console").

A request is data for one call: its body goes to the provider as it came
(the gateway takes out only `stream` and `stream_options`, which it owns)
when the profile routed to (gateway/routes.py) speaks the endpoint's wire,
else translated to the profile's (gateway/translate.py: either endpoint
reaches a profile of any kind; what the target cannot express is a 400
naming the field), through the daemon as an ordinary protocol v1 client
acting as the caller's identity (gateway/keys.py). A call over HTTP always
runs with `on_partial: "continue"`: the providers' wires cannot say "forget
what you got" (the `reset` of `restart`), so a stream never holds two
answers; a cut after text ends with the provider's own "length" ending
instead. A stale kill and its retry before any text are invisible to the
SDK. The answer is rendered in the endpoint's wire by gateway/openai_chat.py
and gateway/anthropic_messages.py; errors by gateway/http_errors.py. Each
SSE frame's `id:` is the event's seq.

A streaming client that goes away cancels its call (its provider stream is
closed), unless it sent an `Idempotency-Key`: the same key again is the same
call (the daemon's idempotency, per identity), so a dropped stream is
re-POSTed with the key and `Last-Event-ID` and resumes exactly after it,
the call live or ended: the call is read again from seq 1 (its renderer's
state), and the request takes the call over from an earlier request of the
key that still reads it (`_take_over`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from streamfence.config.model import DaemonConfig
from streamfence.gateway import access, anthropic_messages, http_errors, openai_chat
from streamfence.gateway.console import Console
from streamfence.gateway.keys import ClientsByIdentity, HttpKeys, caller
from streamfence.gateway.metrics import Health
from streamfence.gateway.neutral import Untranslatable
from streamfence.gateway.routes import PROFILE_HEADER, NoRoute, route
from streamfence.gateway.routes import models as route_models
from streamfence.gateway.translate import translate
from streamfence.protocol.client_async import AsyncClient
from streamfence.protocol.client_router import ClientError
from streamfence.protocol.credentials import Credentials
from streamfence.protocol.failpoints import ARMED, failpoint
from streamfence.protocol.messages import valid_traceparent

log = logging.getLogger("streamfence.gateway")

SESSION_HEADER = "X-Streamfence-Session"
# The same key again is the same call (the daemon's idempotency, per identity):
# with Last-Event-ID, a dropped stream resumes after the last event it got.
IDEMPOTENCY_HEADER = "Idempotency-Key"
CALL_HEADER = "X-Streamfence-Call-Id"
OPTIONS = {"on_partial": "continue"}  # see the module docstring


def _options(traceparent: str | None) -> dict[str, str]:
    """The call's options: with the caller's W3C `traceparent`, the call's
    trace joins the caller's (a malformed one is ignored, as W3C asks)."""
    if traceparent is None or not valid_traceparent(traceparent.strip()):
        return OPTIONS
    return {**OPTIONS, "traceparent": traceparent.strip()}
ENDED = ("failed", "cancelled")


class Renderer(Protocol):
    started: bool  # it has produced bytes

    def feed(self, event: dict[str, Any]) -> bytes: ...


@dataclass(frozen=True, slots=True)
class Wire:
    """What differs between the two endpoints."""

    kind: str  # its wire; a profile of another kind gets the request translated
    stream: Callable[[str, str, bool], Renderer]  # (call_id, model, include_usage)
    body: Callable[[str, str, dict[str, Any]], dict[str, Any]]  # (call_id, model, done)
    error: Callable[[str, str, http_errors.ProviderError | None], tuple[int, dict[str, Any]]]


OPENAI = Wire("openai", lambda c, m, u: openai_chat.ChatCompletionStream(c, m, u),
              openai_chat.completion, http_errors.openai_error)
ANTHROPIC = Wire("anthropic", lambda c, m, u: anthropic_messages.MessageStream(c, m),
                 anthropic_messages.message, http_errors.anthropic_error)


class Gateway:
    """Owns the HTTP app and one protocol client per identity that called."""

    def __init__(self, config: DaemonConfig, keys_dir: str | None) -> None:
        self._config = config
        self._keys = HttpKeys(keys_dir) if keys_dir is not None else None
        self._endpoint = _connectable(config.endpoint)
        self._clients = ClientsByIdentity(self._endpoint, timeout_s=30.0)
        self._readers: dict[str, asyncio.Task[Any]] = {}  # call_id -> the request reading it
        # The requests refused here, before the daemon saw them, by code (/metrics).
        self._refused: Counter[str] = Counter()
        self._health = Health(self._endpoint, keys_dir, config.providers, self._refused)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self._config.max_frame_bytes,
                              middlewares=[access.abandoned])
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/healthz", self._healthz)
        self._health.register(app)
        Console(self._config, self._keys, self._clients, self._refused).register(app)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, _app: web.Application) -> None:
        self._clients.close()

    # ---- who is asking ----------------------------------------------------------

    def _identity(self, request: web.Request) -> Credentials | str | None:
        """The caller's credentials (auth "curve"), LOCAL_NAME (auth "none"),
        or None: no key, or not one of ours. Its name goes to the access log."""
        who = caller(self._keys, request.headers.get("Authorization", ""),
                     request.headers.get("x-api-key", ""))
        if who is not None:
            request[access.IDENTITY] = who if isinstance(who, str) else who.name
        return who

    # ---- endpoints --------------------------------------------------------------

    def _refuse(self, wire: Wire, code: str, message: str) -> web.Response:
        """A request refused by the gateway itself: counted, and answered as
        the wire's error."""
        self._refused[code] += 1
        return _error(wire, code, message)

    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        who = self._identity(request)
        if who is None:
            return self._refuse(OPENAI, "unauthenticated", "no valid API key")
        name = who if isinstance(who, str) else who.name
        ident = self._config.identities.get(name)
        usable = ident.providers if ident is not None else None
        data = [{"id": model, "object": "model", "created": 0, "owned_by": profile}
                for model, profile in route_models(self._config.http, self._config.providers,
                                                   usable, self._config.groups)]
        return web.json_response({"object": "list", "data": data})

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._call(request, OPENAI)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        return await self._call(request, ANTHROPIC)

    async def _call(self, request: web.Request, wire: Wire) -> web.StreamResponse:
        who = self._identity(request)
        if who is None:
            return self._refuse(wire, "unauthenticated", "no valid API key (Authorization: Bearer "
                          "KEY, or x-api-key; `streamfence keys http-key NAME` prints one)")
        try:
            body = await request.json()
        except (ValueError, RecursionError):  # nested past the parser's depth: not JSON we take
            return self._refuse(wire, "bad_message", "the body is not JSON")
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            return self._refuse(wire, "bad_message", "the body must be a JSON object with a model")
        stream = body.pop("stream", False) is True
        usage = body.pop("stream_options", None)
        include_usage = isinstance(usage, dict) and usage.get("include_usage") is True
        model = body["model"]
        try:
            picked = route(self._config.http, self._config.providers, wire.kind, model,
                           request.headers.get(PROFILE_HEADER), self._config.groups)
        except NoRoute as exc:
            return self._refuse(wire, "unknown_provider", str(exc))
        if picked.kind == wire.kind:
            body["model"] = picked.model
        else:
            try:
                body = translate(body, wire.kind, picked.kind, picked.model)
            except Untranslatable as exc:
                log.info("http: refused a request for %s: %s", picked.target, exc)
                return self._refuse(wire, "bad_message", str(exc))
        resume = request.headers.get("Last-Event-ID", "0")
        if not resume.isdigit():
            return self._refuse(wire, "bad_message", f"Last-Event-ID must be a seq, got {resume!r}")
        client = self._clients.of(who)
        try:
            call_id = await client.submit(
                picked.target, body, options=_options(request.headers.get("traceparent")),
                session_id=request.headers.get(SESSION_HEADER),
                idempotency_key=request.headers.get(IDEMPOTENCY_HEADER))
        except ClientError as exc:
            return _error(wire, exc.code, exc.message)
        except TimeoutError:
            return self._refuse(wire, "overloaded", "the daemon did not answer the submit")
        request[access.CALL_ID] = call_id
        log.info("http call %s: %s via %s", call_id, model, picked.target,
                 extra={"call_id": call_id})
        me = asyncio.current_task()
        try:
            await self._take_over(call_id, me)
            if not stream:
                return await self._whole(client, call_id, model, wire)
            return await self._stream(request, client, call_id, model, wire,
                                      wire.stream(call_id, model, include_usage), int(resume),
                                      detached=IDEMPOTENCY_HEADER in request.headers)
        finally:
            if self._readers.get(call_id) is me:
                del self._readers[call_id]

    async def _take_over(self, call_id: str, me: asyncio.Task[Any] | None) -> None:
        """Make this request the call's only reader. A call's events reach one
        client as one stream, each event handed out once, so two requests
        reading it (an Idempotency-Key sent again while its earlier request
        still reads: a dropped stream whose handler has not noticed yet, or
        the same key twice at once) would each miss what the other took. The
        earlier one ends here, before this one reads (its call runs on: it
        came with the key); the submit just made has the client read the
        call again from seq 1 (client_core.submit)."""
        earlier = self._readers.pop(call_id, None)
        if me is not None:
            self._readers[call_id] = me
        if earlier is not None and earlier is not me and not earlier.done():
            log.info("http call %s: a request with its Idempotency-Key again takes it over",
                     call_id, extra={"call_id": call_id})
            earlier.cancel()
            await asyncio.wait([earlier])

    async def _whole(self, client: AsyncClient, call_id: str, model: str,
                     wire: Wire) -> web.Response:
        done: dict[str, Any] | None = None
        texts: dict[tuple[int, str], list[str]] = {}  # (attempt, kind) -> pieces
        async for event in client.events(call_id):
            if event["op"] == "delta" and event["kind"] in _TEXTS:
                texts.setdefault((event["attempt"], event["kind"]), []).append(event["data"])
            elif event["op"] == "done":
                done = event
                break
        if done is None or done.get("status") in ENDED:
            return _ended(wire, done)
        if done["response"].get("content_omitted"):
            done = _with_content(done, texts)
        return web.json_response(wire.body(call_id, model, done),
                                 headers={CALL_HEADER: call_id})

    async def _stream(self, request: web.Request, client: AsyncClient, call_id: str,
                      model: str, wire: Wire, renderer: Renderer,
                      resume: int, detached: bool) -> web.StreamResponse:
        """The call's events in the wire's SSE; after `resume` (a reconnect's
        Last-Event-ID), the renderer is fed the events up to it too (its state
        is theirs), and only what comes after is sent. A client that goes away
        cancels its call, unless it is `detached` (it gave an Idempotency-Key:
        it may come back for the rest)."""
        response: web.StreamResponse | None = None
        try:
            # The events that came together go out in one write (one send, one
            # read for the HTTP client), the done's with the response's end.
            async for batch in client.event_batches(call_id):
                frames: list[bytes] = []
                done = False
                for event in batch:
                    done = event["op"] == "done"
                    if done and not renderer.started and event.get("status") in ENDED:
                        # Nothing sent yet: the HTTP error the provider would have answered.
                        return _ended(wire, event)
                    frame = renderer.feed(event)
                    if frame and event["seq"] > resume:
                        frames.append(frame)
                    if done:
                        break
                if frames:
                    if response is None:
                        response = await self._start(request, call_id, resume)
                    data = frames[0] if len(frames) == 1 else b"".join(frames)
                    await (response.write_eof(data) if done else response.write(data))
                if done:
                    break
        except (asyncio.CancelledError, ConnectionResetError):
            # The HTTP client went away: the call stops (its provider stream with it).
            if not detached:
                log.info("http call %s: the client went away; cancelling it", call_id,
                         extra={"call_id": call_id})
                with contextlib.suppress(ClientError, TimeoutError):
                    await asyncio.shield(client.cancel(call_id))
            raise
        if response is None:
            return _ended(wire, None)
        await response.write_eof()  # no-op when the done's frames ended it
        return response

    @staticmethod
    async def _start(request: web.Request, call_id: str, resume: int) -> web.StreamResponse:
        """The SSE response, prepared (its head goes out with the first frames)."""
        if resume and ARMED:
            failpoint("gateway.replay_to_live")
        response = _SseResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            CALL_HEADER: call_id})
        await response.prepare(request)
        return response


class _SseResponse(web.StreamResponse):
    """A StreamResponse whose head waits for its first write (aiohttp's Response
    does so; a StreamResponse sends it at prepare): the first frames are ready
    when it is prepared, so head and frames leave in one send."""

    _send_headers_immediately = False


_TEXTS = {"text": "content", "reasoning": "reasoning", "refusal": "refusal"}


def _with_content(done: dict[str, Any], texts: dict[tuple[int, str], list[str]]
                  ) -> dict[str, Any]:
    """A done whose answer was too large to keep in it (`content_omitted`),
    with the answer put back from the call's deltas (its last attempt's)."""
    last = max((attempt for attempt, _ in texts), default=0)
    response = dict(done["response"], content_omitted=False)
    for kind, field in _TEXTS.items():
        pieces = texts.get((last, kind))
        if pieces is not None or field != "refusal":
            response[field] = "".join(pieces or [])
    return dict(done, response=response)


def _error(wire: Wire, code: str, message: str,
           provider: http_errors.ProviderError | None = None) -> web.Response:
    status, body = wire.error(code, message, provider)
    headers = {"x-should-retry": "false"} if code in http_errors.NOT_RETRIED else None
    return web.json_response(body, status=status, headers=headers)


def _ended(wire: Wire, done: dict[str, Any] | None) -> web.Response:
    if done is None:
        return _error(wire, "internal", "the call's events ended without its done")
    return _error(wire, *http_errors.done_error(done))


def _connectable(endpoint: str) -> str:
    """The daemon's endpoint as a client connects to it (a wildcard bind is
    reached on loopback)."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:"):
        if endpoint.startswith(wildcard):
            return "tcp://127.0.0.1:" + endpoint[len(wildcard):]
    return endpoint


def keys_dir_of(config: DaemonConfig) -> str | None:
    """Where the identities' credentials are (None: auth "none")."""
    return str(Path(config.state_dir) / "keys") if config.auth == "curve" else None
