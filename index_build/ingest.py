"""Files to documents for a live index: BEIR JSONL, DOCUMENT_INGESTION JSON, text, Markdown, PDF.

Every document of a file is read and validated before any is written, so a bad file adds
nothing, and its error names the file and the line (JSONL), the field (JSON) or the page (PDF).
Files that arrive unchunked (text, Markdown, PDF) are split into sentences by pysbd (a
rule-based splitter that knows abbreviations, decimals and citations) and packed into chunks of
about ``chunk_words`` words, neighbours sharing ``overlap_words`` words of whole sentences; each
chunk keeps its ``page`` (PDF) or ``section`` (the Markdown heading above it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from pydantic import ValidationError

from engine.dataset import DatasetError, read_jsonl
from engine.documents import DocumentIn, problems
from engine.sentences import split_sentences

SUFFIXES = {
    ".jsonl": "beir",
    ".json": "message",
    ".txt": "text",
    ".text": "text",
    ".md": "markdown",
    ".markdown": "markdown",
    ".pdf": "pdf",
}
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")


class IngestError(ValueError):
    """A file that cannot be ingested; the message names the file and where in it."""


def read_documents(path: Path, chunk_words: int = 200, overlap_words: int = 40) -> list[DocumentIn]:
    """Every document in ``path``, validated; IngestError on the first problem."""
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise IngestError(f"{path}: unknown file type {path.suffix!r} (known: {', '.join(sorted(SUFFIXES))})")
    if not path.is_file():
        raise IngestError(f"{path}: no such file")
    if kind == "beir":
        return _beir(path)
    if kind == "message":
        return [_message(path)]
    if kind == "pdf":
        sections = _pdf_pages(path)
    else:
        text = _text(path)
        sections = _markdown_sections(text) if kind == "markdown" else [({}, text)]
    chunks = [
        {"chunk_id": f"c{i}", "content": content, "metadata": meta}
        for i, (meta, content) in enumerate(chunk_sections(sections, chunk_words, overlap_words), start=1)
    ]
    if not chunks:
        raise IngestError(f"{path}: no text to index")
    return [_valid(path, {"document_id": path.stem, "document_name": path.name, "chunks": chunks})]


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


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise IngestError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def _beir(path: Path) -> list[DocumentIn]:
    """``{"_id", "title", "text", "metadata"?}`` per line: one document of one chunk each, as built."""
    try:
        records = list(read_jsonl(path, "document"))
    except DatasetError as exc:
        raise IngestError(str(exc)) from None
    documents = []
    for record in records:
        title, text = record.get("title") or "", record.get("text") or ""
        metadata = {k: v for k, v in (record.get("metadata") or {}).items() if not isinstance(v, dict | list)}
        payload = {
            "document_id": record["_id"],
            "document_name": title,
            "metadata": metadata,
            "chunks": [{"chunk_id": record["_id"], "content": text or title}],
        }
        documents.append(_valid(path, payload, f" ({record['_id']})"))
    return documents


def _message(path: Path) -> DocumentIn:
    """A DOCUMENT_INGESTION payload, bare or inside a whole message (``{"type", "payload", ...}``)."""
    try:
        data = json.loads(_text(path))
    except json.JSONDecodeError as exc:
        raise IngestError(f"{path}:{exc.lineno}: not JSON ({exc.msg})") from None
    if isinstance(data, dict) and data.get("type") == "DOCUMENT_INGESTION":
        data = data.get("payload")
    return _valid(path, data)


def _markdown_sections(text: str) -> list[tuple[dict, str]]:
    sections: list[tuple[dict, str]] = []
    heading, lines = None, []
    for line in text.splitlines():
        match = _HEADING.match(line)
        if match:
            if "".join(lines).strip():
                sections.append(({"section": heading} if heading else {}, "\n".join(lines)))
            heading, lines = match.group(2), []
        else:
            lines.append(line)
    if "".join(lines).strip():
        sections.append(({"section": heading} if heading else {}, "\n".join(lines)))
    return sections


def _pdf_pages(path: Path) -> list[tuple[dict, str]]:
    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    try:
        reader = PdfReader(path)
        pages = []
        for number, page in enumerate(reader.pages, start=1):
            try:
                text = page.extract_text() or ""
            except (PyPdfError, ValueError, KeyError) as exc:
                raise IngestError(f"{path}: page {number}: unreadable ({exc})") from None
            if text.strip():
                pages.append(({"page": number}, text))
        return pages
    except PyPdfError as exc:
        raise IngestError(f"{path}: not a readable PDF ({exc})") from None
