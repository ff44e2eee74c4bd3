"""Commands that make or change an index: build, init, ingest, compact."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from cli.flags import WHERE, add_settings
from engine.store.index_dir import ADAPT_DIR, FUSION_DIR, MANIFEST_FILE
from serving.settings import Settings

if TYPE_CHECKING:
    from index_build.adapt.generated import QueryWriter

console = Console()
ADAPT_HELP = {
    "llm_url": "OpenAI-compatible chat server, e.g. http://127.0.0.1:8080/v1: --adapt asks it for a question each of"
    " --adapt-generated chunks answers, as more pseudo-queries (asked once first, so a wrong URL fails at once;"
    " none: not even HYBRID_SEARCH_LLM_URL's)",
    "llm_model": 'model name sent to that server (default "default")',
}
ADAPT_SETTINGS = ["adapt", "adapt_queries", "adapt_generated", "adapt_min_gain", "llm_url", "llm_model", "llm_api_key"]
BUILD_HELP = {
    "fusion": "auto: train the learned fusion when there are train judgments; rrf: train none",
    "max_length": "with --distil-from: the student's tokens per pair (default 96)",
    "ray": "encode the corpus across a Ray cluster's workers (GPUs when present); the same index as a local build",
    **ADAPT_HELP,
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "build",
        help="build an index from a BEIR dataset or a folder of your files",
        description="Build the BM25, dense and document indexes of --data: a BEIR dataset (a folder with"
        " corpus.jsonl; its train judgments also build the judgment memory and the learned fusion) or any"
        " folder of files, read recursively: .pdf, .md, .txt, .html, .docx, and the .jsonl / DOCUMENT_INGESTION"
        " .json that `ingest` takes. Files are split into sentence-aligned chunks (page / section kept, the"
        " document's type and stated date as metadata); a file that cannot be read is skipped, named with why,"
        " and adds nothing. Without judgments the index serves BM25 + dense fused by RRF (and a reranker if"
        " you give one), and --adapt (fast, the default) fits a corpus graph on pseudo-queries made from the"
        " documents, served only when it beats RRF on those it held out; judgments can come later:"
        " train-fusion, train-reranker.",
        epilog="examples:\n  hybrid-search build --data ../shared/datasets/nfcorpus --index-dir indexes/nfcorpus\n"
        "  hybrid-search build --data ~/docs --index-dir indexes/docs --chunk-words 150\n"
        "  hybrid-search build --data big/ --index-dir indexes/big --vectors big/vectors.npy"
        "   # made elsewhere; stopped? run it again: it resumes\n"
        "  hybrid-search init --index-dir indexes/empty          # nothing yet: ingest or POST /documents later",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--distil-from",
        metavar="DIR",
        help="then distil this trained reranker into the index's CPU student (3 layers, 96 tokens; its time:"
        " docs/cpu-reranking.md); DIR must not be <index-dir>/reranker",
    )
    p.add_argument(
        "--distil-steps", type=int, default=300, help="with --distil-from: the student's training steps (default 300)"
    )
    add_settings(
        p,
        [
            *WHERE,
            "encode_batch_size",
            *Settings.part_fields("build"),
            *ADAPT_SETTINGS,
            "bm25_k1",
            "bm25_b",
            "fusion",
            "max_length",
            "ray",
            "ray_address",
        ],
        BUILD_HELP,
    )
    p.set_defaults(run=build)

    p = sub.add_parser(
        "init",
        help="make an empty index to ingest into or serve",
        description="An empty index (no documents, no judgments) in --index-dir: add documents with `ingest` or"
        " POST /documents while `serve` runs. Refuses a folder that already holds an index.",
    )
    add_settings(p, [*WHERE, "encoder"])
    p.set_defaults(run=init)

    p = sub.add_parser(
        "ingest",
        help="add files to an index: BEIR .jsonl, DOCUMENT_INGESTION .json, .txt, .md, .pdf, .html, .docx",
        description="Add documents to an index (an empty one is made first where there is none), durably"
        " (write-ahead log, then a checkpoint). A document id sent again replaces that document whole. Text,"
        " Markdown, PDF, HTML and DOCX files are split into"
        " sentence-aligned chunks (page / section kept). A file with any error adds nothing and is reported;"
        " the others go in. While `serve` runs on the index, send documents to it (POST /documents) instead.",
        epilog="examples:\n  hybrid-search ingest notes/*.md report.pdf --index-dir indexes/nfcorpus\n"
        "  hybrid-search ingest extra-corpus.jsonl --chunk-words 120",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="files to add")
    add_settings(p, [*WHERE, "encode_batch_size", "chunk_words", "chunk_overlap_words"])
    p.set_defaults(run=ingest)

    p = sub.add_parser(
        "adapt",
        help="learn from an index's documents without judgments (again, after ingest)",
        description="What `build` does by default on a corpus without judgments (--adapt fast), on an index that"
        " exists: pseudo-queries from the chunks' headings, first and inner sentences are taken out of their chunks"
        " in a held-out copy of the corpus; a corpus graph (each chunk's nearest chunks lend it their fused"
        " scores) is fitted on half of them and checked against RRF on the other half; it is served only when it"
        " beats RRF there. The report and the decision go to <index-dir>/adapt/adapt.json; /health shows the"
        " stages served. Run it after `ingest` grew the index (new chunks have no neighbours until then); an index"
        " with live writes not yet checkpointed needs `compact` first. With --llm-url, a chat server also writes"
        " a question for each of --adapt-generated chunks (InPars-style pseudo-queries, closer to what users type).",
        epilog="examples:\n  hybrid-search adapt --index-dir indexes/docs\n"
        "  hybrid-search adapt --index-dir indexes/docs --adapt-queries 1200\n"
        "  hybrid-search adapt --index-dir indexes/docs --llm-url http://127.0.0.1:8080/v1 --llm-model qwen2.5-7b",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings(p, [*WHERE, "encode_batch_size", *ADAPT_SETTINGS, "bm25_k1", "bm25_b"], ADAPT_HELP)
    p.set_defaults(run=adapt)

    p = sub.add_parser(
        "compact",
        help="apply and checkpoint logged writes (empties the write-ahead log)",
        description="Replay the write-ahead log into Lucene, FAISS and SQLite, commit each, and empty the log;"
        " the dense writes since the base are merged into a new base (a server's own checkpoints write only"
        " them, and merge once they change 5% of it). Needed before read-only tools (search, evaluate,"
        " bench) open an index that took live writes; `serve` checkpoints on a clean stop.",
    )
    add_settings(p, WHERE)
    p.set_defaults(run=compact)


def build(settings: Settings, args: argparse.Namespace) -> int:
    return build_from(settings, args.distil_from, args.distil_steps)


def build_from(settings: Settings, distil_from: str | None = None, distil_steps: int = 300) -> int:
    """``build`` as its settings say (``serve --build-if-missing`` builds through it too); then, with
    ``distil_from``, the CPU student distilled from that reranker."""
    from index_build.builder import build_index
    from index_build.corpus import open_corpus

    started = time.perf_counter()
    ray = None
    if settings.scale_out.ray:
        from cli.serve import ray_app

        ray_app()  # Ray installed, or a clear error before any work
        ray = settings.scale_out.ray_address or "local"
    engine, b = settings.engine, settings.build
    corpus = open_corpus(b.data_dir, b.chunk_words, b.chunk_overlap_words)
    for name, why in corpus.skipped:
        print(f"hybrid-search: skipped {name}: {why}", file=sys.stderr)
    judged = corpus.dataset is not None and corpus.dataset.training_split() is not None  # no adaptation then
    writer = None if judged else _query_writer(settings)
    manifest = build_index(engine, b, corpus, ray=ray, questions=writer, release=True)  # its documents: the build's
    fusion = "learned fusion" if (Path(engine.index_dir) / FUSION_DIR).is_dir() else "RRF"
    read = f"{corpus.files} files, {len(corpus.skipped)} skipped; " if corpus.dataset is None else ""
    console.print(
        f"built [bold]{engine.index_dir}[/]: {read}{manifest.documents} documents"
        f" ({manifest.settings['chunks']:,} chunks),"
        f" encoder {manifest.encoder} ({manifest.dimension}-d, {manifest.dense_index}), {fusion},"
        f" {time.perf_counter() - started:.0f} s"
    )
    _print_adaptation(Path(engine.index_dir))
    if distil_from:
        from engine.settings import RERANK_MAX_LENGTH
        from index_build.train_reranker import student_options, train
        from offline.dataset import load_dataset

        card = train(
            engine.model_copy(update={"max_length": engine.max_length or RERANK_MAX_LENGTH}),
            student_options(distil_from, distil_steps),
            load_dataset(b.data_dir),
        )
        console.print(
            f"student reranker in {engine.index_dir}/reranker: {card['layers']} layers, dev nDCG@10"
            f" {card['dev_reranked']['nDCG@10']:.4f} (fused {card['dev_fused']['nDCG@10']:.4f})"
        )
    return 0


def _query_writer(settings: Settings) -> QueryWriter | None:
    """The chat server --llm-url names, asked once now (a clear error before any long work), or None."""
    from index_build.adapt.generated import LLMServer, QueryWriter

    a = settings.agents
    if not a.llm_url or settings.build.adapt == "none":
        return None
    console.print(f"asking {a.llm_url} ({a.llm_model}) for questions about the documents (--llm-url)")
    writer = QueryWriter(LLMServer(a.llm_url, a.llm_model, a.llm_api_key))
    writer.probe()
    return writer


def _print_adaptation(index_dir: Path) -> None:
    from engine.fusion.graph import read_card
    from index_build.adapt import summary

    card = read_card(index_dir / ADAPT_DIR)
    if card is not None:
        console.print(f"adapted without judgments ({index_dir / ADAPT_DIR}):\n{summary(card)}", highlight=False)


def adapt(settings: Settings, args: argparse.Namespace) -> int:
    """Adapt an index in place (one built with --adapt none, or grown by ingest since its build)."""
    from index_build.adapt import adapt_index

    started = time.perf_counter()
    adapt_index(settings.engine, settings.build, writer=_query_writer(settings))
    console.print(f"adapted [bold]{settings.engine.index_dir}[/] in {time.perf_counter() - started:.0f} s")
    _print_adaptation(Path(settings.engine.index_dir))
    console.print("a server already running on it serves the new stage after a restart")
    return 0


def init(settings: Settings, args: argparse.Namespace) -> int:
    """An empty index to ingest into or serve (POST /documents); never over an existing one."""
    from index_build.builder import build_index
    from index_build.corpus import empty_corpus

    index_dir = settings.engine.index_dir
    if (Path(index_dir) / MANIFEST_FILE).is_file():
        raise ValueError(f"{index_dir} already holds an index; `ingest` adds to it, `build` replaces it")
    manifest = build_index(settings.engine, settings.build, empty_corpus(), progress=False)
    console.print(
        f"made an empty index in [bold]{index_dir}[/] (encoder {manifest.encoder}): add documents with"
        f" `hybrid-search ingest FILES --index-dir {index_dir}` or POST /documents while it serves"
    )
    return 0


def ingest(settings: Settings, args: argparse.Namespace) -> int:
    """Read and validate each file whole, then log its documents; one bad file adds nothing. A
    folder that holds no index yet gets an empty one first."""
    from engine.search import HybridEngine
    from index_build.ingest import IngestError, read_documents
    from offline.progress import track

    b = settings.build
    if not Path(settings.engine.index_dir).exists():
        init(settings, args)
    engine = HybridEngine(settings.engine.model_copy(update={"rerank": False}), writable=True)
    added = chunks = failed = 0
    started = time.perf_counter()
    try:
        for path in track(args.paths, "ingesting", "file"):
            try:
                documents = read_documents(path, b.chunk_words, b.chunk_overlap_words)
            except IngestError as exc:
                print(f"hybrid-search: skipped {exc}", file=sys.stderr)
                failed += 1
                continue
            for document in documents:
                chunks += engine.live.upsert(document)["chunks"]
            added += len(documents)
        engine.live.refresh()
    finally:
        engine.close()
    seconds = time.perf_counter() - started
    skipped = f"; {failed} file{'s' * (failed > 1)} skipped (see above)" if failed else ""
    print(f"added {added} documents ({chunks} chunks) to {settings.engine.index_dir} in {seconds:.1f} s{skipped}")
    return 1 if failed else 0


def compact(settings: Settings, args: argparse.Namespace) -> int:
    """Apply and checkpoint every logged write, so the log is empty and readers can open the index;
    the dense writes are merged into a new base. A sharded index's shards, each."""
    from engine.search import HybridEngine
    from engine.store.index_dir import read_manifest, shard_dir

    top = Path(settings.engine.index_dir)
    shards = read_manifest(top).shards
    for folder in [shard_dir(top, i) for i in range(shards)] if shards else [top]:
        engine = HybridEngine(settings.engine.model_copy(update={"rerank": False, "index_dir": folder}), writable=True)
        recovered = engine.live.recovery
        if fields := engine.store.index_fields():
            print(f"indexed the metadata of {fields:,} chunks for equality filters (a store written before they were)")
        result = engine.live.checkpoint(merge=True)
        engine.close()
        print(
            f"checkpointed {folder} at write {result['seq']}: replayed {recovered['records']}"
            f" logged writes, emptied {result['log_bytes']:,} bytes of log"
            f"{', merged the dense writes into a new base' if result['dense_merged'] else ''}"
            f" in {result['seconds']:.2f} s"
        )
    return 0
