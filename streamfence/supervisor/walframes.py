"""A damaged frame in a SQLite -wal file, found before SQLite reads it.

Why: SQLite's recovery reads a WAL's frames in order and stops, silently, at
the first one whose checksum fails; that frame and every later commit are
forgotten, and the next checkpoint makes the loss permanent (measured: one
scribbled 4 KiB page in the transcript's WAL after a SIGKILL, and
transcript.db "lost" 3 of its 4 calls with `PRAGMA integrity_check` ok).
So the start (and `streamfence check`) reads the frames first, with no
SQLite connection open.

Format (https://www.sqlite.org/fileformat2.html#walformat): a 32-byte header
(magic, version, page size, checkpoint seq, salt-1, salt-2, checksum-1,
checksum-2, big-endian), then frames of a 24-byte header (page number, db
size after a commit or 0, salt-1, salt-2, checksum-1, checksum-2) and one
page. Each frame's checksum runs over its header's first 8 bytes and its
page, starting from the previous frame's (the header's for the first); the
magic's low bit says in which byte order the words are summed.

What counts as damage: a frame that fails (its salts are not the header's,
or its checksum fails) while a later frame checks out (the header's salts,
and its checksum from the failed frame's stored one). A WAL is written from
its first frame on, and frames left over from before it last restarted have
other salts and come after all of its own; a write torn by a crash is the
last one. So a sound frame after a failed one means the failed one was
changed after it was written. A header whose checksum fails while frames
follow is damage too (SQLite would ignore every frame).

What looks the same and is not: after a power cut (not a crash: then the
kernel has every write), the unsynced end of a WAL may reach the disk out of
order, one frame missing before a later one; the start refuses that too,
naming the frame.
"""

from __future__ import annotations

import os
import struct

HEADER_BYTES = 32
FRAME_HEADER_BYTES = 24
_MAGIC = (0x377F0682, 0x377F0683)
_MASK = 0xFFFFFFFF


def _checksum(data: bytes, s0: int, s1: int, big_endian: bool) -> tuple[int, int]:
    """SQLite's WAL checksum of `data` (a multiple of 8 bytes), from (s0, s1)."""
    words = struct.unpack(f"{'>' if big_endian else '<'}{len(data) // 4}I", data)
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & _MASK
        s1 = (s1 + words[i + 1] + s0) & _MASK
    return s0, s1


def damaged_frame(wal_path: str) -> str | None:
    """What is damaged in the WAL at `wal_path` (e.g. "frame 3 of 9 (page 4)
    fails its checksum ..."), or None: sound, torn only at its end, empty or
    absent. OSError if it cannot be read."""
    try:
        size = os.path.getsize(wal_path)
    except FileNotFoundError:
        return None
    if size < HEADER_BYTES:
        return None
    with open(wal_path, "rb") as f:
        header = f.read(HEADER_BYTES)
        magic, _version, page_size, _seq, salt1, salt2, c0, c1 = struct.unpack(">8I", header)
        frame_bytes = FRAME_HEADER_BYTES + page_size
        frames = (size - HEADER_BYTES) // frame_bytes if page_size else 0
        if magic not in _MAGIC or page_size < 512 or page_size & (page_size - 1):
            return (f"its header is not a WAL header, and {frames} frame(s) follow: SQLite "
                    f"would ignore them all") if frames else None
        big_endian = bool(magic & 1)
        if _checksum(header[:24], 0, 0, big_endian) != (c0, c1):
            return (f"its header fails its checksum, and {frames} frame(s) follow: SQLite "
                    f"would ignore them all") if frames else None
        chain = (c0, c1)
        first_bad: tuple[int, int] | None = None  # (frame number, page)
        for n in range(1, frames + 1):
            frame = f.read(frame_bytes)
            page, _, fsalt1, fsalt2, f0, f1 = struct.unpack(">6I", frame[:FRAME_HEADER_BYTES])
            good = ((fsalt1, fsalt2) == (salt1, salt2)
                    and _checksum(frame[:8] + frame[FRAME_HEADER_BYTES:], *chain,
                                  big_endian) == (f0, f1))
            if good and first_bad is not None:
                bad, bad_page = first_bad
                return (f"frame {bad} of {frames} (page {bad_page}) fails its checksum while "
                        f"frame {n} after it is sound: SQLite would silently drop frame {bad} "
                        f"and every commit after it")
            if not good and first_bad is None:
                first_bad = (n, page)
            chain = (f0, f1)
    return None
