"""Client identities shared by the hosts of a cluster (ARCHITECTURE §4.17,
docs/SECURITY.md): the bucket `sf_identities` holds, for each client key a
host registered (`streamfence keys new`), the CURVE public key and the name
it is registered under, at the key `<host>.<public key in hex>`; the value
is msgpack `{"name": ..., "public_key": <Z85>}`. Nothing secret: a secret key
never leaves the host that made it, and the gateway's HTTP keys, derived
from secret keys, stay with their host. Roles and limits are not here: they
are each host's config (`[identities.NAME]`), which names an identity the
same way on every host.

Who writes what: a host writes and deletes only the entries under its own
name (`publish`: they are made to match its key store), so no host brings
back a key another host revoked; a revocation is a delete (KV's marker,
kept as the key's last word). Every host reads the others' entries
(`read`) and follows each change as it is stored (`watch`); each entry read
comes with its revision, so an older read never undoes a newer change.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgpack
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue
from zmq.utils import z85

from streamfence.protocol.keys import NAME_RE, valid_key

log = logging.getLogger("streamfence.cluster")
IDENTITIES_BUCKET = "sf_identities"
KV_OPERATION = "KV-Operation"  # the header of a delete (DEL) or purge (PURGE) marker
READS_IN_FLIGHT = 64


@dataclass(frozen=True, slots=True)
class SharedKey:
    """One host's registered client key, as the bucket holds it."""

    host: str
    name: str
    public_key: bytes  # Z85


# Each bucket key's last word and its revision: the entry, or None (revoked, or unreadable).
Known = dict[str, tuple[int, SharedKey | None]]


def bucket_key(host: str, public_key: bytes) -> str:
    return f"{host}.{z85.decode(public_key).hex()}"


def parse_entry(key: str, value: bytes | None) -> SharedKey | None:
    """The entry stored at `key`; None if it is not one this module writes (a
    key whose value names another public key, say)."""
    host = key.partition(".")[0]
    try:
        data = msgpack.unpackb(value or b"", raw=False)
        name, public = data["name"], data["public_key"]
    except (ValueError, TypeError, KeyError, msgpack.UnpackException):
        return None
    if not (isinstance(name, str) and NAME_RE.match(name) and valid_key(public)
            and bucket_key(host, public.encode()) == key):
        return None
    return SharedKey(host, name, public.encode())


class IdentityBucket:
    """This host's handle on `sf_identities` (made by `Ledger.ensure`)."""

    def __init__(self, kv: KeyValue, js: JetStreamContext, host: str) -> None:
        self._kv = kv
        self._js = js
        self.host = host
        self._watching: asyncio.Task[None] | None = None
        self._read: tuple[int, Known] = (-1, {})  # the last read, at the stream's last seq
        self.malformed: set[tuple[str, int]] = set()  # (key, revision) of entries ignored

    async def read(self) -> Known:
        """Every key's last word, read now: the last read's again if nothing was
        stored since (one request, as the hosts read every lease / 3)."""
        stream, prefix = f"KV_{IDENTITIES_BUCKET}", f"$KV.{IDENTITIES_BUCKET}."
        last_seq = int((await self._js.stream_info(stream)).state.last_seq or 0)
        if last_seq == self._read[0]:
            return dict(self._read[1])
        # The keys from the stream's subjects, as Ledger._keys (no consumer per read).
        info = await self._js.stream_info(stream, subjects_filter=prefix + ">")
        subjects = list(info.state.subjects or {})
        known: Known = {}
        for at in range(0, len(subjects), READS_IN_FLIGHT):
            batch = subjects[at:at + READS_IN_FLIGHT]
            for subject, last in zip(batch, await asyncio.gather(*map(self._last, batch)),
                                     strict=True):
                if last is not None:
                    known[subject[len(prefix):]] = last
        self._read = (last_seq, known)  # what was stored after last_seq is read again next time
        return dict(known)

    async def _last(self, subject: str) -> tuple[int, SharedKey | None] | None:
        try:
            msg = await self._js.get_last_msg(f"KV_{IDENTITIES_BUCKET}", subject)
        except NotFoundError:
            return None
        key = subject.removeprefix(f"$KV.{IDENTITIES_BUCKET}.")
        deleted = msg.headers is not None and KV_OPERATION in msg.headers
        revision = int(msg.seq or 0)
        return revision, None if deleted else self._entry(key, revision, msg.data)

    def _entry(self, key: str, revision: int, value: bytes | None) -> SharedKey | None:
        """The entry, or None if malformed: ignored, and logged once."""
        entry = parse_entry(key, value)
        if entry is None and (key, revision) not in self.malformed:
            self.malformed.add((key, revision))
            log.warning("cluster: the entry %r (revision %d) of %s is not a client key; "
                        "ignored", key, revision, IDENTITIES_BUCKET)
        return entry

    async def publish(self, own: Mapping[bytes, str]) -> Known:
        """Make this host's entries `own` (public key -> name): puts the new or
        renamed, deletes the ones gone (revoked, rotated); every key's last
        word, read before."""
        known = await self.read()
        want = {bucket_key(self.host, public): (public, name) for public, name in own.items()}
        for key, (_, entry) in known.items():
            if entry is not None and entry.host == self.host and key not in want:
                await self._kv.delete(key)
        for key, (public, name) in want.items():
            held = known.get(key, (0, None))[1]
            if held is None or held.name != name:
                await self._kv.put(key, msgpack.packb({"name": name,
                                                       "public_key": public.decode()}))
        return known

    @property
    def watching(self) -> bool:
        return self._watching is not None and not self._watching.done()

    async def watch(self, changed: Callable[[str, int, SharedKey | None], None]) -> None:
        """From now on, `changed(key, revision, entry or None)` for each change
        as it is stored (in this loop), until the connection closes."""
        watcher = await self._kv.watchall()

        async def follow() -> None:
            async for entry in watcher:
                if entry is None:  # the end of what was stored before the watch
                    continue
                revision = int(entry.revision or 0)
                changed(entry.key, revision, None if entry.operation is not None
                        else self._entry(entry.key, revision, entry.value))
        self._watching = asyncio.create_task(follow())  # held: a task is weakly referenced
