"""What `build` indexes: a BEIR dataset (with its judgments), a folder of a user's files, or nothing.

A folder is read recursively (hidden files and folders left out); each file whole or not at all,
through ``ingest.read_documents``: a file that cannot be read, or repeats a document id already
read, is skipped with its reason and changes nothing. A file of one document takes its path
relative to the folder as its id (``reports/q3.pdf``), so two ``notes.md`` in two folders differ.

A BEIR corpus is streamed (:class:`BeirDocuments`): its records stay in ``corpus.jsonl`` and a
build reads them a part at a time, so its memory does not grow with the corpus's texts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.store.docstore import DocStore
from engine.store.index_dir import DOCS_FILE
from engine.text import chunk_text
from index_build.ingest import IngestError, read_documents
from offline.dataset import (
    Dataset,
    DatasetError,
    Document,
    StreamedCorpus,
    beir_document,
    fingerprint,
    load_dataset,
    read_jsonl,
    read_qrels,
)
from offline.progress import track


def chunk_texts(docs: Sequence[dict]) -> list[str]:
    """Every chunk's text as it is encoded and indexed (its title, then its content), in order."""
    return [chunk_text(c["title"], c["content"]) for d in docs for c in d["chunks"]]


class BeirDocuments(Sequence[dict]):
    """A streamed BEIR corpus as the store's documents (one chunk a record), read from the file
    when indexed or iterated: ``documents[part]`` reads that part's lines alone."""

    def __init__(self, corpus: StreamedCorpus) -> None:
        self.corpus = corpus

    def __len__(self) -> int:
        return len(self.corpus)

    def __getitem__(self, at):  # an int or a slice of rows, as a list's
        if isinstance(at, slice):
            start, stop, step = at.indices(len(self))
            if step != 1:
                raise ValueError("documents are read in runs of rows")
            return [beir_document(doc) for doc in self.corpus.rows(start, stop)]
        return beir_document(self.corpus.rows(at, at + 1)[0])

    def __iter__(self) -> Iterator[dict]:
        return (beir_document(doc) for doc in self.corpus.values())


@dataclass
class Corpus:
    """Documents as the document store holds them (each chunk with its ``title``), and, for a BEIR
    dataset, the dataset whose judgments train the memory and the fusion."""

    root: Path
    documents: Sequence[dict]  # a list, or BeirDocuments (streamed from the file)
    fingerprint: str
    dataset: Dataset | None = None
    files: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def chunks(self) -> int:
        return sum(self.chunk_counts())

    def chunk_counts(self) -> list[int]:
        """Each document's chunks (a streamed BEIR record is one, known without reading it)."""
        if isinstance(self.documents, BeirDocuments):
            return [1] * len(self.documents)
        return [len(d["chunks"]) for d in self.documents]

    def record_ids(self) -> list[str]:
        """The documents' ids in order (a streamed corpus knows them without reading the file)."""
        if isinstance(self.documents, BeirDocuments):
            return self.documents.corpus.ids
        return [d["document_id"] for d in self.documents]

    def release(self) -> None:
        """Drop the documents held in memory (once stored, a build reads the index instead)."""
        if isinstance(self.documents, list):
            self.documents.clear()


def is_beir(folder: Path) -> bool:
    return (folder / "corpus.jsonl").is_file()


def open_corpus(root: Path, chunk_words: int = 200, overlap_words: int = 40, progress: bool = True) -> Corpus:
    """A BEIR folder (it has ``corpus.jsonl``) or a folder of files; a clear error for anything else."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such folder (give --data a BEIR dataset or a folder of files)")
    if is_beir(root):
        return beir_corpus(load_dataset(root, stream=True))
    return read_folder(root, chunk_words, overlap_words, progress)


def beir_corpus(dataset: Dataset) -> Corpus:
    """Each BEIR record a document of one chunk whose id is the record's: streamed from the file
    when the dataset's corpus is, else made from the documents it holds."""
    if isinstance(dataset.corpus, StreamedCorpus):
        documents: Sequence[dict] = BeirDocuments(dataset.corpus)
    else:
        documents = [beir_document(doc) for doc in dataset.corpus.values()]
    return Corpus(dataset.root, documents, fingerprint(dataset.root), dataset, files=1)


def empty_corpus() -> Corpus:
    """No documents: an index to ingest into."""
    return Corpus(Path("."), [], hashlib.sha256(b"").hexdigest())


def read_folder(root: Path, chunk_words: int = 200, overlap_words: int = 40, progress: bool = True) -> Corpus:
    paths = sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    documents: list[dict] = []
    seen: dict[str, str] = {}
    skipped: list[tuple[str, str]] = []
    digest = hashlib.sha256()
    bar = track(paths, "reading files", "file", enabled=progress)
    for path in bar:
        name = path.relative_to(root).as_posix()
        try:
            found = read_documents(path, chunk_words, overlap_words, document_id=name)
        except IngestError as exc:
            skipped.append((name, str(exc).removeprefix(f"{path}: ").removeprefix(f"{path}")))
            continue
        again = next((d.document_id for d in found if d.document_id in seen), None)
        if again is not None:
            skipped.append((name, f"document id {again!r} was already read from {seen[again]}"))
            continue
        for document in found:
            seen[document.document_id] = name
            payload = document.model_dump(mode="json")
            for chunk in payload["chunks"]:
                chunk["title"] = payload["document_name"]
            documents.append(payload)
        digest.update(name.encode() + b"\0" + path.read_bytes())
        bar.note(chunks=sum(len(d["chunks"]) for d in documents))
    return Corpus(root, documents, digest.hexdigest(), files=len(paths), skipped=skipped)


def index_dataset(index_dir: Path, judgments: Path) -> Dataset:
    """Judgments for an index built from files: ``judgments`` holds ``queries.jsonl`` and
    ``qrels/<split>.tsv`` (BEIR's formats, no corpus); a judged id is a chunk's (``notes.md#c2``) or a
    document's, whose grade then holds for each of its chunks. The index's chunks are the corpus."""
    store = DocStore(Path(index_dir) / DOCS_FILE)
    try:
        chunks = store.chunks(store.unit_map().unit_ids())
    finally:
        store.close()
    corpus = {unit: Document(unit, chunk.title, chunk.text) for unit, chunk in chunks.items()}
    units_of: dict[str, list[str]] = {}
    for unit, chunk in chunks.items():
        units_of.setdefault(chunk.document_id, []).append(unit)
    queries = {obj["_id"]: obj["text"] for obj in read_jsonl(Path(judgments) / "queries.jsonl", what="query")}
    dataset = Dataset(Path(judgments), corpus, queries)
    for path in sorted((Path(judgments) / "qrels").glob("*.tsv")):
        judged = read_qrels(path, {**corpus, **dict.fromkeys(units_of)}, queries)
        dataset._qrels[path.stem] = {
            query: {unit: grade for doc, grade in docs.items() for unit in units_of.get(doc, [doc])}
            for query, docs in judged.items()
        }
    if not dataset._qrels:
        raise DatasetError(f"{judgments}/qrels: no <split>.tsv judgments found")
    return dataset
