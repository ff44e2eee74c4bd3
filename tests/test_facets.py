"""Facets (issue 64): exact counts of a key's values among the chunks (or documents) that match,
equal to a count over the store's own rows, for every key and after live writes; with a query,
among its candidates."""

from __future__ import annotations

import json
import random
import shutil
from collections import Counter

import pytest

from engine.documents import DocumentIn, FacetRequest
from engine.settings import EngineSettings


@pytest.fixture(scope="module")
def engine(index_dir, tmp_path_factory):
    from engine.search import HybridEngine

    target = tmp_path_factory.mktemp("facets") / "live"
    shutil.copytree(index_dir, target)
    engine = HybridEngine(EngineSettings(index_dir=target, device="cpu", rerank=False), writable=True)
    yield engine
    engine.close()


def _write(engine, rng: random.Random, n: int, start: int) -> None:
    for i in range(start, start + n):
        meta = {"year": rng.choice([2019, 2020, 2021]), "kind": rng.choice(["a", "b"]), "tags": rng.sample("xyz", 2)}
        chunks = [{"chunk_id": f"c{j}", "content": f"walnut study {i} part {j}"} for j in range(rng.randint(1, 3))]
        chunks[0]["metadata"] = {"kind": "c"} if rng.random() < 0.3 else {}
        engine.live.upsert(DocumentIn.model_validate({"document_id": f"f{i}", "chunks": chunks, "metadata": meta}))
    engine.live.refresh()


def _counted(engine, key: str, keep=lambda meta: True) -> tuple[Counter, Counter]:
    """A count over the store's rows: each chunk's merged metadata, its own over its document's."""
    rows = engine.store._conn().execute(
        "SELECT c.document_id, d.metadata, c.metadata FROM chunks c JOIN documents d USING (document_id)"
    )
    chunks, documents = Counter(), {}
    for document, shared, own in rows:
        meta = json.loads(shared) | {k: v for k, v in json.loads(own).items() if v is not None}
        if key in meta and keep(meta):
            for value in meta[key] if isinstance(meta[key], list) else [meta[key]]:
                chunks[value] += 1
                documents.setdefault(value, set()).add(document)
    return chunks, Counter({v: len(d) for v, d in documents.items()})


def test_facets_equal_a_count_over_the_store_for_every_key_after_writes(engine) -> None:
    rng = random.Random(7)
    for start in (0, 20):
        _write(engine, rng, 20, start)
        engine.live.delete(f"f{start + 3}", wait=True)
        for key in ("year", "kind", "tags"):
            for count in ("chunks", "documents"):
                found = dict(engine.facets(FacetRequest(key=key, count=count)))
                assert found == dict(_counted(engine, key)[count == "documents"]), (key, count)
        filtered = FacetRequest(key="kind", filters={"year": {"gte": 2020}, "not": {"tags": "x"}})
        keep = lambda meta: meta["year"] >= 2020 and "x" not in meta["tags"]  # noqa: E731
        assert dict(engine.facets(filtered)) == dict(_counted(engine, "kind", keep)[0])


def test_facets_of_a_query_count_its_candidates(engine) -> None:
    _write(engine, random.Random(8), 5, 100)
    counts = dict(engine.facets(FacetRequest(key="kind", query="walnut study")))
    assert counts and sum(counts.values()) <= sum(dict(engine.facets(FacetRequest(key="kind"))).values())
    ranked = engine.stages("walnut study", 1).fused
    held = engine.store.chunks(d for d, _ in ranked)
    assert sum(counts.values()) == sum(1 for d, _ in ranked if "kind" in held[d].metadata)
