"""The access log of the client endpoint: one INFO line per submit, on the
logger `streamfence.front.access`, once it is answered (as the gateway's
`streamfence.gateway.access` logs each HTTP request).

- `submit accepted provider=P model=M` when its `accepted` reply goes (the
  call is durable), `submit accepted (duplicate) …` for an idempotency key
  seen before;
- `submit refused code=CODE provider=P model=M` for every refusal: at
  admission (a rate, a limit, an unknown provider, a stopping daemon), a
  malformed submit, or a call the daemon could not store. The error's
  message went to the client; the log has it once where it is the
  daemon's own (a storage fault's ERROR line), never once per submit.

Each line carries the submitter's `identity`, the `session_id`, the
`call_id` (once there is one), the `provider` and the `model` as its
record's context (protocol/logs.py): `identity=… session=… call=…` before
the message in text, keys in JSON, with `outcome` (accepted, duplicate,
refused) and a refusal's `code` as keys of their own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from streamfence.protocol.errors import ErrorCode
from streamfence.protocol.logs import request_model
from streamfence.protocol.messages import CallSpec

log = logging.getLogger("streamfence.front.access")


@dataclass(frozen=True, slots=True)
class Submitter:
    """Who submitted what, for the access line (None: not known, as in a
    submit refused before it was read)."""

    identity: str
    session_id: str | None = None
    provider: str | None = None
    model: str | None = None

    @classmethod
    def of(cls, identity: str, spec: CallSpec) -> Submitter:
        return cls(identity, spec.session_id, spec.provider, request_model(spec.request))


def log_submit(who: Submitter, call_id: str | None, code: ErrorCode | None = None,
               duplicate: bool = False) -> None:
    """The access line of one submit: accepted (`code` None) or refused."""
    if not log.isEnabledFor(logging.INFO):
        return
    outcome = "refused" if code is not None else "duplicate" if duplicate else "accepted"
    fields: dict[str, str] = {"outcome": outcome}
    if code is not None:
        fields["code"] = code.value
    extra = {"identity": who.identity, "session_id": who.session_id, "call_id": call_id,
             "attempt": None, "provider": who.provider, "model": who.model, "fields": fields}
    provider, model = who.provider or "-", who.model or "-"
    if code is not None:
        log.info("submit refused code=%s provider=%s model=%s", code.value, provider, model,
                 extra=extra)
    else:
        log.info("submit accepted%s provider=%s model=%s", " (duplicate)" if duplicate else "",
                 provider, model, extra=extra)
