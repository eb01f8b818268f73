"""Checking a decoded client message's fields (protocol/messages.py,
protocol/queries.py): each problem a `bad_message` ProtocolError that names
the field.
"""

from __future__ import annotations

from typing import Any

from streamfence.protocol.errors import ErrorCode, ProtocolError

MAX_REF_LEN = 256


def bad_field(field_name: str, what: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_MESSAGE, f"field {field_name!r} {what}")


def field_of(m: dict[str, Any], key: str, types: type | tuple[type, ...], path: str,
         required: bool = True) -> Any:
    if key not in m or m[key] is None:
        if required:
            raise bad_field(path + key, "is missing")
        return None
    value = m[key]
    # bool is an int in Python; a number field must not accept true/false.
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise bad_field(path + key, f"must be {_type_name(types)}, got bool")
    if not isinstance(value, types):
        raise bad_field(path + key, f"must be {_type_name(types)}, got {type(value).__name__}")
    return value


def _type_name(types: type | tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
             dict: "a map", list: "an array"}
    if isinstance(types, tuple):
        return " or ".join(names.get(t, t.__name__) for t in types)
    return names.get(types, types.__name__)


def ref_field(m: dict[str, Any]) -> str:
    ref: str = field_of(m, "ref", str, "")
    if len(ref) > MAX_REF_LEN:
        raise bad_field("ref", f"is longer than {MAX_REF_LEN} characters")
    return ref


def non_empty(value: str, path: str) -> str:
    if not value:
        raise bad_field(path, "must not be empty")
    return value
