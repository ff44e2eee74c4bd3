"""``hybrid-search``: build, search, evaluate, train and serve from one entry point."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pydantic import ValidationError

from engine import threads
from engine.config import Settings
from engine.documents import problems
from engine.rerank.cross_encoder import RerankerError
from engine.store.index_dir import IndexDirError
from index_build.train_reranker import LOSSES
from offline.dataset import DatasetError

log = logging.getLogger("hybrid_search")

EPILOG = """examples:
  hybrid-search build --data ../shared/datasets/nfcorpus --index-dir indexes/nfcorpus
  hybrid-search search "does vitamin D prevent falls?" --top-k 5
  hybrid-search evaluate --split dev
  hybrid-search train-reranker
  hybrid-search train-fusion
  hybrid-search serve --index-dir indexes/nfcorpus
  hybrid-search ingest notes.md leaflet.pdf --index-dir indexes/nfcorpus
  hybrid-search search "soy safety" --filters '{"document_types": ["guideline"]}'

Every option also reads HYBRID_SEARCH_<OPTION> (e.g. HYBRID_SEARCH_RERANK_DEPTH=50) and a TOML
file named by --config or HYBRID_SEARCH_CONFIG; flags win over both."""

TRAIN_EPILOG = """examples:
  hybrid-search train-reranker                     # GPU: one pass over every training query
  hybrid-search train-reranker --max-steps 420 --lr 2e-4 --freeze-layers 2 --max-length 128 \\
      --eval-every 140                            # bounded CPU run: ~36 minutes on 2 cores
  hybrid-search train-reranker --distil-from teacher/ --student-layers 3 --max-length 96 \\
      --max-steps 300 --lr 2e-4 --eval-every 100  # the CPU student: ~35 minutes on 2 cores"""


def _paths(p: argparse.ArgumentParser, data: bool = False) -> None:
    p.add_argument("--index-dir", type=Path, help="index directory (default indexes/nfcorpus)")
    if data:
        p.add_argument(
            "--data", dest="data_dir", type=Path, help="BEIR dataset folder (default ../shared/datasets/nfcorpus)"
        )


def _judgments_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--judgments",
        type=Path,
        metavar="DIR",
        help="for an index built from files: DIR/queries.jsonl and DIR/qrels/train.tsv (dev.tsv to choose"
        " checkpoints), judging the index's document ids (notes.md) or chunk ids (notes.md#c2)",
    )


def _device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="where models run (default auto: CUDA if present)")


def _search_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("retrieval, fusion and reranking")
    g.add_argument("--bm25-depth", type=int, help="BM25 candidates to fuse (default 100)")
    g.add_argument("--dense-depth", type=int, help="dense candidates to fuse (default 100)")
    g.add_argument("--rrf-k", type=float, help="RRF constant k (default 10)")
    g.add_argument("--bm25-weight", type=float, help="BM25 weight in RRF (default 1.0)")
    g.add_argument("--dense-weight", type=float, help="dense weight in RRF (default 1.0)")
    g.add_argument(
        "--query-encoder-runtime",
        choices=["auto", "torch", "onnx"],
        help="what encodes a query: auto = ONNX Runtime on CPU (same embeddings, 3-4x faster), torch on CUDA",
    )
    g.add_argument("--memory-weight", type=float, help="judgment-memory weight in RRF (default 1.5)")
    g.add_argument(
        "--no-memory", dest="memory", action="store_false", default=None, help="leave the judgment memory out"
    )
    g.add_argument(
        "--fusion",
        choices=["auto", "learned", "rrf"],
        help="auto = the index's learned fusion when it has one, else RRF (default); rrf = RRF only",
    )
    g.add_argument("--reranker", help="CrossEncoder id or folder (default <index-dir>/reranker when present)")
    g.add_argument("--rerank-depth", type=int, help="fused candidates to rerank (default 100 on CUDA, 20 on CPU)")
    g.add_argument(
        "--rerank-blend",
        type=float,
        help="reranker's share against the fused scores, 0-1 (default 0.5; 1 = reranker alone)",
    )
    g.add_argument(
        "--max-length",
        type=int,
        help="cross-encoder tokens per pair (default: what the reranker was trained with, at most 96 on a CPU)",
    )
    g.add_argument(
        "--rerank-runtime", choices=["auto", "torch", "onnx"], help="auto = ONNX Runtime on CPU, torch fp16 on CUDA"
    )
    g.add_argument(
        "--rerank-quantize",
        choices=["auto", "none", "int8"],
        help="int8: ONNX Runtime's int8 model, 1.2-1.5x the pairs per second on a CPU for ~0.001 nDCG@10;"
        " auto (default): int8 for a distilled CPU student on a CPU, else none",
    )
    g.add_argument(
        "--rerank-cache-size", type=int, help="scores of repeated (query, document) pairs kept (default 20000; 0 = off)"
    )
    g.add_argument(
        "--rerank-batch-wait-ms", type=float, help="CUDA only: wait to share rerank batches (default 3; 0 = off)"
    )
    g.add_argument("--no-rerank", dest="rerank", action="store_false", default=None, help="serve fused results")
    _device(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybrid-search",
        description="Hybrid BM25 + dense retrieval with learned (or reciprocal rank) fusion and cross-encoder"
        " reranking.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, help="TOML file with settings (keys as the option names, _ for -)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "build",
        help="build an index from a BEIR dataset or a folder of your files",
        description="Build the BM25, dense and document indexes of --data: a BEIR dataset (a folder with"
        " corpus.jsonl; its train judgments also build the judgment memory and the learned fusion) or any"
        " folder of files, read recursively: .pdf, .md, .txt, .html, .docx, and the .jsonl / DOCUMENT_INGESTION"
        " .json that `ingest` takes. Files are split into sentence-aligned chunks (page / section kept, the"
        " document's type and stated date as metadata); a file that cannot be read is skipped, named with why,"
        " and adds nothing. Without judgments the index serves BM25 + dense fused by RRF (and a reranker if"
        " you give one); judgments can come later: train-fusion, train-reranker.",
        epilog="examples:\n  hybrid-search build --data ../shared/datasets/nfcorpus --index-dir indexes/nfcorpus\n"
        "  hybrid-search build --data ~/docs --index-dir indexes/docs --chunk-words 150\n"
        "  hybrid-search init --index-dir indexes/empty          # nothing yet: ingest or POST /documents later",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _paths(p)
    p.add_argument(
        "--data",
        dest="data_dir",
        type=Path,
        help="BEIR dataset or folder of files (default ../shared/datasets/nfcorpus)",
    )
    p.add_argument("--chunk-words", type=int, help="words per chunk when a file is split (default 200)")
    p.add_argument("--chunk-overlap-words", type=int, help="words neighbouring chunks share (default 40)")
    p.add_argument("--encoder", help="sentence-transformers id or folder (default all-MiniLM-L6-v2, offline copy)")
    p.add_argument("--dense-index", choices=["flat", "hnsw"], help="flat: exact (default); hnsw: for >1M docs")
    p.add_argument("--memory-split", help="train judgments for the judgment memory (default auto; none = skip)")
    p.add_argument(
        "--fusion", choices=["auto", "rrf"], help="auto: train the learned fusion when there are train judgments"
    )
    p.add_argument(
        "--distil-from",
        metavar="DIR",
        help="then distil this trained reranker into the index's CPU student (3 layers, 96 tokens; ~35 min on"
        " 2 cores); DIR must not be <index-dir>/reranker",
    )
    p.add_argument("--max-length", type=int, help="with --distil-from: the student's tokens per pair (default 96)")
    p.add_argument(
        "--distil-steps", type=int, default=300, help="with --distil-from: the student's training steps (default 300)"
    )
    p.add_argument(
        "--ray",
        action="store_true",
        help="encode the corpus across a Ray cluster's workers (GPUs when present); the same index as a local build",
    )
    p.add_argument(
        "--address", dest="ray_address", metavar="HOST:PORT", help="with --ray: the cluster to join (default: local)"
    )
    _device(p)

    p = sub.add_parser("search", help="search the index and print a table of hits")
    p.add_argument("query", help="the question, in plain words")
    p.add_argument("--top-k", type=int, default=5, help="hits to show, 1-100 (default 5)")
    p.add_argument(
        "--filters",
        help='JSON filters, e.g. \'{"document_types": ["guideline"], "date_range": ["2020-01-01", null]}\'',
    )
    p.add_argument("--filter", action="append", metavar="KEY=VALUE", help="metadata equality (repeatable)")
    p.add_argument(
        "--similarity-threshold",
        type=float,
        help="drop hits whose similarity_score (probability of relevance, 0-1) is below this",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _paths(p)
    _search_options(p)

    p = sub.add_parser("evaluate", help="quality of every stage on a split's judgments, or of a running agent")
    _paths(p, data=True)
    p.add_argument("--split", default="dev", help="judgments to score against (default dev)")
    p.add_argument("--num-queries", type=int, help="sample N judged queries (default: all; 100 with --agent-url)")
    p.add_argument("--seed", type=int, default=42, help="sampling seed, as the evaluator's (default 42)")
    p.add_argument(
        "--output", type=Path, help="folder for run files and summary (default <index-dir>/reports/eval-<split>)"
    )
    g = p.add_argument_group("scoring a running A2A agent, as the benchmark's evaluator does")
    g.add_argument("--agent-url", help="A2A agent base URL, e.g. http://127.0.0.1:9010")
    g.add_argument("--top-k", type=int, default=5, help="documents asked for (default 5)")
    g.add_argument("--timeout", type=float, default=60.0, help="seconds per query (default 60)")
    _search_options(p)

    p = sub.add_parser(
        "train-reranker",
        help="fine-tune the project's cross-encoder on the train judgments",
        description="Fine-tune a cross-encoder on the corpus's train judgments (1 judged positive + hard negatives"
        " from our own retrievers per query, listwise loss); the checkpoint with the best dev nDCG@10 through"
        " the real pipeline is saved into <index-dir>/reranker with a model card, and the engine uses it.",
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _paths(p, data=True)
    _judgments_option(p)
    p.add_argument(
        "--base", help="model to start from (default: the teacher when distilling, else the offline all-MiniLM-L6-v2)"
    )
    p.add_argument("--split", default=None, help="training judgments (default train.graded if present, else train)")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default: one pass over the queries)")
    p.add_argument("--queries", type=int, default=None, help="sample this many training queries")
    p.add_argument("--batch-queries", type=int, default=8, help="queries per step (default 8)")
    p.add_argument("--group-size", type=int, default=8, help="1 positive + N-1 hard negatives per query (default 8)")
    p.add_argument(
        "--mine-depth",
        type=int,
        default=100,
        help="positives and negatives come from each query's RRF top N (default 100; trained slightly better"
        " than 30 on dev)",
    )
    p.add_argument("--lr", type=float, default=3e-5, help="learning rate (default 3e-5)")
    p.add_argument("--eval-every", type=int, default=None, help="steps between dev checkpoints (default: 4 per run)")
    p.add_argument("--eval-queries", type=int, default=None, help="dev queries per checkpoint (default all)")
    p.add_argument(
        "--freeze-layers", type=int, default=0, help="keep the embeddings and the first N layers fixed (CPU runs: 2)"
    )
    p.add_argument("--seed", type=int, default=13)
    p.add_argument(
        "--loss",
        choices=list(LOSSES),
        default="listwise",
        help="listwise: softmax over each query's group (default); pairwise: logistic loss on the"
        " positive's margin over each negative; pointwise: binary cross-entropy per pair",
    )
    p.add_argument(
        "--max-length", type=int, help="tokens per pair (default 256; CPU runs: 128), saved with the model for serving"
    )
    p.add_argument(
        "--memory-context",
        type=int,
        default=5,
        metavar="N",
        help="prefix each document with the N training queries nearest the query that cited it (the judgment"
        " memory's, the query itself left out), so the model learns which of them ask the same thing;"
        " serving does the same (default 5: on dev far better than plain documents; 0: plain documents)",
    )
    g = p.add_argument_group("distillation: a smaller student that learns a trained reranker's scores")
    g.add_argument(
        "--distil-from",
        metavar="DIR",
        help="the teacher: a trained reranker folder (not <index-dir>/reranker, which the student replaces)",
    )
    g.add_argument(
        "--student-layers",
        type=int,
        metavar="N",
        help="keep N of the base's transformer layers, evenly spaced (default: all)",
    )
    g.add_argument(
        "--distil-weight",
        type=float,
        default=0.75,
        help="share of the loss that follows the teacher (KL over each group); the rest follows the judgments"
        " (default 0.75)",
    )
    _device(p)

    p = sub.add_parser(
        "train-fusion",
        help="(re)train the learned fusion of an existing index (`build` already trains one)",
        description="Train a LightGBM LambdaMART fusion over every retriever's ranks and scores on the train"
        " judgments (each training query left out of the judgment memory) and save it into <index-dir>/fusion;"
        " the card compares it with RRF on dev. About 3 minutes on NFCorpus on 2 CPU cores.",
    )
    _paths(p, data=True)
    _judgments_option(p)
    p.add_argument("--queries", type=int, help="sample this many training queries (default all)")
    p.add_argument("--seed", type=int, default=0)
    _device(p)

    p = sub.add_parser("serve", help="serve MCP + REST (port 8000) and the A2A agent (port 9010)")
    _paths(p, data=True)
    p.add_argument("--build-if-missing", action="store_true", help="build the index from --data first if absent")
    p.add_argument("--host", help="interface to bind (default 127.0.0.1; 0.0.0.0 in containers)")
    p.add_argument("--mcp-port", type=int, help="MCP + REST port (default 8000)")
    p.add_argument("--a2a-port", type=int, help="A2A agent port (default 9010)")
    p.add_argument(
        "--no-mcp", action="store_true", help="no MCP endpoint (/mcp): REST and /health still answer on --mcp-port"
    )
    p.add_argument("--no-a2a", action="store_true", help="serve only MCP + REST")
    p.add_argument("--mcp-url", help="A2A agent searches through this MCP server instead of in-process")
    p.add_argument("--public-url", help="A2A URL advertised in the agent card (default http(s)://HOST:PORT)")
    g = p.add_argument_group("TLS (every door: REST, MCP, /v1 and A2A)")
    g.add_argument("--tls-cert", type=Path, metavar="PEM", help="certificate (chain): serve HTTPS")
    g.add_argument("--tls-key", type=Path, metavar="PEM", help="its private key")
    g.add_argument("--tls-client-ca", type=Path, metavar="PEM", help="require client certificates signed by this CA")
    g = p.add_argument_group("OpenTelemetry (every door; spans with or without export)")
    g.add_argument("--otlp-endpoint", metavar="URL", help="export spans over OTLP/HTTP, e.g. http://127.0.0.1:4318")
    g.add_argument("--otlp-query-text", action="store_true", default=None, help="export query texts too (masked)")
    p.add_argument(
        "--query-timeout", dest="query_timeout_s", type=float, help="seconds before a query fails (default 30)"
    )
    p.add_argument(
        "--max-in-flight", type=int, help="requests doing engine work at once (default 4); more wait in a queue"
    )
    p.add_argument(
        "--max-queue",
        dest="max_queue_s",
        type=float,
        help="seconds a request may wait for a slot before 503 + Retry-After (default 2)",
    )
    p.add_argument("--read-only", action="store_true", help="refuse document writes (POST/DELETE /documents)")
    p.add_argument("--mcp-writes", action="store_true", default=None, help="offer MCP tools that add/delete documents")
    p.add_argument(
        "--refresh-interval", dest="refresh_interval_s", type=float, help="seconds until writes are searchable (1)"
    )
    p.add_argument("--max-body-bytes", type=int, help="largest HTTP request body (default 8 MiB; more gets 413)")
    p.add_argument("--agent-keys", type=Path, help="TOML of agent keys for /v1 (default: loopback clients only)")
    p.add_argument("--agent-rate", help="default messages an agent may send, e.g. 120/minute")
    p.add_argument("--key-all-doors", action="store_true", default=None, help="REST, MCP and A2A want an agent key too")
    p.add_argument("--trace-db", type=Path, help="SQLite file of message traces (default traces/traces.sqlite)")
    p.add_argument("--llm-url", help="OpenAI-compatible chat server for answers (default: extractive answers)")
    p.add_argument("--llm-model", help="model name for that server")
    p.add_argument(
        "--no-llm-fallback",
        dest="llm_fallback",
        action="store_false",
        default=None,
        help="when the LLM server fails, answer GENERATION_FAILED instead of an extractive answer",
    )
    _search_options(p)
    g = p.add_argument_group(
        "scale-out on Ray (pip install 'hybrid-search[ray]')",
        "One port (--mcp-port): MCP + REST at /, the A2A agent at /a2a/. Search replicas (doors and"
        " retrieval), a reranker deployment (a GPU each when the cluster has GPUs) that batches queries"
        " across replicas, and one writer the replicas follow (none with --read-only). The index"
        " directory must be at the same path on every node. Example: serve --ray --search-replicas 2-8",
    )
    g.add_argument("--ray", action="store_true", help="deploy on Ray Serve instead of in this process")
    g.add_argument(
        "--address", dest="ray_address", metavar="HOST:PORT", help="Ray cluster to join (default: start a local one)"
    )
    g.add_argument(
        "--search-replicas", dest="ray_search_replicas", metavar="N", help="N, or MIN-MAX to autoscale (default 1)"
    )
    g.add_argument("--reranker-replicas", dest="ray_reranker_replicas", metavar="N", help="N, or MIN-MAX (default 1)")
    g.add_argument(
        "--replica-cpus", dest="ray_replica_cpus", metavar="CPUS", type=float, help="CPUs (threads) a replica gets (1)"
    )
    g.add_argument("--ray-batch-size", metavar="N", type=int, help="queries scored in one reranker batch (8)")
    g.add_argument(
        "--ray-batch-wait-ms",
        metavar="MS",
        type=float,
        help="ms a reranker batch waits to fill (default: 3 on a GPU, 0 on a CPU)",
    )

    p = sub.add_parser(
        "init",
        help="make an empty index to ingest into or serve",
        description="An empty index (no documents, no judgments) in --index-dir: add documents with `ingest` or"
        " POST /documents while `serve` runs. Refuses a folder that already holds an index.",
    )
    _paths(p)
    p.add_argument("--encoder", help="sentence-transformers id or folder (default all-MiniLM-L6-v2, offline copy)")
    _device(p)

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
    _paths(p)
    p.add_argument("--chunk-words", type=int, help="words per chunk when a file is split (default 200)")
    p.add_argument("--chunk-overlap-words", type=int, help="words neighbouring chunks share (default 40)")
    _device(p)

    p = sub.add_parser(
        "compact",
        help="apply and checkpoint logged writes (empties the write-ahead log)",
        description="Replay the write-ahead log into Lucene, FAISS and SQLite, commit each, and empty the log."
        " Needed before read-only tools (search, evaluate, bench) open an index that took live writes;"
        " `serve` does it on a clean stop.",
    )
    _paths(p)
    _device(p)

    p = sub.add_parser("bench", help="latency per stage in-process, or end to end through a front door")
    _paths(p, data=True)
    p.add_argument("target", choices=["engine", "rest", "mcp", "a2a"], help="engine = in-process per stage")
    p.add_argument("--url", help="front door URL, e.g. http://127.0.0.1:8000/search_nfcorpus, .../mcp, or the A2A root")
    p.add_argument("--num-queries", type=int, default=50, help="dev queries to send (default 50)")
    p.add_argument(
        "--depths",
        help="rerank depths, engine only; 0 = none (default 0,10,20,50,100,200 on CUDA, 0,10,20,30 on CPU)",
    )
    p.add_argument("--concurrency", default="1,8", help="concurrent clients to sweep, e.g. 1,8,32,64,128 (default 1,8)")
    p.add_argument("--name", help="result file name (default: the target)")
    p.add_argument("--output", type=Path, help="results folder (default <index-dir>/reports/<machine>)")
    _search_options(p)

    p = sub.add_parser("schemas", help="JSON Schemas of the agent message protocol's messages")
    p.add_argument("--out", type=Path, help="folder to write <TYPE>.schema.json into (default: print)")

    p = sub.add_parser(
        "agent-key",
        help="make a key for an agent of the message protocol (prints the hashed entry for --agent-keys)",
        epilog="example:\n  hybrid-search agent-key IngestionAgent --types DOCUMENT_INGESTION >> agent-keys.toml\n"
        "  hybrid-search serve --agent-keys agent-keys.toml",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("agent_id", help="the agent the key speaks for (the messages' sender)")
    p.add_argument("--types", required=True, help="message types it may send, comma-separated")
    p.add_argument("--rate", help="its rate limit, e.g. 60/minute (default: --agent-rate)")

    p = sub.add_parser("mcp-stdio", help="serve the MCP tool over stdio, for hosts that launch tools")
    _paths(p)
    _search_options(p)
    return parser


_SETTING_KEYS = set(Settings.model_fields)


def settings_from(args: argparse.Namespace) -> Settings:
    overrides = {k: v for k, v in vars(args).items() if k in _SETTING_KEYS and v is not None}
    return Settings.load(args.config, **overrides)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("httpx", "sentence_transformers", "transformers", "faiss", "a2a", "mcp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.config and not args.config.is_file():
        return _fail(f"--config {args.config}: file not found")
    if args.command in threads.QUERY_COMMANDS:
        threads.for_queries()
    try:
        settings = settings_from(args)
        from serving import commands

        return getattr(commands, args.command.replace("-", "_"))(settings, args)
    except ValidationError as exc:
        return _fail(f"invalid settings: {problems(exc, 'settings')}")
    except (DatasetError, IndexDirError, RerankerError, ValueError, RuntimeError, FileNotFoundError) as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        return 130


def _fail(message: str) -> int:
    print(f"hybrid-search: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
