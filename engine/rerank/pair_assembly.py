"""Pairs made from token ids kept in the index: the query tokenized once, no passage read as text.

The model inputs are those :class:`~engine.rerank.pair_tokens.PairTokenizer` makes of the pair's
texts, bit for bit: ``[CLS] query [SEP] passage [SEP]``, the passage's tail cut as the Hugging Face
tokenizer cuts it with ``truncation="only_second"`` at ``max_length``, where the passage's ids are
its memory context's then its text's (the two meet at a space, and a word is tokenized alone). A
pair it cannot make so is left to the text path (None): a query that leaves the passage no room
(the text path's "longest_first"), a passage needing more tokens than were kept, or one that the
reranker's cut at ``CHARS_PER_TOKEN`` characters a token would end inside a token it keeps.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from engine.rerank.pair_tokens import PairRow
from engine.store.tokens import CHARS_PER_TOKEN, TextTokenizer, TextTokens

log = logging.getLogger(__name__)
NO_CONTEXT = np.zeros(0, dtype=np.int64)


class PassageTokens(NamedTuple):
    """A passage's ids for a pair: the passage text is ``context + " " + body``, or ``body`` alone.
    ``offset``: characters of the text before the body (0 without a context); ``chars``: the
    text's length."""

    body: TextTokens
    chars: int
    context: np.ndarray = NO_CONTEXT
    offset: int = 0


class PairAssembler:
    """Makes pairs for one tokenizer's stored ids at one window (``max_length`` tokens)."""

    def __init__(self, tokenizer: TextTokenizer, max_length: int, cls_id: int, sep_id: int) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.cls, self.tail = np.array([cls_id], dtype=np.int64), np.array([sep_id], dtype=np.int64)
        self.cut = max_length * CHARS_PER_TOKEN  # characters of a passage the text path reads

    @classmethod
    def create(cls, tokenizer, max_length: int) -> PairAssembler | None:
        """One for a Hugging Face fast tokenizer, or None (said in the log, with why) when its pairs
        are not ``[CLS] A [SEP] B [SEP]`` of its words' tokens: such a reranker reads texts."""
        text = TextTokenizer(tokenizer)
        if not text.by_words:
            log.info("reranker tokenizer %s does not tokenize words alone: pairs are tokenized", text.fingerprint)
            return None
        pair = text.backend.encode("a b", "c")
        a, b = text.ids("a b").tolist(), text.ids("c").tolist()
        ids = pair.ids
        cls_id, sep_id = (ids[0], ids[len(a) + 1]) if len(ids) == len(a) + len(b) + 3 else (None, None)
        if ids != [cls_id, *a, sep_id, *b, sep_id] or pair.type_ids != [0] * (len(a) + 2) + [1] * (len(b) + 1):
            log.info("reranker tokenizer %s makes pairs other than [CLS] A [SEP] B [SEP]: tokenized", text.fingerprint)
            return None
        return cls(text, max_length, cls_id, sep_id)

    def rows(self, query: str, passages: Sequence[PassageTokens]) -> list[PairRow | None]:
        """Each passage's pair with ``query``, or None where only the text path gives it exactly."""
        query_ids = self.tokenizer.ids(query)
        room = self.max_length - len(query_ids) - 3
        if room <= 0:  # no room for the passage: the text path cuts both ("longest_first")
            return [None] * len(passages)
        head = np.concatenate((self.cls, query_ids, self.tail))
        types = np.ones(self.max_length, dtype=np.int64)
        types[: len(head)] = 0
        return [self._row(head, types, p, room) for p in passages]

    def _row(self, head: np.ndarray, types: np.ndarray, p: PassageTokens, room: int) -> PairRow | None:
        context = p.context[:room]
        n = min(room - len(context), p.body.total)  # the body's tokens the pair keeps
        if n > len(p.body.ids):
            return None
        if p.chars > self.cut and (
            p.offset - 1 > self.cut or (n and CHARS_PER_TOKEN * n + p.body.overrun > self.cut - p.offset)
        ):
            return None  # the cut text would end inside a kept word: its tokens could differ
        ids = np.concatenate((head, context, p.body.ids[:n], self.tail))
        return PairRow(ids, types[: len(ids)])
