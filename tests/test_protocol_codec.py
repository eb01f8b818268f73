"""streamfence.protocol.codec: one msgpack object per frame, strict limits, one error type."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamfence.protocol.codec import (
    DEFAULT_MAX_FRAME,
    MAX_CONTAINER_LEN,
    decode_untrusted,
    encode,
)
from streamfence.protocol.errors import ErrorCode, ProtocolError

SUBMIT = {"v": 1, "op": "submit", "ref": "r1",
          "call": {"provider": "openai", "request": {"model": "m", "messages": []},
                   "options": {"stale_timeout_s": 1.5, "max_attempts": 3}},
          "subscribe": True}


def _bad(frame: bytes, code: ErrorCode = ErrorCode.BAD_FRAME, **kw: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_untrusted(frame, **kw)
    assert info.value.code is code
    assert str(info.value).startswith(f"{code.value}: ")
    return info.value


def _bin_frame(total: int) -> bytes:
    """A valid frame (one msgpack bin object) of exactly `total` bytes."""
    for header in (2, 3, 5):  # bin8, bin16, bin32 header sizes
        frame = encode(b"x" * (total - header))
        if len(frame) == total:
            return frame
    raise AssertionError(f"cannot build a frame of {total} bytes")


# ---- round trips ---------------------------------------------------------------

def test_round_trip_of_a_message() -> None:
    assert decode_untrusted(encode(SUBMIT)) == SUBMIT


def test_str_and_bin_stay_distinct() -> None:
    assert decode_untrusted(encode({"s": "abc", "b": b"abc"})) == {"s": "abc", "b": b"abc"}


def test_tuples_come_back_as_lists() -> None:
    assert decode_untrusted(encode({"a": (1, 2)})) == {"a": [1, 2]}


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False) | st.text() | st.binary(),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=30,
)


@given(msgpack_values)
def test_round_trip_property(value: Any) -> None:
    assert decode_untrusted(encode(value)) == value


@given(st.floats(allow_nan=True))
def test_floats_round_trip_bit_exact(value: float) -> None:
    back = decode_untrusted(encode(value))
    assert (math.isnan(back) and math.isnan(value)) or back == value


def test_encode_refuses_what_msgpack_cannot_carry() -> None:
    import datetime

    with pytest.raises(TypeError):
        encode({"when": datetime.datetime.now(datetime.UTC)})
    with pytest.raises(TypeError):
        encode({"x": object()})


# ---- the frame limit -----------------------------------------------------------

@pytest.mark.parametrize("limit", [16, 1000, 70_000])
def test_frame_at_limit_is_accepted_and_one_more_byte_is_too_large(limit: int) -> None:
    frame = _bin_frame(limit)
    assert len(frame) == limit
    assert decode_untrusted(frame, max_frame=limit) == b"x" * len(msgpack.unpackb(frame))
    err = _bad(_bin_frame(limit + 1), ErrorCode.TOO_LARGE, max_frame=limit)
    assert f"frame is {limit + 1} bytes, the limit is {limit}" in err.message


def test_default_limit_is_16_mib_exactly() -> None:
    assert DEFAULT_MAX_FRAME == 16 * 1024 * 1024
    assert len(decode_untrusted(_bin_frame(DEFAULT_MAX_FRAME))) == DEFAULT_MAX_FRAME - 5
    _bad(_bin_frame(DEFAULT_MAX_FRAME + 1), ErrorCode.TOO_LARGE)


def test_too_large_is_checked_before_decoding() -> None:
    # garbage over the limit is too_large, not bad_frame: the size is known first
    _bad(b"\xc1" * 33, ErrorCode.TOO_LARGE, max_frame=32)


# ---- container caps ----------------------------------------------------------

def test_array_at_container_cap_is_accepted_one_more_is_refused() -> None:
    assert len(decode_untrusted(encode([0] * MAX_CONTAINER_LEN))) == MAX_CONTAINER_LEN
    _bad(encode([0] * (MAX_CONTAINER_LEN + 1)))


def test_map_at_container_cap_is_accepted_one_more_is_refused() -> None:
    ok = {str(i): 0 for i in range(MAX_CONTAINER_LEN)}
    assert len(decode_untrusted(encode(ok))) == MAX_CONTAINER_LEN
    ok[str(MAX_CONTAINER_LEN)] = 0
    _bad(encode(ok))


def test_nested_containers_are_capped_one_by_one() -> None:
    _bad(encode({"a": {"b": [None] * (MAX_CONTAINER_LEN + 1)}}))


def test_absurd_declared_length_in_a_tiny_frame_is_bad_frame() -> None:
    _bad(b"\xdd\xff\xff\xff\xff")  # array32 claiming 4 G elements, none present
    _bad(b"\xdb\x7f\xff\xff\xff")  # str32 claiming 2 GiB


def test_deep_nesting_is_bad_frame_not_a_crash() -> None:
    _bad(b"\x91" * 100_000 + b"\xc0")


# ---- malformed frames ----------------------------------------------------------

def test_trailing_bytes_are_bad_frame() -> None:
    err = _bad(encode(SUBMIT) + b"\x00")
    assert "trailing bytes" in err.message
    _bad(encode(1) + encode(2))


def test_empty_frame_is_bad_frame() -> None:
    _bad(b"")


def test_every_truncation_of_a_message_is_bad_frame() -> None:
    frame = encode(SUBMIT)
    for cut in range(len(frame)):
        _bad(frame[:cut])


def test_reserved_byte_is_bad_frame() -> None:
    _bad(b"\xc1")


@pytest.mark.parametrize("frame", [
    b"\xd4\x05\x00",  # fixext1, type 5
    b"\xd8\x01" + b"\x00" * 16,  # fixext16
    b"\xc7\x00\x05",  # ext8 of length 0
    b"\xc7\x03\x05abc",  # ext8 of length 3
    b"\xd6\xff\x00\x00\x00\x00",  # timestamp32 (type -1)
    b"\xd7\xff" + b"\x00" * 8,  # timestamp64
    b"\xc7\x0c\xff" + b"\x00" * 12,  # timestamp96
    b"\xc7\x00\xff",  # timestamp of length 0
], ids=["fixext1", "fixext16", "ext8-empty", "ext8", "ts32", "ts64", "ts96", "ts-empty"])
def test_extension_types_are_refused(frame: bytes) -> None:
    _bad(frame)
    _bad(b"\x81\xa1k" + frame)  # also inside a map


def test_extension_built_by_msgpack_is_refused() -> None:
    frame = msgpack.packb({"x": msgpack.ExtType(42, b"payload")})
    err = _bad(frame)
    assert "extension" in err.message or "ext" in err.message


@pytest.mark.parametrize("key", [1, 1.5, None, True])
def test_non_string_map_keys_are_bad_frame(key: Any) -> None:
    _bad(msgpack.packb({key: 1}))


def test_bin_map_keys_are_accepted_and_stay_bytes() -> None:
    # strict_map_key allows str and bin keys; parse_request then sees no "v"
    assert decode_untrusted(msgpack.packb({b"v": 1})) == {b"v": 1}


def test_invalid_utf8_string_is_bad_frame() -> None:
    _bad(b"\xa2\xff\xfe")


# ---- property: bytes from outside raise ProtocolError or nothing -------------------

@settings(max_examples=500)
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_protocol_error(frame: bytes) -> None:
    try:
        decode_untrusted(frame)
    except ProtocolError as exc:
        assert exc.code in (ErrorCode.BAD_FRAME, ErrorCode.TOO_LARGE)


@given(st.binary(max_size=64), st.integers(min_value=0, max_value=64))
def test_random_bytes_with_a_small_limit(frame: bytes, limit: int) -> None:
    try:
        decode_untrusted(frame, max_frame=limit)
    except ProtocolError as exc:
        assert exc.code is (ErrorCode.TOO_LARGE if len(frame) > limit else ErrorCode.BAD_FRAME)
    else:
        assert len(frame) <= limit


@given(msgpack_values, st.binary(min_size=1, max_size=8))
def test_valid_message_plus_junk_is_bad_frame(value: Any, junk: bytes) -> None:
    _bad(encode(value) + junk)
