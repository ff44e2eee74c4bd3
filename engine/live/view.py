"""The index as its live writer and a follower see it: the stores one search reads together, and
the lock that keeps them together.

A search holds the lock's shared side from retrieval to its answer. The writer, applying logged
writes, and a follower, showing the writer's, change the stores under its exclusive side and swap
in a newer dense view whole. Both are handed this view rather than the engine: what they may change
is named here, and nothing else of the engine (fusion, reranker, doors) is theirs to reach.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.live.locks import ViewLock
from engine.retrieval.dense import DenseRetriever
from engine.retrieval.encoder import encode
from engine.retrieval.lucene import LuceneIndex
from engine.store.docstore import DocStore
from engine.store.index_dir import DOCS_FILE, WAL_FILE, DenseCheckpoint, IndexDirError, Manifest


@dataclass(eq=False)
class IndexView:
    """One index directory's stores as searched together, and their lock."""

    index_dir: Path
    manifest: Manifest
    store: DocStore
    bm25: LuceneIndex
    dense: DenseRetriever
    encode_batch_size: int
    lock: ViewLock = field(default_factory=ViewLock)

    def check_settled(self, dense_seq: int) -> None:
        """Refuse, for an engine that neither writes nor follows, stores that hold different writes
        (``dense_seq``: the dense checkpoint's) or a log with writes none of them holds yet."""
        seqs = {self.bm25.committed_seq(), dense_seq, self.store.meta("applied_seq")}
        wal = self.index_dir / WAL_FILE
        if len(seqs) > 1 or (wal.exists() and wal.stat().st_size > 0):
            raise IndexDirError(
                f"{self.index_dir}: live writes are not checkpointed yet (a server is writing it, or one stopped"
                " without a checkpoint); run `hybrid-search compact` when no server writes it"
            )

    def bind_units(self) -> None:
        """Name the dense rows by the store's map; refuses stores that disagree (a missing or stale
        file), which would otherwise answer with the wrong documents."""
        self.dense.bind(self.store.unit_map())
        if self.bm25.documents != len(self.dense.units):
            raise IndexDirError(
                f"{self.bm25.path}: {self.bm25.documents} documents for {len(self.dense.units)} in the store"
                f" ({DOCS_FILE}); rebuild the index"
            )

    def swap_dense(self, dense: DenseRetriever) -> None:
        """Searches from now on read ``dense`` (a newer checkpoint's view); those running finish first."""
        with self.lock.writing():
            self.dense = dense

    def rebase(self, checkpoint: DenseCheckpoint) -> None:
        """Searches from now on read ``checkpoint``, a merged base holding this view's rows (mapped
        as every reader maps it), with the rows named as they are now."""
        current = self.dense
        dense = current.reopened(checkpoint)
        dense.units = current.units
        self.swap_dense(dense)

    def encode_texts(self, texts: list[str]) -> np.ndarray:
        """Dense vectors for new chunks, batched, by the index's encoder."""
        return encode(self.dense.encoder, texts, self.encode_batch_size)
