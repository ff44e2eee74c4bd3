"""Generated pseudo-queries: questions an OpenAI-compatible chat server writes for sampled chunks.

The structural pseudo-queries (:mod:`index_build.adapt.pseudo`) are sentences and headings, not the
short questions users type; what works in the literature (InPars, Promptagator) asks a language
model for those. With `build --llm-url` (or `adapt --llm-url`), each of ``adapt_generated`` chunks
drawn at random gets one question, kept when it is a question of 3 to 40 words in the model's own
words (not a sentence of the chunk copied); the chunk it came from is its relevant chunk. The
question takes nothing out of its chunk in the held-out view. The chunks are others than the
structural pseudo-queries' where the corpus has enough; in a small corpus some are shared, and the
view then lacks only the heading or sentence the structural query took.

The server is asked once before any work (:meth:`QueryWriter.probe`), so a wrong URL fails the
command at once with the reason, not after the index is built; a chunk whose question fails later
(after the client's retries) is counted and skipped, and a server that fails them all leaves the
adaptation to the documents' own pseudo-queries, with a warning, rather than lose the build.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Sequence, Set
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine.store.docstore import Chunk
from index_build.adapt.pseudo import MAX_WORDS, MIN_WORDS, PseudoQuery
from offline.progress import track

log = logging.getLogger(__name__)
PROMPT = (
    "Write one question that a person might type into a search engine and that the passage below answers."
    " Use your own words, at most 20 words; do not copy a sentence of the passage. Reply with the question only."
    "\n\nPassage:\n{passage}"
)
PASSAGE_CHARS = 2000  # what the server reads of a chunk: enough for a question, bounded for small models
GIVE_UP_AFTER = 5  # failures in a row (each after the client's retries) that end the asking
IN_FLIGHT = 4  # requests at once: a server batches them; one at a time would leave it idle between replies
LEAD = re.compile(r"^\s*(?:question\s*:|q\s*:|\d+[.)]|[-*•])\s*", re.IGNORECASE)


class GenerationError(ValueError):
    """The chat server cannot write questions (unreachable, refused, or no usable reply)."""


@dataclass(frozen=True)
class LLMServer:
    """An OpenAI-compatible chat server: its base URL (``.../v1``), the model name sent, its key."""

    url: str
    model: str = "default"
    api_key: str | None = None


class QueryWriter:
    """Asks ``server`` for one question a chunk answers, several requests at once."""

    def __init__(self, server: LLMServer, timeout_s: float = 60.0, max_retries: int = 2) -> None:
        from openai import OpenAI

        self.server = server
        self.client = OpenAI(
            base_url=server.url, api_key=server.api_key or "unused", timeout=timeout_s, max_retries=max_retries
        )

    def probe(self) -> None:
        """One short request; :class:`GenerationError` naming the server and why when it fails."""
        try:
            self._ask("Reply with the word ok.", max_tokens=5)
        except Exception as exc:  # unreachable, refused, or a reply that is not a chat completion
            raise GenerationError(
                f"--llm-url {self.server.url}: the chat server did not answer ({type(exc).__name__}: {exc})"
            ) from None

    def write(
        self, chunks: Sequence[Chunk], n: int, seed: int = 0, exclude: Set[str] = frozenset(), progress: bool = True
    ) -> tuple[list[PseudoQuery], dict]:
        """About ``n`` generated pseudo-queries from distinct chunks drawn at random (``seed``), those
        in ``exclude`` (the structural pseudo-queries' own) only when the others are too few; and
        their report (asked, kept, rejected, failed, seconds, queries/s)."""
        rng = random.Random(seed)
        fresh = [c for c in chunks if c.unit_id not in exclude]
        used = [c for c in chunks if c.unit_id in exclude]
        drawn = rng.sample(fresh, min(n, len(fresh)))
        drawn += rng.sample(used, min(n - len(drawn), len(used)))
        started = time.perf_counter()

        def one(chunk: Chunk) -> str | Exception:
            try:
                return self._ask(PROMPT.format(passage=chunk.contents[:PASSAGE_CHARS]), max_tokens=64)
            except Exception as exc:  # a server's failure or a malformed reply: this chunk is skipped
                return exc

        made, rejected, failed, seen, in_a_row = [], 0, 0, set(), 0
        threads = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="llm-queries")
        try:
            asked = [threads.submit(one, chunk) for chunk in drawn]
            for chunk, reply in track(
                zip(drawn, (a.result() for a in asked), strict=True),
                "questions from --llm-url",
                "query",
                total=len(drawn),
                enabled=progress,
            ):
                if isinstance(reply, Exception):
                    failed, in_a_row = failed + 1, in_a_row + 1
                    if in_a_row == GIVE_UP_AFTER:  # the server broke: stop asking rather than wait on each
                        log.warning("--llm-url %s: %d in a row failed (%s)", self.server.url, in_a_row, reply)
                        break
                    continue
                in_a_row = 0
                question = clean(reply, chunk.contents)
                if question is None or question.lower() in seen:
                    rejected += 1
                    continue
                seen.add(question.lower())
                made.append(PseudoQuery("generated", question, chunk.unit_id, None))
        finally:  # also on Ctrl-C: the queued requests are dropped, not sent
            threads.shutdown(wait=False, cancel_futures=True)
        seconds, answered = time.perf_counter() - started, len(made) + rejected + failed
        if drawn and not made:  # the server broke after the probe: adapt on the documents' own pseudo-queries
            log.warning(
                "--llm-url %s: no usable question from %d chunks (%d requests failed, %d replies rejected)",
                self.server.url,
                answered,
                failed,
                rejected,
            )
        report = {
            "server": self.server.url,
            "model": self.server.model,
            "asked": answered,
            "kept": len(made),
            "rejected": rejected,
            "failed": failed,
            "seconds": round(seconds, 1),
            "queries_per_s": round(answered / seconds, 2) if seconds else None,
        }
        return made, report

    def _ask(self, prompt: str, max_tokens: int) -> str:
        reply = self.client.chat.completions.create(
            model=self.server.model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0.0,
        )
        return reply.choices[0].message.content or ""


def clean(reply: str, passage: str) -> str | None:
    """The question in a reply (its first non-empty line, without a "Question:" or list marker and
    quotes), or None when that is not 3-40 words or is a copy of text in the passage."""
    line = next((line for line in reply.splitlines() if line.strip()), "")
    question = LEAD.sub("", line).strip().strip("\"'“”`").strip()
    if not MIN_WORDS <= len(question.split()) <= MAX_WORDS:
        return None
    if question.rstrip("?.").lower() in passage.lower():
        return None
    return question
