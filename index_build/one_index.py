"""One index directory (BM25 + FAISS + document store + manifest) built from a corpus: the whole
index, or one shard of a sharded build (:mod:`index_build.shards`)."""

from __future__ import annotations

import functools
import logging
import shutil
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from engine.retrieval.encoder import encode, load_encoder, pick_device
from engine.retrieval.lucene import FILTER_FIELDS
from engine.settings import EngineSettings
from engine.store.docstore import DocStore
from engine.store.index_dir import (
    BM25_DIR,
    DENSE_FILE,
    DOCS_FILE,
    FORMAT_VERSION,
    MEMORY_DIR,
    Manifest,
    default_presentation,
)
from engine.store.tokens import TextTokenizer
from engine.text import chunk_text
from index_build.adapt import adapt_index
from index_build.adapt.generated import QueryWriter
from index_build.bm25_build import build_bm25
from index_build.corpus import Corpus, chunk_texts, open_corpus
from index_build.dense_index import RECALL_QUERIES, build_dense, check_factory
from index_build.parts import BuildFolder, Part, plan_parts
from index_build.settings import BuildSettings
from index_build.steps import (
    build_memory,
    keep_reranker,
    record_ids,
    release_corpus,
    swap_in,
    vectors_key,
    versions,
    write_vectors,
)
from index_build.train_fusion import train_fusion, training_split
from index_build.vectors import EncodedRows, GivenVectors
from offline.progress import track

log = logging.getLogger(__name__)
TOKENIZE_BATCH = 2_000  # passages tokenized at once: each encoding holds ~47 KB until its ids are kept


def build_one_index(
    settings: EngineSettings,
    build: BuildSettings,
    corpus: Corpus | None = None,
    progress: bool = True,
    ray: str | None = None,
    questions: QueryWriter | None = None,
    release: bool = False,
    rows: np.ndarray | None = None,
    encoded: Path | None = None,
) -> Manifest:
    """Build into a work folder beside the target, then swap it in, so readers never see half an index.

    ``corpus``: default, what ``build.data_dir`` holds (a BEIR dataset or a folder of files).
    ``ray``: encode the corpus across the Ray cluster at this address ("local": start one); the
    index is the same. ``questions``: a chat server whose questions join the adaptation's
    pseudo-queries (``--llm-url``). ``build.vectors``: take the chunks' vectors from this file
    (:mod:`index_build.vectors`) instead of encoding them. ``release``: the caller no longer needs
    ``corpus.documents``, which are dropped once stored (as always for a corpus opened here).

    The corpus is encoded, tokenized and stored ``build.part_chunks`` chunks at a time, so memory is
    bounded by a part, not the corpus, and each finished part is kept (:class:`BuildFolder`): a build
    that stops, killed or failed, resumes where it stopped when run again with the same inputs.

    With training judgments, the learned fusion is trained on the new index before the swap; without
    them, ``build.adapt`` learns from the documents (:mod:`index_build.adapt`) before the swap, so an
    interrupted build never serves a half-adapted index. A reranker trained into an earlier index of
    the same corpus is carried over.

    One shard's build is given ``rows``, each chunk's row in the whole corpus (default: their order
    here), and ``encoded``, the whole corpus's vectors as the sharded build encoded them.
    """
    started = time.perf_counter()
    release = release or corpus is None  # a corpus opened here is this build's to drop once stored
    if corpus is None:
        corpus = open_corpus(build.data_dir, build.chunk_words, build.chunk_overlap_words, progress)
    if corpus.files and not corpus.documents:
        reasons = "; ".join(f"{name}: {why}" for name, why in corpus.skipped[:5])
        raise ValueError(f"{corpus.root}: no file could be read ({reasons})")
    target = Path(settings.index_dir)
    docs = corpus.documents
    parts = plan_parts(corpus.chunk_counts(), build.part_chunks)
    chunks = parts[-1].rows.stop if parts else 0
    device = pick_device(settings.device)
    encoder = load_encoder(build.encoder, device)
    dimension = encoder.get_embedding_dimension()
    check_factory(build.dense_index, dimension, chunks)
    key = {
        "fingerprint": corpus.fingerprint,
        "encoder": build.encoder,
        "chunks": chunks,
        "part_chunks": build.part_chunks,
        "chunking": [build.chunk_words, build.chunk_overlap_words],  # a folder's fingerprint is its files
        "vectors": vectors_key(build.vectors),
        "format": FORMAT_VERSION,
        "bm25_fields": list(FILTER_FIELDS),
    }
    with BuildFolder.open(target, key) as work:
        given = None
        if encoded is not None:
            given = EncodedRows(encoded, rows)
        elif build.vectors is not None:
            given = GivenVectors(build.vectors, record_ids(corpus), dimension, work.path)
        tmp = work.path / "index"
        tmp.mkdir(exist_ok=True)
        if not work.done("bm25") or not (tmp / BM25_DIR).is_dir():
            shutil.rmtree(tmp / BM25_DIR, ignore_errors=True)
            build_bm25(tmp / BM25_DIR, docs, parts, work, build.bm25_workers, progress)
            work.mark("bm25")
        write_vectors(work, parts, docs, encoder, build.encoder, settings, given, ray, progress)
        tokenizer = TextTokenizer(encoder.tokenizer)  # the rerankers' token ids: MiniLM rerankers share it
        if not work.done("store") or not (tmp / DOCS_FILE).is_file():
            _write_store(tmp / DOCS_FILE, docs, parts, tokenizer, progress, rows)
            work.mark("store")
        vectors = work.vectors() if chunks else np.zeros((0, dimension), dtype=np.float32)
        documents, (probe_texts, sought, probed) = len(docs), _probe_texts(corpus)
        if release:  # the texts are in the store now: the rest of the build reads the index
            release_corpus(corpus)
        probes = functools.partial(encode, encoder, probe_texts)
        probed = f"{probed}, encoded by {build.encoder}" + (" (the query encoder of --vectors)" if given else "")
        index, dense = build_dense(
            vectors, build.dense_index, build.hnsw_m, progress, probes, rows, probed, settings.hnsw_ef_search, sought
        )
        import faiss

        faiss.write_index(index, str(tmp / DENSE_FILE))
        del index, vectors
        dataset = corpus.dataset
        memory = (
            build_memory(tmp / MEMORY_DIR, dataset, build.memory_split, settings, encoder, tokenizer)
            if dataset is not None
            else {}
        )
        shown = default_presentation(corpus.root.name)
        manifest = Manifest(
            name=build.index_name or shown[0],
            description=build.index_description or shown[1],
            dataset=str(corpus.root.resolve()) if corpus.files else "",
            fingerprint=corpus.fingerprint,
            documents=documents,
            encoder=build.encoder,
            dimension=dimension,
            dense_index=_named(dense["factory"]),
            bm25={"k1": settings.bm25_k1, "b": settings.bm25_b},
            bm25_fields=list(FILTER_FIELDS),
            memory=memory,
            passage_tokens=tokenizer.recipe,
            versions=versions(),
            build_seconds=round(time.perf_counter() - started, 2),
            built_at=datetime.now(UTC).isoformat(timespec="seconds"),
            settings={
                "device": device,
                "encode_batch_size": settings.encode_batch_size,
                "hnsw_m": build.hnsw_m,
                "chunks": chunks,
                "dense": dense,
                **({"vectors": given.source} if given is not None else {}),
                **({"files": corpus.files, "skipped_files": len(corpus.skipped)} if dataset is None else {}),
            },
        )
        keep_reranker(target, tmp, manifest.fingerprint)
        manifest.write(tmp)
        judged = dataset is not None and training_split(manifest, dataset) is not None
        if judged and settings.fusion != "rrf":
            train_fusion(settings.model_copy(update={"index_dir": tmp}), dataset, progress=progress)
        elif not judged and build.adapt != "none" and chunks:
            adapt_index(settings.model_copy(update={"index_dir": tmp}), build, progress=progress, writer=questions)
        swap_in(tmp, target)
        work.finish()
    log.info("built %s: %d documents in %.1f s", target, manifest.documents, time.perf_counter() - started)
    return manifest


def _probe_texts(corpus: Corpus) -> tuple[list[str], list[np.ndarray], str]:
    """What an approximate index's recall is measured on, each probe's own answers (the positions of
    their chunks among the corpus's), and their description for the manifest: 200 of the dataset's
    training queries (their texts only; never a held-out split's) seeking the documents judged
    relevant to them, or without any, the opening words of 200 chunks, as a user's short question
    would read, each seeking its own chunk."""
    rng = np.random.default_rng(0)
    counts = np.asarray(corpus.chunk_counts(), dtype=np.int64)
    first = np.cumsum(counts) - counts  # each document's first chunk
    split = corpus.dataset.training_split() if corpus.dataset is not None else None
    queries = corpus.dataset.split_queries(split) if split is not None else {}
    if queries:
        picked = rng.choice(len(queries), size=min(RECALL_QUERIES, len(queries)), replace=False)
        ids = list(queries)
        at = {doc: i for i, doc in enumerate(corpus.record_ids())}
        qrels = corpus.dataset.qrels(split)
        sought = []
        for i in picked:
            documents = [at[doc] for doc, grade in qrels.get(ids[i], {}).items() if grade > 0 and doc in at]
            sought.append(np.asarray([r for d in documents for r in range(first[d], first[d] + counts[d])], np.int64))
        return [queries[ids[i]] for i in picked], sought, f"{len(picked)} of the dataset's {split} queries"
    total = int(counts.sum())
    picked = np.sort(rng.choice(total, size=min(RECALL_QUERIES, total), replace=False)) if total else []
    owner = np.searchsorted(np.cumsum(counts), picked, side="right")  # the document holding each picked row
    chunks = [corpus.documents[int(d)]["chunks"][int(row - first[d])] for d, row in zip(owner, picked, strict=True)]
    return (
        [" ".join(chunk_text(c["title"], c["content"]).split()[:12]) for c in chunks],
        [np.asarray([row], np.int64) for row in picked],
        f"the opening 12 words of {len(chunks)} chunks (the dataset has no training queries)",
    )


def _named(factory: str) -> str:
    """The manifest's name of a dense index: flat and hnsw as before, anything else its factory string."""
    return "flat" if factory == "Flat" else "hnsw" if factory.startswith("HNSW") else factory


def _write_store(
    path: Path,
    docs: Sequence[dict],
    parts: list[Part],
    tokenizer: TextTokenizer,
    progress: bool,
    numbered: np.ndarray | None = None,
) -> None:
    """Every document with its chunks' token ids, a part a transaction, tokenized a part at a time
    (all at once, tokenizing held every encoding alive: 47 KB a passage). A stopped build keeps the
    parts it stored: the store's next row says where to go on. ``numbered``: each chunk's row (a
    shard's, in the whole corpus, ascending), else its position."""
    store = DocStore(path)
    stored = store.meta("next_row")
    row_of = (lambda i: int(numbered[i])) if numbered is not None else (lambda i: i)  # noqa: E731
    todo = [part for part in parts if (row_of(part.rows.start) >= stored if part.rows else stored == 0)]
    for part in track(todo, "document store", "part", enabled=progress and len(parts) > 1):
        part_docs = docs[part.docs]
        texts = chunk_texts(part_docs)
        tokens = [t for i in range(0, len(texts), TOKENIZE_BATCH) for t in tokenizer(texts[i : i + TOKENIZE_BATCH])]
        placed, row = [], part.rows.start
        for doc in part_docs:
            rows = [row_of(i) for i in range(row, row + len(doc["chunks"]))]
            placed.append((doc, rows, tokens[row - part.rows.start : row - part.rows.start + len(rows)]))
            row += len(rows)
        store.write_documents(placed)
    store.close()
