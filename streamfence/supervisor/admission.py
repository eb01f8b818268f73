"""Admission: may this submit become a call? Every refusal of a submit is a
small named check here, and `admit` tries them in one ordered chain: the
first that refuses answers. A new refusal is one new check, named in that
chain. Acceptance (streamfence.supervisor.acceptance) makes an admitted
call so.

The order is part of the contract:
- stopping, a journal fault and a provider the identity may not use refuse
  every submit, a duplicate too;
- a duplicate (its idempotency key seen: the same call again, which starts
  nothing) is answered next, before any limit of new calls;
- the identity's budgets (supervisor/usage.py) come first of those limits;
- the limits of new calls, the rates last: they take their tokens, so a
  submit refused by an earlier check costs none;
- the request's own check (`check_request`) fills in the identity's caps.

A large submit meets its byte limits before it is decoded
(`refuse_unread`): a client that sends giant requests again and again must
not cost the loop their decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import msgpack

from streamfence.config.groups import ModelGroup, resolve
from streamfence.config.groups import may_use as may_use_group
from streamfence.config.identities import Identity
from streamfence.config.model import DaemonConfig, ProviderProfile
from streamfence.protocol.errors import ErrorCode, ProtocolError
from streamfence.protocol.fields import MAX_REF_LEN
from streamfence.protocol.messages import CallSpec
from streamfence.supervisor.attempts import AttemptDriver
from streamfence.supervisor.breaker import Breakers
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.requests import check_request
from streamfence.supervisor.submit_rate import SubmitRate
from streamfence.supervisor.usage import model_of

EARLY_CHECK_BYTES = 64 << 10  # a submit this large meets its byte limits before it is decoded
PEEK_BYTES = 512  # where its op and ref are looked for

_UNSET = object()


@dataclass(frozen=True, slots=True)
class Refusal:
    """A submit refused: the error's code and message; `hold_s`: answered that
    much later (a rate's wait); `tally`: a counter beside `refused.<code>`."""

    code: ErrorCode
    message: str
    hold_s: float = 0.0
    tally: str | None = None


@dataclass(frozen=True, slots=True)
class Duplicate:
    """The same call again (its idempotency key seen): its id; nothing starts."""

    call_id: str


@dataclass(frozen=True, slots=True)
class Admitted:
    """A new call may be accepted: its spec as the daemon runs it (the caps it
    filled in), its profile (a group's call: its first deployment's, until its
    first attempt chooses) and group with the profiles its deployments name
    (`profiles`: the config's, which a reload replaces, never changes), and
    the fields admission set (`overrides`)."""

    spec: CallSpec
    profile: ProviderProfile
    group: ModelGroup | None
    profiles: dict[str, ProviderProfile]
    overrides: dict[str, Any]


class Admission:
    """Owns the submit rates (calls and bytes per second, per identity) and
    whether new calls are accepted; reads the budgets the AttemptDriver
    counts, the breakers and the journal's fault. `existing` finds a call by
    its owner and idempotency key (Acceptance: this turn's, then the journal)."""

    def __init__(self, config: DaemonConfig, journal: Journal, driver: AttemptDriver,
                 breakers: Breakers, clock: Callable[[], float],
                 existing: Callable[[str, str], str | None]) -> None:
        self._config = config
        self._journal = journal
        self._driver = driver
        self._breakers = breakers
        self._existing = existing
        self._rate = SubmitRate(clock)
        self._byte_rate = SubmitRate(clock)  # request bytes per second, per identity
        self.accepting = True

    def use(self, config: DaemonConfig) -> None:
        """A reloaded config (supervisor/reload.py): its profiles for the next submit."""
        self._config = config

    @property
    def identities(self) -> dict[str, Identity]:
        """The configured identities (reloaded ones after a reload)."""
        return self._config.identities

    def admit(self, user: Identity, spec: CallSpec, size: int) -> Admitted | Duplicate | Refusal:
        """`size`: the submit frame's length, what the byte budgets count as the
        request's size (an honest upper bound of its encoding, at hand for free)."""
        refusal = (self._stopping()
                   or self._journal_faulted()
                   or self._unknown_provider(user, spec))
        if refusal is not None:
            return refusal
        if spec.idempotency_key is not None:
            existing = self._existing(user.name, spec.idempotency_key)
            if existing is not None:
                return Duplicate(existing)
        return (self._over_budget(user, spec)
                or self._breaker_open(spec)
                or self._queue_full()
                or self._over_in_flight_bytes(size)
                or self._too_many_in_flight(user)
                or self._over_max_in_flight_bytes(user, size)
                or self._over_submit_rate(user)
                or self._over_submit_byte_rate(user, size)
                or self._checked(user, spec))

    def refuse_unread(self, user: Identity, frame: bytes | memoryview
                      ) -> tuple[str | None, Refusal | None]:
        """A large frame's ref, and its refusal if it is a submit over a byte
        limit (the byte rate is only looked at: `admit` takes its tokens)."""
        op, ref = _peek_op_ref(frame)
        if op != "submit":
            return ref, None
        size = len(frame)
        return ref, (self._over_in_flight_bytes(size)
                     or self._over_max_in_flight_bytes(user, size)
                     or self._byte_rate_refusal(user, self._byte_rate.wait(
                         user.name, user.submit_bytes_per_s, size)))

    # ---- the checks, each None when the submit passes it ------------------------
    def _stopping(self) -> Refusal | None:
        if self.accepting:
            return None
        return Refusal(ErrorCode.SHUTTING_DOWN, "the daemon is stopping")

    def _journal_faulted(self) -> Refusal | None:
        """Nothing new is accepted until the journal can commit."""
        fault = self._journal.fault
        return None if fault is None else Refusal(fault.code, fault.message)

    def _unknown_provider(self, user: Identity, spec: CallSpec) -> Refusal | None:
        """A profile or group this identity may not use is one it cannot see."""
        providers, groups = self._config.providers, self._config.groups
        if spec.provider in providers and user.may_use(spec.provider):
            return None
        group = groups.get(spec.provider)
        if group is not None and may_use_group(user.providers, group):
            return None
        known = ", ".join(sorted(p for p in providers if user.may_use(p))) or "none"
        usable = ", ".join(sorted(g.name for g in groups.values()
                                  if may_use_group(user.providers, g)))
        return Refusal(ErrorCode.UNKNOWN_PROVIDER,
                       f"no provider profile {spec.provider!r} (configured: {known}"
                       + (f"; groups: {usable})" if usable else ")"))

    def _over_budget(self, user: Identity, spec: CallSpec) -> Refusal | None:
        """`budget_exceeded` once a budget is used up; with a spend budget, a
        model without a price could never be counted against it."""
        usage = self._journal.usage
        why = usage.over_budget(user)
        if why is not None:
            return Refusal(ErrorCode.BUDGET_EXCEEDED, why)
        if not user.spend_per_month:
            return None
        group = self._config.groups.get(spec.provider)
        pairs = [(d.profile, d.model) for d in group.deployments] if group is not None else [
            (spec.provider, model_of(spec.request))]
        for profile, model in pairs:  # a group's: any deployment may answer
            if not usage.priced(profile, model):
                return Refusal(ErrorCode.LIMIT_EXCEEDED, f"call.request.model: {model!r} on "
                               f"profile {profile!r} has no price in [prices], and "
                               f"{user.name!r} has a spend_per_month budget")
        return None

    def _breaker_open(self, spec: CallSpec) -> Refusal | None:
        session = spec.session_id or "-"
        group = self._config.groups.get(spec.provider)
        if group is not None:  # refused only if every deployment's breaker is (deployments.py)
            profiles = sorted({d.profile for d in group.deployments})
            if not all(self._breakers.blocks((session, p)) for p in profiles):
                return None
            return Refusal(ErrorCode.BREAKER_OPEN, (
                f"circuit breakers open for session {session!r} on every profile of group "
                f"{group.name!r} ({', '.join(profiles)}): their attempts went stale "
                f"{self._breakers.threshold} times in a row. New calls fail fast until a "
                f"cool-down ({self._breakers.cooldown_s:g}s) lets a probe call through."))
        refusal = self._breakers.admit((session, spec.provider))
        return None if refusal is None else Refusal(ErrorCode.BREAKER_OPEN, refusal)

    def _queue_full(self) -> Refusal | None:
        queued = self._driver.queued()
        if queued < self._config.queue_max:
            return None
        return Refusal(ErrorCode.OVERLOADED, f"{queued} calls are queued (queue_max); retry later")

    def _over_in_flight_bytes(self, size: int) -> Refusal | None:
        """`overloaded` for a request of `size` bytes that would pass the
        daemon's byte budget (`in_flight_bytes_max`: the requests of every
        call accepted and not done)."""
        budget = self._config.in_flight_bytes_max
        held = self._driver.calls.in_flight_bytes()
        if not budget or held + size <= budget:
            return None
        if size > budget:
            why = (f"the request is {_size(size)}, more than in_flight_bytes_max "
                   f"({_size(budget)}) allows for all calls together; it can never be accepted")
        else:
            why = (f"accepted calls hold {_size(held)} of requests and this one is "
                   f"{_size(size)} (in_flight_bytes_max {_size(budget)}); retry later")
        return Refusal(ErrorCode.OVERLOADED, why, tally="refused_bytes.in_flight_bytes_max")

    def _too_many_in_flight(self, user: Identity) -> Refusal | None:
        in_flight = self._driver.calls.in_flight(user.name)
        if not user.max_in_flight or in_flight < user.max_in_flight:
            return None
        return Refusal(ErrorCode.TOO_MANY_CALLS,
                       f"{in_flight} calls of {user.name!r} are not done yet (max_in_flight "
                       f"{user.max_in_flight}); submit again when one ends")

    def _over_max_in_flight_bytes(self, user: Identity, size: int) -> Refusal | None:
        """`too_many_calls` for a request of `size` bytes that would pass
        `user`'s byte budget (`max_in_flight_bytes`: the requests of its calls
        accepted and not done)."""
        budget = user.max_in_flight_bytes
        held = self._driver.calls.in_flight_bytes(user.name)
        if not budget or held + size <= budget:
            return None
        if size > budget:
            why = (f"the request is {_size(size)}, more than {user.name!r} may have in flight "
                   f"(max_in_flight_bytes {_size(budget)}); it can never be accepted")
        else:
            why = (f"calls of {user.name!r} not done yet hold {_size(held)} of requests and "
                   f"this one is {_size(size)} (max_in_flight_bytes {_size(budget)}); submit "
                   f"again when one ends")
        return Refusal(ErrorCode.TOO_MANY_CALLS, why, tally="refused_bytes.max_in_flight_bytes")

    def _over_submit_rate(self, user: Identity) -> Refusal | None:
        wait_s = self._rate.admit(user.name, user.submits_per_s)
        if wait_s is None:
            return None
        return Refusal(ErrorCode.RATE_LIMITED,
                       f"{user.name!r} may submit {user.submits_per_s:g} calls per second; "
                       f"retry in {wait_s:.2f}s", hold_s=wait_s)

    def _over_submit_byte_rate(self, user: Identity, size: int) -> Refusal | None:
        return self._byte_rate_refusal(
            user, self._byte_rate.admit(user.name, user.submit_bytes_per_s, size))

    @staticmethod
    def _byte_rate_refusal(user: Identity, wait_s: float | None) -> Refusal | None:
        if wait_s is None:
            return None
        return Refusal(ErrorCode.RATE_LIMITED,
                       f"{user.name!r} may submit {_size(int(user.submit_bytes_per_s))} of "
                       f"requests per second (submit_bytes_per_s); retry in {wait_s:.2f}s",
                       hold_s=wait_s, tally="refused_bytes.submit_bytes_per_s")

    def _checked(self, user: Identity, spec: CallSpec) -> Admitted | Refusal:
        """The request as its profile's (or group's) wire takes it, with `user`'s caps."""
        route = resolve(spec.provider, self._config.providers, self._config.groups)
        assert route is not None, "admitted: a known profile or group"
        profile, group = route
        try:
            request = check_request((group or profile).kind, spec.request, user.caps)
        except ProtocolError as exc:
            return Refusal(exc.code, exc.message)
        # The fields admission set (a cap filled in): with a large request, the
        # journal keeps the frame as sent, and these beside it.
        overrides = {k: v for k, v in request.items() if spec.request.get(k, _UNSET) is not v}
        if overrides:
            spec = replace(spec, request=request)
        return Admitted(spec, profile, group, self._config.providers, overrides)


def _peek_op_ref(frame: bytes | memoryview) -> tuple[Any, str | None]:
    """The `op` and `ref` of a request map, read from its first bytes only
    (clients put them before `call`); (None, None) if they are not there."""
    unpacker = msgpack.Unpacker(raw=False, max_str_len=PEEK_BYTES, max_bin_len=PEEK_BYTES,
                                max_array_len=64, max_map_len=64)
    unpacker.feed(frame[:PEEK_BYTES])
    found: dict[str, Any] = {}
    try:
        for _ in range(min(unpacker.read_map_header(), 16)):
            key = unpacker.unpack()
            if key in ("op", "ref"):
                found[key] = unpacker.unpack()
                if len(found) == 2:
                    break
            else:
                unpacker.skip()
    except (msgpack.OutOfData, ValueError, TypeError, msgpack.UnpackException):
        pass
    ref = found.get("ref")
    return found.get("op"), ref if isinstance(ref, str) and len(ref) <= MAX_REF_LEN else None


def _size(n: int) -> str:
    """`n` bytes for a message: "256 MiB", "255.9 MiB", "12.5 KiB", "900 bytes".
    Rounded down, so a total just under a budget never reads as the budget."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            tenths = n * 10 // scale
            return f"{tenths // 10} {unit}" if tenths % 10 == 0 else f"{tenths / 10:.1f} {unit}"
    return f"{n} bytes"
