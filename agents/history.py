"""A long conversation, compressed: the last turns verbatim, the older ones in one summary turn.

The summary is extractive and deterministic: the older turns' sentences are scored by how close
each is to the centroid of all of them (the index's own encoder: what the conversation was
mostly about), and the best are kept, in their original order, within a token budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from agents.responder import SENTENCE_BATCH
from engine.retrieval.encoder import encode
from engine.text import split_sentences

SUMMARY_PREFIX = "[Prior context summary: "


@dataclass
class Compressed:
    turns: list[dict]
    compressed: bool
    summary: str | None


def compress(history: list[dict], encoder, keep_last: int = 4, budget_tokens: int = 120) -> Compressed:
    """``history`` (``{"role", "content"}`` turns) with all but the last ``keep_last`` folded."""
    if len(history) <= keep_last:
        return Compressed(list(history), False, None)
    older, recent = history[: len(history) - keep_last], history[len(history) - keep_last :]
    sentences = [s for turn in older for s in split_sentences(turn["content"])]
    if not sentences:
        return Compressed(list(recent), True, None)
    vectors = encode(encoder, sentences, SENTENCE_BATCH)
    centroid = vectors.mean(axis=0)
    order = np.argsort(-(vectors @ centroid), kind="stable")
    tokenizer = encoder.tokenizer
    chosen, spent = [], 0
    for i in order:
        cost = len(tokenizer(sentences[i], add_special_tokens=False, verbose=False)["input_ids"])
        if chosen and spent + cost > budget_tokens:
            continue
        chosen.append(int(i))
        spent += cost
    summary = " ".join(sentences[i] for i in sorted(chosen))
    turn = {"role": "system", "content": f"{SUMMARY_PREFIX}{summary}]"}
    return Compressed([turn, *recent], True, summary)
