"""Recovery at start (docs/ARCHITECTURE.md, "Recovery"): every call the journal
holds as accepted and not finished runs again, under a new epoch (with a reset
first if an earlier attempt published anything); a call whose done event the
sink had already stored (the daemon died between the sink's commit and the
journal's) is finished in the journal from the transcript instead."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import msgpack

from streamfence.config.groups import ModelGroup, resolve
from streamfence.config.model import ProviderProfile
from streamfence.protocol.messages import CallOptions, CallSpec, OnPartial
from streamfence.sink.transcript import TranscriptReader
from streamfence.supervisor import storepair
from streamfence.supervisor.callends import record_usage
from streamfence.supervisor.calls import Call
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.journal_file import JournaledCall
from streamfence.supervisor.timeouts import attempt_timeouts
from streamfence.supervisor.usage import model_of

log = logging.getLogger("streamfence.supervisor")


def recover_calls(journal: Journal, providers: dict[str, ProviderProfile],
                  groups: dict[str, ModelGroup], transcript_path: str) -> list[Call]:
    """The calls to run again (subscribers that come back resume from what the
    transcript holds: the sink serves it). SQLite's errors on the transcript
    are raised as storepair.StoreError naming it; on the journal, as they are."""
    reader = None
    if os.path.exists(transcript_path):
        with storepair.reading(transcript_path):
            reader = TranscriptReader(transcript_path)
            if not reader.made():  # stamped, then the daemon died before its sink ran:
                reader.close()  # nothing can be stored in it
                reader = None
    recovered: list[Call] = []
    for jc in journal.unfinished():
        with storepair.reading(transcript_path):  # damage named as the transcript's
            stored = reader.done_event(jc.call_id) if reader is not None else None
            rows = reader.calls([jc.call_id]) if reader is not None else []
        if stored is not None:
            done = msgpack.unpackb(stored, raw=False)
            journal.finish_call(jc.call_id, str(done.get("status")))
            record_usage(journal, jc.call_id, jc.owner, *_answered_by(journal, jc), done)
            log.info("call %s had finished before the restart (%s)", jc.call_id,
                     done.get("status"))
            continue
        if resolve(jc.provider, providers, groups) is None:
            log.error("journaled call %s names unknown provider profile or group %r; left "
                      "as is", jc.call_id, jc.provider)
            continue
        # A retry's epoch may be the sink's only (supervisor/epoch_join.py): start above both.
        epoch = max([jc.epoch, *(row.max_epoch for row in rows)])
        call = make_call(jc.call_id, jc.owner, jc.provider, providers, groups, jc.request,
                         jc.options, jc.session_id,
                         jc.idempotency_key, jc.created, epoch, jc.attempts,
                         jc.request_file, jc.request_overrides or {})
        call.delivered = epoch > 0  # the transcript may hold an earlier attempt's text
        recovered.append(call)
        log.info("recovered unfinished call %s (last epoch %d)", jc.call_id, epoch)
    if reader is not None:
        reader.close()
    return recovered


def _answered_by(journal: Journal, jc: JournaledCall) -> tuple[str, str]:
    """The (profile, model) of the call's last attempt (a group's call names
    its deployment there), else the profile and model its submit named."""
    rows = journal.attempts_of(jc.call_id)
    if rows and rows[-1].get("profile"):
        return str(rows[-1]["profile"]), str(rows[-1].get("model") or "-")
    return jc.provider, model_of(jc.request)


def make_call(call_id: str, owner: str, provider: str, providers: dict[str, ProviderProfile],
              groups: dict[str, ModelGroup], request: dict[str, Any],
              o: dict[str, Any], session_id: str | None, idempotency_key: str | None,
              created: float | None, epoch: int, attempts: int,
              request_file: str | None = None,
              request_overrides: dict[str, Any] | None = None) -> Call:
    """A call accepted before, to run again: from the journal (a restart) or
    from the cluster (a call taken over: cluster mode, §4.17). `provider`:
    the profile or group it names, one of `providers` or `groups` (a group's
    call chooses its deployments afresh). Its deadline
    counts from `created` (None: from now); the attempts spent count, but it
    always gets at least one more (the crash was not the call's)."""
    options = CallOptions(stale_timeout_s=o.get("stale_timeout_s"),
                          first_chunk_timeout_s=o.get("first_chunk_timeout_s"),
                          max_attempts=o.get("max_attempts"), deadline_s=o.get("deadline_s"),
                          on_partial=OnPartial(o.get("on_partial") or "continue"),
                          traceparent=o.get("traceparent"))
    route = resolve(provider, providers, groups)
    assert route is not None, f"{provider!r} is neither a profile nor a group"
    profile, group = route
    spec = CallSpec(provider=provider, request=request, session_id=session_id,
                    idempotency_key=idempotency_key, options=options)
    max_attempts = options.max_attempts or (group or profile).max_attempts
    deadline = None
    if options.deadline_s is not None:
        left = (created if created is not None else time.time()) + options.deadline_s \
            - time.time()
        deadline = time.monotonic() + max(0.0, left)
    return Call(call_id=call_id, owner=owner, spec=spec, profile=profile,
                timeouts=attempt_timeouts(options, profile, request),
                max_attempts=max_attempts, deadline=deadline, epoch=epoch,
                request_file=request_file, request_overrides=request_overrides or {},
                attempts=min(attempts, max_attempts - 1), group=group,
                profiles=providers if group is not None else {})
