"""The records the cluster's streams hold that are built outside the ledger
(docs/ARCHITECTURE.md §4.17); importing it does not import nats."""

from __future__ import annotations

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
