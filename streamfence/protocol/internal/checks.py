"""What every parser of the internal wire raises, and the field checks
they share (control.py, worker_wire.py, workers.py): a frame of the wrong
shape is a `BadFrame`, never an IndexError or a TypeError."""

from __future__ import annotations

from typing import Any

MAX_CALL_ID = 256


class BadFrame(ValueError):
    """A frame without the shape of its message. `req` is set when the request
    id could be read, so that the sender can still be answered."""

    def __init__(self, reason: str, req: int | str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.req = req


def check_call_id(value: Any, req: int | str | None = None) -> str:
    if type(value) is not str or not 0 < len(value) <= MAX_CALL_ID:
        raise BadFrame(f"call_id must be a string of 1..{MAX_CALL_ID} characters", req)
    return value


def check_int(value: Any, name: str, minimum: int, req: int | str | None = None) -> int:
    # type() not isinstance(): a bool is not an attempt number.
    if type(value) is not int or value < minimum:
        raise BadFrame(f"{name} must be an integer >= {minimum}", req)
    return value
