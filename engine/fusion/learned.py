"""Learned fusion: a LambdaMART ranker over what every retriever said about each candidate.

RRF weighs every retriever's ranks with one fixed curve. A ranker trained on the corpus's train
judgments (LightGBM LambdaMART) also sees each retriever's raw score, how many retrievers agree
and the query's length, so it learns where each retriever is to be trusted. It reorders the RRF
candidates and never adds one, so recall is RRF's. ``index_build.train_fusion`` trains it; the
same :func:`fusion_features` serve both sides, so training and serving cannot drift apart; the
model's feature names say which retrievers it reads (the engine's registry when it was trained).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from engine.fusion.calibration import Calibration

MODEL_FILE = "model.txt"
CARD_FILE = "card.json"
# after each retriever's rank and score (in the order the model was trained on), what every row holds
SHARED = ("rrf_rank", "rrf_score", "retrievers", "query_terms")
ABSENT_RANK = 1000  # a retriever that did not return the document: below any real rank

Ranking = Sequence[tuple[str, float]]


class FusionModelError(RuntimeError):
    """A learned-fusion folder that cannot be loaded or does not fit this engine."""


def feature_names(retrievers: Sequence[str]) -> tuple[str, ...]:
    """The features of a model trained on ``retrievers``' rankings (the engine's registry, in order)."""
    return (*(f"{name}_{part}" for name in retrievers for part in ("rank", "score")), *SHARED)


def retrievers_of(features: Sequence[str]) -> tuple[str, ...]:
    """The retrievers a model's feature names read, in order: each ``<name>_rank`` followed by its
    score (``<name>_score``; a model trained before the registry calls the memory's ``memory_vote``).
    A FusionModelError says which names do not fit that shape."""
    pairs, shared = list(features[: -len(SHARED)]), tuple(features[-len(SHARED) :])
    names = tuple(rank.removesuffix("_rank") for rank in pairs[::2])
    fits = shared == SHARED and len(pairs) % 2 == 0 and all(
        rank == f"{name}_rank" and score.startswith(f"{name}_")
        for name, rank, score in zip(names, pairs[::2], pairs[1::2], strict=True)
    )
    if not fits:
        shape = f"each retriever's rank and score, then {list(SHARED)}"
        raise FusionModelError(f"features {list(features)} are not {shape}")
    return names


def fusion_features(query: str, found: Mapping[str, Ranking], fused: Ranking, retrievers: Sequence[str]) -> np.ndarray:
    """One row of :func:`feature_names` (``retrievers``) per fused candidate, in ``fused`` order.

    ``found`` maps a retriever's name to its ranking (one missing, or the index's absent memory,
    counts as empty). Built a column at a time: one dictionary lookup a candidate and retriever,
    the rest in numpy (a query's ~250 candidates, every search)."""
    ids = [doc_id for doc_id, _ in fused]
    width = 2 * len(retrievers)
    features = np.empty((len(ids), width + len(SHARED)), dtype=np.float64)
    for column, name in enumerate(retrievers):
        lookup = {d: (r, s) for r, (d, s) in enumerate(found.get(name, ()), 1)}
        features[:, 2 * column : 2 * column + 2] = [lookup.get(d, (ABSENT_RANK, 0.0)) for d in ids] or np.empty((0, 2))
    features[:, width] = np.arange(1, len(ids) + 1)
    features[:, width + 1] = [score for _, score in fused]
    features[:, width + 2] = (features[:, 0:width:2] != ABSENT_RANK).sum(axis=1)
    features[:, width + 3] = len(query.split())
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
        self.features = tuple(self.booster.feature_name())
        try:
            self.retrievers = retrievers_of(self.features)
        except FusionModelError as exc:
            raise FusionModelError(f"{path}: {exc}; retrain it") from None
        card = Path(folder) / CARD_FILE
        self.card: dict = json.loads(card.read_text()) if card.is_file() else {}
        self.calibration = Calibration.load(folder)

    def rank(self, query: str, found: Mapping[str, Ranking], fused: Ranking) -> list[tuple[str, float]]:
        """``fused`` reordered by the model, each candidate with its predicted score; ties keep RRF order."""
        if not fused:
            return []
        predicted = self.booster.predict(fusion_features(query, found, fused, self.retrievers), num_threads=1)
        order = np.argsort(-predicted, kind="stable")
        return [(fused[i][0], float(predicted[i])) for i in order]

    def explained(
        self, query: str, found: Mapping[str, Ranking], fused: Ranking, doc_ids: Sequence[str], shares: bool = False
    ) -> list[tuple[dict[str, float], dict[str, float] | None]]:
        """For each of ``doc_ids`` (candidates of ``fused``): its features and, with ``shares``, each
        feature's share of its score (LightGBM's SHAP values, ``bias`` the model's base), which sum
        to the score."""
        rows = {doc_id: i for i, (doc_id, _) in enumerate(fused)}
        features = fusion_features(query, found, [fused[rows[d]] for d in doc_ids], self.retrievers)
        features[:, 2 * len(self.retrievers)] = [rows[d] + 1 for d in doc_ids]  # their ranks in fused, not here
        named = [dict(zip(self.features, map(float, row), strict=True)) for row in features]
        if not shares or not named:
            return [(row, None) for row in named]
        contributions = self.booster.predict(features, pred_contrib=True, num_threads=1)
        names = (*self.features, "bias")
        return [(row, dict(zip(names, map(float, c), strict=True))) for row, c in zip(named, contributions, strict=True)]

    def describe(self) -> str:
        params = self.card.get("params", {})
        return f"LambdaMART, {params.get('n_estimators', '?')} trees of {params.get('num_leaves', '?')} leaves"
