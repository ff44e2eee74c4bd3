"""The dense index as searched: a base and the writes since it.

The base is a checkpointed FAISS index, memory-mapped read-only, so every process serving one
index shares its pages and none ever changes it. The writes since live beside it: added rows in a
small exact delta, removed base rows as tombstones that searches skip through a FAISS selector (a
refined scan's codes take none: it asks for more and drops them, :meth:`DenseSegments._scan`).
A write therefore costs its own rows (before, a removal was FAISS's ``remove_ids``, a pass over
every vector under the lock searches wait on), and a checkpoint writes the delta and the
tombstones, bytes in proportion to the writes since the base, not the index. When they outgrow a
share of the base they are merged into a new base, in the background (:mod:`engine.retrieval.merge`).

Files (the index directory's contract, :mod:`engine.store.index_dir`): ``dense.faiss`` or
``dense-<seq>.faiss`` (a base holding every write up to ``seq``) and ``delta-<base>-<seq>.npz``
(the rows added and removed since base ``base``, up to ``seq``): NumPy's own format, with
``rows`` (int64), ``vectors`` (float32, a row each) and ``removed`` (int64 base rows).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from engine.retrieval.protocol import Rows
from engine.store.index_dir import DenseCheckpoint, IndexDirError, base_path, delta_path
from engine.store.wal import fsync_dir

# a refined scan re-scores at least its k_factor times this many: the depth the build tuned it at
# (recall@100, index_build/dense_index.py)
SCAN_DEPTH = 100


def _mapped(path: Path) -> int:
    """FAISS's read flags that map the file's vectors rather than copy them: a flat index's codes,
    or an inverted file's lists, whose files open with FAISS's ``Iw`` tag (figures: docs/scale.md)."""
    import faiss

    with open(path, "rb") as fh:
        inverted = fh.read(2) == b"Iw"
    return (faiss.IO_FLAG_MMAP if inverted else faiss.IO_FLAG_MMAP_IFC) | faiss.IO_FLAG_READ_ONLY


def read_base(path: Path, mapped: bool = True):
    """A base index from ``path``, mapped read-only (or a private copy to merge into), or a clear error."""
    import faiss

    try:
        return faiss.read_index(str(path), _mapped(path) if mapped else 0)
    except RuntimeError as exc:  # FAISS's message ends with what it could not read
        cause = str(exc).rsplit("Error: ", 1)[-1].strip()
        raise IndexDirError(f"{path}: unreadable dense index ({cause}); rebuild the index") from None


class DenseSegments:
    """One view of the dense index by store row: ``base`` (never changed), ``delta`` and ``removed``.

    Searches are thread-safe reads; ``add`` and ``remove`` run under the engine's view lock."""

    def __init__(self, checkpoint: DenseCheckpoint, earlier: DenseSegments | None = None) -> None:
        """``earlier``: a view this process opened before; its base, when it is this checkpoint's,
        is kept (mapped once, its rows listed once), and only the delta is read."""
        import faiss

        self.checkpoint = checkpoint
        if earlier is not None and earlier.checkpoint.base == checkpoint.base:
            self.base, self.ivf, self.kind, self.held = earlier.base, earlier.ivf, earlier.kind, earlier.held
        else:
            self.base = read_base(checkpoint.base)
            # by store row: flat and HNSW through an id map; an inverted file holds the rows itself (an id
            # map over it loses its way at the first removal), with a hash-table direct map to read vectors back
            self.ivf = None if isinstance(self.base, faiss.IndexIDMap2) else faiss.try_extract_index_ivf(self.base)
            if not isinstance(self.base, faiss.IndexIDMap2) and self.ivf is None:
                raise IndexDirError(
                    f"{checkpoint.base}: not an id-mapped index (built before format 2); rebuild the index"
                )
            self.kind = self.ivf if self.ivf is not None else faiss.downcast_index(self.base.index)
            self.held = np.sort(self._base_rows())  # the base's rows: what a removal may mark
        # whether the base re-scores a scan of its codes exactly (``--dense-index scan``): known once a base
        self.refined = isinstance(self.kind, faiss.IndexRefine)
        self.delta = faiss.IndexIDMap2(faiss.IndexFlatIP(self.base.d))
        self.delta_rows: set[int] = set()
        self.removed: set[int] = set()
        self._skip = None  # the selector that skips ``removed`` and their sorted rows, made once per change
        if checkpoint.delta is not None:
            self._read_delta(checkpoint.delta)

    def _read_delta(self, path: Path) -> None:
        try:
            with np.load(path) as saved:
                rows, vectors, removed = saved["rows"], saved["vectors"], saved["removed"]
        except (OSError, ValueError, KeyError) as exc:
            raise IndexDirError(f"{path}: unreadable dense delta ({exc}); run `hybrid-search compact`") from None
        self.remove(removed.tolist())
        self.add(rows, vectors)

    def _params(self, selector, wider: int = 1):
        """Search parameters skipping what ``selector`` does not select, an approximate index's
        breadth (nprobe, efSearch) multiplied by ``wider``, at most the whole index."""
        import faiss

        if self.ivf is not None:
            return faiss.SearchParametersIVF(sel=selector, nprobe=min(self.ivf.nlist, self.ivf.nprobe * wider))
        if hasattr(self.kind, "hnsw"):
            ef = min(max(self.base.ntotal, 1), self.kind.hnsw.efSearch * wider)
            return faiss.SearchParametersHNSW(sel=selector, efSearch=max(ef, self.kind.hnsw.efSearch))
        return faiss.SearchParameters(sel=selector)

    def skip_removed(self):
        """A selector of every base row not removed (None: none is)."""
        import faiss

        if self.removed and self._skip is None:
            gone = np.sort(np.fromiter(self.removed, dtype=np.int64, count=len(self.removed)))
            batch = faiss.IDSelectorBatch(gone)
            self._skip = (faiss.IDSelectorNot(batch), batch, gone)  # the Not holds a pointer: keep its target alive
        return self._skip[0] if self.removed else None

    def search(self, vector: np.ndarray, k: int, within: Rows | None = None, wider: int = 1, fast=None):
        """Top ``k`` (scores, rows) over base and delta, best first; ``within``: the rows allowed
        (a filter's, all held by this view's store, so none removed), else every row not removed.
        ``wider``: an approximate base's breadth multiplied (a filter's rows are a share of it).
        ``fast``: what searches the base when nothing is removed and nothing filtered (the GPU)."""
        if within is None and not self.removed and fast is not None and fast is not self.base:
            scores, rows = fast.search(vector, min(k, self.base.ntotal)) if self.base.ntotal else _none()
        else:
            sel = within.selector() if within is not None else self.skip_removed()
            held = self.base.ntotal if within is not None else self.base.ntotal - len(self.removed)
            if not held:
                scores, rows = _none()
            elif self.refined:
                scores, rows = self._scan(vector, min(k, held), within, wider)
            elif sel is None:
                scores, rows = self.base.search(vector, min(k, held))
            else:
                scores, rows = self.base.search(vector, min(k, held), params=self._params(sel, wider))
        if not self.delta.ntotal:
            return scores[0], rows[0]
        import faiss

        params = faiss.SearchParameters(sel=within.selector()) if within is not None else None  # the delta is flat
        more_scores, more_rows = self.delta.search(vector, min(k, self.delta.ntotal), params=params)
        scores, rows = np.concatenate([scores[0], more_scores[0]]), np.concatenate([rows[0], more_rows[0]])
        order = np.argsort(-scores, kind="stable")[:k]
        return scores[order], rows[order]

    def _scan(self, vector: np.ndarray, k: int, within: Rows | None, wider: int):
        """A refined scan's top ``k`` of the rows ``within`` (default: those not removed). It asks for
        at least :data:`SCAN_DEPTH` (the depth its ``k_factor`` was tuned at, so a shorter answer is the
        longer one's start); FAISS's fast-scan codes take no selector, so it drops the rows not allowed
        and asks for twice as many until ``k`` are kept or every row was asked for."""
        asked = max(k, SCAN_DEPTH) * wider + (min(k, len(self.removed)) if within is None else 0)
        gone = self._skip[2] if within is None and self.removed else None
        while True:
            asked = min(asked, self.base.ntotal)
            scores, rows = self.base.search(vector, asked)
            kept = rows[0] >= 0
            if within is not None:
                kept &= within.holds(rows[0])
            elif gone is not None:
                kept &= gone[np.searchsorted(gone, rows[0]).clip(max=len(gone) - 1)] != rows[0]
            if kept.sum() >= k or asked == self.base.ntotal:
                return scores[:, kept][:, :k], rows[:, kept][:, :k]
            asked *= 2

    def reconstruct(self, rows: np.ndarray) -> np.ndarray:
        """The stored vectors of ``rows`` (each held by this view)."""
        rows = np.asarray(rows, dtype=np.int64)
        if not self.delta_rows:
            return self.base.reconstruct_batch(rows)
        out = np.empty((len(rows), self.base.d), dtype=np.float32)
        fresh = np.fromiter((int(r) in self.delta_rows for r in rows), dtype=bool, count=len(rows))
        if fresh.any():
            out[fresh] = self.delta.reconstruct_batch(rows[fresh])
        if not fresh.all():
            out[~fresh] = self.base.reconstruct_batch(rows[~fresh])
        return out

    def add(self, rows, vectors: np.ndarray) -> None:
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows):
            self.delta.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), rows)
            self.delta_rows.update(rows.tolist())

    def remove(self, rows: list[int]) -> None:
        """Drop ``rows``: a delta row leaves the delta, a base row becomes a tombstone; a row this
        view does not hold (gone already, or never here) is no change."""
        import faiss

        fresh = {r for r in rows if r in self.delta_rows}
        if fresh:
            self.delta.remove_ids(faiss.IDSelectorBatch(np.fromiter(fresh, dtype=np.int64, count=len(fresh))))
            self.delta_rows -= fresh
        rest = np.asarray([r for r in rows if r not in fresh and r not in self.removed], dtype=np.int64)
        if len(rest) and len(self.held):
            at = np.searchsorted(self.held, rest).clip(max=len(self.held) - 1)
            based = rest[self.held[at] == rest]
            if len(based):
                self.removed.update(based.tolist())
                self._skip = None

    def _base_rows(self) -> np.ndarray:
        """The rows the base holds vectors for, in its order."""
        import faiss

        if self.ivf is None:
            return faiss.vector_to_array(self.base.id_map)
        lists = self.ivf.invlists
        held = [lists.list_size(n) for n in range(self.ivf.nlist)]
        return np.concatenate(
            [np.zeros(0, dtype=np.int64)]
            + [faiss.rev_swig_ptr(lists.get_ids(n), size).copy() for n, size in enumerate(held) if size]
        )

    def row_ids(self) -> np.ndarray:
        """The rows this view holds vectors for."""
        import faiss

        base = self.held
        if self.removed:
            base = base[~np.isin(base, np.fromiter(self.removed, dtype=np.int64, count=len(self.removed)))]
        return np.concatenate([base, faiss.vector_to_array(self.delta.id_map)])

    def write(self, index_dir: Path, seq: int, merge: bool = False) -> dict:
        """Make this view durable as the checkpoint at ``seq``: the delta and tombstones since the
        base, or (``merge``) a new base holding them. Returns what was written and the checkpoint that
        now holds it (readers open that; older files are removed). Merging as the writes grow, off the
        writer's lock, is :class:`engine.retrieval.merge.Merger`'s."""
        if merge:
            checkpoint = DenseCheckpoint(base_path(index_dir, seq), seq, None)
            merged = merged_base(self.checkpoint.base, self.removed, *self.delta_arrays())
            written = write_index(merged, checkpoint.base)
        else:
            checkpoint = DenseCheckpoint(
                self.checkpoint.base, seq, delta_path(index_dir, self.checkpoint.base_seq, seq)
            )
            written = write_delta(checkpoint.delta, *self.delta_arrays(), self.removed)
            self.checkpoint = checkpoint  # the same view, now durable as this checkpoint
        keep_only(index_dir, checkpoint)
        return {"checkpoint": checkpoint, "bytes": written, "merged": merge, "rows_changed": self.changed}

    @property
    def changed(self) -> int:
        """Rows written since the base: added and removed."""
        return self.delta.ntotal + len(self.removed)

    def delta_arrays(self, rows: set[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The delta's rows and their vectors (only ``rows`` of them, when given)."""
        import faiss

        ids = faiss.vector_to_array(self.delta.id_map)
        if rows is not None:
            ids = ids[np.isin(ids, np.fromiter(rows, dtype=np.int64, count=len(rows)))]
        vectors = self.delta.reconstruct_batch(ids) if len(ids) else np.zeros((0, self.base.d), dtype=np.float32)
        return ids, vectors


def merged_base(base: Path, removed: set[int], rows: np.ndarray, vectors: np.ndarray):
    """The base at ``base`` read into memory (a private copy), ``removed`` dropped and the delta's
    ``rows`` added: FAISS's own removal and addition, so the result is the index a build would make
    of the same rows, trained as the base was. An HNSW graph cannot drop a node: it is built again
    from the rows it keeps and the delta's (its M and efConstruction kept), as a build makes it, and so
    is a refined scan, whose fast-scan codes FAISS cannot remove from (its codebooks kept)."""
    import faiss

    merged = read_base(base, mapped=False)
    inner = faiss.downcast_index(merged.index) if isinstance(merged, faiss.IndexIDMap2) else None
    rebuilt = hasattr(inner, "hnsw") or isinstance(inner, faiss.IndexRefine)
    if rebuilt and removed:
        held = faiss.vector_to_array(merged.id_map)
        kept = held[~np.isin(held, np.fromiter(removed, dtype=np.int64, count=len(removed)))]
        old = merged.reconstruct_batch(kept) if len(kept) else np.zeros((0, merged.d), dtype=np.float32)
        merged.reset()  # the graph (or codes) and its vectors emptied; its parameters and training stay
        rows = np.concatenate([kept, np.asarray(rows, dtype=np.int64)])
        vectors = np.concatenate([old, np.asarray(vectors, dtype=np.float32).reshape(-1, merged.d)])
    elif removed:
        ids = np.fromiter(removed, dtype=np.int64, count=len(removed))
        inverted = not isinstance(merged, faiss.IndexIDMap2)  # its hash map removes from an array of ids only
        selector = faiss.IDSelectorArray(len(ids), faiss.swig_ptr(ids)) if inverted else faiss.IDSelectorBatch(ids)
        merged.remove_ids(selector)
    if len(rows):
        merged.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), rows)
    return merged


def write_index(index, target: Path, place: bool = True) -> int:
    """``index`` durably at ``target`` (``place`` False: beside it, :func:`aside`, for a merge placed later)."""
    import faiss

    return _durably(target, lambda tmp: faiss.write_index(index, str(tmp)), place)


def write_delta(target: Path, rows: np.ndarray, vectors: np.ndarray, removed: set[int]) -> int:
    """The delta file at ``target``: rows added and their vectors, base rows removed (module doc)."""
    arrays = {"rows": rows, "vectors": vectors, "removed": np.fromiter(sorted(removed), dtype=np.int64)}
    return _durably(target, lambda tmp: _save_npz(tmp, arrays))


def keep_only(index_dir: Path, checkpoint: DenseCheckpoint) -> None:
    """The checkpoint's files made durable in the folder, then every other base and delta removed."""
    fsync_dir(index_dir)
    keep = {checkpoint.base, checkpoint.delta}
    for older in [*index_dir.glob("dense*.faiss"), *index_dir.glob("delta-*.npz")]:
        if older not in keep:
            older.unlink()


def aside(target: Path) -> Path:
    """Where a file bound for ``target`` is written until it is placed (hidden from listings)."""
    return target.with_name(f".{target.name}.tmp")


def _save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)


def _durably(target: Path, write, place: bool = True) -> int:
    """``write(tmp)`` then fsync and (``place``) rename over ``target``; returns the bytes written. A
    failure (a full disk) leaves no partial file: the log still holds every write."""
    tmp = aside(target)
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if place:
        os.replace(tmp, target)
    return tmp.stat().st_size if not place else target.stat().st_size


def _none() -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((1, 0), dtype=np.float32), np.zeros((1, 0), dtype=np.int64)
