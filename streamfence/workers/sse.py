"""Server-sent-events framing on raw body bytes, shared by the SSE adapters.

Contract: `iter_sse_events(reads)` turns an iterable of raw body reads (any
boundaries) into `(event, data)` pairs of bytes, one per dispatched event, as
the WHATWG SSE rules say: `data` is None for a frame with no `data:` line
(event/id-only frames, Anthropic-style `event: ping` without data); comments
(`: ...`) never dispatch; `id`, `retry` and unknown fields are ignored; LF,
CRLF and CR line ends are accepted, also when split across reads; a leading
UTF-8 BOM is dropped; an event not closed by a blank line at EOF is discarded.
It does no JSON and no I/O; the adapters decide what an event means (whether
it is a chunk, a keep-alive, an error).

Why by hand: the SDKs' own decoders build a ServerSentEvent object and a
str per line; this works on bytes and costs a fraction of that per event.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

__all__ = ["iter_sse_events"]


def iter_sse_events(chunks: Iterable[bytes]) -> Iterator[tuple[bytes | None, bytes | None]]:
    """Parse SSE framing from raw body bytes; yield (event, data) per dispatched event.

    data is None for a frame without `data:` lines (event/id-only keep-alives);
    comments never dispatch. Lines end in LF, CRLF or CR (also split across reads);
    an event not closed by a blank line at EOF is discarded, as the spec says.
    """
    tail = b""
    event: bytes | None = None
    data: bytes | None = None
    cr = False
    first = True
    for chunk in itertools.chain(chunks, (None,)):
        if chunk is None:
            if not cr:
                break
            chunk = b""
        elif not chunk:
            continue
        if first:
            first = False
            if chunk.startswith(b"\xef\xbb\xbf"):
                chunk = chunk[3:]
        if cr:  # a CR ended the previous read: swallow the LF of a CRLF
            cr = False
            if not chunk.startswith(b"\n"):
                chunk = b"\n" + chunk
        if b"\r" in chunk:
            if chunk.endswith(b"\r"):
                chunk = chunk[:-1]
                cr = True
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if tail:
            chunk = tail + chunk
        lines = chunk.split(b"\n")
        tail = lines.pop()
        for line in lines:
            if not line:
                if data is not None or event is not None:
                    yield event, data
                event = data = None
            elif line.startswith(b"data:"):
                value = line[6:] if line[5:6] == b" " else line[5:]
                data = value if data is None else data + b"\n" + value
            elif line[0] != 58:  # 58 = ":" starts a comment; id/retry/unknown fields are ignored
                name, _, value = line.partition(b":")
                if value[:1] == b" ":
                    value = value[1:]
                if name == b"event":
                    event = value
                elif name == b"data":  # a bare "data" line is an empty data field
                    data = value if data is None else data + b"\n" + value
