"""A run's output.log, read for shipping (chunks at byte offsets) and for report tails."""

from __future__ import annotations

import os
from pathlib import Path

CHUNK_BYTES = 64 * 1024
TAIL_LINES = 20
TAIL_WIDTH = 500
_TAIL_READ = 32 * 1024


def utf8_complete(data: bytes) -> int:
    """The length of `data` without a UTF-8 sequence cut off at its end."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        byte = data[n - back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back for the lead
            continue
        if byte < 0x80:
            return n
        need = 2 if byte >= 0xC0 and byte < 0xE0 else 3 if byte < 0xF0 else 4
        return n if back >= need else n - back
    return n


def read_chunks(
    path: Path, offset: int, *, final: bool, max_bytes: int, chunk: int = CHUNK_BYTES
) -> list[tuple[int, bytes]]:
    """New output from `offset`: (byte offset, bytes) chunks of at most `chunk` bytes and
    `max_bytes` in all, each cut at a UTF-8 boundary. A multi-byte character still being
    written stays for next time, unless the run is over (`final`)."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return []
    if size <= offset:
        return []
    out: list[tuple[int, bytes]] = []
    with open(path, "rb") as fh:
        fh.seek(offset)
        data = fh.read(min(size - offset, max_bytes))
    pos = 0
    while pos < len(data):
        piece = data[pos : pos + chunk]
        at_end = pos + len(piece) >= len(data)
        if not (final and at_end and offset + pos + len(piece) >= size):
            cut = utf8_complete(piece)
            if cut == 0:
                if len(piece) < 4:
                    break  # only part of a character so far
                cut = len(piece)  # not UTF-8 at all: ship it as is (U+FFFD)
            piece = piece[:cut]
        out.append((offset + pos, piece))
        pos += len(piece)
    return out


def decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def tail(path: Path, lines: int = TAIL_LINES, width: int = TAIL_WIDTH) -> list[str]:
    """The last `lines` lines of output, each cut to `width` characters."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - _TAIL_READ))
            data = fh.read()
    except OSError:
        return []
    text = decode(data)
    got = text.splitlines()
    if size > _TAIL_READ and got:
        got = got[1:]  # the first line read is probably partial
    return [line[:width] for line in got[-lines:]]
