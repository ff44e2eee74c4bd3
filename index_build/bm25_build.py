"""The BM25 index built a part at a time, on every core.

Each part of the corpus (:mod:`index_build.parts`) is indexed into a Lucene index of its own by a
worker process, a JVM each: pyjnius cannot let two threads of one process make Lucene documents
side by side (``engine/retrieval/lucene.py``). The parts are then added whole into the index
(Lucene's ``addIndexes``: their segments copied, nothing analysed again). BM25 reads its statistics
across segments at search time and breaks ties by id, so scores and rankings are those of an index
one writer made. A part indexed is marked done in the build folder, so a stopped build indexes only
the parts it lacks; a corpus of one part is indexed here, as it always was.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path

from engine.documents import unit_id
from engine.retrieval.lucene import LuceneIndex
from engine.text import chunk_text
from index_build.parts import BuildFolder, Part
from offline.progress import track

MAX_WORKERS = 8  # a JVM each: memory, not cores, is what more would run out of


def index_documents(path: Path, docs: Sequence[dict], progress: bool = False, whole: bool = False) -> int:
    """A new Lucene index of ``docs`` at ``path``: each chunk under its document (live writes replace
    a document's chunks by its id), title and text in one ``contents`` field (BEIR "flat"), and its
    document's filter fields as terms. ``whole``: the build's whole index, merged into one segment
    (a part's are merged once all are added)."""
    index = LuceneIndex(path, writable=True, create=True)
    try:
        for doc in track(docs, "BM25 index", "doc", enabled=progress):
            chunks = doc["chunks"]
            units = [(unit_id(doc["document_id"], c["chunk_id"]), chunk_text(c["title"], c["content"])) for c in chunks]
            index.add(doc["document_id"], units, doc.get("metadata"))
        if whole:
            index.merge_into_one()
        index.commit(0)
    finally:
        index.close()
    return len(docs)


def build_bm25(
    path: Path, docs: Sequence[dict], parts: list[Part], work: BuildFolder, workers: int, progress: bool
) -> None:
    """The BM25 index of ``docs`` at ``path``, its ``parts`` indexed by ``workers`` processes (0:
    one a core, at most ``MAX_WORKERS``) and kept in ``work`` until every one is."""
    parts = [part for part in parts if part.rows]
    if len(parts) <= 1:
        index_documents(path, docs, progress, whole=True)
        return
    folder = work.path / "bm25-parts"
    todo = [part for part in parts if not work.done(_phase(part))]
    workers = min(workers or min(len(os.sched_getaffinity(0)), MAX_WORKERS), len(todo)) or 1
    spawn = multiprocessing.get_context("spawn")  # a fresh JVM: one started here cannot be forked
    with ProcessPoolExecutor(workers, mp_context=spawn) as pool:
        indexed = _indexed(pool, workers, folder, docs, todo)
        for part in track(indexed, f"BM25 index of {len(parts)} parts", "part", len(todo), enabled=progress):
            work.mark(_phase(part))
    shutil.rmtree(path, ignore_errors=True)
    index = LuceneIndex(path, writable=True, create=True)
    try:
        index.absorb([folder / _phase(part) for part in parts])
        index.commit(0)
    finally:
        index.close()


def _indexed(
    pool: ProcessPoolExecutor, workers: int, folder: Path, docs: Sequence[dict], todo: list[Part]
) -> Iterator[Part]:
    """Each part of ``todo`` as its worker finishes it; a part's documents are read (and sent) only
    once a worker is about to be free, so memory holds a few parts, not the corpus."""
    pending: dict[Future, Part] = {}
    waiting = iter(todo)
    while True:
        while len(pending) <= workers and (part := next(waiting, None)) is not None:
            shutil.rmtree(folder / _phase(part), ignore_errors=True)  # a stopped worker's half
            pending[pool.submit(index_documents, folder / _phase(part), docs[part.docs])] = part
        if not pending:
            return
        finished, _ = wait(pending, return_when=FIRST_COMPLETED)
        for future in finished:
            future.result()
            yield pending.pop(future)


def _phase(part: Part) -> str:
    return f"bm25-part-{part.number:05d}"
