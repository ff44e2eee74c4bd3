"""Vectors made elsewhere, for ``build --vectors FILE``: a GPU job, an embedding service or an
existing pipeline embedded the corpus, and the build takes its vectors instead of encoding.

Two forms: a ``.npy`` array (float32, float16 or float64; one row per chunk, in the corpus's
order; read memory-mapped, a part at a time), or a Parquet file with ``_id`` and ``vector`` columns,
one row per record in any order, converted once into a ``.npy`` in corpus order beside the build
(read by record batches: never the whole file in memory). Each row must be finite; rows are
normalised, as the engine's own vectors are (the dense index ranks by inner product). The query
encoder stays the build's ``--encoder``: it must be the model that made these vectors, and the
dimension is checked against it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np


class VectorsError(ValueError):
    """The vectors file does not fit the corpus or the encoder; the message names what and where."""


class GivenVectors:
    """The vectors of ``path`` for the chunks ``ids`` (each chunk's record id, in build order):
    :meth:`rows` gives a part of them, normalised float32."""

    def __init__(self, path: Path, ids: list[str], dimension: int, work: Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise VectorsError(f"--vectors {path}: no such file")
        self.source = {"file": str(path.resolve()), "bytes": path.stat().st_size, "form": path.suffix.lstrip(".")}
        if path.suffix == ".npy":
            array = _open_npy(path)
        elif path.suffix == ".parquet":
            array = _open_npy(_parquet_as_npy(path, ids, dimension, work))
        else:
            raise VectorsError(f"--vectors {path}: a .npy array or a .parquet file with _id and vector columns")
        if array.ndim != 2:
            raise VectorsError(f"--vectors {path}: {array.ndim}-dimensional, where one row a chunk is wanted")
        if array.shape[0] != len(ids):
            raise VectorsError(f"--vectors {path}: {array.shape[0]:,} rows for {len(ids):,} chunks in the corpus")
        if array.shape[1] != dimension:
            raise VectorsError(
                f"--vectors {path}: {array.shape[1]}-dimensional, but the query encoder makes {dimension}: give"
                " --encoder the model that made these vectors"
            )
        self.array = array

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start``..``stop``, float32 and of unit length."""
        part = np.asarray(self.array[start:stop], dtype=np.float32)
        bad = ~np.isfinite(part).all(axis=1)
        if bad.any():
            raise VectorsError(f"--vectors: row {start + int(np.flatnonzero(bad)[0]):,} is not finite")
        norms = np.linalg.norm(part, axis=1, keepdims=True)
        if (norms == 0).any():
            raise VectorsError(f"--vectors: row {start + int(np.flatnonzero(norms[:, 0] == 0)[0]):,} is all zeros")
        return part / norms


class EncodedRows:
    """A sharded build's vectors of the whole corpus, at one shard's ``picked`` rows, as they were
    encoded (already of unit length: taken bit for bit, so a shard's are one index's)."""

    def __init__(self, path: Path, picked: np.ndarray) -> None:
        self.array, self.picked = np.load(path, mmap_mode="r"), np.asarray(picked, dtype=np.int64)
        self.source = {"file": str(Path(path).resolve()), "form": "the sharded build's own"}

    def rows(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.array[self.picked[start:stop]], dtype=np.float32)


def _open_npy(path: Path) -> np.ndarray:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise VectorsError(f"--vectors {path}: not a readable .npy array ({exc})") from None
    if array.dtype not in (np.float32, np.float16, np.float64):
        raise VectorsError(f"--vectors {path}: {array.dtype} values, where float32 (or float16, float64) is wanted")
    return array


def _parquet_as_npy(path: Path, ids: list[str], dimension: int, work: Path) -> Path:
    """The Parquet file's vectors in ``ids``' order as a ``.npy`` in ``work`` (made once per file)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow comes with the datasets package
        raise VectorsError("--vectors FILE.parquet needs pyarrow: pip install pyarrow") from None
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = work / f"given-vectors-{key}.npy"
    if out.is_file():
        return out
    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises its own kinds
        raise VectorsError(f"--vectors {path}: not a readable Parquet file ({exc})") from None
    columns = set(parquet.schema_arrow.names)
    if not {"_id", "vector"} <= columns:
        raise VectorsError(f"--vectors {path}: needs columns _id and vector, has {', '.join(sorted(columns))}")
    position = {doc_id: i for i, doc_id in enumerate(ids)}
    partial = out.with_name(out.name + ".partial")
    array = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=(len(ids), dimension))
    seen = np.zeros(len(ids), dtype=bool)
    for batch in parquet.iter_batches(columns=["_id", "vector"], batch_size=65536):
        got = batch.column("_id").to_pylist()
        rows = [position.get(str(doc_id), -1) for doc_id in got]
        if min(rows, default=0) < 0:
            raise VectorsError(f"--vectors {path}: _id {got[rows.index(-1)]!r} is not a record of the corpus")
        values = batch.column("vector").to_pylist()
        if any(v is None or len(v) != dimension for v in values):
            wrong = next(i for i, v in enumerate(values) if v is None or len(v) != dimension)
            size = "no" if values[wrong] is None else len(values[wrong])
            raise VectorsError(
                f"--vectors {path}: _id {got[wrong]!r} has {size} values, where the query encoder makes {dimension}"
            )
        if seen[rows].any() or len(set(rows)) < len(rows):
            again = next(i for i, row in enumerate(rows) if seen[row] or row in rows[:i])
            raise VectorsError(f"--vectors {path}: _id {got[again]!r} appears twice")
        array[rows] = np.asarray(values, dtype=np.float32)
        seen[rows] = True
    if not seen.all():
        raise VectorsError(
            f"--vectors {path}: no vector for {int((~seen).sum()):,} records, {ids[int(np.argmin(seen))]!r} first"
        )
    array.flush()
    del array
    partial.replace(out)
    return out
