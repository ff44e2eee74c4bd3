"""Files to documents: BEIR JSONL, DOCUMENT_INGESTION JSON, text, Markdown, PDF, HTML, DOCX.

Every document of a file is read and validated before any is written, so a bad file adds
nothing, and its error names the file and the line (JSONL), the field (JSON) or the page (PDF).
Files that arrive unchunked (text, Markdown, PDF, HTML, DOCX; read by ``formats``) are split into
sentences by pysbd (a rule-based splitter that knows abbreviations, decimals and citations) and
packed into chunks of about ``chunk_words`` words, neighbours sharing ``overlap_words`` words of
whole sentences; each chunk keeps its ``page`` (PDF) or ``section`` (the heading above it), and the
document its ``document_type`` (the format) and the ``date`` the file states.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from pydantic import ValidationError

from engine.documents import DATE, DOCUMENT_TYPE, DocumentIn, problems
from engine.text import split_sentences
from index_build.formats import READERS, FormatError, text_file
from offline.dataset import DatasetError, read_jsonl

SUFFIXES = {
    ".jsonl": "beir",
    ".json": "message",
    ".txt": "text",
    ".text": "text",
    ".md": "markdown",
    ".markdown": "markdown",
    ".pdf": "pdf",
    ".html": "html",
    ".htm": "html",
    ".docx": "docx",
}


class IngestError(ValueError):
    """A file that cannot be ingested; the message names the file and where in it."""


def read_documents(
    path: Path, chunk_words: int = 200, overlap_words: int = 40, document_id: str | None = None
) -> list[DocumentIn]:
    """Every document in ``path``, validated; IngestError on the first problem. A file of one
    document takes ``document_id`` (default: the file's name without its suffix)."""
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise IngestError(f"{path}: unknown file type {path.suffix!r} (known: {', '.join(sorted(SUFFIXES))})")
    if not path.is_file():
        raise IngestError(f"{path}: no such file")
    if kind == "beir":
        return _beir(path)
    if kind == "message":
        return [_message(path)]
    try:
        sections, stated = READERS[kind](path)
    except FormatError as exc:
        raise IngestError(f"{path}: {exc}") from None
    chunks = [
        {"chunk_id": f"c{i}", "content": content, "metadata": meta}
        for i, (meta, content) in enumerate(chunk_sections(sections, chunk_words, overlap_words), start=1)
    ]
    if not chunks:
        raise IngestError(f"{path}: no text to index")
    metadata = {DOCUMENT_TYPE: kind, **({DATE: stated} if stated else {})}
    payload = {"document_id": document_id or path.stem, "document_name": path.name, "metadata": metadata}
    return [_valid(path, {**payload, "chunks": chunks})]


def chunk_sections(
    sections: list[tuple[dict, str]], chunk_words: int, overlap_words: int
) -> Iterator[tuple[dict, str]]:
    """Sentences packed into chunks of about ``chunk_words`` words, never across a section (a
    page or a heading), the last ``overlap_words`` words' sentences repeated at the next start."""
    for meta, text in sections:
        sentences = split_sentences(text)
        start = 0
        while start < len(sentences):
            end, words = start, 0
            while end < len(sentences) and (words == 0 or words + len(sentences[end].split()) <= chunk_words):
                words += len(sentences[end].split())
                end += 1
            yield meta, " ".join(sentences[start:end])
            if end >= len(sentences):
                break
            back, shared = end, 0
            while back - 1 > start and shared + len(sentences[back - 1].split()) <= overlap_words:
                back -= 1
                shared += len(sentences[back].split())
            start = back


def _valid(path: Path, payload: object, where: str = "") -> DocumentIn:
    try:
        return DocumentIn.model_validate(payload)
    except ValidationError as exc:
        raise IngestError(f"{path}{where}: {problems(exc, 'document')}") from None


def _beir(path: Path) -> list[DocumentIn]:
    """``{"_id", "title", "text", "metadata"?}`` per line: one document of one chunk each, as built
    (its metadata whole, as a build keeps it)."""
    try:
        records = list(read_jsonl(path, "document"))
    except DatasetError as exc:
        raise IngestError(str(exc)) from None
    documents = []
    for record in records:
        title, text = record.get("title") or "", record.get("text") or ""
        payload = {
            "document_id": record["_id"],
            "document_name": title,
            "metadata": record.get("metadata") or {},
            "chunks": [{"chunk_id": record["_id"], "content": text or title}],
        }
        documents.append(_valid(path, payload, f" ({record['_id']})"))
    return documents


def _message(path: Path) -> DocumentIn:
    """A DOCUMENT_INGESTION payload, bare or inside a whole message (``{"type", "payload", ...}``)."""
    try:
        data = json.loads(text_file(path))
    except FormatError as exc:
        raise IngestError(f"{path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise IngestError(f"{path}:{exc.lineno}: not JSON ({exc.msg})") from None
    if isinstance(data, dict) and data.get("type") == "DOCUMENT_INGESTION":
        data = data.get("payload")
    return _valid(path, data)
