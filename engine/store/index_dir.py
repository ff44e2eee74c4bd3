"""The on-disk contract between the builder and the engine.

An index directory holds ``bm25/`` (Lucene), ``dense.faiss`` (ids are document-store rows),
``docs.sqlite`` (the document store, with each chunk's token ids since format 3), ``manifest.json``
and optionally ``memory/`` (the judgment memory), ``fusion/`` (the learned fusion), ``adapt/`` (what
a build without judgments learned from the documents: its card, report and corpus graph),
``reranker/``, ``tokens/`` (token ids for a reranker whose tokenizer is not the one the store's are for) and,
once documents were written to it live, ``wal.log`` (the write-ahead log) with
``dense-<seq>.faiss`` and ``delta-<base>-<seq>.npz`` checkpoints. The manifest is
written last, inside a temporary folder that is renamed into place, so a directory with a manifest
is complete.

A sharded index (``build --shards N``, the manifest's ``shards``) holds no BM25, dense or store of
its own: each document lives in ``shards/<i>/``, a whole index directory of the documents whose id
hashes to ``i`` (:func:`shard_of`), with rows numbered across the corpus, so the shards' rows are one
index's. The memory, the fusion and the reranker stay at the top, trained on the merged candidates.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT_VERSION = 3  # 3: the store keeps each chunk's token ids (``passage_tokens`` in the manifest)
READABLE = (2, 3)  # a format-2 index gets its token ids at first load (engine/rerank/token_source.py)
BM25_DIR = "bm25"
DENSE_FILE = "dense.faiss"
DOCS_FILE = "docs.sqlite"
MANIFEST_FILE = "manifest.json"
RERANKER_DIR = "reranker"
MEMORY_DIR = "memory"
FUSION_DIR = "fusion"
ADAPT_DIR = "adapt"  # what `build --adapt` learned from the documents (engine/fusion/graph.py)
TOKENS_DIR = "tokens"
SHARDS_DIR = "shards"
REPORTS_DIR = "reports"  # what `evaluate` and `bench` write by default: beside the index they measured
WAL_FILE = "wal.log"
PUBLISHED_FILE = "published"  # the last logged write the writer has made visible to other processes
LOCK_FILE = "writer.lock"  # held by the index's one writing process (engine/live/locks.py)


# corpora whose wording agents have always been shown: folder name -> (name, one-line description)
KNOWN_CORPORA = {"nfcorpus": ("NFCorpus", "NFCorpus medical abstracts")}


def default_presentation(folder: str) -> tuple[str, str]:
    """The name and description an index built from the data folder ``folder`` presents itself with,
    unless its build named them (``--index-name``, ``--index-description``)."""
    name = folder or "this index"
    return KNOWN_CORPORA.get(folder.lower(), (name, f"the documents of {name}"))


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
    passage_tokens: dict = field(default_factory=dict)  # the recipe of the store's token ids (engine/store/tokens.py)
    settings: dict = field(default_factory=dict)
    bm25_fields: list[str] = field(default_factory=list)  # filter fields every chunk carries in Lucene
    shards: int = 0  # 0: the index itself; N: its documents in N shard index directories (shard_dir)
    name: str = ""  # what agents are shown (MCP, the A2A card); "" in an index built before they were kept
    description: str = ""

    def presented(self) -> tuple[str, str]:
        """The index's name and one-line description, as built or from its data folder's name."""
        default = default_presentation(Path(self.dataset).name if self.dataset else "")
        return self.name or default[0], self.description or default[1]

    def write(self, index_dir: Path) -> None:
        fields = asdict(self)
        if not fields["shards"]:  # an index in one piece reads as it did before shards (older readers too)
            del fields["shards"]
        (index_dir / MANIFEST_FILE).write_text(json.dumps(fields, indent=2) + "\n")


def read_manifest(index_dir: Path) -> Manifest:
    """Load and check the manifest; refuse incomplete or foreign directories with a clear message."""
    path = Path(index_dir) / MANIFEST_FILE
    if not Path(index_dir).is_dir():
        raise IndexDirError(f"{index_dir}: no index directory here; run `hybrid-search build` first")
    if not path.is_file():
        raise IndexDirError(f"{index_dir}: no {MANIFEST_FILE}, so the build did not finish; rebuild it")
    try:
        manifest = Manifest(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as exc:  # unreadable, not UTF-8, not JSON, not a manifest's fields
        raise IndexDirError(f"{path}: unreadable manifest ({exc}); rebuild the index") from None
    if manifest.format_version not in READABLE:
        raise IndexDirError(
            f"{path}: format {manifest.format_version}, this version reads {READABLE[0]} to {READABLE[-1]}; rebuild"
            " it with `hybrid-search build` (format 2 keeps documents in SQLite and dense ids by row)"
        )
    if manifest.shards:
        for i in range(manifest.shards):
            read_manifest(shard_dir(index_dir, i))
        return manifest
    for part in (BM25_DIR, DOCS_FILE):
        if not (Path(index_dir) / part).exists():
            raise IndexDirError(f"{index_dir}: {part} is missing; rebuild the index")
    if not latest_dense(index_dir).base.exists():
        raise IndexDirError(f"{index_dir}: {DENSE_FILE} is missing; rebuild the index")
    return manifest


def shard_dir(index_dir: Path, shard: int) -> Path:
    """Shard ``shard``'s index directory inside a sharded index."""
    return Path(index_dir) / SHARDS_DIR / str(shard)


def shard_of(document_id: str, shards: int) -> int:
    """The shard holding ``document_id``: its BLAKE2b hash (8 bytes, big-endian) modulo the shard count,
    the same in every process and release (Python's own ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(document_id.encode(), digest_size=8).digest(), "big") % shards


@dataclass(frozen=True)
class DenseCheckpoint:
    """The dense index as of write ``seq``: a base file and, when writes came after it, the delta
    file holding them (:mod:`engine.retrieval.segments`)."""

    base: Path
    seq: int
    delta: Path | None = None

    @property
    def base_seq(self) -> int:
        return _seq(self.base)


def base_path(index_dir: Path, seq: int) -> Path:
    """The base dense index holding every logged write up to ``seq`` (0: as built)."""
    return Path(index_dir) / (DENSE_FILE if seq == 0 else f"dense-{seq:012d}.faiss")


def delta_path(index_dir: Path, base_seq: int, seq: int) -> Path:
    """The writes from base ``base_seq`` up to ``seq``."""
    return Path(index_dir) / f"delta-{base_seq:012d}-{seq:012d}.npz"


def _seq(path: Path) -> int:
    return 0 if path.name == DENSE_FILE else int(path.name.split(".")[0].split("-")[-1])


def latest_dense(index_dir: Path) -> DenseCheckpoint:
    """The newest dense checkpoint: the newest base and its newest delta (one left by a merge
    that stopped before removing it names an older base and is not read)."""
    bases = [(int(p.stem.split("-")[1]), p) for p in Path(index_dir).glob("dense-*.faiss")]
    base_seq, base = max(bases) if bases else (0, Path(index_dir) / DENSE_FILE)
    deltas = [_seq(p) for p in Path(index_dir).glob(f"delta-{base_seq:012d}-*.npz")]
    if deltas and max(deltas) > base_seq:
        return DenseCheckpoint(base, max(deltas), delta_path(index_dir, base_seq, max(deltas)))
    return DenseCheckpoint(base, base_seq)


def publish(index_dir: Path, seq: int) -> None:
    """Tell the processes following the writer that every write up to ``seq`` is theirs to show
    (Lucene holds it committed, the log or a dense checkpoint the rest). Not fsynced: an
    announcement, rebuilt from the stores after a crash."""
    tmp = Path(index_dir) / f".{PUBLISHED_FILE}.tmp"
    tmp.write_text(str(seq))
    os.replace(tmp, Path(index_dir) / PUBLISHED_FILE)


def published(index_dir: Path) -> int:
    """The last write the writer made visible (-1: none announced yet)."""
    try:
        return int((Path(index_dir) / PUBLISHED_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return -1
