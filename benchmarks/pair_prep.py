"""Making a query's reranker pairs: tokenizing their texts (``PairTokenizer``, all there was before
the index kept token ids) against making them from the ids (``PairAssembler``), for each dev query's
fused top 100 and top 20, at the served reranker's window. The two make the same model inputs,
checked here for every pair. Per path, p50 and p95 milliseconds a query over the dev queries:

- ``inputs``: the padded model inputs, in the batches the model takes, from what both paths start
  with (the passages' texts and chosen memory context; for ``ids`` their token ids);
- ``stage``: what the engine's ``pairs`` stage does (the passages' texts and memory context, and
  ``ids`` looked up, then the pairs made; the cache off), with tokenizing for ``text``.

    python -m benchmarks.pair_prep --index-dir /tmp/pairs/nfcorpus \\
        --reranker /work/shared/models/nfcorpus-reranker-cpu
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from engine import threads
from engine.rerank.cross_encoder import _batches
from engine.rerank.pair_tokens import pad_rows
from engine.search import HybridEngine, SearchOptions
from engine.search.stages import _passages
from engine.settings import EngineSettings
from engine.store.tokens import CHARS_PER_TOKEN
from index_build.settings import BuildSettings
from offline.dataset import load_dataset
from offline.latency import machine_name, percentiles
from offline.progress import track
from offline.records import RESULTS_DIR, write_result

DEPTHS = (100, 20)


def cpu_model() -> str:
    """``lscpu``'s model name."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _timed(engine: HybridEngine, query: str, ids: list[str], vector, chunks, flip: bool) -> tuple[dict, int]:
    """Seconds of each (part, path) for one query's ``ids``, run in turn (in the opposite order when
    ``flip``: neither path always runs first), and the pairs the ids left to the text path."""
    reranker = engine.reranker
    context, cut = reranker.memory_context, reranker.max_length * CHARS_PER_TOKEN
    texts, tokens = _passages(engine, query, ids, context, vector, None, chunks, engine.pair_inputs(reranker))
    batches = list(_batches([len(query) + min(len(text), cut) for text in texts], reranker.batch_size))

    def tokenized() -> list[dict]:
        return [reranker.tokenize([(query, texts[i][:cut]) for i in batch]) for batch in batches]

    def made() -> list[dict]:
        rows = reranker.assembler.rows(query, tokens)
        return [pad_rows([rows[i] for i in batch], reranker.tokenize.pad_id) for batch in batches]

    def stage_text() -> None:
        reranker.prepare(query, _passages(engine, query, ids, context, vector, None, chunks)[0])

    def stage_ids() -> None:
        inputs = engine.pair_inputs(reranker)
        reranker.prepare(query, *_passages(engine, query, ids, context, vector, None, chunks, inputs))

    runs = {("inputs", "text"): tokenized, ("inputs", "ids"): made, ("stage", "text"): stage_text}
    runs["stage", "ids"] = stage_ids
    seconds, out = {}, {}
    for key in list(runs)[:: -1 if flip else 1]:
        started = time.perf_counter()
        out[key] = runs[key]()
        seconds[key] = time.perf_counter() - started
    for theirs, ours in zip(out["inputs", "text"], out["inputs", "ids"], strict=True):
        assert all(np.array_equal(theirs[name], ours[name]) for name in theirs), query
    return seconds, sum(row is None for row in reranker.assembler.rows(query, tokens))


def measure(engine: HybridEngine, queries: list[str]) -> dict:
    samples = {(depth, part, path): [] for depth in DEPTHS for part in ("inputs", "stage") for path in ("text", "ids")}
    left = 0
    for i, query in enumerate(track(queries, "dev queries", "query")):
        result = engine.stages(query, top_k=1, options=SearchOptions(rerank_depth=0))
        head = [d for d, _ in result.fused[: max(DEPTHS)]]
        chunks = engine.store.chunks(head)
        for depth in DEPTHS:
            seconds, unmade = _timed(engine, query, head[:depth], result.query_vector, chunks, i % 2 == 1)
            left += unmade
            for (part, path), spent in seconds.items():
                samples[depth, part, path].append(spent)
    report: dict = {"pairs_left_to_text": left, "depths": {}}
    for depth in DEPTHS:
        report["depths"][depth] = {
            part: {path: percentiles(samples[depth, part, path]) for path in ("text", "ids")}
            for part in ("inputs", "stage")
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index-dir", type=Path, default=EngineSettings().index_dir)
    parser.add_argument("--reranker", default=None, help="default: the index's")
    parser.add_argument("--data", type=Path, default=BuildSettings().data_dir, help="BEIR dataset (its dev queries)")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/<machine>/pair-prep.json")
    args = parser.parse_args()
    threads.for_queries()  # as `serve` runs
    settings = EngineSettings(index_dir=args.index_dir, device="cpu", reranker=args.reranker, rerank_cache_size=0)
    engine = HybridEngine(settings)
    queries = list(load_dataset(args.data).split_queries("dev").values())
    reranker = engine.reranker
    report = {
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "queries": len(queries),
        "reranker": reranker.name,
        "max_length": reranker.max_length,
        "memory_context": reranker.memory_context,
        "ids_from": "store" if engine.pair_inputs(reranker).passages.stored else "tokens/ beside the index",
        **measure(engine, queries),
    }
    out = args.out or Path(RESULTS_DIR) / machine_name() / "pair-prep.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    print(write_result(out, report))
    for depth, parts in report["depths"].items():
        for part, paths in parts.items():
            text, ids = paths["text"]["p50"], paths["ids"]["p50"]
            print(f"depth {depth:3d} {part:6s}: text {text:6.2f} ms, ids {ids:6.2f} ms p50 ({text / ids:.1f}x)")


if __name__ == "__main__":
    main()
