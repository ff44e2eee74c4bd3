"""``build --shards N``: the corpus split by a hash of each document's id, each shard built as any
index is, then the judgment memory and the learned fusion trained once over the shards together.

The corpus is encoded first, by parts and in the batches one index's build encodes them (here, or
across a Ray cluster with ``--ray``), so every shard's vectors are bit for bit those one index would
hold. A shard is then a whole index directory (``shards/<i>/``, :mod:`engine.store.index_dir`) made
by :func:`~index_build.one_index.build_one_index` from its documents and those vectors: its BM25, store
and dense index, resumed by parts as an index is. Its chunks keep their row in the whole corpus, so
merged, the shards' rows are one index's, and so is the order of equal dense scores (by row). A
finished shard is kept in the build folder, so a stopped build resumes with the shards it lacks.
With ``--ray`` each shard is a Ray task of its own, on whichever node has room (the build folder
must be where every node can write it); without, the shards are built one after another here.
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from engine.retrieval.encoder import load_encoder, pick_device
from engine.settings import EngineSettings
from engine.store.index_dir import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    MEMORY_DIR,
    IndexDirError,
    Manifest,
    default_presentation,
    read_manifest,
    shard_dir,
    shard_of,
)
from engine.store.tokens import TextTokenizer
from index_build.corpus import Corpus
from index_build.one_index import build_one_index
from index_build.parts import VECTORS_FILE, BuildFolder, plan_parts
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
from index_build.vectors import GivenVectors
from offline.progress import track

log = logging.getLogger(__name__)


class _Picked(Sequence[dict]):
    """The documents of ``base`` at ``positions`` (ascending), read on demand as ``base`` reads them."""

    def __init__(self, base: Sequence[dict], positions: np.ndarray) -> None:
        self.base, self.positions = base, positions

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, at):
        if isinstance(at, slice):
            return [self.base[int(p)] for p in self.positions[at]]
        return self.base[int(self.positions[at])]

    def __iter__(self) -> Iterator[dict]:
        return (self.base[int(p)] for p in self.positions)


@dataclass(frozen=True)
class ShardPlan:
    """One shard's documents (positions in the corpus's list) and their chunks' rows in the whole corpus."""

    number: int
    documents: np.ndarray
    rows: np.ndarray


def plan_shards(document_ids: Sequence[str], chunk_counts: Sequence[int], shards: int) -> list[ShardPlan]:
    """Each document in shard :func:`~engine.store.index_dir.shard_of` its id; rows as in one index."""
    owner = np.fromiter((shard_of(d, shards) for d in document_ids), dtype=np.int64, count=len(document_ids))
    counts = np.asarray(chunk_counts, dtype=np.int64)
    first = np.cumsum(counts) - counts
    chunk_owner = np.repeat(owner, counts)
    return (
        [
            ShardPlan(i, np.flatnonzero(owner == i), np.flatnonzero(chunk_owner == i).astype(np.int64))
            for i in range(shards)
        ]
        if len(first)
        else [ShardPlan(i, np.zeros(0, np.int64), np.zeros(0, np.int64)) for i in range(shards)]
    )


def build_sharded(
    settings: EngineSettings,
    build: BuildSettings,
    corpus: Corpus | None,
    progress: bool = True,
    ray: str | None = None,
    release: bool = False,
) -> Manifest:
    """The sharded index of ``corpus`` at ``settings.index_dir`` (the arguments as
    :func:`~index_build.builder.build_index` takes them), swapped in whole at the end."""
    from index_build.corpus import open_corpus
    from index_build.train_fusion import train_fusion, training_split

    started = time.perf_counter()
    if corpus is None:
        corpus = open_corpus(build.data_dir, build.chunk_words, build.chunk_overlap_words, progress)
        release = True
    if corpus.files and not corpus.documents:
        raise ValueError(f"{corpus.root}: no file could be read")
    target = Path(settings.index_dir)
    plans = plan_shards(corpus.record_ids(), corpus.chunk_counts(), build.shards)
    chunks = sum(len(p.rows) for p in plans)
    if min(len(p.documents) for p in plans) == 0:
        raise ValueError(
            f"--shards {build.shards}: {len(corpus.documents):,} documents leave a shard empty; use fewer shards"
        )
    encoder = load_encoder(build.encoder, pick_device(settings.device))
    parts = plan_parts(corpus.chunk_counts(), build.part_chunks)
    key = {
        "fingerprint": corpus.fingerprint,
        "encoder": build.encoder,
        "chunks": chunks,
        "part_chunks": build.part_chunks,
        "shards": build.shards,
        "chunking": [build.chunk_words, build.chunk_overlap_words],
        "vectors": vectors_key(build.vectors),
        "format": FORMAT_VERSION,
        "dense_index": [build.dense_index, build.hnsw_m],  # a finished shard is kept: only one built alike
        "bm25": [settings.bm25_k1, settings.bm25_b],
    }
    with BuildFolder.open(target, key) as work:
        tmp = work.path / "index"
        tmp.mkdir(exist_ok=True)
        given = None
        if build.vectors is not None:
            given = GivenVectors(build.vectors, record_ids(corpus), encoder.get_embedding_dimension(), work.path)
        # encoded once, in the batches one index's build encodes: every shard's vectors are its rows'
        write_vectors(work, parts, corpus.documents, encoder, build.encoder, settings, given, ray, progress)
        encoded = work.path / VECTORS_FILE
        shard_build = build.model_copy(update={"shards": 1, "adapt": "none", "memory_split": "none", "vectors": None})
        shard_settings = settings.model_copy(update={"fusion": "rrf"})
        jobs = [
            (
                shard_settings.model_copy(update={"index_dir": shard_dir(tmp, p.number)}),
                shard_build,
                _shard_corpus(corpus, p),
                p.rows,
                encoded,
            )
            for p in plans
            if not _finished(shard_dir(tmp, p.number))
        ]
        reports = _on_ray(jobs, ray, progress) if ray is not None else _here(jobs, progress)
        for p in plans:
            if not _finished(shard_dir(tmp, p.number)):
                raise IndexDirError(f"{shard_dir(tmp, p.number)}: the shard's build did not finish; run it again")
        first = read_manifest(shard_dir(tmp, 0))
        documents, dataset = len(corpus.documents), corpus.dataset
        if release:
            release_corpus(corpus)
        memory = {}
        if dataset is not None:
            memory = build_memory(
                tmp / MEMORY_DIR, dataset, build.memory_split, settings, encoder, TextTokenizer(encoder.tokenizer)
            )
        shown = default_presentation(corpus.root.name)
        manifest = Manifest(
            name=build.index_name or shown[0],
            description=build.index_description or shown[1],
            dataset=str(corpus.root.resolve()) if corpus.files else "",
            fingerprint=corpus.fingerprint,
            documents=documents,
            encoder=build.encoder,
            dimension=first.dimension,
            dense_index=first.dense_index,
            bm25={"k1": settings.bm25_k1, "b": settings.bm25_b},
            bm25_fields=first.bm25_fields,
            memory=memory,
            passage_tokens=first.passage_tokens,
            versions=versions(),
            build_seconds=round(time.perf_counter() - started, 2),
            built_at=datetime.now(UTC).isoformat(timespec="seconds"),
            shards=build.shards,
            settings={
                "device": first.settings.get("device"),
                "chunks": chunks,
                "dense": first.settings.get("dense", {}),
                "partition": "blake2b-64(document id) mod shards",
                "shard_chunks": [len(p.rows) for p in plans],
                **({"shard_builds": reports} if reports else {}),
            },
        )
        keep_reranker(target, tmp, manifest.fingerprint)
        manifest.write(tmp)
        if dataset is not None and training_split(manifest, dataset) is not None and settings.fusion != "rrf":
            train_fusion(settings.model_copy(update={"index_dir": tmp}), dataset, progress=progress)
        elif dataset is None and build.adapt != "none":
            log.info("a sharded index is not adapted (--adapt): it serves RRF until judgments train a fusion")
        swap_in(tmp, target)
        work.finish()
    log.info(
        "built %s: %d documents in %d shards, %.1f s", target, documents, build.shards, time.perf_counter() - started
    )
    return manifest


def _finished(folder: Path) -> bool:
    return (folder / MANIFEST_FILE).is_file()


def _shard_corpus(corpus: Corpus, plan: ShardPlan) -> Corpus:
    return Corpus(
        root=corpus.root,
        documents=_Picked(corpus.documents, plan.documents),
        fingerprint=f"{corpus.fingerprint}:shard-{plan.number}",
        files=corpus.files,
    )


def build_shard(
    settings: EngineSettings, build: BuildSettings, corpus: Corpus, rows: np.ndarray, encoded: Path, progress: bool
) -> dict:
    """One shard's index (what a Ray task runs), and what it cost: seconds and the peak memory of the
    process that built it."""
    started = time.perf_counter()
    build_one_index(settings, build, corpus, progress=progress, rows=rows, encoded=encoded)
    return {
        "shard": Path(settings.index_dir).name,
        "chunks": len(rows),
        "seconds": round(time.perf_counter() - started, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def _here(jobs: list, progress: bool) -> list[dict]:
    return [build_shard(*job, progress) for job in track(jobs, "shards", "shard", enabled=progress and len(jobs) > 1)]


def _on_ray(jobs: list, address: str, progress: bool) -> list[dict]:
    """Each shard a Ray task (one CPU each, the BM25 of its parts in one process), as they finish."""
    import ray

    from engine.retrieval.java import jvm_signals_kept

    with jvm_signals_kept():
        ray.init(
            address=None if address == "local" else address,
            include_dashboard=False,
            log_to_driver=False,
            ignore_reinit_error=True,
        )
    task = ray.remote(num_cpus=1, max_retries=1)(build_shard)
    pending = [
        task.remote(settings, build.model_copy(update={"bm25_workers": 1}), corpus, rows, encoded, False)
        for settings, build, corpus, rows, encoded in jobs
    ]
    reports = []
    for _ in track(range(len(pending)), "shards on Ray", "shard", enabled=progress):
        done, pending = ray.wait(pending, num_returns=1)
        reports.append(ray.get(done[0]))
    return sorted(reports, key=lambda r: int(r["shard"]))
