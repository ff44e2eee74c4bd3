"""Building from a user's files: chunks per second from a folder of mixed files, and through the live
ingest path, beside the encoder's FLOP limit on this CPU.

The files are made here from NFCorpus abstracts, by the libraries a user's tools would use: a PDF
(fpdf2) of two pages, Markdown, HTML and DOCX (python-docx), in turn. The build reads every file
(``read_folder``), then encodes and indexes the chunks; the live path upserts the same documents
into an empty index one by one (what ``ingest`` and POST /documents do) and refreshes.

    python -m benchmarks.files_build --files 2000 --live 200
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks import options
from engine.settings import EngineSettings
from engine.text import chunk_text

GFLOP_PER_CHUNK_256 = 5.4  # MiniLM-L6 forward pass at 256 tokens (the figure)
FORMATS = ("pdf", "md", "html", "docx")


def make_files(dataset: Path, out: Path, count: int) -> dict[str, int]:
    """``count`` files, one NFCorpus abstract each, the formats in turn; returns files per format."""
    import docx
    from fpdf import FPDF

    from offline.dataset import load_dataset

    docs = list(load_dataset(dataset).corpus.values())[:count]
    made = dict.fromkeys(FORMATS, 0)
    for i, doc in enumerate(docs):
        kind = FORMATS[i % len(FORMATS)]
        path = out / kind / f"{doc.doc_id}.{kind}"
        path.parent.mkdir(parents=True, exist_ok=True)
        title = doc.title or doc.doc_id
        if kind == "md":
            path.write_text(f"# {title}\n\n{doc.text}\n")
        elif kind == "html":
            path.write_text(f"<html><body><h1>{title}</h1><p>{doc.text}</p></body></html>")
        elif kind == "docx":
            document = docx.Document()
            document.add_heading(title, 1)
            document.add_paragraph(doc.text)
            document.save(str(path))
        else:
            pdf = FPDF()
            half = len(doc.text) // 2
            for page in (f"{title}. {doc.text[:half]}", doc.text[half:]):
                pdf.add_page()
                pdf.set_font("Helvetica", size=11)
                pdf.multi_cell(0, 6, page.encode("latin-1", "replace").decode("latin-1"))
            pdf.output(str(path))
        made[kind] += 1
    return made


def _simd() -> str:
    flags = Path("/proc/cpuinfo").read_text()
    return "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "sse"


def measure(dataset: Path, files: int, live: int, work: Path) -> dict:
    from engine.retrieval.encoder import load_encoder
    from engine.search import HybridEngine
    from index_build.builder import build_index
    from index_build.corpus import empty_corpus, read_folder
    from index_build.settings import BuildSettings

    folder = work / "files"
    started = time.perf_counter()
    made = make_files(dataset, folder, files)
    make_s = time.perf_counter() - started

    started = time.perf_counter()
    corpus = read_folder(folder, progress=False)
    read_s = time.perf_counter() - started
    build = BuildSettings(data_dir=folder)
    started = time.perf_counter()
    build_index(EngineSettings(index_dir=work / "index", device="cpu"), build, corpus, progress=False)
    build_s = time.perf_counter() - started

    texts = [chunk_text(c["title"], c["content"]) for d in corpus.documents for c in d["chunks"]]
    encoder = load_encoder(build.encoder, "cpu")
    tokens = [min(len(encoder.tokenizer(t)["input_ids"]), encoder.max_seq_length) for t in texts]
    mean_tokens = sum(tokens) / len(tokens)

    live_settings = EngineSettings(index_dir=work / "live", device="cpu", rerank=False)
    build_index(live_settings, build, empty_corpus(), progress=False)
    engine = HybridEngine(live_settings, writable=True)
    from engine.documents import DocumentIn

    untitled = [
        {**d, "chunks": [{k: v for k, v in c.items() if k != "title"} for c in d["chunks"]]} for d in corpus.documents
    ]
    sample = [DocumentIn.model_validate(d) for d in untitled[:live]]
    started = time.perf_counter()
    live_chunks = sum(engine.live.upsert(d)["chunks"] for d in sample)
    engine.live.refresh()
    live_s = time.perf_counter() - started
    engine.close()

    chunks = len(texts)
    return {
        "simd": _simd(),  # the encoder's FLOP limit depends on it
        "files": made,
        "skipped": len(corpus.skipped),
        "make_files_s": round(make_s, 1),
        "documents": len(corpus.documents),
        "chunks": chunks,
        "mean_tokens_per_chunk": round(mean_tokens, 1),
        "read_files_s": round(read_s, 1),
        "files_per_s_reading": round(files / read_s, 1),
        "build_s_after_reading": round(build_s, 1),
        "chunks_per_s_build": round(chunks / (read_s + build_s), 1),
        "chunks_per_s_build_after_reading": round(chunks / build_s, 1),
        "encoder_gflop_per_chunk_at_mean_tokens": round(GFLOP_PER_CHUNK_256 * mean_tokens / 256, 2),
        "live_documents": len(sample),
        "live_chunks": live_chunks,
        "chunks_per_s_live_ingest": round(live_chunks / live_s, 1),
    }


def main() -> None:
    from offline.records import write_result

    p = options.parser(__doc__, "data_dir")
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--live", type=int, default=200, help="documents sent through the live ingest path")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu-2core/files-build.json"))
    args, _ = options.load(p)
    work = Path(tempfile.mkdtemp(prefix="files-build-"))
    try:
        report = measure(args.data_dir, args.files, args.live, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_result(args.out, report, vars(args))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
