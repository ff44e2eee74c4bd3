"""Day one without judgments: `build --adapt` on a folder of files, the held-out check, the stage
served, and the supervised path untouched. Real Lucene, FAISS and MiniLM on a corpus the test writes."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.settings import EngineSettings
from index_build.adapt import nearest
from index_build.settings import BuildSettings
from offline.server_process import free_port
from tests.helpers import chat_completions_server

WORDS = (
    "soil river glacier copper lantern violin orchard harbor falcon meadow quartz cedar ember tundra canyon"
    " saffron plankton basalt mosaic compass beacon lichen walrus juniper cobalt prairie nectar granite"
    " monsoon reef pollen delta marble thistle ferment magnet pulley spindle barley oyster comet sundial"
).split()


def _write_folder(root: Path, files: int = 24) -> Path:
    """Markdown files of three sections each: a heading, then sentences drawn from the section's own
    few words (so a heading's section shares words with it, as real ones do)."""
    rng = random.Random(7)
    root.mkdir(parents=True)
    for f in range(files):
        parts = []
        for s in range(3):
            topic = rng.sample(WORDS, 5)
            sentences = [
                " ".join(rng.choice(topic + rng.sample(WORDS, 3)) for _ in range(rng.randint(8, 14))).capitalize() + "."
                for _ in range(5)
            ]
            parts.append(f"## {' '.join(topic[:3]).title()} notes {f}-{s}\n\n" + " ".join(sentences))
        (root / f"file{f:02d}.md").write_text(f"# Notebook {f}\n\n" + "\n\n".join(parts) + "\n")
    return root


@pytest.fixture(scope="module")
def adapted_index(tmp_path_factory) -> Path:
    """A folder built with the adaptation on, told to serve it whatever the check says (min gain -1),
    so that the engine's side is tested on every run."""
    from index_build.builder import build_index

    root = tmp_path_factory.mktemp("adapt")
    folder = _write_folder(root / "files")
    target = root / "idx"
    build = BuildSettings(data_dir=folder, adapt_queries=60, adapt_min_gain=-1.0, chunk_words=60)
    build_index(EngineSettings(index_dir=target, device="cpu"), build, progress=False)
    return target


def test_build_adapts_and_reports(adapted_index):
    card = json.loads((adapted_index / "adapt" / "adapt.json").read_text())
    sets = card["pseudo_queries"]
    assert set(sets) == {"heading", "lead", "inner"} and all(sets[k]["count"] > 0 for k in sets)
    assert all(not example.endswith(".md") for example in sets["heading"]["examples"])  # no file names
    held = card["heldout"]
    assert held["queries"] >= 20 and 0 <= held["rrf"] <= 1 and 0 <= held["adapted"] <= 1
    assert held["gain"] == pytest.approx(held["adapted"] - held["rrf"], abs=2e-4)
    assert set(card["fit"]["nDCG@10"]) >= {"rrf", "graph k=5 weight=0.1"}
    assert card["served"] and card["decision"].startswith("corpus graph served")
    assert (adapted_index / "adapt" / "graph.npz").is_file()
    assert not list(adapted_index.glob(".adapt*"))  # nothing left aside


def test_engine_serves_the_adapted_stage(adapted_index):
    from engine.search import HybridEngine

    engine = HybridEngine(EngineSettings(index_dir=adapted_index, device="cpu", rerank=False))
    described = engine.describe()
    assert "corpus_graph" in described["stages"] and described["fusion"].startswith("rrf + corpus graph")
    assert described["adapted"]["served"] is True
    for query in ("copper lantern notes", "glacier river soil"):
        result = engine.stages(query, top_k=5)
        assert result.fused == engine.adapted.rerank(result.rrf, engine.dense.units)
        assert sorted(d for d, _ in result.fused) == sorted(d for d, _ in result.rrf)  # reordered, nothing added
    engine.close()
    plain = HybridEngine(EngineSettings(index_dir=adapted_index, device="cpu", rerank=False, adapted=False))
    assert "corpus_graph" not in plain.describe()["stages"]
    result = plain.stages("copper lantern notes", top_k=5)
    assert result.fused == result.rrf
    plain.close()


def test_a_stage_that_does_not_pay_leaves_rrf(adapted_index, tmp_path):
    """The `adapt` command on an existing index; a gain it cannot reach (min gain 1) serves RRF."""
    from cli.main import main
    from engine.search import HybridEngine

    copy = tmp_path / "idx"
    shutil.copytree(adapted_index, copy)
    assert main(["adapt", "--index-dir", str(copy), "--device", "cpu", "--adapt-queries", "60",
                 "--adapt-min-gain", "1"]) == 0  # fmt: skip
    card = json.loads((copy / "adapt" / "adapt.json").read_text())
    assert card["served"] is False and card["decision"].startswith("RRF served")
    assert not (copy / "adapt" / "graph.npz").exists()
    engine = HybridEngine(EngineSettings(index_dir=copy, device="cpu", rerank=False))
    assert engine.adapted is None and "corpus_graph" not in engine.describe()["stages"]
    assert engine.describe()["adapted"]["served"] is False
    result = engine.stages("copper lantern notes", top_k=5)
    assert result.fused == result.rrf
    engine.close()


def test_full_is_refused_with_a_reason(tmp_path, capsys):
    from cli.main import main

    folder = tmp_path / "files"
    folder.mkdir()
    (folder / "a.md").write_text("# A\n\nSome text here.\n")
    assert main(["build", "--data", str(folder), "--index-dir", str(tmp_path / "idx"), "--adapt", "full"]) == 2
    err = capsys.readouterr().err
    assert "--adapt full" in err and "not implemented" in err
    assert not (tmp_path / "idx").exists()


def test_supervised_builds_do_not_adapt(index_dir):
    """A dataset with training judgments gets its learned fusion, never an adaptation."""
    assert (index_dir / "fusion").is_dir() and not (index_dir / "adapt").exists()


def test_pseudo_queries_are_held_out_of_their_chunks(adapted_index):
    from engine.store.docstore import DocStore
    from index_build.adapt.pseudo import pseudo_queries

    store = DocStore(adapted_index / "docs.sqlite")
    chunks = list(store.chunks(store.unit_map().unit_ids()).values())
    store.close()
    queries = pseudo_queries(chunks, 30)
    assert {q.kind for q in queries} == {"heading", "lead", "inner"}
    assert len({q.unit_id for q in queries}) == len(queries)  # one query a chunk
    for q in queries:
        assert q.text not in q.held_out
    assert queries == pseudo_queries(chunks, 30)  # the same each time


def test_adapt_refuses_an_index_with_judgments(index_dir, tmp_path, capsys):
    from cli.main import main

    copy = tmp_path / "idx"
    shutil.copytree(index_dir, copy)
    assert main(["adapt", "--index-dir", str(copy), "--device", "cpu"]) == 2
    assert "learned from judgments" in capsys.readouterr().err
    assert not (copy / "adapt").exists() and not list(copy.glob(".adapt*"))


def test_a_chunk_added_after_the_graph_keeps_its_own_score():
    """Rows past the graph (written live since) and rows with no live neighbours lend nothing."""
    import numpy as np

    from engine.fusion.graph import CorpusGraph
    from engine.store.unit_map import UnitMap

    graph = CorpusGraph(np.array([[1], [0]]), np.array([[0.9], [0.9]]), weight=0.5)
    fused = [("a", 1.0), ("new", 0.9), ("b", 0.5)]
    units = UnitMap.from_pairs([(0, "a"), (1, "b"), (7, "new")])
    ranked = dict(graph.rerank(fused, units))
    assert ranked["new"] == pytest.approx(0.9)  # no neighbours: its own share, whole
    assert ranked["a"] == pytest.approx(0.5 * 1.0 + 0.5 * 0.5)  # lent b's score
    assert ranked["b"] == pytest.approx(0.5 * 0.5 + 0.5 * 1.0)
    assert [u for u, _ in graph.rerank(fused, units)] == ["new", "a", "b"]


def test_the_graph_of_a_large_corpus_is_found_by_hnsw_close_to_the_exact_one():
    vectors = np.random.default_rng(0).standard_normal((2000, 32)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    exact, exact_sims = nearest(vectors, 5)
    approx, approx_sims = nearest(vectors, 5, exact_up_to=1000)  # past the limit: HNSW
    assert approx.shape == exact.shape == (2000, 5) and approx_sims.shape == (2000, 5)
    assert not (approx == np.arange(2000)[:, None]).any(), "a chunk is not its own neighbour"
    found = np.mean([len(set(a) & set(e)) / 5 for a, e in zip(approx, exact, strict=True)])
    assert found > 0.9, found
    assert np.all(np.diff(approx_sims, axis=1) <= 1e-6), "best first"


def _question_writer(body: dict) -> str | None:
    """A stand-in model: a question from three words of the passage it was sent, in the shapes real
    models reply in (a "Question:" lead, quotes); a copied sentence for some, a failure for others."""
    prompt = body["messages"][-1]["content"]
    if "Passage:" not in prompt:
        return "ok"  # the probe
    passage = prompt.split("Passage:\n", 1)[1]
    words = [w.strip(".,").lower() for w in passage.split() if w.strip(".,").isalpha()]
    if len(words) % 7 == 0:
        return None  # a server error for this one
    if len(words) % 7 == 1:
        return passage.split(". ")[1]  # a sentence of the passage copied: rejected
    return f'Question: "Which notes discuss {words[3]} and {words[5]} near {words[8]}?"'


def test_an_llm_server_writes_pseudo_queries(adapted_index, tmp_path):
    """`adapt --llm-url` against a stand-in OpenAI-compatible server: its questions join the
    pseudo-queries (held-out check and card), cleaned, copies rejected, failures counted."""
    from cli.main import main

    copy = tmp_path / "idx"
    shutil.copytree(adapted_index, copy)
    with chat_completions_server(_question_writer) as (url, seen, _):
        code = main(["adapt", "--index-dir", str(copy), "--device", "cpu", "--adapt-queries", "60", "--adapt-generated",
                     "16", "--adapt-min-gain", "-1", "--llm-url", url, "--llm-model", "tiny"])  # fmt: skip
    assert code == 0
    card = json.loads((copy / "adapt" / "adapt.json").read_text())
    generation, generated = card["generation"], card["pseudo_queries"]["generated"]
    assert generation["server"] == url and generation["model"] == "tiny" and generation["asked"] == 16
    assert generation["kept"] + generation["rejected"] + generation["failed"] == 16
    assert generation["kept"] == generated["count"] > 0 and generation["rejected"] > 0 and generation["failed"] > 0
    assert all(e.startswith("Which notes discuss") and e.endswith("?") for e in generated["examples"])
    assert {body["model"] for body in seen} == {"tiny"}
    assert card["heldout"]["by_kind"]["generated"]["queries"] > 0


def test_a_server_that_fails_after_its_probe_leaves_the_documents_own_pseudo_queries(adapted_index, tmp_path):
    from cli.main import main
    from index_build.adapt.generated import GIVE_UP_AFTER

    copy = tmp_path / "idx"
    shutil.copytree(adapted_index, copy)

    def probe_only(body: dict) -> str | None:
        return None if "Passage:" in body["messages"][-1]["content"] else "ok"  # every question fails

    with chat_completions_server(probe_only) as (url, _, _):
        code = main(["adapt", "--index-dir", str(copy), "--device", "cpu", "--adapt-queries", "60",
                     "--adapt-generated", "8", "--llm-url", url])  # fmt: skip
    assert code == 0
    card = json.loads((copy / "adapt" / "adapt.json").read_text())
    assert card["generation"]["asked"] == card["generation"]["failed"] == GIVE_UP_AFTER  # then it stops asking
    assert card["generation"]["kept"] == 0
    assert set(card["pseudo_queries"]) == {"heading", "lead", "inner"} and card["heldout"]["queries"] >= 20


def test_a_generated_question_on_a_structural_querys_chunk_keeps_that_hold_out(adapted_index):
    """In a small corpus the structural pseudo-queries take every chunk, so questions are asked of
    the same chunks; a question takes nothing out, and the structural query's text stays out."""
    from engine.retrieval.encoder import encode
    from engine.search import HybridEngine
    from index_build.adapt import HeldOutView
    from index_build.adapt.generated import LLMServer, QueryWriter
    from index_build.adapt.pseudo import pseudo_queries

    engine = HybridEngine(EngineSettings(index_dir=adapted_index, device="cpu", rerank=False, adapted=False))
    rows, vectors = engine.dense.vectors()
    units = engine.dense.units.names(rows)
    chunks = engine.store.chunks(units)
    ordered = [chunks[u] for u in units]
    structural = pseudo_queries(ordered, 600)  # more than the corpus has: every chunk it can use
    with chat_completions_server(_question_writer) as (url, _, _):
        writer = QueryWriter(LLMServer(url), max_retries=0)
        generated, report = writer.write(ordered, 200, exclude={q.unit_id for q in structural}, progress=False)
    assert report["asked"] == min(200, len(ordered)) and generated
    asked = {g.unit_id for g in generated}
    shared = [q for q in structural if q.unit_id in asked and q.held_out != chunks[q.unit_id].contents]
    assert shared, "some chunks hold both kinds"
    view = HeldOutView(engine, engine.settings, units, vectors, structural + generated, progress=False)
    try:
        position = {u: i for i, u in enumerate(units)}
        held_out = encode(engine.dense.encoder, [q.held_out for q in shared], 32)
        for q, expected in zip(shared, held_out, strict=True):  # the chunk without the query's text, not whole
            assert np.allclose(view.vectors[position[q.unit_id]], expected, atol=1e-5)
            assert not np.allclose(view.vectors[position[q.unit_id]], vectors[position[q.unit_id]], atol=1e-5)
    finally:
        view.close()
        engine.close()


def test_a_build_with_judgments_never_asks_the_llm(beir_dir, tmp_path):
    """Training judgments mean a learned fusion, no adaptation: an --llm-url (a variable set for
    answers, say) that nothing listens on does not stop the build."""
    from cli.main import main

    nobody = f"http://127.0.0.1:{free_port()}/v1"
    assert main(["build", "--data", str(beir_dir), "--index-dir", str(tmp_path / "idx"), "--llm-url", nobody]) == 0
    assert (tmp_path / "idx" / "fusion").is_dir() and not (tmp_path / "idx" / "adapt").exists()


def test_questions_are_cleaned_and_copies_rejected():
    from index_build.adapt.generated import clean

    passage = "Copper lanterns light the harbor. Falcons nest in the cedar canyon."
    assert clean("Question: What lights a harbor at night?\nMore text", passage) == "What lights a harbor at night?"
    assert clean('1. "Where do falcons nest?"', passage) == "Where do falcons nest?"
    assert clean("Falcons nest in the cedar canyon.", passage) is None  # copied
    assert clean("Why?", passage) is None and clean("", passage) is None


def test_a_wrong_llm_url_fails_the_build_before_any_work(tmp_path, capsys):
    from cli.main import main

    folder = _write_folder(tmp_path / "files", files=2)
    nobody = f"http://127.0.0.1:{free_port()}/v1"
    assert main(["build", "--data", str(folder), "--index-dir", str(tmp_path / "idx"), "--llm-url", nobody]) == 2
    err = capsys.readouterr().err
    assert f"--llm-url {nobody}: the chat server did not answer" in err
    assert not (tmp_path / "idx").exists()
