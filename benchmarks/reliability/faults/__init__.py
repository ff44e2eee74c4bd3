"""Faults, measured: damaged index files, a full disk, kill -9 and SIGTERM while the server works,
kill -9 of either worker of ``serve --workers 2`` under load, a reranker and an LLM server that
fail. Everything runs on copies of an index (never the index itself) and reports what a client
would see: refused or not and why, writes acknowledged and lost, requests answered while the
server stops.

    python -m benchmarks.reliability.faults --index-dir indexes/nfcorpus --rounds 20 \\
        --out benchmarks/results/reliability-faults.json
    python -m benchmarks.reliability.faults --faults workers      # one part; the file keeps the others

The scenarios, by name, are :data:`~benchmarks.reliability.faults.scenarios.SCENARIOS`, each in a
module of its family (``corruptions``, ``writes``, ``sigterm``, ``degraded``, ``workers``), on the
load of ``drivers`` and the copies and ledger of ``harness``; what each returns is typed in
``results``. ``tests/test_faults.py`` runs the same functions on the tests' tiny index, with fewer
rounds.
"""

from benchmarks.reliability.faults.scenarios import SCENARIOS, Run, run_faults

__all__ = ["SCENARIOS", "Run", "run_faults"]
