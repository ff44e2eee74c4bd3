"""The write-ahead log of a live index: every acknowledged write, on disk before the answer.

Each record is ``length (4 bytes) | crc32 (4 bytes) | JSON``, little-endian; a write returns only
after the file (and, when the file is new, its directory) is fsynced. Reading stops at the first
record that is short or fails its checksum, a torn tail from a crash mid-append, and truncates the
file there, so what follows is never mistaken for data.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from pathlib import Path

log = logging.getLogger(__name__)
_HEADER = struct.Struct("<II")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WriteAheadLog:
    """Append-only records with ``seq`` numbers; one writer (the live index's writer lock)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        created = not self.path.exists()
        self._fh = open(self.path, "ab")  # noqa: SIM115 - held open for the index's life
        if created:
            os.fsync(self._fh.fileno())
            fsync_dir(self.path.parent)

    def append(self, record: dict) -> None:
        data = json.dumps(record, separators=(",", ":")).encode()
        self._fh.write(_HEADER.pack(len(data), zlib.crc32(data)) + data)
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def records(self) -> list[dict]:
        """Every whole record in order; a torn or corrupt tail is cut off (and logged)."""
        raw = self.path.read_bytes()
        records, offset = [], 0
        while offset + _HEADER.size <= len(raw):
            length, crc = _HEADER.unpack_from(raw, offset)
            data = raw[offset + _HEADER.size : offset + _HEADER.size + length]
            if len(data) < length or zlib.crc32(data) != crc:
                break
            try:
                records.append(json.loads(data))
            except (json.JSONDecodeError, UnicodeDecodeError):
                break
            offset += _HEADER.size + length
        if offset < len(raw):
            log.warning(
                "%s: cut a torn tail of %d bytes after %d whole records", self.path, len(raw) - offset, len(records)
            )
            self._fh.truncate(offset)
            os.fsync(self._fh.fileno())
        return records

    @property
    def size(self) -> int:
        return self._fh.tell()

    def reset(self) -> None:
        """Empty the log once a checkpoint holds everything in it."""
        self._fh.truncate(0)
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()
