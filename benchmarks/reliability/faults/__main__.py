"""``python -m benchmarks.reliability.faults``: the scenarios ``--faults`` names, on copies of
``--index-dir`` in a temporary folder; their figures replace theirs in ``--out`` (the others kept)."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.reliability import faults
from benchmarks.reliability.faults.scenarios import SCENARIOS, run_faults
from offline.records import write_result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(faults.__doc__ or "").split("\n\n")[0])
    parser.add_argument("--index-dir", type=Path, default=Path("indexes/nfcorpus"))
    parser.add_argument("--rounds", type=int, default=20, help="kill -9 rounds")
    parser.add_argument("--reranker", help="reranker folder for the reranker fault (default: the index's own)")
    parser.add_argument("--faults", default=",".join(SCENARIOS), help="which faults, comma-separated (default: all)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/reliability-faults.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="faults-") as tmp:
        figures = run_faults(args.index_dir.resolve(), Path(tmp), args.rounds, args.reranker, args.faults.split(","))
    write_result(args.out, figures, vars(args), update=True)  # faults not run keep their last figures
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
