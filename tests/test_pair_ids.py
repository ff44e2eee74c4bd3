"""Pairs made from the token ids the index keeps: the same model inputs as tokenizing the pairs' texts
(today's ``PairTokenizer``), bit for bit, without tokenizing the passages."""

from __future__ import annotations

import json
import logging
import shutil
import sqlite3

import numpy as np
import pytest

from engine.rerank.cross_encoder import CARD_FILE
from engine.search import HybridEngine
from engine.search.stages import passages
from engine.settings import EngineSettings
from engine.store.index_dir import MANIFEST_FILE, TOKENS_DIR
from engine.store.tokens import CHARS_PER_TOKEN

SENTENCE = "Caffeine intake was associated with lower liver enzyme levels in the cohort. "
ODD = {  # passages that try the ids' every assumption
    "long": SENTENCE * 60,  # far past any window
    "accents": "Ünïcödé résumé naïve café; Ça marche à l'hôpital, Øre Ångström ﬁnal. " * 30,
    "cjk": "咖啡 与 肝脏 coffee 和 liver 酶 " * 40,
    "specials": "a [SEP] b [CLS] c[MASK]d " * 40,  # the tokenizer's own tokens, written in the text
    "combining": "cafe\u0301 \u200b zero\u00a0width\ttab\x00nul e\u0301\u0327 " * 40,
    "punctuation": "...,;;!!??" * 100,  # a token a character
    "spaced": ("liver" + " " * 40) * 60,  # few tokens to many characters: the reranker's cut drops words
    "long words": ("x" * 150 + " ") * 30,  # past WordPiece's 100 characters a word: one [UNK] each
}
QUERIES = (
    "coffee and the liver",
    "Café résumé: naïve ünïcödé?",
    " ".join(["does drinking coffee every day change liver enzyme levels"] * 20),  # fills any window here
)


@pytest.fixture(scope="module")
def odd_index(index_dir, tmp_path_factory):
    """The tiny index (its chunks of empty titles too) with ``ODD``'s documents written live."""
    from engine.documents import DocumentIn

    target = tmp_path_factory.mktemp("odd") / "idx"
    shutil.copytree(index_dir, target)
    engine = HybridEngine(EngineSettings(index_dir=target, device="cpu", rerank=False), writable=True)
    for name, text in ODD.items():
        doc = {"document_id": name, "document_name": name, "chunks": [{"chunk_id": "c1", "content": text}]}
        engine.live.upsert(DocumentIn.model_validate(doc))
    engine.close()
    return target


@pytest.fixture(scope="module")
def aware_dir(reranker_dir, tmp_path_factory) -> str:
    """The seeded reranker, reading each passage after the training queries that cited it."""
    folder = tmp_path_factory.mktemp("aware") / "reranker"
    shutil.copytree(reranker_dir, folder)
    (folder / CARD_FILE).write_text(json.dumps({"memory_context": 3}))
    return str(folder)


def _compare(engine: HybridEngine, queries=QUERIES) -> dict[str, set[str]]:
    """Every passage of the index with each query, as ids and as texts; the pairs each query left to
    the text path."""
    reranker = engine.reranker
    inputs = engine.pair_inputs(reranker)
    doc_ids = sorted(engine.dense.units.unit_ids())
    cut = reranker.max_length * CHARS_PER_TOKEN
    left = {}
    for query in queries:
        texts, tokens = passages(engine, query, doc_ids, reranker.memory_context, None, None, None, inputs)
        ours = reranker.prepare(query, texts, tokens).rows.features(reranker.tokenize.pad_id)
        today = reranker.tokenize([(query, text[:cut]) for text in texts])
        for name in ("input_ids", "attention_mask", "token_type_ids"):
            assert np.array_equal(ours[name], today[name]), (query, name)
        made = reranker.assembler.rows(query, tokens)
        left[query] = {d for d, row in zip(doc_ids, made, strict=True) if row is None}
    return left


@pytest.mark.parametrize("max_length", [48, 128])
@pytest.mark.parametrize("aware", [False, True], ids=["plain", "memory-context"])
def test_pairs_made_from_ids_are_the_tokenized_pairs(odd_index, reranker_dir, aware_dir, aware, max_length):
    folder = aware_dir if aware else reranker_dir
    settings = EngineSettings(
        index_dir=odd_index, device="cpu", reranker=folder, max_length=max_length, rerank_cache_size=0
    )
    engine = HybridEngine(settings.model_copy(update={"rerank_runtime": "torch"}) if aware else settings)
    assert engine.pair_inputs(engine.reranker).passages.stored  # the store's ids: format 3
    left = _compare(engine)
    plain, accented, long_query = QUERIES
    # the query that fills the window is the text path's ("longest_first"); of the others, only the
    # passages that the reranker's cut at 16 characters a token would end inside a kept word
    assert len(left[long_query]) == len(engine.dense.units)
    assert left[plain] == left[accented] == {"spaced#c1", "long words#c1"}
    inputs = engine.pair_inputs(engine.reranker)
    texts, tokens = passages(engine, plain, ["accents#c1", "D-soy-3"], engine.reranker.memory_context, inputs=inputs)
    assert engine.reranker.score(plain, texts, tokens) == engine.reranker.score(plain, texts)


def test_a_query_times_its_pairs_apart_from_the_model(index_dir, reranker_dir):
    engine = HybridEngine(EngineSettings(index_dir=index_dir, device="cpu", reranker=reranker_dir, max_length=48))
    seconds = engine.stages("coffee and the liver", top_k=3).seconds
    assert list(seconds) == ["encode", "bm25", "dense", "memory", "fusion", "pairs", "rerank", "total"]
    assert seconds["pairs"] < seconds["rerank"]


def test_an_older_index_gets_its_ids_at_first_load(index_dir, reranker_dir, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    old = tmp_path / "old"
    shutil.copytree(index_dir, old)
    manifest = json.loads((old / MANIFEST_FILE).read_text())
    del manifest["passage_tokens"]
    (old / MANIFEST_FILE).write_text(json.dumps({**manifest, "format_version": 2}))
    with sqlite3.connect(old / "docs.sqlite") as conn:
        conn.execute("DROP TABLE passage_tokens")
    (old / "memory" / "query_tokens.npz").unlink()
    settings = EngineSettings(index_dir=old, device="cpu", reranker=reranker_dir, max_length=48, rerank_cache_size=0)
    engine = HybridEngine(settings)
    inputs = engine.pair_inputs(engine.reranker)
    assert not inputs.passages.stored and "computed in" in caplog.text
    cached = old / TOKENS_DIR / f"{engine.reranker.text_tokens.fingerprint}.npz"
    assert cached.is_file()
    _compare(engine, QUERIES[:1])
    caplog.clear()
    again = HybridEngine(settings)  # read from the file this time
    assert "computed in" not in caplog.text and _compare(again, QUERIES[:1])[QUERIES[0]] == set()

    shutil.rmtree(old / TOKENS_DIR)
    (old / TOKENS_DIR).write_text("")  # the folder cannot be made: the ids stay in memory
    caplog.clear()
    assert _compare(HybridEngine(settings), QUERIES[:1])[QUERIES[0]] == set()
    assert "kept in memory only" in caplog.text


def test_a_reranker_with_another_tokenizer_gets_its_ids_beside_the_index(index_dir, reranker_dir, tmp_path):
    folder = tmp_path / "reranker"
    shutil.copytree(reranker_dir, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["model"]["vocab"]["[unused0]x"] = spec["model"]["vocab"].pop("[unused0]")  # another vocabulary
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    target = tmp_path / "idx"
    shutil.copytree(index_dir, target)
    settings = EngineSettings(index_dir=target, device="cpu", reranker=str(folder), max_length=48)
    engine = HybridEngine(settings.model_copy(update={"rerank_runtime": "torch"}))
    fingerprint = engine.reranker.text_tokens.fingerprint
    assert fingerprint != json.loads((target / MANIFEST_FILE).read_text())["passage_tokens"]["fingerprint"]
    assert (target / TOKENS_DIR / f"{fingerprint}.npz").is_file()
    assert _compare(engine, QUERIES[:1])[QUERIES[0]] == set()
