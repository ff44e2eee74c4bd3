"""The channel to the reranker process, before and after 2026-11-28, on this machine: bytes a call and
microseconds a call for one query's pairs, the model left out (the callee only reads the rows back).

    python -m benchmarks.channel [--pairs 100] [--window 128] [--calls 2000]

``before``: what a worker sent until then, a list of :class:`~engine.rerank.pair_tokens.PairRow` (two
int64 arrays a pair) with its lengths, on a new connection a call (and a new thread for it in the
callee). ``after``: :class:`~engine.rerank.token_rows.WireRows` (the query's tokens once, uint16 ids,
no type ids) on a connection kept between calls. The pairs are NFCorpus's: dev queries against
their BM25 head, as the reranker's tokenizer makes them."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from engine.rerank.pair_tokens import PairRow, PairTokenizer
from engine.rerank.token_rows import TokenRows, WireRows
from offline.dataset import load_dataset
from offline.records import write_result
from serving.worker_channel import Channel, ChannelClient, ChannelServer, call


def _pairs(data_dir: Path, queries: int, pairs: int, window: int) -> list[list[PairRow]]:
    from transformers import AutoTokenizer

    from engine.retrieval.encoder import DEFAULT_ENCODER, resolve_model

    dataset = load_dataset(data_dir)
    texts = [d.contents for _, d in zip(range(pairs), dataset.corpus.values())]
    tokenize = PairTokenizer(AutoTokenizer.from_pretrained(resolve_model(DEFAULT_ENCODER)), window)
    asked = list(dataset.split_queries("dev").values())[:queries]
    return [tokenize.rows([(q, t) for t in texts]) for q in asked]


def _read_back(rows) -> int:
    """What the callee does before the model: the rows as it scores them."""
    return len(rows.rows()) if isinstance(rows, WireRows) else len(TokenRows.of(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/datasets/nfcorpus"))
    parser.add_argument("--pairs", type=int, default=100)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/channel-cpu.json"))
    args = parser.parse_args()
    queries = _pairs(args.data, 20, args.pairs, args.window)
    report: dict = {"pairs": args.pairs, "window": args.window, "calls": args.calls}
    with tempfile.TemporaryDirectory() as folder:
        channel = Channel(Path(folder), b"k" * 32)
        server = ChannelServer(channel, "reranker", {"score": lambda rows, lengths: np.zeros(_read_back(rows))})
        kept = ChannelClient(channel, "reranker")
        ways = {
            "before": lambda rows: call(channel, "reranker", "score", rows, [500] * len(rows), timeout_s=10),
            "after": lambda rows: kept.call(
                "score", TokenRows.of(rows).wire(), np.full(len(rows), 500, np.int32), timeout_s=10
            ),
        }
        try:
            for send in ways.values():  # warm: the kept connection made, the callee's code run
                for rows in queries:
                    send(rows)
            took: dict[str, list[float]] = {name: [] for name in ways}
            for i in range(args.calls):  # the two ways in turn, so that the machine's load falls on both alike
                for name, send in ways.items():
                    began = time.perf_counter()
                    send(queries[i % len(queries)])
                    took[name].append(time.perf_counter() - began)
            for name, seconds in took.items():
                report[name] = {"us_p50": round(statistics.median(seconds) * 1e6), "us_mean": round(statistics.mean(seconds) * 1e6)}
                print(name, report[name], flush=True)
            sent = kept.stats()
            report["after"]["bytes_a_call"] = round((sent["bytes_sent"] + sent["bytes_received"]) / sent["calls"])
            import pickle

            rows = queries[0]
            report["before"]["bytes_a_call"] = len(pickle.dumps(("score", (rows, [500] * len(rows))), protocol=5)) + len(
                pickle.dumps(("ok", [0.0] * len(rows)), protocol=5)
            )
        finally:
            kept.close()
            server.close(5)
    print(report)
    write_result(args.output, report)


if __name__ == "__main__":
    main()
