"""Learned fusion: a LambdaMART ranker over what every retriever said about each candidate.

RRF weighs every retriever's ranks with one fixed curve. A ranker trained on the corpus's train
judgments (LightGBM LambdaMART) also sees each retriever's raw score, how many retrievers agree
and the query's length, so it learns where each retriever is to be trusted. It reorders the RRF
candidates and never adds one, so recall is RRF's. ``index_build.train_fusion`` trains it; the
same :func:`fusion_features` serve both sides, so training and serving cannot drift apart.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from engine.fusion.calibration import Calibration

MODEL_FILE = "model.txt"
CARD_FILE = "card.json"
RETRIEVERS = ("bm25", "dense", "memory")
FEATURES = (
    "bm25_rank",
    "bm25_score",
    "dense_rank",
    "dense_score",
    "memory_rank",
    "memory_vote",
    "rrf_rank",
    "rrf_score",
    "retrievers",
    "query_terms",
)
ABSENT_RANK = 1000  # a retriever that did not return the document: below any real rank

Ranking = Sequence[tuple[str, float]]


class FusionModelError(RuntimeError):
    """A learned-fusion folder that cannot be loaded or does not fit this engine."""


def fusion_features(query: str, found: Mapping[str, Ranking], fused: Ranking) -> np.ndarray:
    """One row of :data:`FEATURES` per fused candidate, in ``fused`` order.

    ``found`` maps each name in :data:`RETRIEVERS` to that retriever's ranking (an empty one when
    the index has no judgment memory). Built a column at a time: one dictionary lookup a candidate
    and retriever, the rest in numpy (a query's ~250 candidates, every search)."""
    ids = [doc_id for doc_id, _ in fused]
    features = np.empty((len(ids), len(FEATURES)), dtype=np.float64)
    for column, name in enumerate(RETRIEVERS):
        lookup = {d: (r, s) for r, (d, s) in enumerate(found.get(name, ()), 1)}
        features[:, 2 * column : 2 * column + 2] = [lookup.get(d, (ABSENT_RANK, 0.0)) for d in ids] or np.empty((0, 2))
    features[:, 6] = np.arange(1, len(ids) + 1)
    features[:, 7] = [score for _, score in fused]
    features[:, 8] = (features[:, 0 : 2 * len(RETRIEVERS) : 2] != ABSENT_RANK).sum(axis=1)
    features[:, 9] = len(query.split())
    return features


class LearnedFusion:
    """A trained fusion model folder (``model.txt``: LightGBM's text format, ``card.json``)."""

    def __init__(self, folder: str | Path) -> None:
        import lightgbm

        path = Path(folder) / MODEL_FILE
        if not path.is_file():
            raise FusionModelError(f"{folder}: no {MODEL_FILE}; train one with `hybrid-search train-fusion`")
        try:
            self.booster = lightgbm.Booster(model_file=str(path))
        except lightgbm.basic.LightGBMError as exc:
            raise FusionModelError(f"{path}: not a LightGBM model ({exc}); retrain it") from None
        if tuple(self.booster.feature_name()) != FEATURES:
            raise FusionModelError(f"{path}: trained on features {self.booster.feature_name()}, not {FEATURES}")
        card = Path(folder) / CARD_FILE
        self.card: dict = json.loads(card.read_text()) if card.is_file() else {}
        self.calibration = Calibration.load(folder)

    def rank(self, query: str, found: Mapping[str, Ranking], fused: Ranking) -> list[tuple[str, float]]:
        """``fused`` reordered by the model, each candidate with its predicted score; ties keep RRF order."""
        if not fused:
            return []
        predicted = self.booster.predict(fusion_features(query, found, fused), num_threads=1)
        order = np.argsort(-predicted, kind="stable")
        return [(fused[i][0], float(predicted[i])) for i in order]

    def describe(self) -> str:
        params = self.card.get("params", {})
        return f"LambdaMART, {params.get('n_estimators', '?')} trees of {params.get('num_leaves', '?')} leaves"
