"""A search's read of its fused head's chunks, before and after the store's chunk cache
(engine/store/chunk_cache.py), in turn in one process: 50 heads of 100 chunks drawn from the index's
first 1,500 (queries' heads overlap), five rounds.

    python -m benchmarks.chunk_reads [--index-dir indexes/nfcorpus]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from engine.store import docstore
from engine.store.index_dir import DOCS_FILE
from offline.records import write_result


def uncached(store: docstore.DocStore, unit_ids: list[str]) -> dict:
    """The store's read until 2b68145: one join a query, each chunk's JSON parsed again."""
    found = {}
    for start in range(0, len(unit_ids), 500):
        part = unit_ids[start : start + 500]
        query = docstore._CHUNK_SELECT + f" WHERE c.unit_id IN ({','.join('?' * len(part))})"
        found.update((c.unit_id, c) for c in map(docstore._chunk, store._conn().execute(query, part)))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index-dir", type=Path, default=Path("indexes/nfcorpus"))
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/cpu-2core/chunk-reads.json"))
    args = parser.parse_args()
    store = docstore.DocStore(args.index_dir / DOCS_FILE)
    units = [c.unit_id for c in store.sample(1500)]
    random.seed(0)
    heads = [random.sample(units, min(100, len(units))) for _ in range(50)]
    for head in heads:  # the cache as a serving process's, warm
        store.chunks(head)
    ways = {"before": lambda head: uncached(store, head), "after": store.chunks}
    took: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(5):
        for name, read in ways.items():
            for head in heads:
                began = time.perf_counter()
                read(head)
                took[name].append(time.perf_counter() - began)
    report = {name: {"ms_p50": round(statistics.median(t) * 1000, 3)} for name, t in took.items()}
    report["heads"], report["head_size"] = len(heads), len(heads[0])
    print(report)
    write_result(args.output, report)


if __name__ == "__main__":
    main()
