"""The whole engine at a million chunks, built and measured as a user would: ``python -m
benchmarks.scale --engine --distractors 1000000``.

The corpus is NFCorpus plus N distractor passages made from its own abstracts: each takes a random
abstract, keeps its sentences in a shuffled order and drops a fifth of its words, so it shares the
source's vocabulary (BM25 finds it) without being judged (it can only push judged documents down).
Its vector is the source's vector plus Gaussian noise (sigma 0.03 a dimension, cosine ~0.85 to the
source) and renormalised: near its source in the dense space, as a paraphrase would be, without
encoding a million texts on a CPU. Every tenth distractor is a ``review`` (its record's
``metadata.document_type``), the others ``abstract``: a filter on reviews matches ~10% of the
chunks. The real abstracts keep the vectors the index of ``--index-dir`` holds. The build takes
them with ``--vectors``; then the dev table (``evaluate --split dev``, no reranker) and
one-query-at-a-time latency in process, unfiltered and filtered to the reviews.

Families (``--family``): ``copies`` takes any abstract, the judged ones too, so a dev query's
relevant document competes with its own copies, which are judged irrelevant; ``unjudged`` takes
only the abstracts no dev query judges, so no distractor copies an answer and the figures measure
finding answers among look-alikes of other answers; ``unjudged-titled`` keeps the source's title
too. Every distractor records its source (``metadata.source``: the abstract's id), which
:func:`sources` reads back so a run can be scored source-collapsed, and a ``year`` (1925-2024,
uniform, from its own random stream: ``year >= 2015`` holds ~10% of the chunks, ``year >= 2024``
~1%), the numeric field a range filter takes at size.
"""

from __future__ import annotations

import json
import random
import re
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from offline.dataset import load_dataset

ROOT = Path(__file__).resolve().parents[1]
NOISE_SIGMA = 0.03
CORPUS_VERSION = 3  # 2: metadata.document_type; 3: metadata.source and year, families
FAMILIES = ("copies", "unjudged", "unjudged-titled")
YEARS = (1925, 2025)


Block = Callable[[int, int], tuple[np.ndarray, list[dict]]]  # (start, size) -> vectors, records


def make_corpus(data: Path, index_dir: Path, n: int, out: Path, family: str = "copies") -> Path:
    """``out``: NFCorpus and ``n`` distractors of ``family`` (module doc), each a shuffled,
    shortened copy of one abstract (:func:`corpus_beside`)."""
    if family not in FAMILIES:
        raise SystemExit(f"--family {family!r}: one of {', '.join(FAMILIES)}")

    def copies(records: list[dict], known: np.ndarray) -> Block:  # called only when the corpus is made
        rng, shuffle, years = np.random.default_rng(0), random.Random(0), np.random.default_rng(1)
        pool = np.arange(len(records))
        if family != "copies":
            judged = {doc for docs in load_dataset(data).qrels("dev").values() for doc in docs}
            pool = np.asarray([i for i, r in enumerate(records) if r["_id"] not in judged])
        sentences = [re.split(r"(?<=[.!?])\s+", r["text"]) for r in records]

        def block(start: int, size: int) -> tuple[np.ndarray, list[dict]]:
            sources = pool[rng.integers(0, len(pool), size)]
            year = years.integers(*YEARS, size)
            made = []
            for i, source in enumerate(sources):
                parts = list(sentences[source])
                shuffle.shuffle(parts)
                words = [w for w in " ".join(parts).split() if shuffle.random() > 0.2]
                kind = "review" if (start + i) % 10 == 0 else "abstract"
                title = records[source]["title"] if family == "unjudged-titled" else ""
                metadata = {"document_type": kind, "source": records[source]["_id"], "year": int(year[i])}
                made.append({"_id": f"X{start + i}", "title": title, "text": " ".join(words), "metadata": metadata})
            return known[sources] + rng.normal(0, NOISE_SIGMA, (size, known.shape[1])).astype(np.float32), made

        return block

    return corpus_beside(data, index_dir, n, out, [CORPUS_VERSION, family], copies)


def sources(corpus: Path) -> dict[str, str]:
    """Each distractor's source document, read off ``corpus.jsonl`` (records without one are absent)."""
    found = {}
    with open(corpus / "corpus.jsonl") as fh:
        for line in fh:
            if '"source"' in line:
                record = json.loads(line)
                source = record.get("metadata", {}).get("source")
                if isinstance(source, str):
                    found[record["_id"]] = source
    return found


def corpus_beside(
    data: Path, index_dir: Path, n: int, out: Path, version: object, passages: Callable[[list[dict], np.ndarray], Block]
) -> Path:
    """``out``: a BEIR folder (NFCorpus's queries and judgments, its corpus and ``n`` passages) and
    ``vectors.npy`` in the corpus's order, the abstracts' vectors the ones ``index_dir`` holds.
    ``passages(records, vectors)`` makes the passages a block at a time, their vectors before
    normalising. Made once per size and ``version``."""
    import faiss

    marker = out / "made.json"
    if (out / "vectors.npy").is_file() and marker.is_file() and json.loads(marker.read_text()) == version:
        return out
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(data / "queries.jsonl", out / "queries.jsonl")
    shutil.copytree(data / "qrels", out / "qrels", dirs_exist_ok=True)
    records = [json.loads(line) for line in (data / "corpus.jsonl").open()]
    index = faiss.read_index(str(index_dir / "dense.faiss"))
    base = faiss.downcast_index(index.index)
    known = np.zeros((base.ntotal, base.d), dtype=np.float32)
    known[faiss.vector_to_array(index.id_map)] = base.reconstruct_n(0, base.ntotal)
    vectors = np.lib.format.open_memmap(
        out / "vectors.npy", mode="w+", dtype=np.float32, shape=(len(records) + n, base.d)
    )
    vectors[: len(records)] = known  # BEIR's corpus order is the store's row order
    block = passages(records, known)
    with open(out / "corpus.jsonl", "w") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")
        for start in range(0, n, 100_000):
            size = min(100_000, n - start)
            noisy, made = block(start, size)
            at = len(records) + start
            vectors[at : at + size] = noisy / np.linalg.norm(noisy, axis=1, keepdims=True)
            for record in made:
                fh.write(json.dumps(record) + "\n")
    vectors.flush()
    marker.write_text(json.dumps(version))
    return out


def run(
    data: Path, index_dir: Path, n: int, work: Path, out: Path, resume_check: bool = False, family: str = "copies"
) -> dict:
    """Build, evaluate and time; the figures as a dict (written by the caller). ``resume_check``: a
    second build killed at half the first's time and run again, its dev rankings set beside."""

    started = time.perf_counter()
    name = str(n) if family == "copies" else f"{family}-{n}"
    corpus = make_corpus(data, index_dir, n, work / f"corpus-{name}", family)
    made = time.perf_counter() - started
    target = work / f"index-{name}"
    shutil.rmtree(target, ignore_errors=True)
    cli = [sys.executable, "-m", "cli.main"]
    build = cli + ["build", "--data", str(corpus), "--index-dir", str(target), "--vectors", str(corpus / "vectors.npy")]
    started = time.perf_counter()
    subprocess.run(build, cwd=ROOT, check=True)
    build_s = time.perf_counter() - started
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB on Linux
    manifest = json.loads((target / "manifest.json").read_text())
    evaluation = out / f"eval-dev-{name}"
    evaluate = cli + ["evaluate", "--split", "dev", "--data", str(corpus), "--no-rerank"]
    subprocess.run(evaluate + ["--index-dir", str(target), "--output", str(evaluation)], cwd=ROOT, check=True)
    resumed = resumed_build(build, target, build_s, evaluate, evaluation) if resume_check else None
    timed = time_in_process(data, target)
    return {
        "chunks": manifest["settings"]["chunks"],
        "distractors": n,
        "family": family,
        "corpus_seconds": round(made, 1),
        "build_seconds": round(build_s, 1),
        "build_peak_rss_gib": round(peak_gib, 2),
        "dense": manifest["settings"]["dense"],
        "index_bytes": sum(p.stat().st_size for p in target.rglob("*") if p.is_file()),
        **timed,
        "evaluation": str(evaluation),
        **({"killed_at_half": resumed} if resumed else {}),
    }


def time_in_process(data: Path, target: Path) -> dict:
    """200 dev queries one at a time in process, no reranker, after the served warm-up: unfiltered,
    filtered to the reviews (~10% of the chunks, a term Lucene holds) and by a range on the
    distractors' ``year`` (``gte`` 2015: ~10%; 2024: ~1%; a corpus before version 3 has none), in
    turn query by query; each filter's first search apart (its chunks found, then kept)."""
    from engine.documents import Filters, SearchFilters
    from engine.search import HybridEngine
    from engine.settings import EngineSettings
    from offline.latency import percentiles

    engine = HybridEngine(EngineSettings(index_dir=target, rerank=False))
    engine.warm_up(engine.settings.warmup_searches)
    queries = list(load_dataset(data).split_queries("dev").values())[:200]
    for query in queries[:20]:
        engine.search(query, 10)
    asked = {
        "unfiltered": None,
        "reviews": Filters(document_types=["review"]),
        "year >= 2015": SearchFilters.model_validate({"year": {"gte": 2015}}),
        "year >= 2024": SearchFilters.model_validate({"year": {"gte": 2024}}),
    }
    chunks = engine.store.count()
    found = {name: {} for name in asked}
    for name, filters in list(asked.items())[1:]:
        began = time.perf_counter()
        engine.search(queries[0], 10, filters)
        found[name]["first"] = round((time.perf_counter() - began) * 1000, 1)
        found[name]["share_of_chunks"] = round(len(engine.index.allowed(filters)) / chunks, 4)
    times = {name: [] for name in asked}
    for turn, query in enumerate(queries):
        names = list(asked)[turn % len(asked) :] + list(asked)[: turn % len(asked)]
        for name in names:
            began = time.perf_counter()
            engine.search(query, 10, asked[name])
            times[name].append(time.perf_counter() - began)
    engine.close()
    return {"search_ms_one_at_a_time": {name: found[name] | percentiles(times[name]) for name in asked}}


def resumed_build(build: list[str], target: Path, build_s: float, evaluate: list[str], evaluation: Path) -> dict:
    """The same build into a second folder, killed with SIGKILL at half ``build_s`` and run again:
    the two runs' wall time against ``build_s``, and whether every stage's dev ranking is the
    uninterrupted build's (``evaluation`` holds its run files)."""
    import os
    import signal

    other = target.with_name(f"{target.name}-resumed")
    shutil.rmtree(other, ignore_errors=True)
    command = [other if part == str(target) else part for part in build]
    command = [str(part) for part in command]
    started = time.perf_counter()
    with open(other.with_name(f"{other.name}.log"), "w") as log:
        first = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        time.sleep(build_s / 2)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    killed_s = time.perf_counter() - started
    work = other.with_name(f".{other.name}.building")
    state = json.loads((work / "build.json").read_text()) if (work / "build.json").is_file() else {}
    started = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True)
    again_s = time.perf_counter() - started
    second = evaluation.with_name(f"{evaluation.name}-resumed")
    subprocess.run(evaluate + ["--index-dir", str(other), "--output", str(second)], cwd=ROOT, check=True)
    runs = sorted(p.name for p in evaluation.glob("run.*.trec"))
    same = {name: (evaluation / name).read_bytes() == (second / name).read_bytes() for name in runs}
    shutil.rmtree(other)
    return {
        "killed_after_s": round(killed_s, 1),
        "phases_done_when_killed": state.get("done", []),
        "parts_with_vectors_when_killed": len(state.get("vectors", [])),
        "resumed_s": round(again_s, 1),
        "total_over_uninterrupted": round((killed_s + again_s) / build_s, 3),
        "dev_rankings_identical": same,
    }
