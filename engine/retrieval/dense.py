"""Dense retrieval: a sentence-transformers encoder and a FAISS inner-product index.

Embeddings are L2-normalised, so inner product is cosine similarity. ``flat`` is exact, an
inverted file (IVF, the default from 200,000 chunks: index_build/dense_index.py) probes a few
lists, ``hnsw`` walks a graph, ``scan`` re-scores exactly the best of a scan of 4-bit codes. What a
server searches is a base and the writes since it (:mod:`engine.retrieval.segments`).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import numpy as np

from engine.retrieval.protocol import Query, Ranking, Rows, Within
from engine.retrieval.segments import DenseSegments
from engine.store.index_dir import DOCS_FILE, DenseCheckpoint, IndexDirError
from engine.store.unit_map import UnitMap

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

    On CUDA: faiss-gpu when installed, else an exact flat index becomes a ``TorchFlatIndex``, and so
    does a refined scan (its exact vectors: its codes are for a CPU's cache); HNSW (which FAISS cannot
    run on a GPU) stays on CPU threads.
    """
    import faiss

    if device != "cuda" or not isinstance(index, faiss.IndexIDMap2):  # an IVF index keeps its own ids, on the CPU
        return index, "faiss-cpu"
    base = faiss.downcast_index(index.index)
    scan = isinstance(base, faiss.IndexRefine)
    if hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0 and not hasattr(base, "hnsw") and not scan:
        return faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index), "faiss-gpu"
    if isinstance(base, faiss.IndexFlat) or scan:
        ids = faiss.vector_to_array(index.id_map)
        return TorchFlatIndex(base.reconstruct_n(0, base.ntotal), ids, device), "torch-cuda"
    return index, "faiss-cpu"


# A filter's rows an inverted file or a graph scores exactly, its rows' vectors kept with the filter
# (:meth:`DenseRetriever._score_within`), rather than searching widened: kept, 30k rows scored in 7.7 ms
# where HNSW widened tenfold took 101 ms, and 100k rows cost more than IVF's widened probe (11 ms at a
# million); docs/filters.md, "At a million chunks"
EXACT_WITHIN = 50_000


class DenseRetriever:
    """Encodes queries and searches the dense index (:class:`DenseSegments`) by store row.

    Searches and ``encode_query`` are thread-safe reads; ``add`` and ``remove`` must not run beside
    searches (the live index applies writes under its view lock). ``encoder`` is the
    sentence-transformers model (batches of texts), ``query_encoder`` what encodes one query
    (:func:`engine.retrieval.encoder.load_query_encoder`).
    """

    def __init__(
        self,
        checkpoint: DenseCheckpoint,
        encoder,
        query_encoder: QueryEncoder,
        ef_search: int = 128,
        device: str = "cpu",
        earlier: DenseRetriever | None = None,
    ) -> None:
        """``earlier``: this process's retriever of an older checkpoint (:meth:`reopened`)."""
        self.segments = DenseSegments(checkpoint, earlier.segments if earlier is not None else None)
        if hasattr(self.segments.kind, "hnsw"):  # the breadth the build tuned (in the file), or ef_search if wider
            self.segments.kind.hnsw.efSearch = max(ef_search, self.segments.kind.hnsw.efSearch)
        self.path = checkpoint.base
        if earlier is not None and earlier.segments.base is self.segments.base:  # placed once a base
            self._fast, self.backend = earlier._fast, earlier.backend
        else:
            self._fast, self.backend = place_index(self.segments.base, device)  # the base never changes
        self.units = UnitMap.from_pairs(())  # row <-> unit id: the live set
        self.encoder = encoder
        self.query_encoder = query_encoder
        self._opened = (ef_search, device)
        self._changes = 0  # rows added or removed in place: what a kept filter's vectors were read at
        self._exact: weakref.WeakKeyDictionary[Rows, tuple] = weakref.WeakKeyDictionary()

    def reopened(self, checkpoint: DenseCheckpoint) -> DenseRetriever:
        """The same encoders on a newer checkpoint (a follower's, the writer's after a merge), its
        rows not named yet (:meth:`bind`); a base this one maps already is kept, with its placement."""
        return DenseRetriever(checkpoint, self.encoder, self.query_encoder, *self._opened, earlier=self)

    def bind(self, units: UnitMap) -> None:
        """Name the rows (the document store's map); refuses an index whose rows are not the store's,
        which would answer with the wrong documents or none."""
        ids = np.sort(self.segments.row_ids())
        rows = units.row_array()
        if not np.array_equal(ids, rows):
            strays = len(np.setdiff1d(ids, rows)) + len(np.setdiff1d(rows, ids))
            raise IndexDirError(
                f"{self.path}: {len(ids)} vectors for {len(rows)} documents in the store ({DOCS_FILE}), {strays}"
                " of their rows unmatched; rebuild the index"
            )
        self.units = units

    @property
    def accepts_deletes(self) -> bool:
        """Exact (flat) and inverted-file (IVF) bases drop removed rows when merged, HNSW graphs and
        refined scans are built again without them (:func:`~engine.retrieval.segments.merged_base`);
        until then a removed row is skipped by every kind."""
        import faiss

        return isinstance(self.segments.kind, (faiss.IndexFlat, faiss.IndexIVF, faiss.IndexHNSW, faiss.IndexRefine))

    def encode_query(self, query: str) -> np.ndarray:
        """The query's (1, dim) embedding."""
        return self.query_encoder(query)

    def retrieve(self, query: Query, k: int, within: Within) -> Ranking:
        """:class:`~engine.retrieval.protocol.Retriever`: the top ``k`` (unit id, cosine similarity)
        by the query's vector, best first; a filter's ``within.rows`` restrict the search itself (a
        FAISS id selector), so a narrow filter still fills ``k``."""
        vector, allowed_rows = query.vector, within.rows
        segments = self.segments
        if allowed_rows is None:
            if not self.units:  # an empty index (`init`): FAISS refuses k = 0
                return []
            scores, rows = segments.search(vector, min(k, len(self.units)), fast=self._fast)
        elif len(allowed_rows) == 0:
            return []
        elif self._approximate and len(allowed_rows) <= EXACT_WITHIN:
            return self._score_within(vector, k, allowed_rows)
        else:  # an approximate index widens its search by the share of the index the filter leaves out
            wider = -(-segments.base.ntotal // len(allowed_rows))
            scores, rows = segments.search(vector, min(k, len(allowed_rows)), allowed_rows, wider=wider)
        found = rows >= 0
        return list(zip(self.units.names(rows[found]), scores[found].tolist(), strict=True))

    @property
    def _approximate(self) -> bool:
        return self.segments.ivf is not None or hasattr(self.segments.kind, "hnsw") or self.segments.refined

    def _score_within(self, vector: np.ndarray, k: int, allowed_rows: Rows) -> list[tuple[str, float]]:
        """An inverted file probes a few lists, and a filter's rows are mostly in others; a graph's
        search meets few of them: a few thousand rows are scored exactly, read back by row (only
        those this view holds). The rows read back are kept with the filter's set while it is kept
        (:class:`~engine.search.allowed.AllowedSets`) and this view has not changed: decoding them
        cost more than scoring them."""
        kept = self._exact.get(allowed_rows)
        if kept is None or kept[0] != self._changes:
            ids = allowed_rows.ids[self.units.holds_rows(allowed_rows.ids)]
            kept = (self._changes, ids, self.segments.reconstruct(ids) if len(ids) else None)
            self._exact[allowed_rows] = kept
        _, ids, vectors = kept
        if not len(ids):
            return []
        scores = vectors @ vector.reshape(-1)
        top = np.argsort(-scores, kind="stable")[:k]
        return list(zip(self.units.names(ids[top]), scores[top].tolist(), strict=True))

    def similarity(self, vector: np.ndarray, unit_ids: list[str]) -> list[float]:
        """Cosine of the query and each chunk (read back from the index by row)."""
        if not unit_ids:
            return []
        rows = self.units.rows_of(unit_ids)
        if (rows < 0).any():
            raise KeyError(unit_ids[int(np.argmin(rows))])
        vectors = self.segments.reconstruct(rows)
        return [float(x) for x in vectors @ vector.reshape(-1)]

    def add(self, rows: list[int], vectors: np.ndarray, unit_ids: list[str]) -> None:
        self.segments.add(rows, vectors)
        self.units.add(rows, unit_ids)
        self._changes += 1

    def remove(self, rows: list[int]) -> None:
        self.segments.remove(rows)
        self.units.remove(rows)
        self._changes += 1

    def row_ids(self) -> np.ndarray:
        """The rows (store ids) the index holds vectors for."""
        return self.segments.row_ids()

    def vectors(self) -> tuple[np.ndarray, np.ndarray]:
        """Every stored vector and its row (what a corpus graph is made of)."""
        rows = self.row_ids()
        return rows, self.segments.reconstruct(rows)
