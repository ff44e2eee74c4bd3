"""The write-ahead log of a live index: every acknowledged write, on disk before the answer.

Each record is ``length (4 bytes) | crc32 (4 bytes) | JSON``, little-endian; a write returns only
after the file (and, when the file is new, its directory) is fsynced. An append that fails (a full
disk, a file-size limit) is cut back to where it began, so the log never holds half a record that
was not acknowledged and stays appendable. Reading stops at a torn tail, the one record a crash
mid-append can leave short or unchecked, and truncates the file there; a damaged record with whole
records after it is not a torn tail but damage, and is refused rather than cut (that would drop
acknowledged writes).

Other processes read the log without writing it (:class:`LogTail`): from where they stopped, up to
the last whole record, so that following a writer costs the records since, not the log.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
import zlib
from pathlib import Path

from engine.errors import ServiceError
from engine.store.index_dir import IndexDirError

log = logging.getLogger(__name__)
_HEADER = struct.Struct("<II")
_NO_ROOM = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


class StorageFull(ServiceError, OSError):
    """No room for the record (disk full, quota, file-size limit): nothing was logged, so the caller
    may retry once there is room (507)."""

    status, jsonrpc_code = 507, -32003


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
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._broken: str | None = None  # why appending is refused: a failed append could not be cut back
        if created:
            os.fsync(self._fd)
            fsync_dir(self.path.parent)

    def append(self, record: dict) -> None:
        """Write and fsync one record, or raise with the log as it was (StorageFull when out of room)."""
        if self._broken:
            raise OSError(errno.EIO, self._broken)
        data = json.dumps(record, separators=(",", ":")).encode()
        blob = memoryview(_HEADER.pack(len(data), zlib.crc32(data)) + data)
        start = self.size
        try:
            while blob:
                blob = blob[os.write(self._fd, blob) :]
            os.fsync(self._fd)
        except OSError as exc:
            self._cut_back(start)
            if exc.errno in _NO_ROOM:
                raise StorageFull(
                    f"{self.path}: no room to log the write ({os.strerror(exc.errno)}); nothing was written"
                ) from None
            raise

    def _cut_back(self, size: int) -> None:
        try:
            os.ftruncate(self._fd, size)
            os.fsync(self._fd)
        except OSError as exc:
            self._broken = f"{self.path}: a failed append could not be cut back ({exc}); restart to recover the log"
            log.error("%s", self._broken)

    def records(self) -> list[dict]:
        """Every whole record in order; a torn tail is cut off (and logged), damage before whole
        records raises IndexDirError."""
        raw = self.path.read_bytes()
        records, offset = [], 0
        while offset + _HEADER.size <= len(raw):
            record, end = _record_at(raw, offset)
            if record is None:
                if end <= len(raw) and _record_at(raw, end)[0] is not None:
                    raise IndexDirError(
                        f"{self.path}: record {len(records) + 1} (byte {offset:,}) is damaged and whole records"
                        f" follow it; restore the file, or truncate it to {offset:,} bytes to keep the"
                        f" {len(records)} records before it"
                    )
                break
            records.append(record)
            offset = end
        if offset < len(raw):
            log.warning(
                "%s: cut a torn tail of %d bytes after %d whole records", self.path, len(raw) - offset, len(records)
            )
            os.ftruncate(self._fd, offset)
            os.fsync(self._fd)
        return records

    @property
    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def reset(self) -> None:
        """Empty the log once a checkpoint holds everything in it."""
        os.ftruncate(self._fd, 0)
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


def _record_at(raw: bytes, offset: int) -> tuple[dict | None, int]:
    """The record at ``offset`` (None when short, failing its checksum or not JSON) and where it ends."""
    if offset + _HEADER.size > len(raw):
        return None, offset + _HEADER.size
    length, crc = _HEADER.unpack_from(raw, offset)
    end = offset + _HEADER.size + length
    data = raw[offset + _HEADER.size : end]
    if len(data) < length or zlib.crc32(data) != crc:
        return None, end
    try:
        return json.loads(data), end
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None, end


class LogTail:
    """Another process's reading of the log: the records after a position, from the byte offset
    where the last read stopped. The writer empties the log at each checkpoint, so a read that
    does not find the next record where it stopped reads the log again from its start."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._offset, self._seq = 0, 0  # where the record after seq ``_seq`` begins

    def between(self, seq: int, upto: int) -> list[dict]:
        """The whole records after ``seq`` up to ``upto``, in order: fewer (or none) when the log no
        longer holds them (a checkpoint emptied it) or does not hold them yet."""
        if seq != self._seq:
            self._offset, self._seq = 0, seq
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size == self._offset or upto <= seq:
            return []
        found = self._read(self._offset) if size > self._offset else []
        if not found or found[0][0]["seq"] != seq + 1:  # emptied since (and written again): from its start
            found = [(record, end) for record, end in self._read(0) if record["seq"] > seq]
        found = [(record, end) for record, end in found if record["seq"] <= upto]
        if found:
            self._offset, self._seq = found[-1][1], found[-1][0]["seq"]
        return [record for record, _ in found]

    def _read(self, offset: int) -> list[tuple[dict, int]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(offset)
                raw = fh.read()
        except FileNotFoundError:
            return []
        found, at = [], 0
        while at + _HEADER.size <= len(raw):
            record, end = _record_at(raw, at)
            if record is None:  # a torn tail, or an append in progress: the next read gets it
                break
            found.append((record, offset + end))
            at = end
        return found


def read_records(path: Path) -> list[dict]:
    """Every whole record of a log no writer holds (a snapshot's copy), in order; a torn tail is
    left where it is, for the writer that opens it to cut."""
    return [record for record, _ in LogTail(path)._read(0)]
