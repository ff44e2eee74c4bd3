"""Live documents: real Lucene, FAISS and SQLite under a real server and its HTTP and MCP doors
(kill -9 while writing: test_faults.py)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading
import time

import httpx
import pytest

from engine.search.opening import Remotes
from engine.settings import EngineSettings
from offline.server_process import CLI, ROOT, free_port, serve_args, start_server, stop_server


@pytest.fixture
def live_dir(index_dir, tmp_path):
    """A private copy of the built index, so writes never reach other tests."""
    target = tmp_path / "live"
    shutil.copytree(index_dir, target)
    return target


def _doc(doc_id: str, text: str, **metadata) -> dict:
    return {
        "document_id": doc_id,
        "document_name": f"{doc_id}.txt",
        "metadata": metadata,
        "chunks": [{"chunk_id": "c1", "content": text}, {"chunk_id": "c2", "content": f"{text} continued"}],
    }


@pytest.fixture(scope="module")
def live_server(index_dir, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("live-server")
    live_dir = tmp_path / "live"
    shutil.copytree(index_dir, live_dir)
    port = free_port()
    args = serve_args(live_dir, port, "--mcp-writes", "--max-body-bytes", "20000", "--refresh-interval", "0.2")
    proc = start_server(args, f"http://127.0.0.1:{port}/health", tmp_path / "serve.log")
    yield {"url": f"http://127.0.0.1:{port}", "proc": proc, "dir": live_dir, "log": tmp_path / "serve.log"}
    if proc.poll() is None:
        assert stop_server(proc) == 0
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


# ---------------------------------------------------------------- the log itself


def test_a_torn_tail_is_cut_and_whole_records_survive(tmp_path, caplog):
    from engine.store.wal import WriteAheadLog

    wal = WriteAheadLog(tmp_path / "wal.log")
    for seq in (1, 2, 3):
        wal.append({"seq": seq, "op": "delete", "document_id": f"d{seq}", "old_rows": []})
    wal.close()
    whole = (tmp_path / "wal.log").stat().st_size
    with open(tmp_path / "wal.log", "ab") as fh:
        fh.write(b"\x40\x00\x00\x00garbage")  # a record header promising 64 bytes, then a crash
    wal = WriteAheadLog(tmp_path / "wal.log")
    assert [r["seq"] for r in wal.records()] == [1, 2, 3]
    assert (tmp_path / "wal.log").stat().st_size == whole
    assert "torn tail" in caplog.text
    wal.close()


# ---------------------------------------------------------------- the engine


def test_filters_act_inside_retrieval_and_deletes_never_return(live_dir):
    from engine.documents import DocumentIn, Filters
    from engine.search import HybridEngine
    from engine.store.docstore import matching_sql

    engine = HybridEngine(EngineSettings(index_dir=live_dir, device="cpu", rerank=False), writable=True)
    try:
        for i in range(40):
            kind = "rare" if i < 4 else "common"
            body = "kiwi orchard pruning" if kind == "rare" else "vitamin D supplements bone density falls"
            engine.live.upsert(DocumentIn.model_validate(_doc(f"n{i}", f"{body} note {i}", document_type=kind)))
        engine.live.refresh()
        # the query favours the 36 common notes and the corpus; the rare ones still fill top_k
        hits = engine.search("vitamin D supplements falls", 4, Filters(document_types=["rare"]))
        assert len(hits) == 4 and {h.metadata["document_type"] for h in hits} == {"rare"}
        by_id = engine.search("kiwi orchard", 8, Filters(document_ids=["n1", "n2"]))
        assert {h.document_id for h in by_id} == {"n1", "n2"} and len(by_id) == 4
        assert engine.search("kiwi orchard", 5, Filters(document_types=["none-such"])) == []
        rare = Filters(document_types=["rare"])
        assert engine.index.allowed(rare) is engine.index.allowed(rare)  # a repeated filter's chunks are kept...
        engine.live.upsert(DocumentIn.model_validate(_doc("n99", "kiwi orchard pruning note 99", document_type="rare")))
        engine.live.refresh()  # ...until the store changes
        assert "n99" in {h.document_id for h in engine.search("kiwi orchard pruning", 10, rare)}
        plans = [engine.store.plan(*matching_sql(f)) for f in (rare, Filters(date_range=["2024-01-01", None]))]
        assert [any("USING INDEX documents_by_" in step for step in plan) for plan in plans] == [True, True]

        engine.live.delete("n1", wait=True)
        for query in ("kiwi orchard pruning note 1", "vitamin D supplements bone density falls"):
            assert all(h.document_id != "n1" for h in engine.search(query, 50))
        # a corpus document the judgment memory votes for stays gone once deleted
        memory_pick = engine.stages("calcium and density effects", 5).retrieved["memory"][0][0]
        engine.live.delete(memory_pick, wait=True)
        result = engine.stages("calcium and density effects", 5)
        assert memory_pick not in {d for d, _ in result.retrieved["memory"] + result.fused}
    finally:
        engine.close()
    reopened = HybridEngine(EngineSettings(index_dir=live_dir, device="cpu", rerank=False))
    assert reopened.store.document("n1") is None and reopened.store.document("n2") is not None
    reopened.close()


class _DeletingReranker:
    """A reranker handed to the engine (its extension point) that deletes documents the first time it
    scores: a write landing between retrieval and the answer, every time."""

    name, device, runtime, max_length, memory_context = "deleting", "cpu", "test", 64, 0

    def __init__(self, doomed: list[str]) -> None:
        self.doomed, self.live = doomed, None

    def score(self, query: str, passages: list[str]) -> list[float]:
        for document_id in self.doomed:
            self.live.delete(document_id, wait=True)
        self.doomed = []
        return [-float(i) for i in range(len(passages))]  # the fused order


def test_a_delete_between_retrieval_and_the_answer_never_fails_the_search(live_dir):
    from engine.search import HybridEngine

    reranker = _DeletingReranker([f"D-soy-{i}" for i in range(4)])
    settings = EngineSettings(index_dir=live_dir, device="cpu", fusion="rrf")  # similarity: the dense cosine
    engine = HybridEngine(settings, writable=True, reranker=reranker)
    reranker.live = engine.live
    try:
        hits = engine.search("soy isoflavones prostate cancer", 5)
        # answered from the view it retrieved in: the documents deleted meanwhile, scored as they were
        assert len(hits) == 5 and hits[0].document_id.startswith("D-soy-")
        assert all(0 <= h.similarity_score <= 1 for h in hits)
        assert not any(h.document_id.startswith("D-soy-") for h in engine.search("soy isoflavones prostate", 5))
    finally:
        engine.close()


def test_similarity_threshold_reads_the_calibrated_probability(engine):
    hits = engine.search("soy isoflavones prostate", 10)
    scores = [h.similarity_score for h in hits]
    assert all(0 <= s <= 1 for s in scores) and engine.fusion.calibration is not None
    cut = sorted(scores)[len(scores) // 2]
    kept = engine.search("soy isoflavones prostate", 10, similarity_threshold=cut)
    assert [h.doc_id for h in kept] == [h.doc_id for h in hits if h.similarity_score >= cut]
    assert engine.search("soy isoflavones prostate", 10, similarity_threshold=1.0) == []


def test_a_read_only_engine_refuses_unsettled_writes(live_dir):
    from engine.documents import DocumentIn
    from engine.search import HybridEngine
    from engine.store.index_dir import IndexDirError

    writer = HybridEngine(EngineSettings(index_dir=live_dir, device="cpu", rerank=False), writable=True)
    writer.live.upsert(DocumentIn.model_validate(_doc("w1", "walnuts and omega-3")), wait=True)
    with pytest.raises(IndexDirError, match="another process writes this index"):
        HybridEngine(EngineSettings(index_dir=live_dir, device="cpu", rerank=False), writable=True)
    with pytest.raises(IndexDirError, match="compact"):
        HybridEngine(EngineSettings(index_dir=live_dir, device="cpu", rerank=False))
    writer.close()
    reader = HybridEngine(EngineSettings(index_dir=live_dir, device="cpu", rerank=False))
    assert reader.search("walnuts omega-3", 1)[0].document_id == "w1"
    reader.close()


# ---------------------------------------------------------------- HTTP and MCP


def test_documents_over_http(live_server):
    url = live_server["url"]
    created = httpx.post(f"{url}/documents?refresh=wait_for", json=_doc("g1", "quinoa saponins bitterness"))
    assert created.status_code == 201 and created.json()["chunks"] == 2
    found = httpx.post(f"{url}/search", json={"query": "quinoa saponins", "top_k": 2}).json()["results"]
    assert sorted(r["doc_id"] for r in found) == ["g1#c1", "g1#c2"]
    assert found[0]["source_document"] == "g1.txt" and 0 <= found[0]["similarity_score"] <= 1
    again = httpx.post(
        f"{url}/documents?refresh=wait_for",
        json={**_doc("g1", "amaranth grain"), "chunks": [{"chunk_id": "only", "content": "amaranth grain protein"}]},
    )
    assert again.status_code == 200 and again.json()["replaced"] is True
    got = httpx.get(f"{url}/documents/g1").json()
    assert [c["chunk_id"] for c in got["chunks"]] == ["only"]
    results = httpx.post(f"{url}/search", json={"query": "quinoa saponins", "top_k": 50}).json()["results"]
    assert not any(r["document_id"] == "g1" and r["chunk_id"] != "only" for r in results)
    # visible within the refresh interval without waiting
    httpx.post(f"{url}/documents", json=_doc("g2", "teff injera fermentation")).raise_for_status()
    deadline = time.time() + 10
    while time.time() < deadline:
        top = httpx.post(f"{url}/search", json={"query": "teff injera", "top_k": 1}).json()["results"]
        if top and top[0]["document_id"] == "g2":
            break
        time.sleep(0.1)
    else:
        pytest.fail("an acknowledged write was not searchable within 10 s")
    assert httpx.delete(f"{url}/documents/g2?refresh=wait_for").json()["deleted_chunks"] == 2
    assert httpx.get(f"{url}/documents/g2").status_code == 404
    assert httpx.delete(f"{url}/documents/g2").status_code == 404
    health = httpx.get(f"{url}/health").json()
    assert health["writable"] and health["live"]["seq"] >= 4


def test_operator_filters_over_http(live_server):
    """Ranges, membership, negation and or over /search: each hit holds the filter, and the hits are
    the unfiltered ranking's chunks that hold it."""
    url = live_server["url"]
    for i in range(6):
        body = _doc(f"y{i}", f"sorghum harvest yields note {i}", year=2018 + i, source=["x", "y", "z"][i % 3])
        httpx.post(f"{url}/documents?refresh=wait_for", json=body).raise_for_status()
    filters = {"or": [{"year": {"gte": 2021}}, {"not": {"source": {"in": ["x", "y"]}}}], "year": {"exists": True}}
    reply = httpx.post(f"{url}/search", json={"query": "sorghum harvest", "top_k": 20, "filters": filters})
    assert reply.status_code == 200, reply.text
    found = {r["document_id"] for r in reply.json()["results"]}
    assert found == {"y2", "y3", "y4", "y5"}  # 2021 and later, or a source of z
    bad = httpx.post(f"{url}/search", json={"query": "sorghum", "filters": {"year": {"gte": "soon"}}})
    assert bad.status_code == 422 and "year" in bad.json()["error"]
    grouped = {"query": "sorghum harvest", "top_k": 3, "group_by": "document_id", "group_size": 2, "filters": filters}
    results = httpx.post(f"{url}/search", json=grouped).json()["results"]
    assert len({r["document_id"] for r in results}) == 3 and all(len(r["group"]) == 1 for r in results)
    assert all(r["group"][0]["document_id"] == r["document_id"] != "" for r in results)
    assert "group" not in httpx.post(f"{url}/search", json={"query": "sorghum"}).json()["results"][0]
    asked, pages = {"query": "sorghum harvest", "top_k": 3, "filters": filters, "paginate": True}, []
    while True:
        reply = httpx.post(f"{url}/search", json=asked).json()
        pages += [r["doc_id"] for r in reply["results"]]
        if "next_page_token" not in reply:
            break
        asked["page_token"] = reply["next_page_token"]
    assert sorted(pages) == sorted(f"y{i}#c{j}" for i in range(2, 6) for j in (1, 2))  # each once
    facets = httpx.post(f"{url}/facets", json={"key": "source", "filters": {"year": {"gte": 2020}}}).json()
    counted = [{"value": "z", "count": 4}, {"value": "x", "count": 2}, {"value": "y", "count": 2}]  # y2-y5's
    assert facets == {"key": "source", "count": "chunks", "values": counted}
    refused = httpx.post(f"{url}/facets", json={"key": "source", "count": "pages"})
    assert refused.status_code == 422 and refused.json()["error"].startswith("count")
    highlighted = {"query": "sorghum harvest", "top_k": 2, "highlight": {"sentences": 1}, "context": {"neighbors": 1}}
    for r in httpx.post(f"{url}/search", json=highlighted).json()["results"]:
        assert [r["text"][h["start"] : h["end"]] for h in r["highlights"]] == [h["text"] for h in r["highlights"]]
        assert len(r["context"]["before"]) + len(r["context"]["after"]) == 1  # each note's other chunk
    foreign = httpx.post(f"{url}/search", json={"query": "millet", "page_token": asked["page_token"]})
    assert foreign.status_code == 422 and foreign.json()["error"].startswith("page_token")
    plain = httpx.post(f"{url}/search_nfcorpus", json={"query": "sorghum", "filters": {"year": {"gte": 2020}}})
    assert plain.status_code == 422  # the benchmark's search keeps today's filters
    for i in range(6):
        httpx.delete(f"{url}/documents/y{i}?refresh=wait_for").raise_for_status()


def test_a_beir_record_moves_between_a_file_and_the_live_api_unchanged(live_server):
    """Metadata of any JSON shape, as BEIR files carry it (tests/test_beir_shapes.py builds them):
    kept and returned; a list filters by membership, a key held as an object is refused by name."""
    url = live_server["url"]
    evidence = {"4": [{"sentences": [4], "label": "SUPPORT"}]}
    metadata = {"tags": ["mac", "mount"], "year": "2011", "evidence": evidence, "extra": {}, "date": "Tue, 04 Jun"}
    chunk = {"chunk_id": "13734012", "content": "zinc finger nucleases edit genomes", "metadata": {"spans": [[0, 4]]}}
    body = {"document_id": "13734012", "document_name": "Zinc", "metadata": metadata, "chunks": [chunk]}
    assert httpx.post(f"{url}/documents?refresh=wait_for", json=body).status_code == 201
    got = httpx.get(f"{url}/documents/13734012").json()
    assert got["metadata"] == metadata and got["chunks"][0]["metadata"] == chunk["metadata"]
    asked = {"query": "zinc finger nucleases", "top_k": 3, "filters": {"tags": "mount", "year": "2011"}}
    hits = httpx.post(f"{url}/search", json=asked).json()["results"]
    assert [h["doc_id"] for h in hits] == ["13734012"] and hits[0]["metadata"]["evidence"] == evidence
    for key in ("evidence", "spans", "extra"):
        refused = httpx.post(f"{url}/search", json={"query": "zinc", "filters": {key: "SUPPORT"}})
        assert refused.status_code == 422 and f"filter {key!r}" in refused.json()["error"]


@pytest.mark.parametrize(
    ("body", "status", "names"),
    [
        (
            {"document_id": "x", "chunks": [{"chunk_id": "a", "content": "1"}, {"chunk_id": "a", "content": "2"}]},
            422,
            "appears twice",
        ),
        ({"document_id": "x", "chunks": [{"chunk_id": "a", "content": "   "}]}, 422, "chunks.0.content"),
        ({"document_id": "x", "chunks": []}, 422, "chunks"),
        ({"document_id": "x", "metadata": ["guide"], "chunks": [{"chunk_id": "a", "content": "t"}]}, 422, "metadata"),
        ({"document_id": "x", "total_chunks": 3, "chunks": [{"chunk_id": "a", "content": "t"}]}, 422, "total_chunks"),
        ({"chunks": [{"chunk_id": "a", "content": "t"}]}, 422, "document_id"),
        ({"document_id": "x", "chunks": [{"chunk_id": "a", "content": "t" * 30000}]}, 413, "limit"),
    ],
)
def test_bad_documents_are_refused_whole(live_server, body, status, names):
    reply = httpx.post(f"{live_server['url']}/documents", json=body)
    assert reply.status_code == status and names in reply.json()["error"]
    assert httpx.get(f"{live_server['url']}/documents/x").status_code == 404


@pytest.mark.parametrize(
    ("filters", "names"),
    [
        ({"date_range": ["2020-02-30", None]}, "date_range"),
        ({"document_types": "guide"}, "document_types"),
        ({"page": {"above": 3}}, "page"),
        ("guide", "filters"),
    ],
)
def test_bad_filters_are_refused(live_server, filters, names):
    reply = httpx.post(f"{live_server['url']}/search", json={"query": "soy", "filters": filters})
    assert reply.status_code == 422 and names in reply.json()["error"]


def test_searches_never_fail_while_documents_arrive(live_server):
    url, errors, searches = live_server["url"], [], [0]
    stop = threading.Event()

    def search_loop():
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                reply = client.post(f"{url}/search", json={"query": "broccoli sulforaphane", "top_k": 5})
                searches[0] += 1
                if reply.status_code != 200 or len(reply.json()["results"]) != 5:
                    errors.append(reply.text)

    threads = [threading.Thread(target=search_loop) for _ in range(2)]
    for t in threads:
        t.start()
    with httpx.Client(timeout=30) as client:
        for i in range(25):
            client.post(f"{url}/documents", json=_doc(f"s{i}", f"broccoli sprouts batch {i}")).raise_for_status()
    stop.set()
    for t in threads:
        t.join()
    assert not errors and searches[0] > 5


def test_mcp_search_and_write_tools(live_server):
    from mcp import Client

    async def run():
        async with Client(live_server["url"] + "/mcp") as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert set(tools) >= {"search_nfcorpus", "search", "add_document", "delete_document"}
            assert set(tools["search_nfcorpus"].input_schema["properties"]) == {"query", "top_k"}
            added = await client.call_tool(
                "add_document",
                {
                    "document_id": "m1",
                    "document_name": "Millet",
                    "metadata": {"document_type": "note", "tags": ["grain", "porridge"], "source": {"book": "Grains"}},
                    "chunks": [{"chunk_id": "p1", "content": "millet porridge", "metadata": {"page": 1}}],
                },
            )
            assert not added.is_error, added.content
            filters = {"page": 1, "tags": "grain"}
            hits = await client.call_tool("search", {"query": "millet", "top_k": 3, "filters": filters})
            assert [r["doc_id"] for r in hits.structured_content["results"]] == ["m1#p1"]
            operators = {"and": [{"page": {"gte": 1, "lt": 2}}, {"not": {"tags": {"in": ["rice", "oats"]}}}]}
            hits = await client.call_tool("search", {"query": "millet", "top_k": 3, "filters": operators})
            assert [r["doc_id"] for r in hits.structured_content["results"]] == ["m1#p1"]
            assert "and" in json.dumps(tools["search"].input_schema)
            assert {"group_by", "group_size"} <= set(tools["search"].input_schema["properties"])
            counted = await client.call_tool("facets", {"key": "tags", "filters": {"page": {"exists": True}}})
            assert {v["value"]: v["count"] for v in counted.structured_content["values"]} == {"grain": 1, "porridge": 1}
            nested = await client.call_tool("search", {"query": "millet", "filters": {"source": "Grains"}})
            assert nested.is_error and "filter 'source'" in nested.content[0].text
            bad = await client.call_tool("search", {"query": "millet", "filters": {"date_range": ["soon", None]}})
            assert bad.is_error and "date_range" in bad.content[0].text
            assert not (await client.call_tool("delete_document", {"document_id": "m1"})).is_error
            gone = await client.call_tool("delete_document", {"document_id": "m1"})
            assert gone.is_error and "no document" in gone.content[0].text

    asyncio.run(run())


# ---------------------------------------------------------------- the CLI


def _pdf(pages: list[str]) -> bytes:
    """A minimal PDF with one line of text a page."""
    objects = ["<< /Type /Catalog /Pages 2 0 R >>", None, "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    kids = []
    for text in pages:
        stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET"
        objects.append(f"<< /Length {len(stream)} >>\nstream\n{stream}\nendstream")
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {len(objects)} 0 R"
            " /Resources << /Font << /F1 3 0 R >> >> >>"
        )
        kids.append(f"{len(objects)} 0 R")
    objects[1] = f"<< /Type /Pages /Kids [{' '.join(kids)}] /Count {len(kids)} >>"
    out, offsets = "%PDF-1.4\n", []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n{body}\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n" + "".join(f"{o:010d} 00000 n \n" for o in offsets)
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n"
    return out.encode("latin-1")


def test_ingest_files_then_search_from_the_cli(live_dir, tmp_path):
    published = {"tags": ["syrup"], "source": {"journal": "Food Chem", "volume": "12"}, "extra": {}}
    (tmp_path / "extra.jsonl").write_text(
        json.dumps({"_id": "X-1", "title": "Sorghum", "text": "sorghum syrup polyphenols", "metadata": published})
        + "\n"
    )
    message = {
        "type": "DOCUMENT_INGESTION",
        "sender": "IngestionAgent",
        "receiver": "RetrievalAgent",
        "payload": {**_doc("msg-1", "chia seeds mucilage"), "embedding_model": "all-MiniLM-L6-v2", "total_chunks": 2},
    }
    (tmp_path / "message.json").write_text(json.dumps(message))
    sentences = " ".join(f"Fermented kimchi sentence {i} describes lactobacillus counts." for i in range(60))
    (tmp_path / "kimchi.md").write_text(f"# Kimchi\n\n{sentences}\n\n## Storage\n\nKeep kimchi cold.\n")
    (tmp_path / "notes.txt").write_text("Tempeh is fermented soybean cake. It is rich in protein.")
    (tmp_path / "leaflet.pdf").write_bytes(_pdf(["Natto has nattokinase.", "Miso is fermented paste."]))
    (tmp_path / "broken.jsonl").write_text('{"_id": "B-1", "text": "fine"}\n{"_id": oops}\n')
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    files = ["extra.jsonl", "message.json", "kimchi.md", "notes.txt", "leaflet.pdf", "broken.jsonl"]
    run = subprocess.run(
        [
            *CLI,
            "ingest",
            *(str(tmp_path / f) for f in files),
            "--index-dir",
            str(live_dir),
            "--device",
            "cpu",
            "--chunk-words",
            "60",
            "--chunk-overlap-words",
            "10",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1, run.stderr  # one file was bad
    assert "broken.jsonl:2: malformed JSON" in run.stderr and "added 5 documents" in run.stdout

    from engine.search import HybridEngine

    engine = HybridEngine(EngineSettings(index_dir=live_dir, device="cpu", rerank=False))
    try:
        assert engine.store.document("B-1") is None  # nothing of the bad file
        kimchi = engine.store.document("kimchi")
        sections = [c["metadata"].get("section") for c in kimchi["chunks"]]
        assert len(kimchi["chunks"]) >= 4 and sections[0] == "Kimchi" and sections[-1] == "Storage"
        first, second = kimchi["chunks"][0]["content"], kimchi["chunks"][1]["content"]
        assert first.split(". ")[-1].rstrip(".") in second  # neighbours share a sentence
        leaflet = engine.store.document("leaflet")
        assert [c["metadata"]["page"] for c in leaflet["chunks"]] == [1, 2]
        assert engine.search("nattokinase", 1)[0].metadata["page"] == 1
        assert engine.search("chia mucilage", 1)[0].document_id == "msg-1"
        assert engine.search("sorghum syrup", 1)[0].doc_id == "X-1"
        assert engine.store.document("X-1")["metadata"] == published  # as a build keeps it
        assert engine.store.document("msg-1")["embedding_model"] == "all-MiniLM-L6-v2"
    finally:
        engine.close()


def test_a_follower_answers_whole_when_the_store_moved_ahead_of_its_view(live_dir):
    """A worker that follows the writer searches its last checkpoint while the shared store already
    lost a document: the answer is made of chunks the store still holds, top_k of them, never a 500
    (a KeyError in assembling the hits, measured under `serve --workers 2`)."""
    from engine.search import HybridEngine

    writer = HybridEngine(
        EngineSettings(index_dir=live_dir, device="cpu", rerank=False, checkpoint_bytes=1 << 40), writable=True
    )
    follower = HybridEngine(
        EngineSettings(index_dir=live_dir, device="cpu", rerank=False), remotes=Remotes(writer=writer.live)
    )
    try:
        top = follower.search("caffeine and the liver", 3)
        writer.live.delete(top[0].document_id, wait=True)  # no checkpoint: the follower's view keeps it
        hits = follower.search("caffeine and the liver", 3)
        assert len(hits) == 3 and top[0].document_id not in {h.document_id for h in hits}
    finally:
        writer.close()
        follower.close()


def test_a_follower_shows_each_published_write_from_the_log_not_a_rewritten_index(live_dir):
    """``serve --workers N``: a refresh writes Lucene's changes and a few bytes for the followers,
    never the dense index again; a follower applies the log's records since its position."""
    from engine.documents import DocumentIn
    from engine.search import HybridEngine

    writer = HybridEngine(EngineSettings(index_dir=live_dir, device="cpu", rerank=False, followed=True), writable=True)
    follower = HybridEngine(
        EngineSettings(index_dir=live_dir, device="cpu", rerank=False), remotes=Remotes(writer=writer.live)
    )
    try:
        dense_files = sorted(live_dir.glob("dense*.faiss"))
        writer.live.upsert(DocumentIn.model_validate(_doc("f1", "quokka marsupial diet")), wait=True)
        assert follower.search("quokka marsupial diet", 1)[0].document_id == "f1"  # acknowledged: shown at once
        writer.live.upsert(DocumentIn.model_validate(_doc("f1", "wombat burrow digging")), wait=True)
        assert follower.search("wombat burrow digging", 1)[0].document_id == "f1"
        # replaced whole: no chunk of the old text is left (f1's new chunks may still rank in a 34-chunk corpus)
        assert all("quokka" not in h.text for h in follower.search("quokka marsupial diet", 5))
        assert sorted(live_dir.glob("dense*.faiss")) == dense_files  # no dense index written for them
        assert follower.index.follower.status()["applied_from_log"] == 2

        base = follower.dense.segments.base
        follower.index.follower.close()  # its own thread stopped: searches alone catch it up now
        writer.live.delete("f1", wait=True)
        written = writer.live.checkpoint()  # the log emptied past the follower's position
        assert not written["dense_merged"] and sorted(live_dir.glob("dense*.faiss")) == dense_files
        assert all(h.document_id != "f1" for h in follower.search("wombat burrow digging", 5))
        assert follower.index.follower.status()["checkpoint"] == written["seq"] == writer.live.seq
        assert follower.dense.segments.base is base  # the checkpoint's writes read; the shared base kept mapped
        # its names carried over and the changed rows looked up: the store's whole map, as read afresh
        assert sorted(follower.dense.units.pairs()) == sorted(follower.store.unit_map().pairs())
        writer.live.upsert(DocumentIn.model_validate(_doc("f2", "quokka marsupial diet")), wait=True)
        assert follower.search("quokka marsupial diet", 1)[0].document_id == "f2"  # from the log again
    finally:
        writer.close()
        follower.close()
