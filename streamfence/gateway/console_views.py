"""The console's HTML (gateway/console.py serves it): whole pages and the
fragments its live updates replace, built from the daemon's replies.

Everything that comes from a reply is escaped here (`_e`): a call's text,
ids, names and errors are untrusted, and the browser only ever inserts
these fragments or sets text (static/console.js). No template engine: the
pages are a few tables, and a function per piece keeps each one testable.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from html import escape
from typing import Any
from urllib.parse import urlencode

STATES = ("live", "done", "completed", "partial", "failed", "cancelled")
LIVE_STATES = frozenset({"queued", "authorizing", "running", "fencing", "backoff",
                         "finishing"})
# How an attempt ended (the journal's `how`), as the timeline says it.
ENDINGS = {
    "ended": "ended: its final was accepted",
    "stale": "stale kill: no chunk within the stale timeout; fenced, then killed",
    "worker_died": "its worker died; fenced",
    "final_refused": "its final was refused; fenced, then killed",
    "deadline": "the call's deadline passed; fenced, then killed",
    "sink_restarted": "the sink restarted; fenced",
    "cancelled": "cancelled; fenced, then killed",
    "cluster_lost": "another host took the call over; fenced, then killed",
    "rebound": "rebound: the sink restarted, the attempt goes on as the next epoch",
}


def _e(value: Any) -> str:
    return escape("" if value is None else str(value), quote=True)


def page(title: str, viewer: str, admin: bool, body: str, live: str | None = None,
         current: str = "calls") -> str:
    """A whole page: the header (viewer, tabs, log-out), `body`, and, with
    `live`, the SSE address its script follows."""
    tabs = "".join(
        f'<a href="/console/{name}"{" class=current" if name == current else ""}>{label}</a>'
        for name, label in (("calls", "Calls"), ("daemon", "Daemon")))
    who = (f'<span class="who">{_e(viewer)} <small>{"admin" if admin else "client"}</small>'
           '</span><form method="post" action="/console/logout"><button>Log out</button></form>')
    data = f' data-live="{_e(live)}"' if live else ""
    return ("<!doctype html><html lang=en><head><meta charset=utf-8>"
            '<meta name=viewport content="width=device-width, initial-scale=1">'
            f"<title>{_e(title)} · streamfence</title>"
            '<link rel=stylesheet href="/console/static/console.css"></head>'
            f'<body{data}><header><a class=brand href="/console/calls">streamfence</a>'
            f"<nav>{tabs}</nav>{who}</header><main>{body}</main>"
            '<script src="/console/static/console.js"></script></body></html>')


def login_page(error: str | None) -> str:
    note = f'<p class=error role=alert>{_e(error)}</p>' if error else ""
    return ("<!doctype html><html lang=en><head><meta charset=utf-8>"
            '<meta name=viewport content="width=device-width, initial-scale=1">'
            "<title>Log in · streamfence</title>"
            '<link rel=stylesheet href="/console/static/console.css"></head><body>'
            '<header><span class=brand>streamfence</span></header><main class=login>'
            f"<h1>Console</h1>{note}"
            '<form method=post action="/console/login">'
            '<label>HTTP key <input type=password name=key id=key autocomplete=off '
            'placeholder="sf-NAME.…" required></label><button>Log in</button></form>'
            "<p class=hint><code>streamfence keys http-key NAME</code> prints an "
            "identity's key. An admin sees every call, a client its own.</p>"
            "</main></body></html>")


# ---- the calls ---------------------------------------------------------------------

def calls_body(filters: Mapping[str, str], admin: bool, reply: Mapping[str, Any]) -> str:
    options = "".join(f"<option{' selected' if filters.get('state') == s else ''}>{s}</option>"
                      for s in STATES)
    ident = (f'<label>Identity <input name=identity value="{_e(filters.get("identity"))}">'
             "</label>" if admin else "")
    form = ('<form class=filters method=get action="/console/calls">'
            f'<label>State <select name=state><option value="">any</option>{options}'
            f"</select></label>{ident}"
            f'<label>Provider <input name=provider value="{_e(filters.get("provider"))}">'
            "</label>"
            f'<label>Search <input name=search value="{_e(filters.get("search"))}" '
            'placeholder="call or session id"></label><button>Filter</button></form>')
    head = ("<tr><th>Call</th><th>State</th><th class=wide>Identity</th>"
            "<th class=wide>Provider / model</th><th class=num>Att.</th><th class=num>Age</th>"
            "<th class=\"num ttft\">First token</th><th class=num>Output</th></tr>")
    more = ""
    if reply.get("next"):
        query = urlencode({**{k: v for k, v in filters.items() if v}, "before": reply["next"]})
        more = f'<p class=more><a href="/console/calls?{_e(query)}">Older calls →</a></p>'
    return (f"<h1>Calls</h1>{form}<div class=scroll><table class=calls><thead>{head}</thead>"
            f"<tbody id=rows>{call_rows(reply['calls'])}</tbody></table></div>{more}"
            '<p class=live id=live aria-live=polite></p>')


def call_rows(calls: Iterable[Mapping[str, Any]], now: float | None = None) -> str:
    """The table's rows (the fragment its live updates replace)."""
    now = time.time() if now is None else now
    rows = [_call_row(call, now) for call in calls]
    return "".join(rows) or '<tr><td colspan=8 class=empty>No calls.</td></tr>'


def _call_row(c: Mapping[str, Any], now: float) -> str:
    call_id = c["call_id"]
    session = f"<div class=sub>{_e(c['session_id'])}</div>" if c.get("session_id") else ""
    model = f"<div class=sub>{_e(c['model'])}</div>" if c.get("model") else ""
    ttft = "" if c.get("first_chunk_ms") is None else f"{c['first_chunk_ms']:.0f} ms"
    output = (f"{c['chunks']} chunks" if c["state"] in LIVE_STATES
              else f"{c.get('chars') or 0} chars")
    return (f'<tr data-call="{_e(call_id)}" data-state="{_e(c["state"])}">'
            f'<td><a href="/console/calls/{_e(call_id)}"><code>{_e(call_id[:12])}</code></a>'
            f"{session}</td><td>{state_badge(c['state'])}</td>"
            f"<td class=wide>{_e(c['identity'])}</td>"
            f"<td class=wide>{_e(c['provider'])}{model}</td><td class=num>{c['attempts']}</td>"
            f'<td class=num data-created="{c["created"]}">{age(now - c["created"])}</td>'
            f'<td class="num ttft">{ttft}</td><td class=num>{output}</td></tr>')


def state_badge(state: str) -> str:
    return f'<span class="state s-{_e(state)}">{_e(state)}</span>'


def age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m"
    if seconds < 86400:
        return f"{seconds // 3600:.0f}h"
    return f"{seconds // 86400:.0f}d"


# ---- one call ----------------------------------------------------------------------

def call_body(call: Mapping[str, Any]) -> str:
    call_id = call["call_id"]
    facts = "".join(f"<dt>{label}</dt><dd>{value}</dd>" for label, value in (
        ("State", f"<span id=call-state>{state_badge(call['state'])}</span>"),
        ("Identity", _e(call["identity"])), ("Session", _e(call.get("session_id") or "—")),
        ("Provider", _e(call["provider"])), ("Model", _e(call.get("model") or "—")),
        (("Taken over", f"{_e(_clock(call['created']))} from host "
          f"<b>{_e(call['taken_from'])}</b> at epoch {_e(call.get('taken_epoch'))}")
         if call.get("taken_from") else ("Accepted", _e(_clock(call["created"])))),
        ("Finished", _e(_clock(call["finished"]) if call.get("finished") else "—"))))
    cancel = ""
    if call["state"] in LIVE_STATES:
        cancel = (f'<form method=post action="/console/calls/{_e(call_id)}/cancel" '
                  "id=cancel><button class=danger>Cancel call</button></form>")
    request = call.get("request")
    shown = ("(kept as a file: too large to show here)" if request is None
             else json.dumps(request, indent=2, ensure_ascii=False))
    options = {k: v for k, v in (call.get("options") or {}).items() if v is not None}
    return (f"<h1>Call <code class=id>{_e(call_id)}</code></h1>{cancel}"
            f"<dl class=facts>{facts}</dl>"
            f"<h2>Attempts</h2><div id=attempts>{attempts_fragment(call)}</div>"
            "<h2>Transcript</h2><p class=hint>As a subscriber saw it, from seq 1; a reset "
            "voids the text before it.</p><div id=transcript class=transcript></div>"
            "<p id=ended class=ended></p>"
            f"<h2>Request</h2><pre class=request>{_e(shown)}</pre>"
            f"<h3>Options</h3><pre class=request>{_e(json.dumps(options))}</pre>")


def attempts_fragment(call: Mapping[str, Any]) -> str:
    """The attempts on a timeline from the call's acceptance here: each one's
    bar (start to end, its first chunk marked), the back-off before a retry,
    and how each ended; in cluster mode, where the call came from (a take-over)
    or went (moved to another host)."""
    attempts: list[Mapping[str, Any]] = call.get("attempt_rows") or []
    items = [_taken(call)] if call.get("taken_from") else []
    if attempts:
        start = call["created"]
        end = max([call.get("finished") or 0.0,
                   time.time() if call["state"] in LIVE_STATES else 0.0,
                   *(a["ended"] or a["started"] for a in attempts)])
        span, previous_end = max(end - start, 1e-3), None
        for a in attempts:
            if previous_end is not None:
                items.append(f"<li class=gap>back-off {a['started'] - previous_end:.2f} s, "
                             "then a retry</li>")
            items.append(_attempt(a, start, span))
            previous_end = a["ended"]
    elif call["state"] != "moved":
        items.append("<li class=hint>No attempt has started here yet.</li>")
    if call["state"] == "moved":
        items.append("<li class=moved data-how=moved>Moved: another host of the cluster took "
                     "the call over; the attempts after that are on that host's console.</li>")
    return f"<ol class=timeline>{''.join(items)}</ol>"


def _taken(call: Mapping[str, Any]) -> str:
    epoch, host = call.get("taken_epoch"), _e(call["taken_from"])
    ran = "" if not isinstance(epoch, int) or epoch < 2 else \
        "attempt 1" if epoch == 2 else f"attempts 1–{epoch - 1}"
    before = (f"{ran} ran on host <b>{host}</b> (its console shows them)" if ran
              else f"it ran on host <b>{host}</b>")
    return (f'<li class=takeover data-from="{host}" data-epoch="{_e(epoch)}">Taken over from '
            f"host <b>{host}</b> at epoch {_e(epoch)}: {before}; the attempts below ran "
            "here.</li>")


def _attempt(a: Mapping[str, Any], start: float, span: float) -> str:
    left = 100.0 * (a["started"] - start) / span
    width = max(0.8, 100.0 * ((a["ended"] or time.time()) - a["started"]) / span)
    first = ""
    if a.get("first_chunk_ms") is not None:
        at = 100.0 * (a["started"] + a["first_chunk_ms"] / 1000.0 - start) / span
        first = f'<i class=first style="left:{at:.2f}%" title="first chunk"></i>'
    how = a.get("how")
    ending = "running" if a["ended"] is None else ENDINGS.get(how or "", how or "ended")
    kind = "running" if a["ended"] is None else ("ok" if how == "ended" else "fenced")
    error = (f" ({_e(a['error_code'])})" if a.get("error_code") else
             f" (finish: {_e(a['finish_reason'])})" if a.get("finish_reason") else "")
    figures = " · ".join(f"{a[k]} {label}" for k, label in (
        ("chunks", "chunks"), ("deltas", "deltas"), ("chars", "chars"),
        ("refused", "refused by the fence")) if a.get(k) is not None)
    ttft = ("" if a.get("first_chunk_ms") is None
            else f" · first chunk after {a['first_chunk_ms']:.0f} ms")
    took = "" if a["ended"] is None else f", {a['ended'] - a['started']:.2f} s"
    return (f'<li class="attempt a-{kind}" data-attempt="{a["attempt"]}" '
            f'data-how="{_e(how)}"><div class=line><b>Attempt {a["attempt"]}</b> '
            f"<span class=pid>worker pid {_e(a.get('worker_pid') or '—')}</span> "
            f"<span class=how>{_e(ending)}{error}</span></div>"
            f'<div class=bar><span style="left:{left:.2f}%;width:{width:.2f}%"></span>{first}'
            f"</div><div class=sub>started +{a['started'] - start:.2f} s{took}{ttft}"
            f"{' · ' + figures if figures else ''}</div></li>")


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


# ---- the daemon --------------------------------------------------------------------

# The status reply's sections: small ones side by side, then the wide ones,
# then the long ones folded.
SMALL = (("processes", "Processes"), ("pool", "Pool"), ("storage", "Storage"),
         ("connections", "Connections"))
WIDE = (("workers", "Workers"), ("calls", "Calls"), ("breakers", "Breakers"))
FOLDED = (("usage", "Usage"), ("sink", "Sink"), ("counters", "Counters"),
          ("histograms", "Histograms"))


def daemon_fragment(status: Mapping[str, Any]) -> str:
    """The `status` reply, a section per owner (the fragment its live updates
    replace); a client's reply has only its own calls."""
    facts = "".join(f"<dt>{_e(k)}</dt><dd>{_e(status.get(k))}</dd>" for k in (
        "identity", "role", "version", "uptime_s", "config_path", "state_dir")
        if k in status)
    parts = [f"<dl class=facts>{facts}</dl>", _summary(status), "<div class=grid>"]
    parts += [f"<section><h2>{title}</h2>{_value(status[key])}</section>"
              for key, title in SMALL if key in status]
    parts.append("</div>")
    if status.get("cluster"):
        parts.append(_cluster(status["cluster"]))
    parts += [f"<section><h2>{title}</h2>{_value(status[key])}</section>"
              for key, title in WIDE if key in status]
    parts += [f"<details><summary>{title}</summary>{_value(status[key])}</details>"
              for key, title in FOLDED if key in status]
    return "".join(parts)


def _cluster(cluster: Mapping[str, Any]) -> str:
    """Cluster mode: the hosts (this one first), their leases and the calls
    each owns, then this host's counts."""
    def row(host: str, lease: str, lost: bool, owned: Any) -> str:
        return (f'<tr data-host="{_e(host)}"><td><code>{_e(host)}</code></td>'
                f'<td class="{"s-failed" if lost else ""}">{lease}</td>'
                f"<td class=num>{_e('—' if owned is None else owned)}</td></tr>")
    age = cluster.get("lease_age_s")
    rows = [row(cluster["host"], ("this host · " + ("not beaten yet" if age is None else
                f"beat {age:.1f} s ago")) + ("" if cluster.get("connected") else
                                             " · not connected"),
                False, cluster.get("calls_owned"))]
    for host, seen in (cluster.get("hosts") or {}).items():
        lost = bool(seen.get("lease_lost"))
        lease = f"beat {seen.get('beat_age_s', 0):.1f} s ago" + (
            " · lease lost: its calls taken over" if lost else "")
        rows.append(row(host, lease, lost, seen.get("calls_owned")))
    rest = {k: v for k, v in cluster.items()
            if k not in ("host", "hosts", "lease_age_s", "connected", "calls_owned")}
    return ("<section id=cluster><h2>Cluster</h2><div class=scroll><table class=hosts>"
            "<thead><tr><th>host</th><th>lease</th><th>calls owned</th></tr></thead>"
            f"{''.join(rows)}</table></div>{_value(rest)}</section>")


def _summary(status: Mapping[str, Any]) -> str:
    """The figures an operator looks for first, as a strip of tiles."""
    tiles: list[tuple[str, str, str]] = []  # (label, value, kind: ok, warn or bad)
    workers = status.get("workers")
    if isinstance(workers, list):
        busy = sum(1 for w in workers if w.get("state") == "busy")
        tiles.append(("workers", f"{busy} busy · {len(workers) - busy} other", "ok"))
    calls = status.get("calls") or {}
    tiles.append(("calls", f"{calls.get('active', 0)} active · {calls.get('queued', 0)} queued",
                  "ok"))
    if "breakers" in status:
        opened = sum(1 for b in status["breakers"] or [] if b.get("state") == "open")
        tiles.append(("breakers", f"{opened} open", "bad" if opened else "ok"))
    if "storage" in status:
        fault = status["storage"]
        tiles.append(("storage", "ok" if fault is None else str(fault.get("code", "fault")),
                      "ok" if fault is None else "bad"))
    if "sink_answered" in status:
        answered = status["sink_answered"]
        tiles.append(("sink", "answered" if answered else "silent", "ok" if answered else "warn"))
    if "cluster" in status:
        tiles.append(("cluster", "off" if status["cluster"] is None else "on", "ok"))
    return "<ul class=tiles>" + "".join(
        f"<li class=t-{kind}><small>{_e(label)}</small><b>{_e(value)}</b></li>"
        for label, value, kind in tiles) + "</ul>"


def _value(value: Any) -> str:
    """A reply's value as HTML: a map as a two-column table, a list of maps as
    a table with a column per key, anything else as text."""
    if isinstance(value, Mapping):
        if not value:
            return "<p class=hint>none</p>"
        rows = "".join(f"<tr><th>{_e(k)}</th><td>{_value(v)}</td></tr>"
                       for k, v in value.items())
        return f"<div class=scroll><table class=kv>{rows}</table></div>"
    if isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
        keys = list(dict.fromkeys(k for v in value for k in v))
        head = "".join(f"<th>{_e(k)}</th>" for k in keys)
        body = "".join("<tr>" + "".join(f"<td>{_cell(k, v.get(k))}</td>" for k in keys) + "</tr>"
                       for v in value)
        return f"<div class=scroll><table><thead><tr>{head}</tr></thead>{body}</table></div>"
    if value is None or value == []:
        return "<span class=hint>none</span>"
    return _e(json.dumps(value) if isinstance(value, list) else value)


def _cell(key: str, value: Any) -> str:
    if key == "call_id" and isinstance(value, str):
        return f'<a href="/console/calls/{_e(value)}"><code>{_e(value[:12])}</code></a>'
    return _e(json.dumps(value) if isinstance(value, (Mapping, list)) else value)
