"""The records the cluster's streams hold (docs/ARCHITECTURE.md §4.17): a
call's record on SF_CALLS, a host's beat in sf_hosts, a call log's records
and which of them a reader keeps; importing it does not import nats."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

EPOCH, EVENTS = 1, 2  # record kinds on a call's events subject (cluster/ledger.py)


def call_record(call_id: str, owner: str, provider: str, request: dict[str, Any],
                options: dict[str, Any], session_id: str | None,
                idempotency_key: str | None) -> bytes:
    """What SF_CALLS holds of an accepted call: all another host needs to run it."""
    packed: bytes = msgpack.packb({"call_id": call_id, "owner": owner, "provider": provider,
                                   "request": request, "options": options,
                                   "session_id": session_id,
                                   "idempotency_key": idempotency_key}, use_bin_type=True)
    return packed


@dataclass(frozen=True, slots=True)
class Beat:
    """A host's entry in `sf_hosts` as read: its revision (it moves while the
    host beats) and the calls the host owned when it beat (None: a beat that
    does not say, from an earlier version)."""

    revision: int
    calls_owned: int | None


def beat_record(beats: int, calls_owned: int) -> bytes:
    packed: bytes = msgpack.packb({"beat": beats, "calls_owned": calls_owned})
    return packed


def read_beat(revision: int, data: bytes | None) -> Beat:
    try:
        said = msgpack.unpackb(data or b"\xc0")
    except ValueError:  # not a beat streamfence wrote
        said = None
    owned = said.get("calls_owned") if isinstance(said, dict) else None
    return Beat(revision, owned if isinstance(owned, int) else None)


@dataclass(frozen=True, slots=True)
class Record:
    """One record of a call's events subject."""

    seq: int  # its sequence in SF_EVENTS
    kind: int
    epoch: int
    host: str
    body: Any


def decode(seq: int, data: bytes | None) -> Record:
    """The record stored at `seq`: a msgpack array `[kind, epoch, host, body]`."""
    kind, epoch, host, body = msgpack.unpackb(data or b"")
    return Record(seq, kind, epoch, host, body)


def valid(records: list[Record]) -> list[Record]:
    """The records every reader keeps (ARCHITECTURE §4.17, rule 6): those not
    below the epoch of an EPOCH record before them."""
    out, epoch = [], 0
    for record in records:
        if record.epoch < epoch:
            continue
        if record.kind == EPOCH:
            epoch = record.epoch
        out.append(record)
    return out
