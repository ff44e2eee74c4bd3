"""The on-disk contract between the builder and the engine.

An index directory holds ``bm25/`` (Lucene), ``dense.faiss``, ``docs.jsonl`` (the document store,
in FAISS row order), ``manifest.json`` and optionally ``memory/`` (the judgment memory), ``fusion/``
(the learned fusion) and ``reranker/``. The manifest is written last,
inside a temporary folder that is renamed into place, so a directory with a manifest is complete.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.dataset import Document

FORMAT_VERSION = 1
BM25_DIR = "bm25"
DENSE_FILE = "dense.faiss"
DOCS_FILE = "docs.jsonl"
MANIFEST_FILE = "manifest.json"
RERANKER_DIR = "reranker"
MEMORY_DIR = "memory"
FUSION_DIR = "fusion"


class IndexDirError(RuntimeError):
    """The index directory is missing, incomplete or does not match what is asked of it."""


@dataclass
class Manifest:
    dataset: str
    fingerprint: str
    documents: int
    encoder: str
    dimension: int
    dense_index: str
    bm25: dict[str, float]
    versions: dict[str, str]
    build_seconds: float
    built_at: str
    memory: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    settings: dict = field(default_factory=dict)

    def write(self, index_dir: Path) -> None:
        (index_dir / MANIFEST_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")


def read_manifest(index_dir: Path) -> Manifest:
    """Load and check the manifest; refuse incomplete or foreign directories with a clear message."""
    path = Path(index_dir) / MANIFEST_FILE
    if not Path(index_dir).is_dir():
        raise IndexDirError(f"{index_dir}: no index directory here; run `hybrid-search build` first")
    if not path.is_file():
        raise IndexDirError(f"{index_dir}: no {MANIFEST_FILE}, so the build did not finish; rebuild it")
    try:
        manifest = Manifest(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as exc:
        raise IndexDirError(f"{path}: unreadable manifest ({exc}); rebuild the index") from None
    if manifest.format_version != FORMAT_VERSION:
        raise IndexDirError(f"{path}: format {manifest.format_version}, this version reads {FORMAT_VERSION}; rebuild")
    for part in (BM25_DIR, DENSE_FILE, DOCS_FILE):
        if not (Path(index_dir) / part).exists():
            raise IndexDirError(f"{index_dir}: {part} is missing; rebuild the index")
    return manifest


def write_docs(path: Path, docs: list[Document]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for doc in docs:
            fh.write(json.dumps({"_id": doc.doc_id, "title": doc.title, "text": doc.text}) + "\n")


def read_docs(index_dir: Path, expected: int) -> list[Document]:
    with open(Path(index_dir) / DOCS_FILE, encoding="utf-8") as fh:
        docs = [Document(o["_id"], o["title"], o["text"]) for o in map(json.loads, fh)]
    if len(docs) != expected:
        raise IndexDirError(f"{index_dir}: {DOCS_FILE} has {len(docs)} documents, manifest says {expected}")
    return docs
