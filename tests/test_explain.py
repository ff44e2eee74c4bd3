"""Explained hits and a request's own fusion, reranking and depths: on the engine, on a retriever a
test registers, and through every door (plain HTTP, the official MCP and A2A clients, /v1)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from engine.documents import SearchRequest
from engine.retrieval.protocol import Query, Ranking, Within
from engine.search.controls import InvalidControl
from engine.settings import EngineSettings
from tests.helpers import a2a_v1_send

QUERY = "soy isoflavones and cancer"


def _asked(engine, top_k: int = 5, **controls):
    """Hits for ``controls`` as a door would take them (the request model, then the engine's check)."""
    request = SearchRequest(query=QUERY, top_k=top_k, **controls)
    return engine.search(request.query, request.top_k, options=engine.options_for(request))


def test_explained_hits_say_every_stage_and_how_fusion_placed_them(engine):
    plain = engine.search(QUERY, 5)
    explained = _asked(engine, explain="full")
    assert [(h.doc_id, h.score) for h in explained] == [(h.doc_id, h.score) for h in plain]
    assert all(h.explanation is None for h in plain)
    result = engine.stages(QUERY, 5)
    for final_rank, hit in enumerate(explained, start=1):
        why = hit.explanation
        assert set(why.retrievers) == {"bm25", "dense", "memory"}
        for name, part in why.retrievers.items():
            ranked = [d for d, _ in result.retrieved[name]]
            assert part.rank == (ranked.index(hit.doc_id) + 1 if hit.doc_id in ranked else None)
            assert part.contribution == pytest.approx(part.weight / (why.fusion.k + part.rank) if part.rank else 0)
        assert why.fusion.rrf_score == pytest.approx(sum(p.contribution for p in why.retrievers.values()))
        assert why.fusion.method == "learned" and why.fusion.score == hit.fused_score
        assert sum(why.fusion.contributions.values()) == pytest.approx(why.fusion.score, abs=1e-6)  # SHAP adds up
        assert why.fusion.features["bm25_rank"] == (why.retrievers["bm25"].rank or 1000)
        assert why.rerank is None and why.final.by == "fusion" and why.final.rank == final_rank
    brief = _asked(engine, explain=True)[0].explanation.fusion  # the model's features, not their shares
    assert brief.features == explained[0].explanation.fusion.features and brief.contributions is None


def test_one_retriever_alone_gives_exactly_its_ranking(engine):
    for alone in ("bm25", "dense", "memory"):
        weights = {name: float(name == alone) for name in ("bm25", "dense", "memory")}
        hits = _asked(engine, 10, fusion={"method": "rrf", "weights": weights}, rerank={"enabled": False})
        ranking = engine.stages(QUERY, 10).retrieved[alone]
        assert [h.doc_id for h in hits] == [d for d, _ in ranking[:10]], alone


def test_a_request_sets_k_and_depths_and_the_explanation_says_so(engine):
    hits = _asked(engine, 3, explain=True, fusion={"method": "rrf", "k": 30}, retrievers={"dense": {"depth": 7}})
    why = hits[0].explanation
    assert why.fusion.method == "rrf" and why.fusion.k == 30 and why.fusion.contributions is None
    assert why.retrievers["dense"].depth == 7 and why.retrievers["bm25"].depth == EngineSettings().bm25_depth


@pytest.mark.parametrize(
    "controls, field",
    [
        ({"fusion": {"weights": {"sparse": 1}}}, "fusion.weights.sparse: no such retriever"),
        ({"retrievers": {"colbert": {"depth": 5}}}, "retrievers.colbert: no such retriever"),
        ({"fusion": {"weights": {"bm25": 0, "dense": 0, "memory": 0}}}, "fusion.weights: at least one"),
    ],
)
def test_controls_the_engine_cannot_honour_are_refused_by_name(engine, controls, field):
    with pytest.raises(InvalidControl, match=field):
        engine.options_for(SearchRequest(query=QUERY, **controls))


def test_a_server_pins_controls_and_limits_depths(index_dir):
    from engine.search import HybridEngine

    settings = EngineSettings(
        index_dir=index_dir, device="cpu", rerank=False, fusion="rrf", request_controls="fusion.weights",
        max_request_depth=50,
    )  # fmt: skip
    pinned = HybridEngine(settings)
    try:
        allowed = pinned.options_for(SearchRequest(query=QUERY, fusion={"weights": {"dense": 0.5}}))
        assert allowed.weights == {"dense": 0.5}
        for controls, field in (
            ({"fusion": {"k": 5}}, "fusion.k: this server does not let a request change it"),
            ({"rerank": {"enabled": False}}, "rerank.enabled: this server does not"),
        ):
            with pytest.raises(InvalidControl, match=field):
                pinned.options_for(SearchRequest(query=QUERY, **controls))
        with pytest.raises(InvalidControl, match="fusion.method: this index serves no learned fusion"):
            pinned.settings.request_controls = ["fusion.method"]
            pinned.options_for(SearchRequest(query=QUERY, fusion={"method": "learned"}))
        pinned.settings.request_controls = ["retrievers.depth", "rerank.enabled"]
        with pytest.raises(InvalidControl, match="retrievers.bm25.depth: at most 50"):
            pinned.options_for(SearchRequest(query=QUERY, retrievers={"bm25": {"depth": 51}}))
        with pytest.raises(InvalidControl, match="rerank.enabled: this server serves no reranker"):
            pinned.options_for(SearchRequest(query=QUERY, rerank={"enabled": True}))
    finally:
        pinned.close()


class Favourite:
    """A retriever of a test's own: always the same documents, best first."""

    reads_vector = False

    def __init__(self, ranking: Ranking) -> None:
        self.ranking = ranking

    def retrieve(self, query: Query, k: int, within: Within) -> Ranking:
        return [hit for hit in self.ranking if hit[0] in within.live][:k]


@pytest.mark.parametrize("sharded", [False, True])
def test_a_registered_retriever_is_fused_explained_and_controlled(index_dir, sharded_index_dir, sharded):
    from engine.search import HybridEngine

    folder = sharded_index_dir if sharded else index_dir
    engine = HybridEngine(EngineSettings(index_dir=folder, device="cpu", rerank=False, fusion="rrf"))
    try:
        engine.register("favourite", Favourite([("D-meat-2", 9.0), ("D-berries-0", 4.0)]))
        hits = _asked(engine, 5, explain=True, fusion={"weights": {"favourite": 10}})
        assert [h.doc_id for h in hits[:2]] == ["D-meat-2", "D-berries-0"]
        part = hits[0].explanation.retrievers["favourite"]
        assert (part.rank, part.score, part.weight) == (1, 9.0, 10.0)
        alone = {"favourite": 1, "bm25": 0, "dense": 0, "memory": 0}
        assert [h.doc_id for h in _asked(engine, 5, fusion={"weights": alone})] == ["D-meat-2", "D-berries-0"]
        assert "favourite" in engine.stages(QUERY, 5).seconds  # timed as a stage of its own
        with pytest.raises(ValueError, match="new"):
            engine.register("bm25", Favourite([]))
        engine.settings.retrievers = {"favourite": {"depth": 1, "weight": 3}}  # [engine.retrievers.favourite]
        part = _asked(engine, 5, explain=True)[0].explanation.retrievers["favourite"]
        assert (part.depth, part.weight) == (5, 3.0)  # at least top_k candidates, as every retriever
    finally:
        engine.close()


def test_a_retrievers_depth_and_weight_are_settings_of_its_name(tmp_path):
    from serving.settings import Settings

    (tmp_path / "s.toml").write_text("bm25_weight = 2\n[engine.retrievers.favourite]\ndepth = 7\nweight = 0.5\n")
    engine = Settings.load(tmp_path / "s.toml").engine
    assert engine.retriever("favourite").depth == 7 and engine.retriever("favourite").weight == 0.5
    assert engine.retriever("bm25").weight == 2 and engine.retriever("memory").weight == EngineSettings().memory_weight
    assert engine.retriever("other") == type(engine.retriever("other"))()  # 100 candidates of weight 1


def test_a_reranked_hit_explains_the_blend(index_dir, reranker_dir):
    from engine.search import HybridEngine

    engine = HybridEngine(EngineSettings(index_dir=index_dir, device="cpu", reranker=reranker_dir, rerank_depth=8))
    try:
        hits = _asked(engine, 4, explain=True)
        for hit in hits:
            blend = hit.explanation.rerank
            assert hit.explanation.final.by == "rerank" and blend.head == 8 and blend.score == hit.rerank_score
            mixed = (1 - blend.blend) * blend.fused_z + blend.blend * blend.reranker_z
            assert mixed == pytest.approx(hit.score)
        fused = _asked(engine, 4, explain=True, rerank={"enabled": False})
        assert all(h.explanation.rerank is None and h.rerank_score is None for h in fused)
        assert _asked(engine, 4, explain=True, rerank={"depth": 5})[0].explanation.rerank.head == 5
    finally:
        engine.close()


# ---------------------------------------------------------------- the doors


def test_rest_search_explains_on_request_and_is_unchanged_without(server):
    url = server["mcp"]
    plain = httpx.post(f"{url}/search", json={"query": QUERY, "top_k": 3})
    explained = httpx.post(f"{url}/search", json={"query": QUERY, "top_k": 3, "explain": True}).json()["results"]
    assert "explanation" not in plain.text and b'"explanation"' not in plain.content
    assert [r["doc_id"] for r in explained] == [r["doc_id"] for r in plain.json()["results"]]
    assert set(explained[0]["explanation"]) == {"retrievers", "fusion", "rerank", "final"}
    assert explained[0]["explanation"]["final"] == {"rank": 1, "score": explained[0]["score"], "by": "fusion"}
    bm25 = {"fusion": {"method": "rrf", "weights": {"bm25": 1, "dense": 0, "memory": 0}}}
    alone = httpx.post(f"{url}/search", json={"query": QUERY, "top_k": 3, "explain": True, **bm25}).json()["results"]
    assert [r["explanation"]["retrievers"]["bm25"]["rank"] for r in alone] == [1, 2, 3]
    for body, field in (
        ({"fusion": {"weights": {"nope": 1}}}, "fusion.weights.nope"),
        ({"rerank": {"depth": 0}}, "rerank.depth"),
        ({"fusion": {"method": "borda"}}, "fusion.method"),
        ({"retrievers": {"dense": {"depth": 5, "k": 1}}}, "retrievers.dense.k"),
    ):
        refused = httpx.post(f"{url}/search", json={"query": QUERY, **body})
        assert refused.status_code == 422 and refused.json()["error"].startswith(field), refused.text
    nfcorpus = httpx.post(f"{url}/search_nfcorpus", json={"query": QUERY, "top_k": 3, "explain": True, **bm25})
    assert nfcorpus.json() == httpx.post(f"{url}/search_nfcorpus", json={"query": QUERY, "top_k": 3}).json()
    spec = httpx.get(f"{url}/openapi.json").json()
    body = spec["paths"]["/search"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "explain" in str(spec["components"]) and "/search_nfcorpus" in spec["paths"], body


def test_mcp_search_tool_takes_the_options_and_search_nfcorpus_stays(server):
    from mcp import Client

    async def run():
        async with Client(server["mcp"] + "/mcp") as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert set(tools["search_nfcorpus"].input_schema["properties"]) == {"query", "top_k"}
            props = tools["search"].input_schema["properties"]
            assert {"explain", "fusion", "rerank", "retrievers"} <= set(props)
            assert "1000" in str(tools["search"].input_schema) and "rrf" in str(tools["search"].input_schema)
            found = await client.call_tool("search", {"query": QUERY, "top_k": 2, "explain": True})
            plain = await client.call_tool("search", {"query": QUERY, "top_k": 2})
            refused = await client.call_tool("search", {"query": QUERY, "fusion": {"weights": {"nope": 1}}})
            return found, plain, refused

    found, plain, refused = asyncio.run(run())
    assert found.structured_content["results"][0]["explanation"]["final"]["rank"] == 1
    assert "explanation" not in plain.structured_content["results"][0]
    assert refused.is_error and "fusion.weights.nope" in " ".join(c.text for c in refused.content)


def test_a2a_data_part_takes_the_options(server):
    from a2a.helpers.proto_helpers import new_data_part
    from google.protobuf.json_format import MessageToDict

    asked = {"query": QUERY, "top_k": 3, "explain": True, "rerank": {"enabled": False}}
    task = a2a_v1_send(server["a2a"], [new_data_part(asked)])
    data = MessageToDict(task.artifacts[0].parts[0].data)
    assert len(data["doc_ids"]) == 3 and len(data["explanations"]) == 3
    assert data["explanations"][0]["final"]["rank"] == 1


def test_v1_retrieval_request_takes_the_options(server):
    message = {"type": "RETRIEVAL_REQUEST", "sender": "System", "receiver": "RetrievalAgent"}
    payload = {"query": QUERY, "top_k": 2, "explain": True, "fusion": {"method": "rrf"}}
    reply = httpx.post(server["mcp"] + "/v1/messages", json={**message, "payload": payload}, timeout=60).json()
    chunks = reply["payload"]["retrieved_chunks"]
    assert chunks[0]["explanation"]["fusion"]["method"] == "rrf"
    bad = httpx.post(
        server["mcp"] + "/v1/messages", json={**message, "payload": {"query": QUERY, "fusion": {"weights": {"x": 1}}}}
    ).json()
    assert bad["type"] == "ERROR_MESSAGE" and "fusion.weights.x" in str(bad["payload"]), bad


def test_a_sharded_index_explains_as_the_one_index(index_dir, sharded_index_dir):
    from engine.search import HybridEngine

    settings = EngineSettings(device="cpu", rerank=False, fusion="rrf")
    engines = [HybridEngine(settings.model_copy(update={"index_dir": d})) for d in (index_dir, sharded_index_dir)]
    try:
        one, sharded = (_asked(engine, 5, explain=True) for engine in engines)
    finally:
        for engine in engines:
            engine.close()
    assert [h.doc_id for h in one] == [h.doc_id for h in sharded]
    for a, b in zip(one, sharded, strict=True):
        ranks = [{n: p.rank for n, p in h.explanation.retrievers.items()} for h in (a, b)]
        assert ranks[0] == ranks[1] and a.explanation.fusion.rrf_rank == b.explanation.fusion.rrf_rank
        assert a.explanation.final.rank == b.explanation.final.rank
