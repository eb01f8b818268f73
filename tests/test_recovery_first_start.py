"""Recovery after a daemon that died during its very first start
(supervisor/recovery.py, supervisor/storepair.py), in process on real
SQLite files: the path `Daemon._build` takes (check, the journal, the stamp,
recover_calls).

A first start stamps transcript.db (storepair.stamp creates it with its
`meta` table) before the sink creates its own tables. A daemon killed
between the two, with a call already journaled (found by the cluster
test of a supervisor crash after a submit's journal commit), left a
transcript without them, and every later start refused: "transcript.db
cannot be read (no such table: events)". Nothing can be stored in such a
transcript: its calls run again from the journal."""

from __future__ import annotations

from pathlib import Path

from streamfence.config.model import ProviderProfile
from streamfence.supervisor import storepair
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.recovery import recover_calls

REQUEST = {"model": "gpt-emu#first", "messages": [{"role": "user", "content": "hi"}]}
PROFILES = {"emu": ProviderProfile(name="emu", kind="openai")}


def test_a_transcript_the_sink_never_opened_holds_nothing_to_recover(tmp_path: Path) -> None:
    pairing = storepair.check(tmp_path)  # a fresh state dir: generation 1
    journal = Journal(str(tmp_path / storepair.JOURNAL))
    try:
        storepair.stamp(tmp_path, pairing)
        journal.add_call("c1", "alice", None, None, "emu", REQUEST, {})
        journal.commit()
        # ... and the daemon dies here, before its sink made the transcript's tables.
        calls = recover_calls(journal, PROFILES, {}, str(tmp_path / storepair.TRANSCRIPT))
        assert [(c.call_id, c.epoch, c.delivered) for c in calls] == [("c1", 0, False)]
    finally:
        journal.close()
