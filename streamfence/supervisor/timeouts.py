"""Timeouts and backoff, as pure functions (docs/ARCHITECTURE.md, "Liveness and
the stale watchdog", "Socket timeouts", "Retries and error classes").

Stale timeout precedence: the call's option, then the profile's setting, then
the implicit default: 180 s, raised for large contexts (>50k tokens: 240 s,
>100k: 300 s) and for local endpoints (900 s: a local model may be slow, but
never silent forever). The first-chunk budget is separate, because a
reasoning model may think for minutes before its first token yet must never
go silent for long mid-stream; it defaults to the stale timeout.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import msgpack

from streamfence.config.model import ProviderProfile
from streamfence.protocol.messages import CallOptions

DEFAULT_STALE_S = 180.0
LOCAL_STALE_S = 900.0


@dataclass(frozen=True, slots=True)
class AttemptTimeouts:
    first_chunk_s: float
    stale_s: float
    connect_s: float
    read_s: float


def estimate_tokens(request_bytes: int) -> int:
    # ~4 bytes of JSON per token is a coarse but stable estimate; it only
    # selects between three default tiers.
    return request_bytes // 4


def implicit_stale(profile: ProviderProfile, request_bytes: int) -> float:
    if profile.is_local:
        return LOCAL_STALE_S
    tokens = estimate_tokens(request_bytes)
    if tokens > 100_000:
        return 300.0
    if tokens > 50_000:
        return 240.0
    return DEFAULT_STALE_S


def attempt_timeouts(options: CallOptions, profile: ProviderProfile,
                     request: dict[str, object]) -> AttemptTimeouts:
    return sized_timeouts(options, profile, len(msgpack.packb(request, default=str)))


def sized_timeouts(options: CallOptions, profile: ProviderProfile,
                   request_bytes: int) -> AttemptTimeouts:
    """`attempt_timeouts` of a request whose size is known (a group's call's
    next deployment: its request is not encoded again on the loop)."""
    if options.stale_timeout_s is not None:
        stale = options.stale_timeout_s
    elif profile.stale_timeout_s is not None:
        stale = profile.stale_timeout_s
    else:
        stale = implicit_stale(profile, request_bytes)
    first = options.first_chunk_timeout_s or profile.first_chunk_timeout_s or stale
    # The socket read timeout is raised to the stale timeout when that is
    # longer, so the SDK never gives up before the watchdog would.
    read = max(profile.read_timeout_s, stale, first)
    return AttemptTimeouts(first_chunk_s=first, stale_s=stale,
                           connect_s=profile.connect_timeout_s, read_s=read)


def backoff_delay(failed_attempts: int, base_s: float, max_s: float,
                  retry_after_s: float | None, rng: random.Random) -> float:
    """Jittered exponential backoff, never shorter than a provider's Retry-After."""
    exp = min(max_s, base_s * (2 ** max(0, failed_attempts - 1)))
    delay = rng.uniform(exp / 2, exp) if exp > 0 else 0.0
    if retry_after_s is not None:
        delay = max(delay, retry_after_s)
    return delay
