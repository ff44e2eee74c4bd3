"""``build --shards``: documents partitioned by a hash of their id into whole shard indexes, searched in
one process as one index (real Lucene, FAISS and SQLite), with every stage's rankings the unsharded
index's."""

from __future__ import annotations

import numpy as np
import pytest

from engine.documents import Filters
from engine.settings import EngineSettings
from engine.store.docstore import DocStore
from engine.store.index_dir import DOCS_FILE, IndexDirError, read_manifest, shard_dir, shard_of
from index_build.settings import BuildSettings
from tests.conftest import SHARDS

QUERIES = ["arsenic in rice", "soy and breast cancer", "broccoli sulforaphane", "red meat", "report", "the of"]


@pytest.fixture(scope="module")
def sharded_dir(sharded_index_dir):
    return sharded_index_dir


@pytest.fixture(scope="module")
def engines(index_dir, sharded_dir, tmp_path_factory):
    """The unsharded engine, and the sharded index with the unsharded one's learned fusion: what the
    shards retrieve compared alone (a fusion trained on the shards' scores, equal to float rounding,
    is LightGBM's own answer to them: docs/ray.md)."""
    import shutil

    from engine.search import HybridEngine
    from engine.store.index_dir import FUSION_DIR

    copy = tmp_path_factory.mktemp("sharded-copy") / "tiny"
    shutil.copytree(sharded_dir, copy)
    shutil.rmtree(copy / FUSION_DIR)
    shutil.copytree(index_dir / FUSION_DIR, copy / FUSION_DIR)
    whole = HybridEngine(EngineSettings(index_dir=index_dir, device="cpu", rerank=False))
    sharded = HybridEngine(EngineSettings(index_dir=copy, device="cpu", rerank=False))
    yield whole, sharded
    whole.close()
    sharded.close()


def test_each_document_is_in_the_shard_its_id_names_with_its_rows_in_the_whole(index_dir, sharded_dir):
    manifest = read_manifest(sharded_dir)
    assert manifest.shards == SHARDS and manifest.memory["queries"] > 0
    assert (sharded_dir / "fusion" / "model.txt").is_file()  # trained on the shards' merged candidates
    whole = DocStore(index_dir / DOCS_FILE).unit_map()
    seen = {}
    for i in range(SHARDS):
        store = DocStore(shard_dir(sharded_dir, i) / DOCS_FILE)
        units = store.unit_map()
        assert len(units)
        for row, unit in units.pairs():
            assert shard_of(store.chunks([unit])[unit].document_id, SHARDS) == i
            seen[unit] = row
    assert seen == dict((unit, row) for row, unit in whole.pairs())  # one index's rows, each chunk once


def test_every_stage_ranks_as_the_unsharded_index(engines):
    whole, sharded = engines
    for query in QUERIES:
        want, got = whole.stages(query, 10), sharded.stages(query, 10)
        assert [d for d, _ in got.retrieved["bm25"]] == [d for d, _ in want.retrieved["bm25"]], query
        assert [s for _, s in got.retrieved["bm25"]] == pytest.approx([s for _, s in want.retrieved["bm25"]], rel=1e-5)
        assert got.retrieved["dense"] == want.retrieved["dense"], query  # exact: the same vectors, ties alike
        assert got.retrieved["memory"] == want.retrieved["memory"]
        assert [d for d, _ in got.final] == [d for d, _ in want.final], query
        assert [h.doc_id for h in sharded.search(query, 5)] == [h.doc_id for h in whole.search(query, 5)]


def test_filters_and_documents_are_answered_across_the_shards(engines):
    whole, sharded = engines
    ids = [f"D-{topic}-{i}" for topic in ("arsenic", "soy") for i in range(4)]
    assert len({shard_of(d, SHARDS) for d in ids}) > 1  # the filter's documents are on several shards
    only = Filters(document_ids=ids)
    want, got = whole.stages("rice soy cancer", 8, filters=only), sharded.stages("rice soy cancer", 8, filters=only)
    assert [d for d, _ in got.final] == [d for d, _ in want.final]
    assert {d.split("#")[0] for d, _ in got.final} <= set(ids)
    for doc_id in ids:
        assert sharded.store.document(doc_id) == whole.store.document(doc_id)
    assert sharded.store.document("D-nowhere") is None
    assert len(sharded.dense.units) == len(whole.dense.units)
    sims = sharded.dense.similarity(whole.dense.encode_query("soy"), [d for d, _ in want.final])
    assert np.allclose(sims, whole.dense.similarity(whole.dense.encode_query("soy"), [d for d, _ in want.final]))


def test_writes_in_one_process_go_to_their_documents_shard(sharded_dir, tmp_path):
    import shutil

    from engine.documents import DocumentIn
    from engine.search import HybridEngine

    copy = tmp_path / "index"
    shutil.copytree(sharded_dir, copy)
    settings = EngineSettings(index_dir=copy, device="cpu", rerank=False)
    ids = [f"okapi-{i}" for i in range(6)]
    assert len({shard_of(d, SHARDS) for d in ids}) > 1
    engine = HybridEngine(settings, writable=True)
    try:
        for doc_id in ids:
            chunk = {"chunk_id": doc_id, "content": f"okapi forest giraffe {doc_id}"}
            engine.live.upsert(DocumentIn.model_validate({"document_id": doc_id, "chunks": [chunk]}), wait=True)
        assert set(ids) <= {h.doc_id for h in engine.search("okapi forest giraffe", 10)}
        engine.live.delete(ids[0], wait=True)
        assert engine.live.document(ids[0]) is None and engine.live.document(ids[1])["document_id"] == ids[1]
    finally:
        engine.close()  # each shard checkpoints its own writes
    for doc_id in ids[1:]:
        held = [DocStore(shard_dir(copy, i) / DOCS_FILE).document(doc_id) is not None for i in range(SHARDS)]
        assert held == [i == shard_of(doc_id, SHARDS) for i in range(SHARDS)], doc_id
    reader = HybridEngine(settings)
    try:
        assert {h.doc_id for h in reader.search("okapi forest giraffe", 10)} >= set(ids[1:])
    finally:
        reader.close()


def test_a_missing_shard_is_named(sharded_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(sharded_dir, copy)
    shutil.rmtree(shard_dir(copy, 1))
    with pytest.raises(IndexDirError, match="shards/1"):
        read_manifest(copy)


def test_too_many_shards_for_the_corpus_is_refused(beir_dir, tmp_path):
    from index_build.builder import build_index

    with pytest.raises(ValueError, match="leave a shard empty"):
        build_index(
            EngineSettings(index_dir=tmp_path / "x", device="cpu"),
            BuildSettings(data_dir=beir_dir, shards=64),
            progress=False,
        )


def test_shards_in_other_processes_answer_as_here_and_a_shard_down_is_said(sharded_dir, tmp_path):
    """The shards behind the workers' channel (real sockets; Ray's handles are the other carrier,
    tests/test_ray.py): the same answers; a shard that stops answering is named in the
    answer when partial results are allowed, else the search fails with a 503."""
    import os

    from engine.search import HybridEngine
    from engine.search.opening import Remotes, open_view
    from engine.search.shard import LocalShard
    from engine.shards.fanout import Shard, ShardUnavailable
    from engine.shards.opened import shard_settings
    from serving.remotes import RemoteShards
    from serving.transport import ChannelTransport, served
    from serving.worker_channel import Channel, ChannelServer

    settings = EngineSettings(index_dir=sharded_dir, device="cpu", rerank=False)
    channel = Channel(tmp_path, os.urandom(32))
    local = [LocalShard(open_view(shard_settings(settings, sharded_dir, i))) for i in range(SHARDS)]
    servers = [ChannelServer(channel, i, served(shard, Shard)) for i, shard in enumerate(local)]
    transports = [ChannelTransport(channel, i, f"shard {i}") for i in range(SHARDS)]
    here = HybridEngine(settings)
    try:
        for partial in (True, False):
            remote = HybridEngine(settings, remotes=Remotes(shards=RemoteShards(transports, 5, partial)))
            for query in QUERIES:
                assert [(h.doc_id, h.score) for h in remote.search(query, 5)] == [
                    (h.doc_id, h.score) for h in here.search(query, 5)
                ]
            held = here.search(QUERIES[0], 1)[0].document_id  # a document asked of the one shard holding it
            assert remote.store.document(held) == here.store.document(held) is not None
            remote.close()
        servers[1].close(5)
        partial = HybridEngine(settings, remotes=Remotes(shards=RemoteShards(transports, 5, True)))
        hits = partial.search("soy and breast cancer", 8)
        assert hits.missing_shards == [1] and hits
        assert all(shard_of(h.document_id, SHARDS) != 1 for h in hits)
        assert [s.get("reachable", True) for s in partial.index.shards.status()] == [True, False, True]
        on_one = next(f"D-soy-{i}" for i in range(99) if shard_of(f"D-soy-{i}", SHARDS) == 1)
        with pytest.raises(ShardUnavailable):  # its document: unknown now, not "not found"
            partial.store.document(on_one)
        whole = HybridEngine(settings, remotes=Remotes(shards=RemoteShards(transports, 5, False)))
        with pytest.raises(ShardUnavailable, match="shard 1") as failed:
            whole.search("soy and breast cancer", 8)
        assert failed.value.status == 503 and failed.value.headers["Retry-After"]
    finally:
        for server in servers:
            server.close(5)
        for shard in local:
            shard.close()
        here.close()


def test_serve_answers_from_a_sharded_index_and_routes_its_writes(sharded_dir, tmp_path):
    """``serve`` (one process) on a sharded index: REST searches, a write to its document's shard,
    /health naming the shards; ``--workers 2`` is refused with the way to serve it."""
    import shutil

    import httpx

    from offline.server_process import free_port, serve_args, start_server, stop_server
    from tests.helpers import fails_to_serve

    copy = tmp_path / "index"
    shutil.copytree(sharded_dir, copy)
    port = free_port()
    args = serve_args(copy, port, "--warmup-searches", "300")
    proc = start_server(args, f"http://127.0.0.1:{port}/health", tmp_path / "serve.log")
    try:
        url = f"http://127.0.0.1:{port}"
        reply = httpx.post(f"{url}/search", json={"query": "soy and breast cancer", "top_k": 3}).json()
        assert reply["results"] and "missing_shards" not in reply
        body = {"document_id": "okapi-9", "chunks": [{"chunk_id": "c", "content": "okapi forest giraffe"}]}
        assert httpx.post(f"{url}/documents?refresh=wait_for", json=body, timeout=60).status_code == 201
        found = httpx.post(f"{url}/search", json={"query": "okapi forest giraffe", "top_k": 1}).json()["results"]
        assert found[0]["document_id"] == "okapi-9"
        health = httpx.get(f"{url}/health").json()
        assert [s["shard"] for s in health["shards"]] == list(range(SHARDS)) and health["documents"] == 33
    finally:
        assert stop_server(proc) == 0
    assert DocStore(shard_dir(copy, shard_of("okapi-9", SHARDS)) / DOCS_FILE).document("okapi-9") is not None
    assert "not with --workers" in fails_to_serve(["serve", "--index-dir", str(copy), "--workers", "2"])
