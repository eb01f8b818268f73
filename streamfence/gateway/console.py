"""The web console at `/console` (README "Console", docs/SECURITY.md): the
calls, one call (its attempts, its transcript, its request), the daemon.

The console is a protocol client like the rest of the gateway: it asks the
daemon with the viewer's own identity (`calls`, `status`, `subscribe`,
`cancel`), so the daemon decides what a viewer sees, never the page. Who
views: the identity's HTTP key (gateway/keys.py), as `Authorization:
Bearer KEY` or, for a browser (which cannot set a header on an
EventSource), the cookie the login form sets (HttpOnly, SameSite=Strict,
Path=/console). Under auth "none" every viewer is `local`.

Live updates are SSE from here: a page's stream watches a question shared
by every page asking it (console_polls.py), asked once per `POLL_S` (the
calls list: its page of `calls`; one call: its row and attempts; the
daemon: `status` every `STATUS_POLL_S`), and sends a fragment only when
the answer changed; one call's transcript comes from a subscription
from seq 1 on a client of its own (a call's events go to one reader per
client: the HTTP endpoints' clients are never shared with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import aclosing
from html import escape
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from streamfence.config.identities import identity_named
from streamfence.config.model import DaemonConfig
from streamfence.gateway import console_views as views
from streamfence.gateway.console_polls import Polls
from streamfence.gateway.keys import ClientsByIdentity, HttpKeys, caller
from streamfence.protocol.client_async import AsyncClient
from streamfence.protocol.client_router import ClientError
from streamfence.protocol.credentials import Credentials

log = logging.getLogger("streamfence.gateway.console")

COOKIE = "sf_console"
POLL_S = 1.0  # a live page's questions to the daemon: one per this, at most
MAX_LIVE_PAGES = 16  # live streams one identity may hold open at once (a page each)
STATUS_POLL_S = 2.0
STATIC = Path(__file__).parent / "static"
Write = Callable[[bytes], Awaitable[None]]


class Viewer:
    """Who views: the identity's name, its credentials (None: auth "none")
    and whether the config makes it an admin (for the page's shape only:
    the daemon decides what it answers)."""

    def __init__(self, who: Credentials | str, admin: bool) -> None:
        self.who = who
        self.name = who if isinstance(who, str) else who.name
        self.admin = admin


class Console:
    """Owns the console's routes, its shared polls and a protocol client per
    open transcript; its questions go on the gateway's client of the viewing
    identity (`clients`)."""

    def __init__(self, config: DaemonConfig, keys: HttpKeys | None,
                 clients: ClientsByIdentity, refused: Counter[str]) -> None:
        self._config = config
        self._keys = keys
        self._clients = clients
        self._refused = refused  # the gateway's refusals by code (app.py owns it)
        self._live: Counter[str] = Counter()  # live streams open, by identity
        self._polls = Polls()  # the live pages' questions, shared (console_polls.py)

    def register(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/console", self._index)
        r.add_get("/console/login", self._login_form)
        r.add_post("/console/login", self._login)
        r.add_post("/console/logout", self._logout)
        r.add_get("/console/calls", self._calls)
        r.add_get("/console/calls/events", self._calls_events)
        r.add_get("/console/calls/{call_id}", self._call)
        r.add_get("/console/calls/{call_id}/events", self._call_events)
        r.add_post("/console/calls/{call_id}/cancel", self._cancel)
        r.add_get("/console/daemon", self._daemon)
        r.add_get("/console/daemon/events", self._daemon_events)
        r.add_static("/console/static", STATIC)
        app.on_cleanup.append(self._close)

    async def _close(self, _app: web.Application) -> None:
        await self._polls.close()

    # ---- who views ----------------------------------------------------------------

    def _viewer(self, request: web.Request) -> Viewer | None:
        who = caller(self._keys, request.headers.get("Authorization", ""),
                     request.cookies.get(COOKIE, ""))
        if who is None:
            return None
        name = who if isinstance(who, str) else who.name
        return Viewer(who, identity_named(name, self._config.identities).is_admin)

    def _seen(self, request: web.Request) -> Viewer:
        """The viewer, or a redirect to the login form."""
        viewer = self._viewer(request)
        if viewer is None:
            raise web.HTTPSeeOther("/console/login")
        return viewer

    @contextlib.contextmanager
    def _streaming(self, request: web.Request) -> Iterator[Viewer]:
        """The viewer of a live stream, counted while it is open: one identity
        holds at most MAX_LIVE_PAGES (each is a poll, a transcript a connection
        of its own to the daemon), so one cannot flood the daemon for all."""
        viewer = self._viewer(request)
        if viewer is None:
            raise web.HTTPUnauthorized(text="log in first")
        if self._live[viewer.name] >= MAX_LIVE_PAGES:
            self._refused["too_many_live_pages"] += 1
            raise web.HTTPTooManyRequests(text=f"too_many_live_pages: {viewer.name} has "
                                          f"{MAX_LIVE_PAGES} live console pages open; "
                                          "close one")
        self._live[viewer.name] += 1
        try:
            yield viewer
        finally:
            self._live[viewer.name] -= 1
            if not self._live[viewer.name]:
                del self._live[viewer.name]

    def _client(self, viewer: Viewer) -> AsyncClient:
        return self._clients.of(viewer.who)

    # ---- pages ----------------------------------------------------------------------

    async def _index(self, request: web.Request) -> web.Response:
        self._seen(request)
        raise web.HTTPSeeOther("/console/calls")

    async def _login_form(self, _request: web.Request) -> web.Response:
        return _html(views.login_page(None))

    async def _login(self, request: web.Request) -> web.Response:
        form = await request.post()
        key = str(form.get("key", "")).strip()
        if self._keys is not None and (not key or self._keys.identify(key) is None):
            log.info("console: a login with a key that names no identity")
            return _html(views.login_page("That key names no identity."), status=401)
        response = web.HTTPSeeOther("/console/calls")
        if self._keys is not None:
            response.set_cookie(COOKIE, key, path="/console", httponly=True, samesite="Strict")
        raise response

    async def _logout(self, _request: web.Request) -> web.Response:
        response = web.HTTPSeeOther("/console/login")
        response.del_cookie(COOKIE, path="/console")
        raise response

    async def _calls(self, request: web.Request) -> web.Response:
        viewer = self._seen(request)
        filters = _filters(request)
        try:
            reply = await self._client(viewer).calls(**_query(filters), limit=50)
        except (ClientError, TimeoutError) as exc:
            return self._trouble(viewer, "Calls", exc)
        live = "/console/calls/events?" + request.query_string
        return _html(views.page("Calls", viewer.name, viewer.admin,
                                views.calls_body(filters, viewer.admin, reply), live))

    async def _call(self, request: web.Request) -> web.Response:
        viewer = self._seen(request)
        call_id = request.match_info["call_id"]
        try:
            call = await self._one(self._client(viewer), call_id)
        except (ClientError, TimeoutError) as exc:
            return self._trouble(viewer, "Call", exc)
        if call is None:
            return _html(views.page("No such call", viewer.name, viewer.admin,
                                    "<h1>No such call</h1><p>None of the calls you may see "
                                    "has that id.</p>"), status=404)
        return _html(views.page(f"Call {call_id[:12]}", viewer.name, viewer.admin,
                                views.call_body(call), f"/console/calls/{call_id}/events"))

    async def _cancel(self, request: web.Request) -> web.Response:
        viewer = self._seen(request)
        origin = request.headers.get("Origin")
        if origin is not None and urlsplit(origin).netloc != request.host:
            raise web.HTTPForbidden(text="a cancel from another origin")
        call_id = request.match_info["call_id"]
        try:
            await self._client(viewer).cancel(call_id)
        except (ClientError, TimeoutError) as exc:
            return self._trouble(viewer, "Cancel", exc)
        raise web.HTTPSeeOther(f"/console/calls/{call_id}")

    async def _daemon(self, request: web.Request) -> web.Response:
        viewer = self._seen(request)
        try:
            status = await self._client(viewer).status()
        except (ClientError, TimeoutError) as exc:
            return self._trouble(viewer, "Daemon", exc)
        body = f"<h1>Daemon</h1><div id=daemon>{views.daemon_fragment(status)}</div>"
        return _html(views.page("Daemon", viewer.name, viewer.admin, body,
                                "/console/daemon/events", current="daemon"))

    def _trouble(self, viewer: Viewer, title: str, exc: Exception) -> web.Response:
        what = f"{exc.code}: {exc.message}" if isinstance(exc, ClientError) else \
            "the daemon did not answer in time"
        body = f"<h1>{title}</h1><p class=error role=alert>{escape(what)}</p>"
        return _html(views.page(title, viewer.name, viewer.admin, body), status=502)

    @staticmethod
    async def _one(client: AsyncClient, call_id: str) -> dict[str, Any] | None:
        calls: list[dict[str, Any]] = (await client.calls(call_id=call_id, limit=1))["calls"]
        return calls[0] if calls else None

    # ---- live updates (SSE) ---------------------------------------------------------

    async def _calls_events(self, request: web.Request) -> web.StreamResponse:
        with self._streaming(request) as viewer:
            query = _query(_filters(request))
            client = self._client(viewer)
            response = await _sse(request)

            async def ask() -> list[dict[str, Any]]:
                calls: list[dict[str, Any]] = (await client.calls(**query, limit=50))["calls"]
                return calls
            key = (viewer.name, "calls", tuple(sorted(query.items())))
            async with aclosing(self._polls.watch(key, ask, POLL_S)) as answers:
                async for calls in answers:
                    await response.write(_frame("trouble", str(calls))
                                         if isinstance(calls, Exception)
                                         else _frame("rows", views.call_rows(calls)))
            return response

    async def _call_events(self, request: web.Request) -> web.StreamResponse:
        with self._streaming(request) as viewer:
            call_id = request.match_info["call_id"]
            response = await _sse(request)
            lock = asyncio.Lock()

            async def write(data: bytes) -> None:
                async with lock:
                    await response.write(data)

            # This transcript's own reader: see the module docstring.
            reader = self._clients.fresh(viewer.who, timeout_s=10.0)
            transcript = asyncio.create_task(_transcript(reader, call_id, write))
            try:
                await self._follow_call(viewer.name, self._client(viewer), call_id, transcript,
                                        write)
                await transcript
                await write(_frame("end", "over"))  # else the EventSource reconnects
            finally:
                transcript.cancel()
                await asyncio.wait([transcript])
                reader.close()
            return response

    async def _follow_call(self, viewer: str, client: AsyncClient, call_id: str,
                           transcript: asyncio.Task[None], write: Write) -> None:
        """The call's row and attempts, sent when they change, until it is
        over and its transcript sent."""
        key = (viewer, "call", call_id)
        answers = self._polls.watch(key, lambda: self._one(client, call_id), POLL_S)
        async with aclosing(answers):
            async for call in answers:
                if isinstance(call, Exception):
                    await write(_frame("trouble", str(call)))
                    continue
                if call is not None:
                    await write(_frame("call", json.dumps({
                        "state": call["state"], "badge": views.state_badge(call["state"]),
                        "attempts": views.attempts_fragment(call),
                        "live": call["state"] in views.LIVE_STATES})))
                if call is None or call["state"] not in views.LIVE_STATES:
                    await transcript  # the last answer: the transcript's end follows
                    return

    async def _daemon_events(self, request: web.Request) -> web.StreamResponse:
        with self._streaming(request) as viewer:
            client = self._client(viewer)
            response = await _sse(request)
            last = ""
            answers = self._polls.watch((viewer.name, "status"), client.status, STATUS_POLL_S)
            async with aclosing(answers):
                async for status in answers:
                    if isinstance(status, Exception):
                        await response.write(_frame("trouble", str(status)))
                        continue
                    fragment = views.daemon_fragment(status)
                    if fragment != last:  # a reply differs in its ref and uptime at least
                        await response.write(_frame("daemon", fragment))
                        last = fragment
            return response


async def _transcript(client: AsyncClient, call_id: str, write: Write) -> None:
    """The call's events from seq 1, as a subscriber sees them, each an SSE
    event of its own (`delta`, `reset`, `done`), until the done."""
    try:
        await client.subscribe(call_id, 0)
        async for batch in client.event_batches(call_id):
            frames = []
            for event in batch:
                op = event["op"]
                if op == "delta":
                    frames.append(_frame("delta", json.dumps(
                        {"attempt": event["attempt"], "seq": event["seq"],
                         "kind": event["kind"], "data": event["data"]})))
                elif op in ("reset", "done"):
                    fields = ("attempt", "seq") if op == "reset" else (
                        "seq", "status", "error", "attempts")
                    frames.append(_frame(op, json.dumps({k: event.get(k) for k in fields})))
            await write(b"".join(frames))
            if batch and batch[-1]["op"] == "done":
                return
    except (ClientError, TimeoutError) as exc:
        await write(_frame("trouble", str(exc)))


def _filters(request: web.Request) -> dict[str, str]:
    q = request.query
    state = q.get("state", "")
    return {"state": state if state in views.STATES else "",
            **{key: q.get(key, "").strip() for key in ("identity", "provider", "search",
                                                        "before")}}


def _query(filters: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in filters.items() if value}


async def _sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    await response.write(b": live\n\n")  # the head goes now: the page shows it is live
    return response


def _frame(event: str, data: str) -> bytes:
    lines = "".join(f"data: {line}\n" for line in data.split("\n"))
    return f"event: {event}\n{lines}\n".encode()


def _html(text: str, status: int = 200) -> web.Response:
    return web.Response(text=text, status=status, content_type="text/html",
                        headers={"Cache-Control": "no-store",
                                 "Content-Security-Policy": "default-src 'self'; "
                                 "style-src 'self' 'unsafe-inline'; frame-ancestors 'none'",
                                 "X-Content-Type-Options": "nosniff"})
