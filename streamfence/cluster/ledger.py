"""The cluster's shared record on NATS JetStream (ARCHITECTURE §4.17): what
makes a call accepted, who owns it at which epoch, and the fenced log of its
events. Every rule that keeps two hosts from both writing a call is enforced
here by the engine, not by a host's view:

- **Accepted means replicated.** `accept` stores a call's record on the
  stream `SF_CALLS` (subject `sf.calls.<call>`) and returns only when
  JetStream acknowledged it, which it does once the record is stored on a
  quorum of the stream's replicas. A second accept of the same call within
  the stream's duplicate window (2 minutes) is the same record
  (`Nats-Msg-Id` is the call id; no expectation on the subject is sent).
- **Ownership by compare-and-set.** The bucket `sf_owners` maps a call to
  its owner and epoch. `take` creates the key (at epoch 0 when a call is
  accepted) or updates it from the revision the taker saw, to a higher
  epoch: of two hosts that saw the same revision, the engine lets exactly
  one through (`KeyWrongLastSequenceError` for the other).
- **The fence.** A call's events are appended to `SF_EVENTS` (subject
  `sf.events.<call>`), each append carrying `Nats-Expected-Last-Subject-Sequence`:
  the subject's last sequence as the appending owner knows it. An owner
  first appends an epoch record (`open_epoch`), which moves the subject on;
  from then on every append of an earlier owner carries a stale sequence and
  the engine refuses it (error 10071), whatever that owner still believes:
  `append` raises `Fenced`, and the host fences the attempt locally and
  kills its worker. `open_epoch` reads the last record and its sequence in
  one read, refuses if it is of a later epoch, and appends conditional on
  that sequence: a host paused anywhere in between cannot put an older
  epoch after a newer one (the log's epochs never go down). A caller that
  knows where the log ends appends there at once, and reads only if that
  is refused or a duplicate (`open_epoch`'s `known`).

Records are msgpack arrays `[kind, epoch, host, body]` (cluster/records.py).
Asyncio, on the official `nats-py` client; one `Ledger` per host process.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, Self, TypeVar

import msgpack
import nats
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    PubAck,
    StorageType,
    StreamConfig,
)
from nats.js.errors import (
    BadRequestError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from streamfence.cluster.cancels import Cancels
from streamfence.cluster.connect import connect as connect_nats
from streamfence.cluster.identities import IDENTITIES_BUCKET, IdentityBucket
from streamfence.cluster.records import EPOCH, EVENTS, Beat, Record, beat_record, decode, read_beat
from streamfence.cluster.retry import RetryPolicy, TryAgain, retry_async
from streamfence.cluster.settings import ClusterSettings
from streamfence.protocol.failpoints import ARMED, failpoint

T = TypeVar("T")
CALLS_STREAM = "SF_CALLS"
EVENTS_STREAM = "SF_EVENTS"
OWNERS_BUCKET = "sf_owners"
HOSTS_BUCKET = "sf_hosts"
CALLS_SUBJECT = "sf.calls."
EVENTS_SUBJECT = "sf.events."
EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
MSG_ID = "Nats-Msg-Id"
WRONG_LAST_SEQUENCE = 10071  # JetStream's err_code when that expectation fails
# ... and when another conditional append to the subject is still being replicated
# (the server's fix of its issue 4320): the other may yet fail, so ours is tried again.
IN_FLIGHT = 10164
READS_IN_FLIGHT = 64  # owner entries read together by a scan of sf_owners


def _in_flight(failure: BaseException) -> bool:
    return isinstance(failure, BadRequestError) and failure.err_code == IN_FLIGHT


# How the ledger tries again (cluster/retry.py); a budget `within` a multiple of timeout_s.
# A node restarting, a leader being elected, at connect: 6 timeouts.
CONNECTING = RetryPolicy((TimeoutError, nats.errors.Error), first_s=0.2)
# A stream just made electing its leader: 4 timeouts.
ELECTING = RetryPolicy((TryAgain,), first_s=0.05)
# A write JetStream answered 503 (no stream there yet: it surely did not land): 1 timeout.
NO_STREAM = RetryPolicy((NoStreamResponseError, nats.errors.NoRespondersError), first_s=0.05)
# An append raced by another conditional append still being replicated (IN_FLIGHT).
APPEND_IN_FLIGHT = RetryPolicy((BadRequestError,), first_s=0.005, step_s=0.005, tries=5,
                               only_if=_in_flight)
# An epoch record raced by the previous owner's appends: read the log again, at once.
EPOCH_RACED = RetryPolicy((TryAgain,), tries=20)


@dataclass(frozen=True, slots=True)
class Owner:
    """A call's entry in `sf_owners` as read (or written) at `revision`."""

    call_id: str
    host: str
    epoch: int
    revision: int


@dataclass(frozen=True, slots=True)
class Ownership:
    """This host's hold on a call: its entry, and the last sequence of the call's
    events subject this host wrote or read (what its next append expects)."""

    owner: Owner
    log_seq: int = 0

    @property
    def call_id(self) -> str:
        return self.owner.call_id

    @property
    def epoch(self) -> int:
        return self.owner.epoch


class Fenced(Exception):
    """The engine refused an append: a later owner opened an epoch of the call."""

    def __init__(self, ownership: Ownership, detail: str) -> None:
        super().__init__(f"call {ownership.call_id}: epoch {ownership.epoch} is fenced "
                         f"(the log moved past seq {ownership.log_seq}): {detail}")
        self.ownership = ownership


class Ledger:
    """Owns this host's NATS connection and counts the engine's refusals."""

    def __init__(self, nc: NatsClient, settings: ClusterSettings) -> None:
        self._nc = nc
        self.cancels = Cancels(nc, settings)  # cancels across hosts (cluster/cancels.py)
        self._js: JetStreamContext = nc.jetstream(timeout=settings.timeout_s)
        self.settings = settings
        self._owners: KeyValue | None = None
        self._hosts: KeyValue | None = None
        self._no_stream = NO_STREAM.within(settings.timeout_s)
        self._beats = 0
        self.refused = 0  # appends the engine refused (Fenced)

    @classmethod
    async def connect(cls, settings: ClusterSettings) -> Self:
        nc = await connect_nats(settings)
        ledger = cls(nc, settings)
        try:
            await retry_async(CONNECTING.within(settings.timeout_s * 6), ledger.ensure)
        except BaseException:
            await nc.close()
            raise
        return ledger

    async def ensure(self) -> None:
        """Make the streams and the buckets if missing (idempotent, any host)."""
        r = self.settings.replicas
        for name, subject in ((CALLS_STREAM, CALLS_SUBJECT), (EVENTS_STREAM, EVENTS_SUBJECT)):
            await self._js.add_stream(StreamConfig(
                name=name, subjects=[subject + "*"], storage=StorageType.FILE, num_replicas=r,
                duplicate_window=120.0))
        self._owners = await self._js.create_key_value(KeyValueConfig(
            bucket=OWNERS_BUCKET, history=1, storage=StorageType.FILE, replicas=r))
        self._hosts = await self._js.create_key_value(KeyValueConfig(
            bucket=HOSTS_BUCKET, history=1, storage=StorageType.FILE, replicas=r))
        self.identities = IdentityBucket(await self._js.create_key_value(KeyValueConfig(
            bucket=IDENTITIES_BUCKET, history=1, storage=StorageType.FILE, replicas=r)),
            self._js, self.settings.host)  # cluster/identities.py
        for name in (CALLS_STREAM, EVENTS_STREAM, f"KV_{OWNERS_BUCKET}", f"KV_{HOSTS_BUCKET}",
                     f"KV_{IDENTITIES_BUCKET}"):
            await self._led(name)

    async def _led(self, stream: str) -> None:
        """Until the stream has a leader (a new stream's first writes would find
        no responder while its replicas elect one)."""
        async def has_leader() -> None:
            info = await self._js.stream_info(stream)
            if info.cluster is not None and not info.cluster.leader:
                raise TryAgain
        budget_s = self.settings.timeout_s * 4
        try:
            await retry_async(ELECTING.within(budget_s), has_leader)
        except TryAgain:
            raise TimeoutError(f"stream {stream} has no leader after {budget_s:g} s") from None

    async def close(self) -> None:
        await self._nc.close()

    def _stored(self, write: Callable[[], Awaitable[T]]) -> Coroutine[Any, Any, T]:
        """`write()`, tried again while no stream answers its subject (one just
        made, whose interest has not reached this node yet, or electing its
        leader: JetStream answers 503, so the write surely did not land), for
        up to `timeout_s` (NO_STREAM)."""
        return retry_async(self._no_stream, write)

    @property
    def connected(self) -> bool:
        return bool(self._nc.is_connected)

    # ---- accepted calls ---------------------------------------------------------

    async def accept(self, call_id: str, record: bytes) -> int:
        """Store the call's record at the stream's replication; its sequence."""
        ack = await self._stored(lambda: self._js.publish(CALLS_SUBJECT + call_id, record,
                                                          headers={MSG_ID: call_id}))
        return int(ack.seq)

    async def accepted(self, call_id: str) -> bytes | None:
        try:
            msg = await self._js.get_last_msg(CALLS_STREAM, CALLS_SUBJECT + call_id)
        except NotFoundError:
            return None
        return bytes(msg.data or b"")

    # ---- ownership --------------------------------------------------------------

    @property
    def owners(self) -> KeyValue:
        assert self._owners is not None, "Ledger.ensure() first"
        return self._owners

    async def owner(self, call_id: str) -> Owner | None:
        try:
            entry = await self.owners.get(call_id)
        except (NotFoundError, KeyNotFoundError):
            return None
        host, epoch = msgpack.unpackb(entry.value or b"")
        return Owner(call_id, host, int(epoch), int(entry.revision or 0))

    async def take(self, call_id: str, seen: Owner | None,
                   epoch: int | None = None) -> Ownership | None:
        """Own the call at `epoch` (default: the one after `seen`'s; 1 for a new
        call; 0 records an accepted call not run yet), from `seen`, the entry
        this host read (None: the key must not exist). None if the entry
        changed since: another host took it first."""
        floor = -1 if seen is None else seen.epoch  # epoch 0: accepted, not run yet
        epoch = max(floor + 1, 1) if epoch is None else epoch
        if epoch <= floor:
            raise ValueError(f"call {call_id}: epoch {epoch} is not above {floor}")
        value = msgpack.packb([self.settings.host, epoch])
        try:
            if seen is None:
                revision = await self._stored(lambda: self.owners.create(call_id, value))
            else:
                if ARMED:  # a pause here stands the whole ledger still: no beat either
                    failpoint("cluster.before_take")
                revision = await self._stored(
                    lambda: self.owners.update(call_id, value, last=seen.revision))
        except KeyWrongLastSequenceError:
            return None
        return Ownership(Owner(call_id, self.settings.host, epoch, int(revision)))

    async def release(self, owner: Owner) -> bool:
        """The call is done: its entry goes, if it is still `owner`'s (so
        `sf_owners` holds the live calls only). False if it had changed."""
        try:
            await self._stored(lambda: self.owners.delete(owner.call_id, last=owner.revision))
        except KeyWrongLastSequenceError:
            return False
        return True

    async def _keys(self, bucket: str) -> list[str]:
        """A bucket's keys, from its stream's subjects (no consumer is made: the
        client's `keys()` makes one per call, and a cluster under load ran out)."""
        prefix = f"$KV.{bucket}."
        info = await self._js.stream_info(f"KV_{bucket}", subjects_filter=prefix + ">")
        return [subject[len(prefix):] for subject in (info.state.subjects or {})]

    async def owned_by(self, host: str) -> list[Owner]:
        """Every call `host` owns (a scan of `sf_owners`: after a host's lease)."""
        keys = await self._keys(OWNERS_BUCKET)
        out = []
        for at in range(0, len(keys), READS_IN_FLIGHT):  # one round trip per batch, not per key
            for owner in await asyncio.gather(*map(self.owner, keys[at:at + READS_IN_FLIGHT])):
                if owner is not None and owner.host == host:
                    out.append(owner)
        return out

    # ---- hosts' heartbeats --------------------------------------------------------

    async def beat(self, calls_owned: int = 0) -> int:
        """This host is alive: its key in `sf_hosts` moves (a new revision), and
        says how many calls it owns (for the other hosts' `status`)."""
        assert self._hosts is not None, "Ledger.ensure() first"
        self._beats += 1
        hosts, beat = self._hosts, beat_record(self._beats, calls_owned)
        return int(await self._stored(lambda: hosts.put(self.settings.host, beat)))

    async def host_beats(self) -> dict[str, Beat]:
        """Each host's heartbeat: its revision (it moves while the host beats)
        and the calls it said it owns."""
        assert self._hosts is not None, "Ledger.ensure() first"
        keys = await self._keys(HOSTS_BUCKET)
        out = {}
        for key in keys:
            try:
                entry = await self._hosts.get(key)
            except (NotFoundError, KeyNotFoundError):
                continue
            out[key] = read_beat(int(entry.revision or 0), entry.value)
        return out

    # ---- the fenced log ----------------------------------------------------------

    async def last_record(self, call_id: str) -> Record | None:
        """The last record of the call's events subject, with its sequence (None:
        none yet): one read, so what it says and where it is go together."""
        try:
            msg = await self._js.get_last_msg(EVENTS_STREAM, EVENTS_SUBJECT + call_id)
        except NotFoundError:
            return None
        return decode(int(msg.seq or 0), msg.data)

    async def open_epoch(self, own: Ownership, known: bool = False) -> Ownership:
        """Append this owner's epoch record right after the log's last record, if
        that record is not of a later epoch (nor of this epoch and another
        host): from then on no earlier owner can append, and the log's epochs
        never go down. Raises Fenced if a later owner took the call.

        With `known`, the caller knows where the log ends, `own.log_seq`: 0 for
        a call whose log it never opened (a new call's is empty), else its own
        last record, of an earlier epoch of this host. The epoch record is
        then appended conditional on that at once (one round trip, not two):
        if it still ends there, nothing is above this epoch; if not, the log
        is read and judged as without `known`, and so if the record was
        stored before (a duplicate: an earlier process's open at the same
        place, after which the log may have moved on)."""
        if known:
            try:
                ack = await self._publish(own, EPOCH, None)
            except BadRequestError as exc:
                if exc.err_code not in (WRONG_LAST_SEQUENCE, IN_FLIGHT):
                    raise
            else:
                if not ack.duplicate:
                    return Ownership(own.owner, int(ack.seq))

        async def after_the_last_record() -> Ownership:
            # Both read at once (one round trip, not two): the owner entry, so that
            # a take after ours is refused early, and the log's last record, which
            # the append below is conditional on (the fence: the entry is a hint).
            current, last = await asyncio.gather(self.owner(own.call_id),
                                                 self.last_record(own.call_id))
            if current is None or current.epoch != own.epoch or current.host != own.owner.host:
                raise Fenced(own, f"the call's owner is now {current}")
            if last is not None and (last.epoch > own.epoch or (
                    last.epoch == own.epoch and last.host != own.owner.host)):
                raise Fenced(replace(own, log_seq=last.seq),
                             f"the log holds epoch {last.epoch} of {last.host} at seq {last.seq}")
            try:  # conditional on the record just judged: nothing can slip in between
                return await self._append(replace(own, log_seq=last.seq if last else 0),
                                          EPOCH, None)
            except Fenced:  # the log moved meanwhile (the previous owner, or a later one)
                raise TryAgain from None
        try:
            return await retry_async(EPOCH_RACED, after_the_last_record)
        except TryAgain:
            raise Fenced(own, f"the log kept moving for {EPOCH_RACED.tries} tries") from None

    async def append(self, own: Ownership, body: Any) -> Ownership:
        """Append a batch of the call's events; the ownership to append with next.
        Raises Fenced when the engine refuses (module docstring)."""
        return await self._append(own, EVENTS, body)

    async def _append(self, own: Ownership, kind: int, body: Any) -> Ownership:
        try:
            ack = await self._publish(own, kind, body)
        except BadRequestError as exc:
            if exc.err_code not in (WRONG_LAST_SEQUENCE, IN_FLIGHT):
                raise
            self.refused += 1
            raise Fenced(own, f"{exc.description} (JetStream error {exc.err_code})") from None
        return Ownership(own.owner, int(ack.seq))

    async def _publish(self, own: Ownership, kind: int, body: Any) -> PubAck:
        """The record, conditional on `own.log_seq`; JetStream's answer."""
        if ARMED and kind == EPOCH:  # where the log ends decided, the epoch's append not sent
            failpoint("cluster.before_epoch_append")
        record = msgpack.packb([kind, own.epoch, own.owner.host, body])
        # The id makes a retry of an append whose answer was lost (a node died
        # meanwhile) the same append: JetStream answers it as a duplicate. Its
        # content is in it: another record at that position is not a retry.
        headers = {EXPECTED_LAST_SUBJECT_SEQ: str(own.log_seq),
                   MSG_ID: f"{own.call_id}.{own.epoch}.{own.log_seq}.{zlib.crc32(record):x}"}
        return await retry_async(APPEND_IN_FLIGHT, lambda: self._stored(lambda: self._js.publish(
            EVENTS_SUBJECT + own.call_id, record, headers=headers)))

    async def follow(self, call_id: str, after: int,
                     deliver: Callable[[Record], None]
                     ) -> Callable[[], Coroutine[Any, Any, None]]:
        """`deliver` each record of the call's log after stream sequence `after`,
        as it is stored (an ordered consumer); the unsubscribe."""
        async def got(msg: Msg) -> None:
            deliver(decode(int(msg.metadata.sequence.stream), msg.data))

        sub = await self._js.subscribe(
            EVENTS_SUBJECT + call_id, cb=got, ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                  opt_start_seq=after + 1))
        return sub.unsubscribe

    async def read(self, call_id: str, after: int = 0) -> list[Record]:
        """The call's records after stream sequence `after`, in order, up to the
        last one stored when asked: streamed by an ordered consumer (one round
        trip per record was 0.75 ms a record on loopback)."""
        last_record = await self.last_record(call_id)
        last = last_record.seq if last_record is not None else 0
        if last <= after:
            return []
        out: list[Record] = []
        loop = asyncio.get_running_loop()
        read_all = loop.create_future()

        async def got(msg: Msg) -> None:
            seq = int(msg.metadata.sequence.stream)
            if seq > last:
                return
            out.append(decode(seq, msg.data))
            if seq == last and not read_all.done():
                read_all.set_result(None)

        sub = await self._js.subscribe(
            EVENTS_SUBJECT + call_id, cb=got, ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                  opt_start_seq=after + 1))
        try:
            await asyncio.wait_for(read_all, self.settings.timeout_s * 2)
        finally:
            await sub.unsubscribe()
        return out
