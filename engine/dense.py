"""Dense retrieval: a sentence-transformers encoder and a FAISS inner-product index.

Embeddings are L2-normalised, so inner product is cosine similarity. ``flat`` is exact and right
for corpora up to about a million documents on CPU; ``hnsw`` trades a little recall for
sub-linear search on larger ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.progress import track


def build_faiss(embeddings: np.ndarray, kind: str, hnsw_m: int = 32):
    """An index over ``embeddings`` (rows = documents in document-store order)."""
    import faiss

    dim = embeddings.shape[1]
    if kind == "flat":
        index = faiss.IndexFlatIP(dim)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 200
    else:
        raise ValueError(f"unknown dense index kind {kind!r} (flat or hnsw)")
    index.add(np.ascontiguousarray(embeddings, dtype=np.float32))
    return index


def encode(model, texts: list[str], batch_size: int = 64, progress: bool = False) -> np.ndarray:
    """Normalised float32 embeddings, encoded ``batch_size`` at a time (progress per batch)."""
    starts = range(0, len(texts), batch_size)
    parts = [
        model.encode(
            texts[i : i + batch_size],
            batch_size=batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        for i in track(starts, f"encoding {len(texts):,} texts", "batch", enabled=progress)
    ]
    dimension = model.get_embedding_dimension()
    return np.asarray(np.concatenate(parts) if parts else np.zeros((0, dimension)), dtype=np.float32)


class TorchFlatIndex:
    """Exact inner-product search as one matrix product on a torch device (fp16 on CUDA).

    The GPU path when faiss-gpu is not installed: for corpora that fit in GPU memory (a million
    384-d vectors are 0.8 GB in fp16) a matmul + top-k is as exact as ``IndexFlatIP`` and takes
    well under a millisecond. Same ``search`` contract as a FAISS index.
    """

    def __init__(self, vectors: np.ndarray, device: str) -> None:
        import torch

        dtype = torch.float16 if device == "cuda" else torch.float32
        self._vectors = torch.as_tensor(vectors, device=device, dtype=dtype)
        self.ntotal = len(vectors)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        import torch

        with torch.inference_mode():
            q = torch.as_tensor(queries, device=self._vectors.device, dtype=self._vectors.dtype)
            scores, rows = torch.topk(q @ self._vectors.T, k, dim=1)
        return scores.float().cpu().numpy(), rows.cpu().numpy()


def place_index(index, device: str) -> tuple[object, str]:
    """Move a FAISS index to where the engine runs; returns the index and what searches it.

    On CUDA: faiss-gpu when installed, else an exact flat index becomes a ``TorchFlatIndex``;
    HNSW (which FAISS cannot run on a GPU) stays on CPU threads.
    """
    import faiss

    if device != "cuda":
        return index, "faiss-cpu"
    if hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0 and not hasattr(index, "hnsw"):
        return faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index), "faiss-gpu"
    if isinstance(index, faiss.IndexFlat):
        return TorchFlatIndex(index.reconstruct_n(0, index.ntotal), device), "torch-cuda"
    return index, "faiss-cpu"


class DenseRetriever:
    """Encodes a query and searches the dense index; searches are thread-safe reads."""

    def __init__(
        self, faiss_path: str | Path, doc_ids: list[str], encoder, ef_search: int = 128, device: str = "cpu"
    ) -> None:
        import faiss

        index = faiss.read_index(str(faiss_path))
        if index.ntotal != len(doc_ids):
            raise ValueError(f"{faiss_path}: {index.ntotal} vectors for {len(doc_ids)} documents")
        if hasattr(index, "hnsw"):
            index.hnsw.efSearch = ef_search
        self._index, self.backend = place_index(index, device)
        self._doc_ids = doc_ids
        self.encoder = encoder

    def encode_query(self, query: str) -> np.ndarray:
        return encode(self.encoder, [query])

    def search(self, vector: np.ndarray, k: int) -> list[tuple[str, float]]:
        """Top ``k`` (doc id, cosine similarity) for an encoded query, best first."""
        scores, rows = self._index.search(vector, min(k, len(self._doc_ids)))
        return [(self._doc_ids[r], float(s)) for r, s in zip(rows[0], scores[0], strict=True) if r >= 0]
