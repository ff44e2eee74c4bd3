"""The scale benchmarks' corpora and scoring: the distractor families (benchmarks/scale_engine.py),
made beside the tiny index, and the source-collapsed scoring of the peer table at size."""

import json

import numpy as np
import pytest

from benchmarks.peers import Peer
from benchmarks.peers_at_size import SUPERVISED, UNSUPERVISED, collapsed, markdown, measure
from benchmarks.scale_engine import make_corpus, sources
from offline.dataset import load_dataset


def _records(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "corpus.jsonl").open()]


def test_each_family_copies_the_abstracts_it_should_and_says_which(beir_dir, index_dir, tmp_path):
    dataset = load_dataset(beir_dir)
    judged = {doc for docs in dataset.qrels("dev").values() for doc in docs}
    titles = {d.doc_id: d.title for d in dataset.corpus.values()}
    made = {}
    for family in ("copies", "unjudged", "unjudged-titled"):
        folder = make_corpus(beir_dir, index_dir, 300, tmp_path / family, family)
        records, vectors = _records(folder), np.load(folder / "vectors.npy")
        added = records[len(titles) :]
        assert len(added) == 300 and vectors.shape[0] == len(records)
        assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
        assert all(r["metadata"]["source"] in titles and 1925 <= r["metadata"]["year"] < 2025 for r in added)
        assert sources(folder) == {r["_id"]: r["metadata"]["source"] for r in added}
        made[family] = added
    assert {r["metadata"]["source"] for r in made["copies"]} & judged  # any abstract, the judged too
    assert not {r["metadata"]["source"] for r in made["unjudged"]} & judged  # none a dev query judges
    assert all(r["title"] == "" for r in made["unjudged"])
    assert all(r["title"] == titles[r["metadata"]["source"]] for r in made["unjudged-titled"])
    # the year has its own random stream: the copies' texts are those the family made before years
    assert [r["metadata"]["year"] for r in made["copies"]] == [r["metadata"]["year"] for r in made["unjudged"]]
    again = make_corpus(beir_dir, index_dir, 300, tmp_path / "copies", "copies")  # made once, then reused
    assert _records(again)[-300:] == made["copies"]


@pytest.mark.filterwarnings("ignore:Precision loss:RuntimeWarning")  # the first row tested against itself
def test_a_run_is_scored_as_ranked_and_source_collapsed():
    source = {"X1": "d1", "X2": "d1", "X3": "d2"}
    assert collapsed({"q": ["X1", "d3", "X2", "d1", "X3"]}, source) == {"q": ["d1", "d3", "d2"]}
    queries, qrels = {"q1": "soy", "q2": "tea"}, {"q1": {"d1": 1}, "q2": {"d2": 1}}
    copies = Peer("copies first", "", lambda q: ["X1", "d1"] if q == "soy" else ["X3", "d2"])
    exact = Peer("originals", "", lambda q: ["d1"] if q == "soy" else ["d2"])
    rows = measure({UNSUPERVISED: [copies], SUPERVISED: [exact]}, queries, qrels, source)
    by = {r["system"]: r for r in rows}
    assert by["originals"]["nDCG@10"] == 1.0 == by["originals"]["nDCG@10 source-collapsed"]
    assert by["copies first"]["nDCG@10"] < 1.0 == by["copies first"]["nDCG@10 source-collapsed"]
    assert [r["group"] for r in rows] == [UNSUPERVISED, SUPERVISED]
    table = markdown({"rows": rows, "recall_at_100": {"exact": 1.0}})
    assert "**unsupervised**" in table and "| copies first |" in table and "exact 1.000" in table
