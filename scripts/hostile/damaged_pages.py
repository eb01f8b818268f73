"""Damaged pages (issue 29, item 7): a page of transcript.db overwritten
under a finished call while the daemon runs, and that call replayed again
and again; then, once the probe is done, a page of journal.db.

Each replay must end with an error event (`storage_error`), never a sink
restart; the probe's calls go on beside them. The journal's damage then
refuses a submit with `storage_error` while `status` answers and the
supervisor stays up; each file's damage is logged once, with no traceback.
(The journal's comes after the probe: it refuses every submit by design.)
The pages are damaged as tests/test_damage_at_run_time_e2e.py does.
"""

from __future__ import annotations

from pathlib import Path

from scripts.hostile import Attack, request
from streamfence.devtools import pages
from streamfence.protocol.client import Client, ClientError

NAME = "damaged pages"
ABOUT = "a transcript page under a finished call overwritten, the call replayed on and on"


def _first_leaf_of(path: Path, call_id: str) -> int:
    """The first leaf of `events` holding the call's rows, not the table's last."""
    for page in pages.leaves(path, "events")[:-1]:
        if call_id.encode() in pages.page_bytes(path, page):
            return page
    raise RuntimeError(f"no leaf page but the last holds call {call_id}")


def attack(a: Attack) -> None:
    creds = a.register("damager")
    with Client(a.endpoint, 10.0, credentials=creds) as c:
        a.script("victim", 300, 0.005)  # paced: its events fill many small rows
        victim = c.submit("emu", request("victim"))
        c.result(victim, wait_s=30.0)
    pages.scribble(a.state_dir / "transcript.db", _first_leaf_of(a.state_dir / "transcript.db",
                                                            victim))
    a.count("pages overwritten")
    while not a.stop.wait(0.2):
        with Client(a.endpoint, 10.0, credentials=creds) as fresh:  # never read the call
            fresh.subscribe(victim, from_seq=0)
            try:
                list(fresh.events(victim, timeout_s=5.0))
                a.count("replays served whole (damage not met)")
            except ClientError as exc:
                a.count(f"replays ended {exc.code}")
            except TimeoutError:
                a.count("replays timed out")


def checks(a: Attack) -> list[tuple[str, bool]]:
    daemon = a.daemon
    out: list[tuple[str, bool]] = []
    ended = a.counts.get("replays ended storage_error", 0)
    with daemon.client() as admin:
        status = admin.status()
        restarts = status["counters"].get("sink_restarts", 0)
        damaged = status["sink"].get("replays_damaged")
        out.append((f"every replay ended storage_error ({ended} of "
                    f"{sum(n for k, n in a.counts.items() if k.startswith('replays'))}), "
                    f"sink replays_damaged {damaged}, sink restarts {restarts}",
                    ended > 0 and damaged == ended and restarts == 0
                    and set(a.counts) == {"pages overwritten", "replays ended storage_error"}))
        journal = a.state_dir / "journal.db"
        # (owner, idempotency_key): every new call's row goes into it
        pages.scribble(journal, pages.root_page(journal, "sqlite_autoindex_calls_2"))
        a.script("after-journal", 3)
        codes = []
        for _ in range(3):
            try:
                admin.submit("emu", request("after-journal"))
                codes.append("accepted")
            except ClientError as exc:
                codes.append(exc.code)
            except TimeoutError:
                codes.append("no reply")
        alive = daemon.proc is not None and daemon.proc.poll() is None
        try:
            storage = admin.status()["storage"]
        except TimeoutError:
            storage = {"code": "no status reply"}
        out.append((f"journal page overwritten: submits {codes}, status storage "
                    f"{storage and storage['code']}, supervisor alive {alive}",
                    codes == ["storage_error"] * 3 and alive
                    and storage is not None and storage["code"] == "storage_error"))
    log = daemon.log_text()
    once = {name: log.count(f"{a.state_dir / name} is damaged")
            for name in ("transcript.db", "journal.db")}
    out.append((f"damage logged once per file {once}, tracebacks {log.count('Traceback')}",
                once == {"transcript.db": 1, "journal.db": 1} and "Traceback" not in log))
    return out
