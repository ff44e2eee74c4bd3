"""An index from a folder of a user's files (PDF, HTML, DOCX, Markdown, text written here by real
libraries), or from nothing, served without judgments."""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from engine.documents import Filters
from engine.search import HybridEngine
from engine.settings import EngineSettings
from index_build.builder import build_index
from index_build.corpus import read_folder
from index_build.settings import BuildSettings

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "cli.main"]


def write_pdf(path: Path, pages: list[str], created: datetime | None = None) -> None:
    from fpdf import FPDF

    pdf = FPDF()
    for text in pages:
        pdf.add_page()
        pdf.set_font("Helvetica", size=12)
        pdf.multi_cell(0, 8, text)
    if created:
        pdf.set_creation_date(created)
    pdf.output(str(path))


def write_docx(path: Path, heading: str, paragraphs: list[str], created: datetime) -> None:
    import docx

    document = docx.Document()
    document.add_heading(heading, 1)
    for text in paragraphs:
        document.add_paragraph(text)
    document.core_properties.created = created
    document.save(str(path))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("files")
    (root / "guides").mkdir()
    write_pdf(
        root / "report.pdf",
        [
            "Quarterly sales of fortified cereals rose in the northern region.",
            "Vitamin D supplements reduced falls among elderly participants in the trial.",
        ],
        datetime(2021, 1, 2, tzinfo=UTC),
    )
    write_docx(
        root / "guides" / "statins.docx",
        "Statins",
        ["Statins lower cholesterol and were studied for breast cancer survival."],
        datetime(2022, 3, 4),
    )
    (root / "guides" / "rice.html").write_text(
        "<html><head><meta name='date' content='2023-02-10'><script>var tracking = 1;</script></head><body>"
        "<nav>Home | About</nav><h1>Arsenic</h1><p>Brown rice can hold more arsenic than white rice.</p>"
        "<h2>Children</h2><p>Infant rice cereal deserves attention from parents.</p></body></html>"
    )
    (root / "notes.md").write_text(
        "---\ndate: 2024-05-01\n---\n# Soy\nSoy foods in moderation are safe for most adults.\n"
    )
    (root / "guides" / "notes.md").write_text("Broccoli sprouts hold sulforaphane.\n")  # same name, other folder
    (root / "broken.pdf").write_bytes(b"%PDF-1.4 this is not really a pdf")
    (root / "binary.txt").write_bytes(b"\x00\x01\x02 not text")
    (root / "empty.md").write_text("")
    (root / "photo.xyz").write_bytes(b"??")
    (root / ".hidden.md").write_text("never read")
    return root


@pytest.fixture(scope="module")
def files_index(folder, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("idx") / "files"
    build_index(EngineSettings(index_dir=target, device="cpu"), BuildSettings(data_dir=folder), progress=False)
    return target


def test_a_folder_reads_every_format_and_names_what_it_skipped(folder):
    corpus = read_folder(folder, progress=False)
    assert {d["document_id"] for d in corpus.documents} == {
        "report.pdf",
        "guides/statins.docx",
        "guides/rice.html",
        "notes.md",
        "guides/notes.md",
    }
    skipped = dict(corpus.skipped)
    assert set(skipped) == {"broken.pdf", "binary.txt", "empty.md", "photo.xyz"}
    assert "PDF" in skipped["broken.pdf"] and "binary" in skipped["binary.txt"]
    assert "no text" in skipped["empty.md"] and "unknown file type" in skipped["photo.xyz"]
    docs = {d["document_id"]: d for d in corpus.documents}
    assert docs["report.pdf"]["metadata"] == {"document_type": "pdf", "date": "2021-01-02"}
    assert [c["metadata"]["page"] for c in docs["report.pdf"]["chunks"]] == [1, 2]
    assert docs["guides/statins.docx"]["metadata"] == {"document_type": "docx", "date": "2022-03-04"}
    assert docs["guides/rice.html"]["metadata"]["date"] == "2023-02-10"
    html = " ".join(c["content"] for c in docs["guides/rice.html"]["chunks"])
    assert "tracking" not in html and "Home" not in html  # scripts and navigation left out
    assert [c["metadata"].get("section") for c in docs["guides/rice.html"]["chunks"]] == ["Arsenic", "Children"]
    assert docs["notes.md"]["metadata"] == {"document_type": "markdown", "date": "2024-05-01"}


def test_search_finds_the_file_and_page_and_filters_by_type_and_date(files_index):
    engine = HybridEngine(EngineSettings(index_dir=files_index, device="cpu"))
    top = engine.search("do vitamin D supplements prevent falls in the elderly?", 3)
    assert top[0].document_id == "report.pdf" and top[0].metadata["page"] == 2
    recent = Filters(date_range=("2022-01-01", None))
    assert {h.document_id for h in engine.search("rice arsenic statins soy", 10, recent)} <= {
        "guides/statins.docx",
        "guides/rice.html",
        "notes.md",
    }
    only_html = engine.search("arsenic", 5, Filters(document_types=["html"]))
    assert only_html and all(h.document_id == "guides/rice.html" for h in only_html)


def test_without_judgments_rrf_serves_and_similarity_falls_down_the_list(files_index, reranker_dir):
    engine = HybridEngine(EngineSettings(index_dir=files_index, device="cpu"))
    described = engine.describe()
    assert described["stages"] == ["bm25", "dense", "fusion"] and described["fusion"] == "rrf"
    assert "not a probability" in described["similarity_score"]
    scores = [h.similarity_score for h in engine.search("rice cereal for children", 6)]
    assert all(0 <= s <= 1 for s in scores) and scores == sorted(scores, reverse=True)
    reranked = HybridEngine(EngineSettings(index_dir=files_index, device="cpu", reranker=reranker_dir))
    assert reranked.describe()["stages"][-1] == "rerank"
    assert len(reranked.search("statins and cholesterol", 3)) == 3


def test_init_then_ingest_then_search_from_the_command_line(folder, tmp_path, capsys):
    """The commands through ``main`` in this process (a subprocess each cost an interpreter, torch and
    a JVM started again: 5 of them, most of this test's time)."""
    from types import SimpleNamespace

    from cli.main import main

    index = tmp_path / "mine"

    def run(*args: str) -> SimpleNamespace:
        code = main(list(args))
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)

    made = run("init", "--index-dir", str(index), "--device", "cpu")
    assert made.returncode == 0 and (index / "manifest.json").is_file(), made.stderr
    empty = run("search", "anything", "--index-dir", str(index), "--json", "--device", "cpu")
    assert empty.returncode == 0 and json.loads(empty.stdout) == []
    again = run("init", "--index-dir", str(index))
    assert again.returncode == 2 and "already holds an index" in again.stderr
    added = run("ingest", str(folder / "report.pdf"), str(folder / "broken.pdf"), "--index-dir", str(index))
    assert added.returncode == 1 and "broken.pdf" in added.stderr and "added 1 documents (2 chunks)" in added.stdout
    found = run("search", "vitamin D and falls", "--index-dir", str(index), "--json", "--top-k", "1", "--device", "cpu")
    assert json.loads(found.stdout)[0]["metadata"]["page"] == 2


def test_a_folder_of_unreadable_files_builds_nothing(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.pdf").write_bytes(b"not a pdf")
    with pytest.raises(ValueError, match="no file could be read"):
        build_index(
            EngineSettings(index_dir=tmp_path / "idx", device="cpu"),
            BuildSettings(data_dir=tmp_path / "data"),
            progress=False,
        )
    assert not (tmp_path / "idx").exists()


def test_a_rag_turn_over_the_files_cites_the_right_file_and_page(files_index, tmp_path):
    import httpx

    from offline.server_process import free_port, serve_args, start_server, stop_server

    port = free_port()
    server = start_server(serve_args(files_index, port), f"http://127.0.0.1:{port}/health", tmp_path / "serve.log")
    try:
        health = httpx.get(f"http://127.0.0.1:{port}/health").json()
        assert health["stages"] == ["bm25", "dense", "fusion"] and "not a probability" in health["similarity_score"]
        question = {"question": "Do vitamin D supplements prevent falls in the elderly?", "top_k": 3}
        turn = httpx.post(f"http://127.0.0.1:{port}/v1/rag", json=question, timeout=60).json()
        retrieved = turn["messages"][1]["payload"]["retrieved_chunks"]
        answer = turn["messages"][3]["payload"]
        assert answer["source_documents"][0] == "report.pdf"
        first = next(c for c in retrieved if c["source_document"] == "report.pdf")
        assert first["metadata"]["page"] == 2 and "falls" in first["content"]
        asyncio.run(_read_through_mcp(f"http://127.0.0.1:{port}/mcp"))
    finally:
        assert stop_server(server) == 0


async def _read_through_mcp(url: str) -> None:
    """A file in a subfolder has a path for its id: its resource URI percent-encodes it, and reads back."""
    from mcp import Client

    async with Client(url) as client:
        found = await client.call_tool("search", {"query": "broccoli sprouts sulforaphane", "top_k": 1})
        hit = found.structured_content["results"][0]
        assert hit["document_id"] == "guides/notes.md" and hit["resource_uri"] == "document://guides%2Fnotes.md"
        read = await client.read_resource(hit["resource_uri"])
        assert json.loads(read.contents[0].text)["document_id"] == "guides/notes.md"


def test_judgments_can_come_later_for_an_index_built_from_files(files_index, tmp_path):
    """Queries judged against document ids and chunk ids train a learned fusion on the files' index."""
    import shutil

    from index_build.corpus import index_dataset
    from index_build.train_fusion import train_fusion
    from offline.dataset import DatasetError

    index = tmp_path / "index"
    shutil.copytree(files_index, index)
    judged = tmp_path / "judgments"
    (judged / "qrels").mkdir(parents=True)
    asks = {
        "report.pdf#c2": ["vitamin D and falls", "supplements for elderly falls", "do falls drop with vitamin D"],
        "guides/rice.html": ["arsenic in rice", "is brown rice safe", "rice cereal for infants"],
        "guides/statins.docx": ["statins and cholesterol", "statins breast cancer", "cholesterol drugs"],
        "notes.md": ["is soy safe", "soy foods for adults", "plant estrogens in soy"],
    }
    queries = [
        (f"q{i}-{j}", text, target) for i, (target, texts) in enumerate(asks.items()) for j, text in enumerate(texts)
    ]
    (judged / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t, _ in queries))
    (judged / "qrels" / "train.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{target}\t1\n" for q, _, target in queries)
    )
    dataset = index_dataset(index, judged)
    assert set(dataset.qrels("train")["q1-0"]) == {
        "guides/rice.html#c1",
        "guides/rice.html#c2",
    }  # a document: its chunks
    assert set(dataset.qrels("train")["q0-0"]) == {"report.pdf#c2"}
    card = train_fusion(EngineSettings(index_dir=index, device="cpu"), dataset, progress=False)
    assert card["train_queries"] == len(queries)
    assert HybridEngine(EngineSettings(index_dir=index, device="cpu")).describe()["fusion"].startswith("learned")

    (judged / "qrels" / "train.tsv").write_text("q0-0\tnot-in-the-index.pdf\t1\n")
    with pytest.raises(DatasetError, match="unknown document id 'not-in-the-index.pdf'"):
        index_dataset(index, judged)
