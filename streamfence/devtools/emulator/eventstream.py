"""AWS binary event-stream framing (``application/vnd.amazon.eventstream``), encode side.

Contract
--------
One message is::

    total length      uint32 BE  (the whole message, CRCs included)
    headers length    uint32 BE
    prelude CRC32     uint32 BE  (of the 8 bytes above)
    headers           repeated: name length uint8, name (UTF-8),
                      value type uint8 (7 = string), value length uint16 BE, value
    payload           bytes (here: a JSON document)
    message CRC32     uint32 BE  (of everything before it)

* :func:`event` frames a data event: headers ``:event-type`` (the member name
  of the stream union, e.g. ``contentBlockDelta``), ``:content-type:
  application/json``, ``:message-type: event``.
* :func:`exception` frames a modelled in-stream exception: headers
  ``:exception-type`` (e.g. ``throttlingException``), ``:content-type``,
  ``:message-type: exception``; boto3 raises it as ``EventStreamError``.
* :func:`corrupt` returns a frame whose message CRC is wrong: an undecodable
  frame for the ``malformed`` fault (botocore raises ``ChecksumMismatch``).
* Only string headers are written; that is all Bedrock's stream uses. The
  header block of an event type is built once and cached: framing a message
  is two ``struct.pack`` calls and two CRCs.

The reference decoder is botocore's own ``botocore.eventstream.EventStreamBuffer``
(the tests decode every kind of frame with it); nothing here decodes.
"""

from __future__ import annotations

import functools
import struct
import zlib
from collections.abc import Sequence

STRING = 7
_PRELUDE = struct.Struct(">II")
_CRC = struct.Struct(">I")
_MAX_HEADER_VALUE = 0xFFFF
JSON = "application/json"


class EncodeError(ValueError):
    """A header that cannot be framed (a name over 255 or a value over 65535 bytes)."""


def encode_headers(headers: Sequence[tuple[str, str]]) -> bytes:
    """The header block for string-valued ``(name, value)`` pairs, in order."""
    parts: list[bytes] = []
    for name, value in headers:
        raw_name = name.encode()
        raw_value = value.encode()
        if not 0 < len(raw_name) <= 0xFF:
            raise EncodeError(f"header name {name!r} must be 1..255 bytes")
        if len(raw_value) > _MAX_HEADER_VALUE:
            raise EncodeError(f"header {name!r}: value over {_MAX_HEADER_VALUE} bytes")
        parts.append(
            bytes((len(raw_name),)) + raw_name + bytes((STRING,))
            + len(raw_value).to_bytes(2, "big") + raw_value
        )
    return b"".join(parts)


def encode_message(header_block: bytes, payload: bytes) -> bytes:
    """One framed message from an already-encoded header block and a payload."""
    total = _PRELUDE.size + _CRC.size + len(header_block) + len(payload) + _CRC.size
    prelude = _PRELUDE.pack(total, len(header_block))
    head = prelude + _CRC.pack(zlib.crc32(prelude))
    crc = zlib.crc32(payload, zlib.crc32(header_block, zlib.crc32(head)))
    return head + header_block + payload + _CRC.pack(crc)


@functools.lru_cache(maxsize=64)
def _event_headers(event_type: str) -> bytes:
    return encode_headers(
        ((":event-type", event_type), (":content-type", JSON), (":message-type", "event"))
    )


@functools.lru_cache(maxsize=64)
def _exception_headers(exception_type: str) -> bytes:
    return encode_headers(
        (
            (":exception-type", exception_type),
            (":content-type", JSON),
            (":message-type", "exception"),
        )
    )


def event(event_type: str, payload: bytes) -> bytes:
    """A data event of ``event_type`` carrying the JSON ``payload``."""
    return encode_message(_event_headers(event_type), payload)


def exception(exception_type: str, payload: bytes) -> bytes:
    """An in-stream exception of ``exception_type`` carrying the JSON ``payload``."""
    return encode_message(_exception_headers(exception_type), payload)


def corrupt(frame: bytes) -> bytes:
    """``frame`` with its message CRC inverted: a frame no decoder accepts."""
    crc = _CRC.unpack_from(frame, len(frame) - _CRC.size)[0]
    return frame[: -_CRC.size] + _CRC.pack(crc ^ 0xFFFFFFFF)
