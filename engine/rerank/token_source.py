"""Where a reranker's token ids come from: the document store, or a file computed beside the index.

The store keeps each chunk's ids for the tokenizer the manifest names (``passage_tokens``: the
encoder's, whose vocabulary every MiniLM reranker here shares), written with the chunk and deleted
with it. A reranker whose tokenizer has another fingerprint, or an index from before the store kept
ids (format 2), gets them computed at load, once, into ``tokens/<fingerprint>.npz`` (kept in memory
only when the folder cannot be written); a chunk written since is tokenized when first reranked,
and remembered (a row is never reused for other text).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from engine.retrieval.memory import CitedTokens, JudgmentMemory
from engine.store.docstore import Chunk, DocStore
from engine.store.index_dir import TOKENS_DIR, Manifest
from engine.store.tokens import TextTokenizer, TextTokens, TokenTable

log = logging.getLogger(__name__)


class PassageTokenSource:
    """Each chunk's :class:`TextTokens` for one tokenizer."""

    def __init__(self, tokenizer: TextTokenizer, store: DocStore, index_dir: Path, manifest: Manifest) -> None:
        self.tokenizer = tokenizer
        self.stored = manifest.passage_tokens == tokenizer.recipe
        self._table: TokenTable | None = None
        self._index: dict[int, int] = {}  # row -> position in the table
        self._later: dict[int, TextTokens] = {}  # rows tokenized when first reranked
        self._lock = threading.Lock()
        if not self.stored:
            self._load(store, Path(index_dir) / TOKENS_DIR / f"{tokenizer.fingerprint}.npz", manifest)

    def __call__(self, chunks: Sequence[Chunk]) -> list[TextTokens]:
        found = [self._known(chunk) for chunk in chunks]
        missing = [i for i, tokens in enumerate(found) if tokens is None]
        if missing:
            fresh = self.tokenizer([chunks[i].contents for i in missing])
            with self._lock:
                for i, tokens in zip(missing, fresh, strict=True):
                    self._later[chunks[i].row] = found[i] = tokens
        return found

    def _known(self, chunk: Chunk) -> TextTokens | None:
        if self.stored and chunk.tokens is not None:
            return chunk.tokens
        at = self._index.get(chunk.row)
        return self._table[at] if at is not None else self._later.get(chunk.row)

    def _load(self, store: DocStore, path: Path, manifest: Manifest) -> None:
        """The file at ``path`` when it was made by this recipe for this build, else computed now."""
        built = json.dumps([manifest.fingerprint, manifest.built_at, self.tokenizer.recipe])
        if path.is_file():
            try:
                table, arrays = TokenTable.load(path)
            except (OSError, ValueError, KeyError) as exc:
                log.warning("%s unreadable (%s): computing the token ids again", path, exc)
            else:
                if str(arrays.get("built")) == built:
                    self._table, self._index = table, {int(row): i for i, row in enumerate(arrays["rows"])}
                    return
        started = time.perf_counter()
        contents = store.contents_by_row()
        rows, texts = [row for row, _ in contents], [text for _, text in contents]
        table = TokenTable.of(self.tokenizer(texts), self.tokenizer.dtype)
        self._table, self._index = table, {row: i for i, row in enumerate(rows)}
        try:
            path.parent.mkdir(exist_ok=True)
            table.save(path, rows=np.array(rows, dtype=np.int64), built=np.array(built))
            where = f"kept in {path}"
        except OSError as exc:
            where = f"kept in memory only ({path.parent}: {exc.strerror or exc})"
        log.info(
            "token ids of %d chunks for tokenizer %s computed in %.1f s, %s",
            len(rows),
            self.tokenizer.fingerprint,
            time.perf_counter() - started,
            where,
        )


class PairInputs:
    """What one tokenizer's pairs are made from: its passages' ids and, for a reranker that reads
    the judgment memory's context, the cited training queries' ids."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        store: DocStore,
        index_dir: Path,
        manifest: Manifest,
        memory: JudgmentMemory | None = None,
    ) -> None:
        self.passages = PassageTokenSource(tokenizer, store, index_dir, manifest)
        self.cited = CitedTokens(memory, tokenizer) if memory is not None else None
