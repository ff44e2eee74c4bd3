"""``hybrid-search``: build, search, evaluate, train and serve from one entry point.

Each command lives with what it does (:mod:`cli.index`, :mod:`cli.train`, :mod:`cli.measure`,
:mod:`cli.query`, :mod:`cli.serve`) and registers its own parser there; the settings' flags are
generated from the settings (:mod:`cli.flags`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pydantic import ValidationError

from cli import index, measure, query, serve, snapshot, train
from cli.flags import setting_problems, settings_from
from engine import threads
from engine.rerank.cross_encoder import RerankerError
from engine.store.index_dir import IndexDirError
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
  hybrid-search snapshot restore indexes/nfcorpus.snapshots/20261128T101500Z-0 --index-dir indexes/restored

Every setting flag also reads HYBRID_SEARCH_<SETTING> (e.g. HYBRID_SEARCH_RERANK_DEPTH=50) and a TOML
file named by --config or HYBRID_SEARCH_CONFIG (rerank_depth = 50, at the top or under its part's
table, e.g. [engine]); flags win over both. docs/configuration.md lists every setting."""


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
    for commands in (index, query, measure, train, serve, snapshot):
        commands.register(sub)
    return parser


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
    if getattr(args, "answers_queries", False):
        threads.for_queries()
    try:
        return args.run(settings_from(args), args)
    except ValidationError as exc:
        return _fail(f"invalid settings: {setting_problems(exc)}")
    except (DatasetError, IndexDirError, RerankerError, ValueError, RuntimeError, FileNotFoundError) as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        return 130


def _fail(message: str) -> int:
    print(f"hybrid-search: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
