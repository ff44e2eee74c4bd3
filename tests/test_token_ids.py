"""The token ids the index keeps for the reranker: made by the tokenizer as it makes a pair's, kept
with each chunk and dropped with it, and the judgment memory's queries' ids."""

from __future__ import annotations

import shutil
import sqlite3

import numpy as np
import pytest

from engine.search import HybridEngine
from engine.settings import EngineSettings
from engine.store.tokens import TextTokenizer


@pytest.mark.parametrize(
    "left, right",
    [
        ("cited for: tofu; soy milk.", "Soy report 0 soy isoflavones"),
        ("Ünïcödé résumé", "naïve café"),
        ("ends with a combining mark e\u0301", "\u0301starts with one"),
        ("咖啡", "肝脏 [SEP] x"),
        ("x" * 150, "y" * 99),
        ("", "empty before"),
    ],
)
def test_words_are_tokenized_alone_so_pieces_join_at_a_space(minilm_path, left, right):
    """Why a passage's ids are its context's then its text's: the tokenizer splits at spaces and
    punctuation before it tokenizes each word; joined without a space, a word spans the join."""
    from transformers import AutoTokenizer

    tokenizer = TextTokenizer(AutoTokenizer.from_pretrained(minilm_path))
    assert tokenizer.by_words
    joined = np.concatenate((tokenizer.ids(left), tokenizer.ids(right)))
    assert np.array_equal(tokenizer.ids(f"{left} {right}"), joined)
    assert not np.array_equal(tokenizer.ids("hydroxy" + "chloroquine"), tokenizer.ids("hydroxy chloroquine"))
    text = "hydroxychloroquine and caffeine"
    whole = tokenizer.ids(text)
    assert np.array_equal(tokenizer.ids(text[: text.index(" and")]), whole[:7])  # cut at a word's end: a prefix
    assert not np.array_equal(tokenizer.ids(text[:4]), whole[:3])  # inside a word: "h ##yd ##r", not "hydro ##xy ##ch"


def test_the_memory_context_is_made_of_each_cited_querys_ids(index_dir, minilm_path):
    from transformers import AutoTokenizer

    from engine.retrieval.memory import CitedTokens, JudgmentMemory

    memory = JudgmentMemory(index_dir / "memory")
    tokenizer = TextTokenizer(AutoTokenizer.from_pretrained(minilm_path))
    cited = CitedTokens(memory, tokenizer)
    vector = np.ones(memory.vectors.shape[1], dtype=np.float32)
    for doc_id in ("D-soy-0", "D-soy-1", "D-coffee-3"):
        for n in (1, 2, 5):
            rows = memory.cited_rows(vector, doc_id, n)
            assert np.array_equal(cited(rows), tokenizer.ids(memory.cited_text(rows)))
    assert np.array_equal(cited([]), tokenizer.ids("cited for: none."))


def test_live_writes_keep_each_chunks_ids_and_drop_them_with_it(index_dir, tmp_path):
    from engine.documents import DocumentIn

    target = tmp_path / "idx"
    shutil.copytree(index_dir, target)
    engine = HybridEngine(EngineSettings(index_dir=target, device="cpu", rerank=False), writable=True)

    def held(document_id: str) -> list[int]:
        with sqlite3.connect(target / "docs.sqlite") as conn:
            query = "SELECT t.row FROM passage_tokens t JOIN chunks c USING (row) WHERE c.document_id = ?"
            return [row for (row,) in conn.execute(query, (document_id,))]

    def orphans() -> int:
        with sqlite3.connect(target / "docs.sqlite") as conn:
            return conn.execute(
                "SELECT count(*) FROM passage_tokens WHERE row NOT IN (SELECT row FROM chunks)"
            ).fetchone()[0]

    try:
        chunks = [{"chunk_id": f"c{i}", "content": f"soy milk and tofu, part {i}"} for i in range(3)]
        engine.live.upsert(DocumentIn(document_id="soy", document_name="Soy.md", chunks=chunks), wait=True)
        first = held("soy")
        assert len(first) == 3 and len(held("D-soy-0")) == 1  # built with ids, written with ids
        stored = engine.store.chunks(["soy#c1"])["soy#c1"]
        tokenizer = TextTokenizer(engine.dense.encoder.tokenizer)
        assert np.array_equal(stored.tokens.ids, tokenizer.ids(stored.contents))
        engine.live.upsert(DocumentIn(document_id="soy", document_name="Soy.md", chunks=chunks[:1]), wait=True)
        assert len(held("soy")) == 1 and set(held("soy")).isdisjoint(first) and orphans() == 0
        engine.live.delete("soy", wait=True)
        assert held("soy") == [] and orphans() == 0
    finally:
        engine.close()
