"""The text of a user's files, in sections that chunks never cross, and the document's date.

Each reader returns ``(sections, date)``: sections are ``(metadata, text)`` with a ``page`` (PDF) or
the ``section`` heading above the text (Markdown, HTML, DOCX); the date (ISO, or None) is the one
the file states: PDF and DOCX creation dates, an HTML ``<meta>`` date or ``<time datetime>``, a
Markdown front matter ``date:``. Readers raise :class:`FormatError` naming what is wrong and where.
"""

from __future__ import annotations

import re
from datetime import date, datetime
from pathlib import Path

Sections = list[tuple[dict, str]]

_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_FRONT_DATE = re.compile(r"^date:\s*['\"]?(\d{4}-\d{2}-\d{2})", re.M)
_HTML_DATES = ("date", "dcterms.date", "dc.date", "article:published_time", "citation_publication_date")
_HTML_SKIP = {"script", "style", "noscript", "template", "nav", "footer", "header", "aside", "form"}
_HTML_HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}
_HTML_BLOCKS = _HTML_HEADINGS | {"p", "li", "pre", "blockquote", "td", "th", "dd", "dt", "figcaption", "div"}


class FormatError(ValueError):
    """The file is not what its name says, or cannot be read."""


def text_file(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(f"not UTF-8 text (byte {exc.start})") from None


def plain(path: Path) -> tuple[Sections, str | None]:
    text = text_file(path)
    if "\x00" in text:
        raise FormatError("binary data, not text")
    return [({}, text)], None


def markdown(path: Path) -> tuple[Sections, str | None]:
    text = text_file(path)
    found = None
    if text.startswith("---"):
        end = text.find("\n---", 3)
        if end > 0:
            front, text = text[3:end], text[end + 4 :]
            match = _FRONT_DATE.search(front)
            found = match.group(1) if match else None
    sections: Sections = []
    heading, lines = None, []
    for line in text.splitlines():
        match = _HEADING.match(line)
        if match:
            _close(sections, heading, lines)
            heading, lines = match.group(2), []
        else:
            lines.append(line)
    _close(sections, heading, lines)
    return sections, _valid_date(found)


def pdf(path: Path) -> tuple[Sections, str | None]:
    """Page by page: a page's text is dropped once extracted, so a 300-page PDF holds one page at a time
    beside the text kept."""
    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    try:
        reader = PdfReader(path)
        pages: Sections = []
        for number, page in enumerate(reader.pages, start=1):
            try:
                text = page.extract_text() or ""
            except (PyPdfError, ValueError, KeyError) as exc:
                raise FormatError(f"page {number}: unreadable ({exc})") from None
            if text.strip():
                pages.append(({"page": number}, text))
        created = reader.metadata.creation_date if reader.metadata else None
    except PyPdfError as exc:
        raise FormatError(f"not a readable PDF ({exc})") from None
    return pages, created.date().isoformat() if isinstance(created, datetime) else None


def html(path: Path) -> tuple[Sections, str | None]:
    """The page's text by headings, without scripts, styles and navigation."""
    from lxml import etree
    from lxml import html as lxml_html

    raw = path.read_bytes()
    if b"\x00" in raw[:4096]:
        raise FormatError("binary data, not HTML")
    try:
        root = lxml_html.document_fromstring(raw)
    except (etree.ParserError, ValueError) as exc:
        raise FormatError(f"not readable HTML ({exc})") from None
    found = None
    for meta in root.iter("meta"):
        name = (meta.get("name") or meta.get("property") or "").lower()
        if name in _HTML_DATES and meta.get("content"):
            found = meta.get("content")
            break
    if found is None:
        stamp = next((t.get("datetime") for t in root.iter("time") if t.get("datetime")), None)
        found = stamp
    for element in list(root.iter(*_HTML_SKIP)):
        element.drop_tree()
    sections: Sections = []
    heading, lines = None, []
    for element in root.iter(*_HTML_BLOCKS):
        if element.tag == "div" and any(child.tag in _HTML_BLOCKS for child in element):
            continue  # a container: its blocks come on their own
        text = " ".join(element.text_content().split())
        if not text:
            continue
        if element.tag in _HTML_HEADINGS:
            _close(sections, heading, lines)
            heading, lines = text, []
        else:
            lines.append(text)
    _close(sections, heading, lines)
    return sections, _valid_date(found)


def docx(path: Path) -> tuple[Sections, str | None]:
    """Paragraphs by the headings above them (Word's Heading styles) and table cells."""
    from zipfile import BadZipFile

    import docx as python_docx
    from docx.opc.exceptions import PackageNotFoundError

    try:
        document = python_docx.Document(str(path))
    except (BadZipFile, PackageNotFoundError, KeyError, ValueError) as exc:
        raise FormatError(f"not a readable DOCX ({exc or type(exc).__name__})") from None
    sections: Sections = []
    heading, lines = None, []
    for paragraph in document.paragraphs:
        text = paragraph.text.strip()
        if not text:
            continue
        style = (paragraph.style.name if paragraph.style is not None else "") or ""
        if style.startswith("Heading") or style == "Title":
            _close(sections, heading, lines)
            heading, lines = text, []
        else:
            lines.append(text)
    for table in document.tables:
        lines.extend(" | ".join(cell.text.strip() for cell in row.cells) for row in table.rows)
    _close(sections, heading, lines)
    created = document.core_properties.created
    return sections, created.date().isoformat() if isinstance(created, datetime) else None


def _close(sections: Sections, heading: str | None, lines: list[str]) -> None:
    if "".join(lines).strip():
        sections.append(({"section": heading} if heading else {}, "\n".join(lines)))


def _valid_date(text: str | None) -> str | None:
    """The ISO date at the start of ``text``, or None when it holds none."""
    if not text:
        return None
    try:
        return date.fromisoformat(text.strip()[:10]).isoformat()
    except ValueError:
        return None


READERS = {"text": plain, "markdown": markdown, "pdf": pdf, "html": html, "docx": docx}
