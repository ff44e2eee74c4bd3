"""Build an index directory (BM25 + FAISS + document store + manifest) from a BEIR dataset, a folder
of files, or nothing (an empty index to ingest into)."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
import time
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from engine.documents import unit_id
from engine.retrieval.dense import build_faiss, encode
from engine.retrieval.encoder import load_encoder, pick_device
from engine.retrieval.lucene import LuceneIndex
from engine.retrieval.memory import write_memory
from engine.settings import EngineSettings
from engine.store.docstore import DocStore
from engine.store.index_dir import (
    BM25_DIR,
    DENSE_FILE,
    DOCS_FILE,
    MEMORY_DIR,
    RERANKER_DIR,
    IndexDirError,
    Manifest,
    read_manifest,
)
from engine.store.tokens import TextTokenizer, TextTokens
from engine.text import chunk_text
from index_build.adapt import FULL_MISSING, AdaptError, adapt_index
from index_build.adapt.generated import QueryWriter
from index_build.corpus import Corpus, open_corpus
from index_build.settings import BuildSettings
from index_build.train_fusion import train_fusion, training_split
from offline.dataset import Dataset
from offline.progress import track

log = logging.getLogger(__name__)
_LIBRARIES = ("pyserini", "faiss-cpu", "faiss-gpu-cu12", "sentence-transformers", "torch", "transformers")


def build_index(
    settings: EngineSettings,
    build: BuildSettings,
    corpus: Corpus | None = None,
    progress: bool = True,
    ray: str | None = None,
    questions: QueryWriter | None = None,
) -> Manifest:
    """Build into a temporary sibling folder, then swap it in, so readers never see half an index.

    ``corpus``: default, what ``build.data_dir`` holds (a BEIR dataset or a folder of files).
    ``ray``: encode the corpus across the Ray cluster at this address ("local": start one); the
    index is the same. ``questions``: a chat server whose questions join the adaptation's
    pseudo-queries (``--llm-url``).

    With training judgments, the learned fusion is trained on the new index before the swap; without
    them, ``build.adapt`` learns from the documents (:mod:`index_build.adapt`) before the swap, so an
    interrupted build never serves a half-adapted index. A reranker trained into an earlier index of
    the same corpus is carried over.
    """
    started = time.perf_counter()
    if build.adapt == "full":
        raise AdaptError(FULL_MISSING)
    if corpus is None:
        corpus = open_corpus(build.data_dir, build.chunk_words, build.chunk_overlap_words, progress)
    if corpus.files and not corpus.documents:
        reasons = "; ".join(f"{name}: {why}" for name, why in corpus.skipped[:5])
        raise ValueError(f"{corpus.root}: no file could be read ({reasons})")
    target = Path(settings.index_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=target.parent))
    try:
        docs = corpus.documents
        units = [(d["document_id"], c) for d in docs for c in d["chunks"]]
        texts = [chunk_text(c["title"], c["content"]) for _, c in units]
        _build_bm25(tmp / BM25_DIR, docs, progress)
        device = pick_device(settings.device)
        encoder = load_encoder(build.encoder, device)
        if not texts:
            vectors = np.zeros((0, encoder.get_embedding_dimension()), dtype=np.float32)
        elif ray is not None:
            from index_build.ray_encode import encode_on_ray

            vectors = encode_on_ray(texts, build.encoder, settings.device, settings.encode_batch_size, ray)
        else:
            bar = functools.partial(track, desc=f"encoding {len(texts):,} texts", unit="batch", enabled=progress)
            vectors = encode(encoder, texts, settings.encode_batch_size, bar)
        import faiss

        faiss.write_index(build_faiss(vectors, build.dense_index, build.hnsw_m), str(tmp / DENSE_FILE))
        # the rerankers' token ids: every MiniLM reranker shares the encoder's tokenizer
        tokenizer = TextTokenizer(encoder.tokenizer)
        _write_store(tmp / DOCS_FILE, docs, tokenizer(texts))
        dataset = corpus.dataset
        memory = (
            _build_memory(tmp / MEMORY_DIR, dataset, build.memory_split, settings, encoder, tokenizer)
            if dataset is not None
            else {}
        )
        manifest = Manifest(
            dataset=str(corpus.root.resolve()) if corpus.files else "",
            fingerprint=corpus.fingerprint,
            documents=len(docs),
            encoder=build.encoder,
            dimension=int(vectors.shape[1]),
            dense_index=build.dense_index,
            bm25={"k1": settings.bm25_k1, "b": settings.bm25_b},
            memory=memory,
            passage_tokens=tokenizer.recipe,
            versions=_versions(),
            build_seconds=round(time.perf_counter() - started, 2),
            built_at=datetime.now(UTC).isoformat(timespec="seconds"),
            settings={
                "device": device,
                "encode_batch_size": settings.encode_batch_size,
                "hnsw_m": build.hnsw_m,
                "chunks": len(units),
                **({"files": corpus.files, "skipped_files": len(corpus.skipped)} if dataset is None else {}),
            },
        )
        _keep_reranker(target, tmp, manifest.fingerprint)
        manifest.write(tmp)
        judged = dataset is not None and training_split(manifest, dataset) is not None
        if judged and settings.fusion != "rrf":
            train_fusion(settings.model_copy(update={"index_dir": tmp}), dataset, progress=progress)
        elif not judged and build.adapt != "none" and texts:
            adapt_index(settings.model_copy(update={"index_dir": tmp}), build, progress=progress, writer=questions)
        _swap_in(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("built %s: %d documents in %.1f s", target, manifest.documents, time.perf_counter() - started)
    return manifest


def _build_bm25(path: Path, docs: list[dict], progress: bool) -> None:
    """Title and text in one ``contents`` field, Anserini's analyzer: BEIR "flat". Each chunk is
    indexed under its document, so that live updates replace a document's chunks by its id."""
    index = LuceneIndex(path, writable=True, create=True)
    for doc in track(docs, "BM25 index", "doc", enabled=progress):
        units = [
            (unit_id(doc["document_id"], c["chunk_id"]), chunk_text(c["title"], c["content"])) for c in doc["chunks"]
        ]
        index.add(doc["document_id"], units)
    index.commit(0)
    index.close()


def _write_store(path: Path, docs: list[dict], tokens: list[TextTokens]) -> None:
    """Every document with its chunks' token ids; the chunks' rows are their positions in the build
    (the dense index's ids)."""
    store = DocStore(path)
    start = 0
    placed = []
    for doc in docs:
        rows = list(range(start, start + len(doc["chunks"])))
        placed.append((doc, rows, tokens[start : start + len(rows)]))
        start += len(rows)
    store.write_documents(placed)
    store.close()


def _build_memory(
    folder: Path, dataset: Dataset, split: str | None, settings: EngineSettings, encoder, tokenizer: TextTokenizer
) -> dict:
    """Embed the training queries that have positive judgments; skipped when there are none."""
    if split == "auto":
        split = dataset.training_split()
    if split is None:
        log.info("no training judgments: building without a judgment memory")
        return {}
    qrels = dataset.qrels(split)
    query_ids = sorted(q for q, docs in qrels.items() if any(g > 0 for g in docs.values()))
    texts = [dataset.queries[q] for q in query_ids]
    vectors = encode(encoder, texts, settings.encode_batch_size)
    write_memory(folder, vectors, qrels, query_ids, texts, tokenizer)
    return {"split": split, "queries": len(query_ids)}


def _keep_reranker(old: Path, new: Path, corpus_fingerprint: str) -> None:
    if not (old / RERANKER_DIR).is_dir():
        return
    try:
        same_corpus = read_manifest(old).fingerprint == corpus_fingerprint
    except IndexDirError:
        same_corpus = False
    if same_corpus:
        shutil.copytree(old / RERANKER_DIR, new / RERANKER_DIR)


def _swap_in(tmp: Path, target: Path) -> None:
    """Rename the finished build over the target; the old index lives until the rename."""
    if target.exists():
        retired = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.rename(target, retired)
        os.rename(tmp, target)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.rename(tmp, target)


def _versions() -> dict[str, str]:
    found = {}
    for name in _LIBRARIES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found
