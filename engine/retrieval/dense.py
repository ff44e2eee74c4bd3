"""Dense retrieval: a sentence-transformers encoder and a FAISS inner-product index.

Embeddings are L2-normalised, so inner product is cosine similarity. ``flat`` is exact and right
for corpora up to about a million documents on CPU; ``hnsw`` trades a little recall for
sub-linear search on larger ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.store.index_dir import DOCS_FILE, IndexDirError

if TYPE_CHECKING:
    from engine.retrieval.encoder import QueryEncoder


def build_faiss(embeddings: np.ndarray, kind: str, hnsw_m: int = 32, rows: np.ndarray | None = None):
    """An index over ``embeddings`` whose ids are ``rows`` (default 0..n-1, the document store's
    rows), so that single rows can later be removed or replaced."""
    import faiss

    dim = embeddings.shape[1]
    if kind == "flat":
        base = faiss.IndexFlatIP(dim)
    elif kind == "hnsw":
        base = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        base.hnsw.efConstruction = 200
    else:
        raise ValueError(f"unknown dense index kind {kind!r} (flat or hnsw)")
    index = faiss.IndexIDMap2(base)
    ids = np.arange(len(embeddings), dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
    index.add_with_ids(np.ascontiguousarray(embeddings, dtype=np.float32), ids)
    return index


def encode(
    model, texts: list[str], batch_size: int = 64, batches: Callable[[range], Iterable[int]] = iter
) -> np.ndarray:
    """Normalised float32 embeddings, ``batch_size`` at a time; ``batches`` wraps the batch starts
    (a build passes a progress bar).

    Batches are cut from the texts sorted longest first, as sentence-transformers cuts them in one
    call, so every text shares a batch (and padding) with the same neighbours either way and the
    vectors are bit-for-bit those of a single ``model.encode`` call.
    """
    order = np.argsort([-len(text) for text in texts])
    vectors = np.zeros((len(texts), model.get_embedding_dimension()), dtype=np.float32)
    for start in batches(range(0, len(texts), batch_size)):
        rows = order[start : start + batch_size]
        vectors[rows] = model.encode(
            [texts[i] for i in rows],
            batch_size=batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
    return vectors


class TorchFlatIndex:
    """Exact inner-product search as one matrix product on a torch device (fp16 on CUDA).

    The GPU path when faiss-gpu is not installed: for corpora that fit in GPU memory (a million
    384-d vectors are 0.8 GB in fp16) a matmul + top-k is as exact as ``IndexFlatIP`` and takes
    well under a millisecond. Same ``search`` contract as a FAISS index (ids are the rows given).
    """

    def __init__(self, vectors: np.ndarray, ids: np.ndarray, device: str) -> None:
        import torch

        dtype = torch.float16 if device == "cuda" else torch.float32
        self._vectors = torch.as_tensor(vectors, device=device, dtype=dtype)
        self._ids = np.asarray(ids, dtype=np.int64)
        self.ntotal = len(vectors)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        import torch

        with torch.inference_mode():
            q = torch.as_tensor(queries, device=self._vectors.device, dtype=self._vectors.dtype)
            scores, positions = torch.topk(q @ self._vectors.T, k, dim=1)
        return scores.float().cpu().numpy(), self._ids[positions.cpu().numpy()]


def place_index(index, device: str) -> tuple[object, str]:
    """Where searches without a filter run; returns the index and what searches it.

    On CUDA: faiss-gpu when installed, else an exact flat index becomes a ``TorchFlatIndex``;
    HNSW (which FAISS cannot run on a GPU) stays on CPU threads.
    """
    import faiss

    if device != "cuda" or not isinstance(index, faiss.IndexIDMap2):  # an IVF index keeps its own ids, on the CPU
        return index, "faiss-cpu"
    base = faiss.downcast_index(index.index)
    if hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0 and not hasattr(base, "hnsw"):
        return faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index), "faiss-gpu"
    if isinstance(base, faiss.IndexFlat):
        ids = faiss.vector_to_array(index.id_map)
        return TorchFlatIndex(base.reconstruct_n(0, base.ntotal), ids, device), "torch-cuda"
    return index, "faiss-cpu"


class Rows:
    """Store rows a search is held to (a filter's), with the FAISS selector over them made once
    for every search that shares them (100,000 rows: milliseconds a search otherwise)."""

    def __init__(self, ids: np.ndarray) -> None:
        self.ids = np.asarray(ids, dtype=np.int64)
        self._selector = None

    def __len__(self) -> int:
        return len(self.ids)

    def selector(self):
        import faiss

        if self._selector is None:
            self._selector = faiss.IDSelectorBatch(self.ids)
        return self._selector


EXACT_WITHIN = 20_000  # a filter's rows an inverted file scores one by one rather than by its lists


def _mapped(path: Path) -> int:
    """FAISS's read flags that map the file's vectors rather than copy them, so the processes serving
    one index share its pages (a writer reads a copy it can change): a flat index's codes, or an
    inverted file's lists, whose files open with FAISS's ``Iw`` tag (figures: docs/scale.md)."""
    import faiss

    with open(path, "rb") as fh:
        inverted = fh.read(2) == b"Iw"
    return (faiss.IO_FLAG_MMAP if inverted else faiss.IO_FLAG_MMAP_IFC) | faiss.IO_FLAG_READ_ONLY


class DenseRetriever:
    """Encodes queries and searches the dense index by store row.

    Searches and ``encode_query`` are thread-safe reads; ``add`` and ``remove`` must not run beside
    searches (the live index applies writes under its refresh lock). A writable retriever searches
    the CPU index, which writes change in place; a read-only one may move to the GPU. ``encoder`` is
    the sentence-transformers model (batches of texts), ``query_encoder`` what encodes one query
    (:func:`engine.retrieval.encoder.load_query_encoder`).
    """

    def __init__(
        self,
        faiss_path: str | Path,
        encoder,
        query_encoder: QueryEncoder,
        ef_search: int = 128,
        device: str = "cpu",
        writable: bool = False,
    ) -> None:
        import faiss

        try:
            index = faiss.read_index(str(faiss_path), 0 if writable else _mapped(Path(faiss_path)))
        except RuntimeError as exc:  # FAISS's message ends with what it could not read
            cause = str(exc).rsplit("Error: ", 1)[-1].strip()
            raise IndexDirError(f"{faiss_path}: unreadable dense index ({cause}); rebuild the index") from None
        # by store row: flat and HNSW through an id map; an inverted file holds the rows itself (an id
        # map over it loses its way at the first removal), with a hash-table direct map to read vectors back
        self._ivf = None if isinstance(index, faiss.IndexIDMap2) else faiss.try_extract_index_ivf(index)
        if not isinstance(index, faiss.IndexIDMap2) and self._ivf is None:
            raise IndexDirError(f"{faiss_path}: not an id-mapped index (built before format 2); rebuild the index")
        base = faiss.downcast_index(index.index) if self._ivf is None else self._ivf
        self._base = base
        if hasattr(base, "hnsw"):
            base.hnsw.efSearch = ef_search
        self.path = Path(faiss_path)
        self._index = index
        self._fast, self.backend = (index, "faiss-cpu") if writable else place_index(index, device)
        self.units: dict[int, str] = {}  # row -> unit id
        self.rows: dict[str, int] = {}  # unit id -> row: the live set
        self.encoder = encoder
        self.query_encoder = query_encoder

    def bind(self, units: dict[int, str]) -> None:
        """Name the rows (the document store's map); refuses an index whose rows are not the store's,
        which would answer with the wrong documents or none."""
        ids = np.sort(self.row_ids())
        rows = np.sort(np.fromiter(units, dtype=np.int64, count=len(units)))
        if not np.array_equal(ids, rows):
            strays = len(np.setdiff1d(ids, rows)) + len(np.setdiff1d(rows, ids))
            raise IndexDirError(
                f"{self.path}: {len(ids)} vectors for {len(rows)} documents in the store ({DOCS_FILE}), {strays}"
                " of their rows unmatched; rebuild the index"
            )
        self.units = dict(units)
        self.rows = {u: r for r, u in self.units.items()}

    @property
    def accepts_deletes(self) -> bool:
        """Exact (flat) and inverted-file (IVF) indexes can drop single vectors; HNSW graphs cannot."""
        import faiss

        return isinstance(self._base, (faiss.IndexFlat, faiss.IndexIVF))

    def encode_query(self, query: str) -> np.ndarray:
        """The query's (1, dim) embedding."""
        return self.query_encoder(query)

    def search(self, vector: np.ndarray, k: int, allowed_rows: Rows | None = None) -> list[tuple[str, float]]:
        """Top ``k`` (unit id, cosine similarity) for an encoded query, best first; ``allowed_rows``
        restricts the search itself (a FAISS id selector), so a narrow filter still fills ``k``."""
        import faiss

        if allowed_rows is None:
            if not self.units:  # an empty index (`init`): FAISS refuses k = 0
                return []
            scores, rows = self._fast.search(vector, min(k, len(self.units)))
        elif len(allowed_rows) == 0:
            return []
        elif self._ivf is not None:
            return self._search_ivf_within(vector, k, allowed_rows)
        else:
            params = faiss.SearchParameters(sel=allowed_rows.selector())
            scores, rows = self._index.search(vector, min(k, len(allowed_rows)), params=params)
        return [(self.units[r], float(s)) for r, s in zip(rows[0], scores[0], strict=True) if r >= 0]

    def _search_ivf_within(self, vector: np.ndarray, k: int, allowed_rows: Rows) -> list[tuple[str, float]]:
        """An inverted file probes a few lists, and a filter's rows are mostly in others: a few rows
        are scored exactly (read back by row), many are searched with the probes widened in
        proportion to how much of the index they leave out."""
        import faiss

        if len(allowed_rows) <= EXACT_WITHIN:  # only the rows this view holds can be read back
            ids = np.asarray([r for r in allowed_rows.ids.tolist() if r in self.units], dtype=np.int64)
            if not len(ids):
                return []
            scores = self._index.reconstruct_batch(ids) @ vector.reshape(-1)
            top = np.argsort(-scores, kind="stable")[:k]
            return [(self.units[int(ids[i])], float(scores[i])) for i in top]
        nprobe = min(self._ivf.nlist, self._ivf.nprobe * -(-self._ivf.ntotal // len(allowed_rows)))
        params = faiss.SearchParametersIVF(sel=allowed_rows.selector(), nprobe=nprobe)  # rows it lacks match none
        scores, rows = self._index.search(vector, min(k, len(allowed_rows)), params=params)
        return [(self.units[r], float(s)) for r, s in zip(rows[0], scores[0], strict=True) if r >= 0]

    def similarity(self, vector: np.ndarray, unit_ids: list[str]) -> list[float]:
        """Cosine of the query and each chunk (read back from the index by row)."""
        vectors = np.vstack([self._index.reconstruct(int(self.rows[u])) for u in unit_ids]) if unit_ids else None
        return [] if vectors is None else [float(x) for x in vectors @ vector.reshape(-1)]

    def add(self, rows: list[int], vectors: np.ndarray, unit_ids: list[str]) -> None:
        self._index.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), np.asarray(rows, dtype=np.int64))
        self.units.update(zip(rows, unit_ids, strict=True))
        self.rows.update(zip(unit_ids, rows, strict=True))

    def row_ids(self) -> np.ndarray:
        """The rows (store ids) the index holds vectors for."""
        import faiss

        if self._ivf is None:
            return faiss.vector_to_array(self._index.id_map)
        lists = self._ivf.invlists
        held = [lists.list_size(n) for n in range(self._ivf.nlist)]
        return np.concatenate(
            [np.zeros(0, dtype=np.int64)]
            + [faiss.rev_swig_ptr(lists.get_ids(n), size).copy() for n, size in enumerate(held) if size]
        )

    def vectors(self) -> tuple[np.ndarray, np.ndarray]:
        """Every stored vector and its row, in the index's order (what a corpus graph is made of)."""
        rows = self.row_ids()
        if self._ivf is not None:
            return rows, np.vstack([self._index.reconstruct(int(r)) for r in rows])
        return rows, self._base.reconstruct_n(0, self._base.ntotal)

    def remove(self, rows: list[int]) -> None:
        import faiss

        if rows:
            ids = np.asarray(rows, dtype=np.int64)  # an IVF's hash map removes from an array of ids only
            selector = faiss.IDSelectorArray(len(ids), faiss.swig_ptr(ids)) if self._ivf is not None else None
            self._index.remove_ids(selector or faiss.IDSelectorBatch(ids))
            for row in rows:
                self.rows.pop(self.units.pop(row, None), None)

    def save(self, path: Path) -> None:
        import faiss

        faiss.write_index(self._index, str(path))
