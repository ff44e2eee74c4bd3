"""Token ids of texts, kept so that a query does not tokenize the passages it reranks.

A cross-encoder pair is ``[CLS] query [SEP] passage [SEP]``, and a passage's tokens do not depend on
the query: they are computed once, when the passage is written (build, live writes), for one
tokenizer, named by its :func:`fingerprint`. Only the first ``KEPT`` tokens are kept (no pair reads
more), with what a reader needs to know whether a pair would have read the same tokens from the
text: how many the whole text has, and how far its words reach (``overrun``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KEPT = 512  # BERT's positions: a pair keeps at most 509 of a passage's tokens
# Characters of a passage the reranker reads per token of its window before tokenizing (it never
# reads whole abstracts to drop most of them): a WordPiece token of an NFCorpus abstract averages 4.6
# characters (2.9-6.4 over 500 of them), so the cut keeps the same tokens for real text.
CHARS_PER_TOKEN = 16
# what decides a text's tokens: its pairs' specials and template are checked where pairs are made
_FINGERPRINTED = ("added_tokens", "normalizer", "pre_tokenizer", "model")


def fingerprint(tokenizer_json: str) -> str:
    """A tokenizer's identity for what it makes of a text: its normalizer, pre-tokenizer, model with
    its vocabulary, and added tokens (a ``tokenizer.json``; padding and truncation do not count)."""
    spec = json.loads(tokenizer_json)
    parts = json.dumps({key: spec.get(key) for key in _FINGERPRINTED}, sort_keys=True)
    return hashlib.sha256(parts.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TextTokens:
    """The first (at most ``KEPT``) token ids of a text. ``total``: the whole text's token count.
    ``overrun``: the most that the word of the k-th token ends past ``CHARS_PER_TOKEN * k``
    characters, over the kept tokens; a text cut at c characters has its first k tokens whole when
    ``CHARS_PER_TOKEN * k + overrun <= c``."""

    ids: np.ndarray
    total: int
    overrun: int

    def blob(self) -> tuple[bytes, int, int, int]:
        """(ids, bytes an id, total, overrun) as the document store keeps them."""
        return self.ids.tobytes(), self.ids.itemsize, self.total, self.overrun

    @classmethod
    def from_blob(cls, ids: bytes, width: int, total: int, overrun: int) -> TextTokens:
        return cls(np.frombuffer(ids, dtype="<u2" if width == 2 else "<i4"), total, overrun)


class TextTokenizer:
    """Tokenizes texts on their own, as a pair's tokenizer does each of its two texts (no special
    tokens, no truncation), through its own copy of a fast tokenizer's pipeline (thread-safe)."""

    def __init__(self, tokenizer) -> None:
        from tokenizers import Tokenizer

        spec = tokenizer.backend_tokenizer.to_str()
        self.backend = Tokenizer.from_str(spec)
        self.backend.no_truncation()
        self.backend.no_padding()
        self.fingerprint = fingerprint(spec)
        parts = json.loads(spec)
        # BERT's pipeline: each word (split at spaces and punctuation) is tokenized alone, so texts
        # joined at a space or a punctuation mark, or cut after a word, keep each piece's tokens
        self.by_words: bool = (
            (parts.get("normalizer") or {}).get("type", "BertNormalizer") == "BertNormalizer"
            and (parts.get("pre_tokenizer") or {}).get("type") == "BertPreTokenizer"
            and parts["model"].get("type") == "WordPiece"
        )
        wide = self.backend.get_vocab_size(with_added_tokens=True) > 1 << 16
        self.dtype = np.dtype("<i4" if wide else "<u2")

    @property
    def recipe(self) -> dict:
        """What stored tokens were made by: an index's manifest and a cache file record it."""
        return {"fingerprint": self.fingerprint, "kept": KEPT, "chars_per_token": CHARS_PER_TOKEN}

    def ids(self, text: str) -> np.ndarray:
        """Every token id of ``text``."""
        return np.asarray(self.backend.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def __call__(self, texts: Sequence[str], kept: int | None = KEPT) -> list[TextTokens]:
        """The tokens of each text, the first ``kept`` of them (None: all)."""
        return [self._tokens(e, kept) for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def _tokens(self, encoding, kept: int | None) -> TextTokens:
        n = len(encoding.ids)
        k = n if kept is None else min(n, kept)
        ids = np.asarray(encoding.ids[:k], dtype=self.dtype)
        if not k:
            return TextTokens(ids, n, 0)
        ends = np.fromiter((end for _, end in encoding.offsets), dtype=np.int64, count=n)
        words = np.array([-1 - i if w is None else w for i, w in enumerate(encoding.word_ids)])
        new_word = np.r_[True, words[1:] != words[:-1]]
        last = np.r_[np.flatnonzero(new_word)[1:] - 1, n - 1]  # each word's last token
        word_end = ends[last][np.cumsum(new_word) - 1]
        overrun = int(np.max(word_end[:k] - CHARS_PER_TOKEN * np.arange(1, k + 1)))
        return TextTokens(ids, n, overrun)


@dataclass(frozen=True)
class TokenTable:
    """Many texts' tokens in flat arrays (one file): text i's ids are ``ids[starts[i]:starts[i + 1]]``."""

    ids: np.ndarray
    starts: np.ndarray
    totals: np.ndarray
    overruns: np.ndarray

    @classmethod
    def of(cls, tokens: Sequence[TextTokens], dtype: np.dtype | str = "<u2") -> TokenTable:
        starts = np.zeros(len(tokens) + 1, dtype=np.int64)
        np.cumsum([len(t.ids) for t in tokens], out=starts[1:])
        ids = np.concatenate([t.ids for t in tokens]) if tokens else np.zeros(0, dtype=dtype)
        return cls(
            ids.astype(dtype, copy=False),
            starts,
            np.array([t.total for t in tokens], dtype=np.int64),
            np.array([t.overrun for t in tokens], dtype=np.int64),
        )

    def __len__(self) -> int:
        return len(self.totals)

    def __getitem__(self, i: int) -> TextTokens:
        return TextTokens(self.ids[self.starts[i] : self.starts[i + 1]], int(self.totals[i]), int(self.overruns[i]))

    def save(self, path: Path, **arrays: np.ndarray) -> None:
        """Written to a temporary file and renamed: a reader never sees half a table."""
        partial = path.with_name(path.name + ".partial")
        with open(partial, "wb") as fh:
            np.savez(fh, ids=self.ids, starts=self.starts, totals=self.totals, overruns=self.overruns, **arrays)
        partial.replace(path)

    @classmethod
    def load(cls, path: Path) -> tuple[TokenTable, dict[str, np.ndarray]]:
        """The table and the other arrays saved with it."""
        with np.load(path, allow_pickle=False) as stored:
            arrays = {name: stored[name] for name in stored.files}
        table = cls(*(arrays.pop(name) for name in ("ids", "starts", "totals", "overruns")))
        return table, arrays
