"""Pseudo-queries from the documents' own structure, each held out of the chunk it came from.

Three kinds, as a corpus without judgments offers them (a fourth, ``generated``, when a chat server
writes questions: :mod:`index_build.adapt.generated`):

- ``heading``: a chunk's section heading (Markdown, HTML, DOCX: what the file readers found) or its
  title (a BEIR record's), against the chunk without it;
- ``lead``: a chunk's first sentence against the rest of the chunk;
- ``inner``: a sentence from inside a chunk against the chunk without it (the inverse cloze task).

The query's text is taken out of its chunk in the held-out view the check searches (index_build/adapt/
__init__.py): a title searched against the same title would only teach near-duplicate matching. A
chunk is relevant to its pseudo-query, as is any other chunk of the same document that holds the
query's text verbatim (neighbouring chunks of a file share sentences).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePath

from engine.store.docstore import Chunk
from engine.text import chunk_text, split_sentences

STRUCTURE = ("heading", "lead", "inner")  # what the documents themselves give
KINDS = (*STRUCTURE, "generated")
FILE_NAME = re.compile(r"\.(pdf|md|markdown|txt|text|html?|docx|jsonl?)$", re.IGNORECASE)  # a name, not a title
MIN_WORDS, MAX_WORDS = 3, 40  # a pseudo-query's length in words (a title can be short; a sentence is cut)


@dataclass(frozen=True)
class PseudoQuery:
    kind: str
    text: str
    unit_id: str  # the chunk it came from
    held_out: str | None  # that chunk's contents without it (None: nothing taken out, a generated question)


def pseudo_queries(chunks: Sequence[Chunk], n: int, seed: int = 0) -> list[PseudoQuery]:
    """About ``n`` pseudo-queries, a third of each kind where the corpus has them, from distinct
    chunks drawn at random (``seed``: the same ones each time)."""
    order = list(range(len(chunks)))
    random.Random(seed).shuffle(order)
    rng = random.Random(seed + 1)
    per_kind = max(1, n // len(STRUCTURE))
    made: dict[str, list[PseudoQuery]] = {kind: [] for kind in STRUCTURE}
    for i in order:
        wanted = [kind for kind in STRUCTURE if len(made[kind]) < per_kind]
        if not wanted:
            break
        chunk = chunks[i]
        # start with the kind that has fewest, so that each chunk serves where it is most needed
        for kind in sorted(wanted, key=lambda k: len(made[k])):
            query = _make(kind, chunk, rng)
            if query is not None:
                made[kind].append(query)
                break
    return [q for kind in STRUCTURE for q in made[kind]]


def _make(kind: str, chunk: Chunk, rng: random.Random) -> PseudoQuery | None:
    if kind == "heading":
        section = chunk.metadata.get("section")  # a file's heading; a record's may be of any shape
        heading = (section if isinstance(section, str) else None) or _title(chunk)
        if not heading or not MIN_WORDS <= len(heading.split()) <= MAX_WORDS:
            return None
        title = chunk.title.replace(heading, " ").strip()
        return PseudoQuery(kind, heading, chunk.unit_id, chunk_text(title, chunk.text.replace(heading, " ", 1)))
    sentences = split_sentences(chunk.text)
    if len(sentences) < (3 if kind == "lead" else 4):
        return None
    at = 0 if kind == "lead" else rng.randrange(1, len(sentences))
    words = sentences[at].split()
    if len(words) < 6:
        return None
    rest = sentences[:at] + sentences[at + 1 :]
    return PseudoQuery(kind, " ".join(words[:MAX_WORDS]), chunk.unit_id, chunk_text(chunk.title, " ".join(rest)))


def _title(chunk: Chunk) -> str | None:
    """A chunk's title when it says something of its text: not a file's name nor the document's id."""
    title = chunk.title.strip()
    if not title or title in (chunk.document_id, PurePath(chunk.document_id).name) or FILE_NAME.search(title):
        return None
    return title


def relevant(query: PseudoQuery, siblings: Sequence[Chunk]) -> dict[str, int]:
    """The chunk it came from, and any chunk of the same document holding its text verbatim."""
    found = {query.unit_id: 1}
    found.update({c.unit_id: 1 for c in siblings if c.unit_id != query.unit_id and query.text in c.contents})
    return found
