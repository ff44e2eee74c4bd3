"""What a build of one index and a sharded build share (:mod:`index_build.builder`,
:mod:`index_build.shards`): the corpus's vectors written by parts, the judgment memory, the finished
folder swapped in for the old, and what the manifest records of the build."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import logging
import os
import shutil
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from engine.retrieval.encoder import encode
from engine.retrieval.memory import write_memory
from engine.settings import EngineSettings
from engine.store.index_dir import RERANKER_DIR, IndexDirError, read_manifest
from engine.store.tokens import TextTokenizer
from index_build.corpus import Corpus, chunk_texts
from index_build.parts import BuildFolder, Part
from index_build.vectors import EncodedRows, GivenVectors, VectorsError
from offline.dataset import Dataset
from offline.progress import track

log = logging.getLogger(__name__)
_LIBRARIES = ("pyserini", "faiss-cpu", "faiss-gpu-cu12", "sentence-transformers", "torch", "transformers")


def release_corpus(corpus: Corpus) -> None:
    """The corpus's documents dropped and their memory handed back to the system (a folder's chunks,
    held in memory, would otherwise stay through the dense index and the training after it)."""
    corpus.release()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # glibc's; elsewhere the allocator keeps it
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def vectors_key(path: Path | None) -> dict | None:
    if path is None:
        return None
    stat = Path(path).stat() if Path(path).is_file() else None
    return {
        "file": str(Path(path).resolve()),
        "bytes": stat.st_size if stat else None,
        "mtime_ns": stat.st_mtime_ns if stat else None,
    }


def record_ids(corpus: Corpus) -> list[str]:
    """Each chunk's record id, for vectors given a record each: a record split in several chunks
    cannot take one vector."""
    ids = corpus.record_ids()
    split = next(((i, n) for i, n in enumerate(corpus.chunk_counts()) if n != 1), None)
    if split is not None:
        raise VectorsError(
            f"--vectors needs one chunk a record, but {ids[split[0]]!r} has {split[1]}"
            " (a BEIR corpus keeps a record whole; for files, vectors cannot match chunks the build cuts)"
        )
    return ids


def write_vectors(
    work: BuildFolder,
    parts: list[Part],
    docs: Sequence[dict],
    encoder,
    name: str,
    settings: EngineSettings,
    given: GivenVectors | EncodedRows | None,
    ray: str | None,
    progress: bool,
) -> None:
    """Every part's vectors into ``work``'s vectors file, the parts it lacks: taken from ``given``,
    encoded on the Ray cluster at ``ray`` (``encoder`` there by its ``name``), or encoded here."""
    chunks = parts[-1].rows.stop if parts else 0
    todo = [part for part in parts if part.rows and not work.has_vectors(part.number)]
    if ray is not None and given is None and todo:  # written by the cluster's actors
        from index_build.ray_encode import encode_on_ray

        dimension, batch = encoder.get_embedding_dimension(), settings.encode_batch_size
        encode_on_ray(work, todo, docs, chunks, dimension, name, settings.device, batch, ray, progress)
        todo = []
    for part in track(todo, f"vectors of {chunks:,} chunks", "part", enabled=progress and len(todo) > 1):
        work.save_vectors(part, _part_vectors(encoder, settings, given, docs, part, progress), chunks)


def _part_vectors(
    encoder,
    settings: EngineSettings,
    given: GivenVectors | EncodedRows | None,
    docs: Sequence[dict],
    part: Part,
    progress: bool,
) -> np.ndarray:
    """A part's vectors: the given file's rows (the part's texts are not even read), or encoded here."""
    if given is not None:
        return given.rows(part.rows.start, part.rows.stop)
    texts = chunk_texts(docs[part.docs])
    bar = functools.partial(track, desc=f"encoding {len(texts):,} texts", unit="batch", enabled=progress)
    return encode(encoder, texts, settings.encode_batch_size, bar)


def build_memory(
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


def keep_reranker(old: Path, new: Path, corpus_fingerprint: str) -> None:
    if not (old / RERANKER_DIR).is_dir():
        return
    try:
        same_corpus = read_manifest(old).fingerprint == corpus_fingerprint
    except IndexDirError:
        same_corpus = False
    if same_corpus:
        shutil.rmtree(new / RERANKER_DIR, ignore_errors=True)  # a resumed build copied it before it stopped
        shutil.copytree(old / RERANKER_DIR, new / RERANKER_DIR)


def swap_in(tmp: Path, target: Path) -> None:
    """Rename the finished build over the target; the old index lives until the rename."""
    if target.exists():
        retired = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.rename(target, retired)
        os.rename(tmp, target)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.rename(tmp, target)


def versions() -> dict[str, str]:
    found = {}
    for name in _LIBRARIES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found
