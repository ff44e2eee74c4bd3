"""Train the learned fusion on a corpus's train judgments and save it into the index directory.

Each training query runs through the engine as a new query would, left out of the judgment memory
(otherwise the memory hands it its own labels and the model learns to trust the memory blindly);
every RRF candidate becomes a row of :func:`engine.fusion.learned.feature_names` (the engine's
retrievers) labelled with its grade.
LightGBM LambdaMART, deterministic: the same index and judgments give the same model. 15 leaves and
200 trees were chosen on dev (``benchmarks/results/learned-fusion-dev.json``; docs/experiments.md,
"Retired benchmarks").
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from engine.fusion.calibration import Calibration
from engine.fusion.learned import CARD_FILE, MODEL_FILE, LearnedFusion, feature_names, fusion_features
from engine.search import HybridEngine, SearchOptions
from engine.settings import EngineSettings
from engine.store.index_dir import FUSION_DIR, Manifest
from offline.dataset import Dataset
from offline.evaluation import evaluate_run, stage_runs
from offline.progress import track

log = logging.getLogger(__name__)
LEAVES, TREES, LEARNING_RATE = 15, 200, 0.05
EVAL_SPLIT = "dev"
FIRST_STAGE = {"bm25_depth", "dense_depth", "memory_depth", "rrf_k", "bm25_weight", "dense_weight", "memory_weight"}


def training_split(manifest: Manifest, dataset: Dataset) -> str | None:
    """The judgments the index's memory learned from, else train.graded or train when present."""
    return manifest.memory.get("split") or dataset.training_split()


def collect(
    engine: HybridEngine,
    dataset: Dataset,
    qrels: Mapping[str, Mapping[str, int]],
    query_ids: list[str],
    progress: bool = True,
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Feature rows, grades and per-query group sizes for ``query_ids``, each left out of the memory."""
    rows, grades, groups = [], [], []
    for qid in track(query_ids, "fusion features", "query", enabled=progress):
        text = dataset.queries[qid]
        result = engine.stages(text, top_k=1, exclude=qid)
        rows.append(fusion_features(text, result.retrieved, result.rrf, list(result.retrieved)))
        grades += [max(0, qrels[qid].get(d, 0)) for d, _ in result.rrf]
        groups.append(len(result.rrf))
    return np.vstack(rows), np.asarray(grades), groups


def fit(
    features: np.ndarray,
    grades: np.ndarray,
    groups: list[int],
    names: Sequence[str],
    leaves: int = LEAVES,
    trees: int = TREES,
    seed: int = 0,
):
    """LambdaMART with exponential gains (2^grade - 1) up to the highest grade seen."""
    import lightgbm

    model = lightgbm.LGBMRanker(
        objective="lambdarank",
        n_estimators=trees,
        num_leaves=leaves,
        learning_rate=LEARNING_RATE,
        label_gain=[2**g - 1 for g in range(int(grades.max()) + 1)],
        random_state=seed,
        deterministic=True,
        force_row_wise=True,
        n_jobs=os.cpu_count() or 1,
        verbose=-1,
    )
    return model.fit(features, grades, group=groups, feature_name=list(names))


def calibrate(
    features: np.ndarray, grades: np.ndarray, groups: list[int], names: Sequence[str], seed: int = 0
) -> Calibration:
    """Fit the score calibration on out-of-fold scores: two models, each scoring the half of the
    queries it did not learn from, so the probabilities are those of a new query."""
    starts = np.cumsum([0, *groups])
    halves = [list(range(0, len(groups), 2)), list(range(1, len(groups), 2))]
    scores = np.empty(len(grades))
    ranks = np.empty(len(grades))
    for learn, held in (halves, halves[::-1]):
        rows = np.concatenate([np.arange(starts[q], starts[q + 1]) for q in learn])
        model = fit(features[rows], grades[rows], [groups[q] for q in learn], names, seed=seed)
        for q in held:
            part = slice(starts[q], starts[q + 1])
            scores[part] = model.booster_.predict(features[part])
            ranks[part] = np.argsort(np.argsort(-scores[part], kind="stable"), kind="stable") + 1
    fitted_on = f"out-of-fold fusion scores of {len(groups)} training queries (2 folds)"
    return Calibration.fit(scores, ranks, grades > 0, fitted_on)


def train_fusion(
    settings: EngineSettings,
    dataset: Dataset,
    queries: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Train on the training judgments, save ``<index_dir>/fusion`` (atomically) and return its card,
    which compares the model with RRF on dev when the corpus has dev judgments."""
    started = time.perf_counter()
    engine = HybridEngine(settings.model_copy(update={"rerank": False, "fusion": "rrf"}))
    split = training_split(engine.manifest, dataset)
    if split is None:
        raise ValueError(f"{dataset.root}: no qrels/train*.tsv, so there is nothing to learn a fusion from")
    qrels = dataset.qrels(split)
    query_ids = sorted(q for q, docs in qrels.items() if q in dataset.queries and any(g > 0 for g in docs.values()))
    if queries:
        query_ids = random.Random(seed).sample(query_ids, min(queries, len(query_ids)))
    if not query_ids:
        raise ValueError(f"{split}: no query with a positive judgment to learn a fusion from")
    features, grades, groups = collect(engine, dataset, qrels, query_ids, progress)
    names = feature_names(list(engine.retrievers()))
    model = fit(features, grades, groups, names, seed=seed)
    calibration = calibrate(features, grades, groups, names, seed)
    target = Path(settings.index_dir) / FUSION_DIR
    work = Path(tempfile.mkdtemp(prefix=f".{FUSION_DIR}-", dir=settings.index_dir))
    try:
        model.booster_.save_model(str(work / MODEL_FILE))
        calibration.save(work)
        card = {
            "model": "LightGBM LambdaMART over the RRF candidates",
            "features": list(names),
            "params": {"num_leaves": LEAVES, "n_estimators": TREES, "learning_rate": LEARNING_RATE, "seed": seed},
            "first_stage": settings.model_dump(include=FIRST_STAGE),
            "data": str(Path(dataset.root).resolve()),
            "train_split": split,
            "train_queries": len(query_ids),
            "seconds": round(time.perf_counter() - started, 1),
            **_compare_on_dev(engine, LearnedFusion(work), dataset, progress),
        }
        (work / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        work.rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("learned fusion: %d %s queries in %.0f s", len(query_ids), split, card["seconds"])
    return card


def _compare_on_dev(engine: HybridEngine, fusion: LearnedFusion, dataset: Dataset, progress: bool) -> dict:
    """Dev metrics of RRF and of the new model, for the card; nothing is chosen on them here."""
    if EVAL_SPLIT not in dataset.splits():
        return {}
    queries = dataset.split_queries(EVAL_SPLIT)
    runs = stage_runs(engine, queries, progress=progress, options=SearchOptions(fusion=fusion))
    qrels = dataset.qrels(EVAL_SPLIT)
    return {
        "eval_split": EVAL_SPLIT,
        "dev_rrf": evaluate_run(qrels, runs["rrf"]),
        "dev_learned": evaluate_run(qrels, runs["learned"]),
    }
