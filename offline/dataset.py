"""BEIR-format datasets: ``corpus.jsonl``, ``queries.jsonl`` and ``qrels/<split>.tsv``.

Real BEIR files carry CRLF line ends, optional titles and ``metadata`` of any JSON shape (a
query's is data, never read; a document's is kept as published: :func:`engine.documents.kept_metadata`);
everything else that is wrong is reported as a :class:`DatasetError` naming the file, the line and
the problem, because a silently skipped judgment or document would skew every number computed
downstream.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.documents import json_metadata, kept_metadata
from engine.text import chunk_text


class DatasetError(ValueError):
    """A dataset file is missing or malformed; the message names the file and line."""


@dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    text: str
    metadata: dict = field(default_factory=dict, compare=False)  # a record's own "metadata" object, as kept

    @property
    def contents(self) -> str:
        """What every stage reads of this document (:func:`engine.text.chunk_text`)."""
        return chunk_text(self.title, self.text)


def beir_document(doc: Document) -> dict:
    """A BEIR record as the document store holds documents: one chunk, whose id is the record's."""
    chunk = {"chunk_id": doc.doc_id, "title": doc.title, "content": doc.text, "metadata": {}}
    return {"document_id": doc.doc_id, "document_name": doc.title, "metadata": doc.metadata, "chunks": [chunk]}


Qrels = dict[str, dict[str, int]]


class StreamedCorpus(Mapping[str, Document]):
    """``corpus.jsonl`` read once, checked as :func:`read_jsonl` checks it, keeping only each record's
    id and where its line starts; a document is read from the file when asked for. A million
    passages then cost their ids, not their texts, and a build reads them a part at a time."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        ids: list[str] = []
        starts: list[int] = []
        for start, obj in read_jsonl_at(self.path, what="document"):
            ids.append(obj["_id"])
            starts.append(start)
        self.ids = ids
        self._row = {doc_id: row for row, doc_id in enumerate(ids)}
        self._starts = np.asarray(starts, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[str]:
        return iter(self.ids)

    def __contains__(self, doc_id: object) -> bool:
        return doc_id in self._row

    def __getitem__(self, doc_id: str) -> Document:
        return self.rows(self._row[doc_id], self._row[doc_id] + 1)[0]

    def rows(self, start: int, stop: int) -> list[Document]:
        """The documents of rows ``start`` to ``stop`` (file order), read in one pass over their lines."""
        found: list[Document] = []
        if start >= stop:
            return found
        with open(self.path, "rb") as fh:
            fh.seek(int(self._starts[start]))
            while len(found) < stop - start:
                line = fh.readline()
                if line.strip():
                    found.append(_document(json.loads(line)))
        return found

    def values(self) -> Iterator[Document]:  # type: ignore[override]  # streamed, in file order
        for _, obj in read_jsonl_at(self.path, what="document"):
            yield _document(obj)


def _document(obj: dict) -> Document:
    return Document(obj["_id"], obj.get("title") or "", obj["text"], kept_metadata(obj.get("metadata") or {}))


@dataclass
class Dataset:
    root: Path
    corpus: Mapping[str, Document]  # a dict, or a StreamedCorpus (load_dataset's ``stream``)
    queries: dict[str, str]
    _qrels: dict[str, Qrels] = field(default_factory=dict, repr=False)

    def splits(self) -> list[str]:
        """Splits whose judgments are present (``train.graded`` counts as its own split)."""
        return sorted(p.stem for p in (self.root / "qrels").glob("*.tsv"))

    def training_split(self) -> str | None:
        """The judgments to learn from: graded train judgments when present (NFCorpus ships both),
        else ``train``, else none."""
        return next((s for s in ("train.graded", "train") if s in self.splits()), None)

    def qrels(self, split: str) -> Qrels:
        """Judgments of ``split``, validated against the corpus and the queries."""
        if split not in self._qrels:
            path = self.root / "qrels" / f"{split}.tsv"
            if not path.is_file():
                have = ", ".join(self.splits()) or "none"
                raise DatasetError(f"{path}: no judgments for split {split!r} (present: {have})")
            self._qrels[split] = read_qrels(path, self.corpus, self.queries)
        return self._qrels[split]

    def split_queries(self, split: str) -> dict[str, str]:
        """Queries that have at least one judgment in ``split``, in file order."""
        judged = self.qrels(split)
        return {qid: text for qid, text in self.queries.items() if qid in judged}


def load_dataset(root: str | Path, stream: bool = False) -> Dataset:
    """Read and validate a BEIR folder; judgments are read lazily per split. ``stream``: the corpus
    as a :class:`StreamedCorpus` (documents read from the file when asked for), not held whole."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"{root}: dataset folder not found")
    path = root / "corpus.jsonl"
    corpus = StreamedCorpus(path) if stream else {obj["_id"]: _document(obj) for obj in read_jsonl(path, "document")}
    queries = {obj["_id"]: obj["text"] for obj in read_jsonl(root / "queries.jsonl", what="query")}
    return Dataset(root, corpus, queries)


def fingerprint(root: str | Path) -> str:
    """SHA-256 of the corpus file: an index built from other documents must not be served."""
    digest = hashlib.sha256()
    with open(Path(root) / "corpus.jsonl", "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_jsonl(path: Path, what: str) -> Iterator[dict]:
    """Records of a BEIR JSONL file, each an object with a unique ``_id`` and some text (a document's
    ``metadata`` an object the store can keep); a DatasetError names the file and line of the first
    that is not."""
    for _, obj in read_jsonl_at(path, what):
        yield obj


def read_jsonl_at(path: Path, what: str) -> Iterator[tuple[int, dict]]:
    """:func:`read_jsonl`'s records, each with the byte offset its line starts at."""
    if not path.is_file():
        raise DatasetError(f"{path}: file not found")
    seen: set[str] = set()
    start = 0
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            at, start = start, start + len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{path}:{lineno}: not UTF-8 ({exc.reason})") from None
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{where}: malformed JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            doc_id = obj.get("_id")
            if not isinstance(doc_id, str) or not doc_id.strip():
                raise DatasetError(f"{where}: {what} has no '_id'")
            if doc_id in seen:
                raise DatasetError(f"{where}: duplicate {what} id {doc_id!r}")
            seen.add(doc_id)
            text = obj.get("text")
            if not isinstance(text, str) or not (text.strip() or str(obj.get("title") or "").strip()):
                raise DatasetError(f"{where}: {what} {doc_id!r} has empty text")
            if what == "document":  # a query's metadata (evidence, narratives...) is never read
                _check_metadata(obj.get("metadata") or {}, f"{where}: {what} {doc_id!r}")
            yield at, obj
    if not seen:
        raise DatasetError(f"{path}: no {what} found")


def _check_metadata(metadata: object, where: str) -> None:
    """A document's optional ``metadata``: an object, any JSON in it (:func:`json_metadata`)."""
    if not isinstance(metadata, dict):
        raise DatasetError(f"{where} has metadata that is not an object")
    try:
        json_metadata(metadata)
    except ValueError as exc:
        raise DatasetError(f"{where}: {exc}") from None


def read_qrels(path: Path, corpus: Mapping[str, object], queries: Mapping[str, str]) -> Qrels:
    """``query-id<TAB>doc-id<TAB>grade`` lines (a header allowed), every id known."""
    qrels: Qrels = {}
    with open(path, encoding="utf-8", newline=None) as fh:
        for lineno, line in enumerate(fh, start=1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            cols = line.split("\t")
            if lineno == 1 and cols[0] == "query-id":
                continue
            where = f"{path}:{lineno}"
            if len(cols) != 3:
                raise DatasetError(f"{where}: expected 3 tab-separated columns, got {len(cols)}")
            qid, doc_id, grade = cols
            try:
                score = int(grade)
            except ValueError:
                raise DatasetError(f"{where}: relevance {grade!r} is not an integer") from None
            if qid not in queries:
                raise DatasetError(f"{where}: unknown query id {qid!r}")
            if doc_id not in corpus:
                raise DatasetError(f"{where}: unknown document id {doc_id!r}")
            qrels.setdefault(qid, {})[doc_id] = score
    if not qrels:
        raise DatasetError(f"{path}: no judgments found")
    return qrels
