"""Cross-encoder inputs for (query, passage) pairs from their texts, tokenizing as little of each
passage as it keeps: the path for pairs that cannot be made from the index's token ids
(:mod:`engine.rerank.pair_assembly`), and the reference those are held to.

A pair keeps ``max_length`` tokens and an NFCorpus abstract runs ~400, so most of a passage is
dropped. Through the Hugging Face tokenizer, passages cut at 16 characters a token, a 20-pair query
took milliseconds to tokenize on 2 cores; reading each only up to the last space before ``FIRST_CUT``
characters a token, and again in full only when that came up short of the window, gives the same
tokens in much less time (docs/experiments.md, "2026-11-24 · CPU reranking: the trace, the
tokenizer and smoothed int8").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

# Characters of a passage read per token of the window at first: NFCorpus's WordPiece tokens average
# 4.6 characters (2.9-6.4 an abstract), so 6 fill the window for nearly every passage.
FIRST_CUT = 6


class PairRow(NamedTuple):
    """One pair's model input before padding: token ids and their token type ids."""

    ids: np.ndarray
    types: np.ndarray


def pad_rows(rows: Sequence[PairRow], pad_id: int) -> dict[str, np.ndarray]:
    """``input_ids``, ``attention_mask`` and ``token_type_ids`` of ``rows``, padded to the longest."""
    width = max(len(row.ids) for row in rows)
    arrays = {
        "input_ids": np.full((len(rows), width), pad_id, dtype=np.int64),
        "attention_mask": np.zeros((len(rows), width), dtype=np.int64),
        "token_type_ids": np.zeros((len(rows), width), dtype=np.int64),
    }
    for i, row in enumerate(rows):
        n = len(row.ids)
        arrays["input_ids"][i, :n] = row.ids
        arrays["attention_mask"][i, :n] = 1
        arrays["token_type_ids"][i, :n] = row.types
    return arrays


class PairTokenizer:
    """``input_ids``, ``attention_mask`` and ``token_type_ids`` of pairs, as the Hugging Face
    tokenizer gives them with ``truncation="only_second"`` at ``max_length``.

    Cutting a passage just before a space keeps the tokens of the words before it (the tokenizers
    split words at spaces first), so a pair whose cut passage still fills the window has the tokens
    it would have had whole. A query too long to leave the passage any room is cut too (longest
    first: the two share the window) rather than failing the pair; that split follows the passage as
    first read, so it can give the query one token more than the Hugging Face tokenizer would with
    the whole passage (pairs made from token ids leave such queries here, and agree with this path).
    Uses its own copies of the fast tokenizer's pipeline: thread-safe, and the caller's tokenizer
    keeps its own settings.
    """

    def __init__(self, tokenizer, max_length: int) -> None:
        from tokenizers import Tokenizer

        pipeline = tokenizer.backend_tokenizer.to_str()
        self.backend, self.long_query = Tokenizer.from_str(pipeline), Tokenizer.from_str(pipeline)
        for backend, strategy in ((self.backend, "only_second"), (self.long_query, "longest_first")):
            backend.no_padding()
            backend.enable_truncation(max_length, strategy=strategy)
        self.max_length = max_length
        self.pad_id: int = tokenizer.pad_token_id or 0

    def __call__(self, pairs: list[tuple[str, str]]) -> dict[str, np.ndarray]:
        return pad_rows(self.rows(pairs), self.pad_id)

    def rows(self, pairs: list[tuple[str, str]]) -> list[PairRow]:
        """Each pair's tokens, unpadded."""
        first = [(query, _cut(passage, self.max_length * FIRST_CUT)) for query, passage in pairs]
        encodings = self._encode(first)
        short = [
            i
            for i, (e, (_, cut)) in enumerate(zip(encodings, first, strict=True))
            if len(e.ids) < self.max_length and len(cut) < len(pairs[i][1])
        ]
        if short:
            for i, encoding in zip(short, self._encode([pairs[i] for i in short]), strict=True):
                encodings[i] = encoding
        return [PairRow(np.array(e.ids, dtype=np.int64), np.array(e.type_ids, dtype=np.int64)) for e in encodings]

    def _encode(self, pairs: list[tuple[str, str]]) -> list:
        try:
            return self.backend.encode_batch(pairs)
        except Exception:  # tokenizers says only "Truncation error": a query that fills the window
            return [self._encode_one(pair) for pair in pairs]

    def _encode_one(self, pair: tuple[str, str]):
        try:
            return self.backend.encode(*pair)
        except Exception:
            return self.long_query.encode(*pair)


def _cut(passage: str, limit: int) -> str:
    """``passage`` up to the last space before ``limit`` characters (whole when it has no space there)."""
    if len(passage) <= limit:
        return passage
    space = passage.rfind(" ", 0, limit)
    return passage[:space] if space > 0 else passage
