"""msgpack codec with strict limits.

Frame layout: every message on every streamfence socket is exactly one ZeroMQ
frame holding one msgpack object. Public messages are maps with `"v": 1` and
`"op"`; internal messages (worker, sink, supervisor) are arrays whose first
element is a small integer tag (see streamfence.protocol.internal).

Bytes from outside are decoded only by `decode_untrusted`, which raises only
`ProtocolError`. Extension types are refused (no pickle, no timestamps), and
strings, binaries and containers have size caps so a hostile frame cannot make
the daemon allocate without bound.
"""

from __future__ import annotations

from typing import Any

import msgpack

from streamfence.protocol.errors import ErrorCode, ProtocolError

DEFAULT_MAX_FRAME = 16 * 1024 * 1024
MAX_CONTAINER_LEN = 100_000


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def _limits(max_frame: int) -> dict[str, Any]:
    """The decoder settings for bytes from outside the process."""
    return {"raw": False, "strict_map_key": True, "ext_hook": _refuse_ext,
            "max_str_len": max_frame, "max_bin_len": max_frame,
            "max_array_len": MAX_CONTAINER_LEN, "max_map_len": MAX_CONTAINER_LEN,
            "max_ext_len": 0}


def untrusted_unpacker(max_frame: int = DEFAULT_MAX_FRAME) -> msgpack.Unpacker:
    """A stream decoder for bytes from outside the process: the limits of
    `decode_untrusted`, and at most `max_frame` bytes buffered."""
    return msgpack.Unpacker(max_buffer_size=max_frame, **_limits(max_frame))


def encode(obj: Any) -> bytes:
    """Encode one message. Only plain msgpack types; no extension types."""
    return msgpack.packb(obj, use_bin_type=True, datetime=False)  # type: ignore[no-any-return]


def decode_untrusted(frame: bytes | memoryview, max_frame: int = DEFAULT_MAX_FRAME) -> Any:
    """Decode one frame that came from outside the process.

    Raises ProtocolError(too_large) above `max_frame` bytes and
    ProtocolError(bad_frame) for anything that is not exactly one msgpack
    object within the limits.
    """
    if len(frame) > max_frame:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"frame is {len(frame)} bytes, the limit is {max_frame}"
        )
    try:
        return msgpack.unpackb(frame, **_limits(max_frame))
    except msgpack.ExtraData:
        raise ProtocolError(ErrorCode.BAD_FRAME, "trailing bytes after the msgpack object") from None
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"not valid msgpack: {exc}") from None
