"""The console's HTML (gateway/console_views.py) from replies as the daemon
sends them, without a process: everything from a reply is escaped, the
timeline says how each attempt ended, the daemon page takes a client's
reply and an admin's."""

from __future__ import annotations

from typing import Any

from streamfence.gateway import console_views as views

HOSTILE = '<script>alert(1)</script>"\'&'


def _call(**fields: Any) -> dict[str, Any]:
    call = {"call_id": "c" * 32, "identity": "alice", "session_id": None, "provider": "emu",
            "model": "gpt", "state": "completed", "epoch": 1, "attempts": 1,
            "created": 1000.0, "finished": 1002.0, "first_chunk_ms": 12.7, "chunks": 8,
            "chars": 40}
    call.update(fields)
    return call


def test_a_row_escapes_every_field_from_the_reply() -> None:
    html = views.call_rows([_call(identity=HOSTILE, session_id=HOSTILE, provider=HOSTILE,
                                  model=HOSTILE, state=HOSTILE)], now=1010.0)
    assert "<script>" not in html and html.count("&lt;script&gt;") >= 5
    assert '"\'&' not in html


def test_a_row_shows_chunks_while_live_and_chars_once_ended() -> None:
    assert "8 chunks" in views.call_rows([_call(state="running")], now=1010.0)
    ended = views.call_rows([_call()], now=1010.0)
    assert "40 chars" in ended and "13 ms" in ended and ">10s<" in ended
    assert "No calls." in views.call_rows([])


def test_the_timeline_says_how_each_attempt_ended() -> None:
    attempts = [
        {"attempt": 1, "started": 1000.0, "ended": 1001.0, "worker_pid": 41, "how": "stale",
         "finish_reason": None, "error_code": None, "first_chunk_ms": None, "chunks": None,
         "deltas": None, "chars": 20},
        {"attempt": 2, "started": 1001.2, "ended": 1002.0, "worker_pid": 42, "how": "ended",
         "finish_reason": "stop", "error_code": None, "first_chunk_ms": 5.0, "chunks": 9,
         "deltas": 8, "chars": 40}]
    html = views.attempts_fragment(_call(attempt_rows=attempts))
    assert html.index("stale kill") < html.index("back-off 0.20 s") < html.index("Attempt 2")
    assert "worker pid 41" in html and "(finish: stop)" in html and "first chunk" in html
    assert "No attempt" in views.attempts_fragment(_call(state="queued"))


def test_the_call_page_escapes_the_request_and_offers_cancel_while_live() -> None:
    live = views.call_body(_call(state="running", request={"messages": [HOSTILE]},
                                 options={"on_partial": "restart", "deadline_s": None}))
    assert "<script>" not in live and "id=cancel" in live
    assert '{"on_partial": "restart"}' in live.replace("&quot;", '"')
    ended = views.call_body(_call(request=None))
    assert "id=cancel" not in ended and "kept as a file" in ended


def test_the_daemon_page_takes_a_clients_reply_and_an_admins() -> None:
    client = views.daemon_fragment({"identity": "alice", "role": "client", "calls": {
        "active": 1, "queued": 0, "running": [{"call_id": "c" * 32, "owner": HOSTILE}]}})
    assert "1 active" in client and "Workers" not in client and "<script>" not in client
    assert 'href="/console/calls/' + "c" * 32 in client
    admin = views.daemon_fragment({
        "identity": "local", "role": "admin", "workers": [{"state": "busy"}, {"state": "idle"}],
        "breakers": [{"state": "open"}], "storage": {"code": "storage_full"},
        "sink_answered": False, "cluster": None, "counters": {"x": 1}, "calls": {},
        "connections": {"live": 7, "max": 4096}, "usage": [{"identity": "alice", "calls": 3}]})
    assert "1 busy" in admin and "1 open" in admin and "storage_full" in admin
    assert "t-bad" in admin and "silent" in admin and "<details>" in admin
    assert "<h2>Connections</h2>" in admin and "4096" in admin
    assert "<summary>Usage</summary>" in admin and "alice" in admin


def test_the_daemon_page_lists_the_cluster_s_hosts_this_one_first() -> None:
    page = views.daemon_fragment({"identity": "local", "role": "admin", "calls": {}, "cluster": {
        "host": "host-a", "lease_s": 2.0, "lease_age_s": 0.4, "connected": True,
        "calls_owned": 3, "takes_won": 1, "hosts": {
            "host-b": {"beat_age_s": 0.2, "lease_lost": False, "calls_owned": 5},
            HOSTILE: {"beat_age_s": 9.0, "lease_lost": True, "calls_owned": None}}}})
    rows = page[page.index("<table class=hosts>"):]
    assert rows.index('data-host="host-a"') < rows.index('data-host="host-b"')
    assert "this host · beat 0.4 s ago" in page and "lease lost" in page
    assert "<script>" not in page and "takes_won" in page


def test_the_login_page_escapes_its_message() -> None:
    assert "<script>" not in views.login_page(HOSTILE)


def test_a_call_taken_over_says_from_where_and_a_call_taken_away_says_moved() -> None:
    attempt = {"attempt": 3, "started": 1000.5, "ended": 1001.5, "worker_pid": 7,
               "how": "ended", "first_chunk_ms": 5.0, "chunks": 4}
    taken = views.call_body(_call(taken_from=HOSTILE, taken_epoch=3, attempt_rows=[attempt]))
    assert "Taken over" in taken and "Accepted" not in taken
    assert "attempts 1–2 ran on host" in taken and "<script>" not in taken
    assert 'data-attempt="3"' in taken
    assert "attempt 1 ran on host" in views.attempts_fragment(
        _call(taken_from="host-a", taken_epoch=2))
    moved = views.attempts_fragment(_call(state="moved", attempt_rows=[dict(attempt, attempt=1)]))
    assert "<li class=moved" in moved and "No attempt" not in moved
    assert "Taken over" not in views.call_body(_call())
