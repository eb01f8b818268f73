"""The public delta event as pre-encoded byte pieces, for the sink's per-delta path.

`delta_prefix(call_id, attempt)` (once per attempt) and `KIND_TAIL[kind]` are
the constant parts of `protocol.messages.delta_event`'s encoding, so the hot
path (sink/intake.py `_take`) packs only seq and data:
`prefix + pack(seq) + KIND_TAIL[kind] + pack(data)`. They are derived from
`delta_event`, and a test checks the bytes equal `encode(delta_event(...))`:
those bytes are stored, and sent to subscribers as they are.

The worker wire's messages (what a worker sends the sink, and the answers)
are built and parsed by `protocol.internal.worker_wire`.
"""

from __future__ import annotations

from streamfence.protocol.codec import encode
from streamfence.protocol.messages import DeltaKind, delta_event

_TAIL_KEYS = ["seq", "kind", "data"]


def delta_prefix(call_id: str, attempt: int) -> bytes:
    """Encoded `delta_event` map up to and including the "seq" key."""
    template = delta_event(call_id, attempt, 0, "", "")
    keys = list(template)
    if keys[-3:] != _TAIL_KEYS or len(keys) > 15:
        raise RuntimeError("delta_event's layout changed: update streamfence.sink.event_pieces")
    parts = [bytes([0x80 | len(keys)])]  # fixmap header
    for key in keys[:-3]:
        parts.append(encode(key))
        parts.append(encode(template[key]))
    parts.append(encode("seq"))
    return b"".join(parts)


# kind -> encoded '"kind": kind, "data"' (the data value follows).
KIND_TAIL: dict[str, bytes] = {
    k.value: encode("kind") + encode(k.value) + encode("data") for k in DeltaKind
}
