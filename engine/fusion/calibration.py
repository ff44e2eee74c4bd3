"""What a score means: the probability that a hit is relevant.

Fused scores are not probabilities (RRF's depend only on ranks, LambdaMART's only order a list),
so a threshold on them means nothing across queries. A logistic calibration maps a hit's fused
score and its final rank to the probability that the training judgments call it relevant. It is
fitted on out-of-fold fusion scores of the training queries (a model never scores the queries it
learned from), kept in ``fusion/calibration.json`` and refitted by ``train-fusion``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

CALIBRATION_FILE = "calibration.json"


def calibration_features(scores: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """(fused score, log rank) per hit; ranks from 1."""
    return np.column_stack([np.asarray(scores, dtype=float), np.log(np.asarray(ranks, dtype=float))])


@dataclass
class Calibration:
    coef: list[float]
    intercept: float
    fitted_on: str
    positive_rate: float
    features: tuple[str, ...] = ("fused_score", "log_rank")

    @classmethod
    def fit(cls, scores: np.ndarray, ranks: np.ndarray, relevant: np.ndarray, fitted_on: str) -> Calibration:
        from sklearn.linear_model import LogisticRegression

        model = LogisticRegression(C=1.0, max_iter=1000).fit(calibration_features(scores, ranks), relevant)
        return cls([float(c) for c in model.coef_[0]], float(model.intercept_[0]), fitted_on, float(relevant.mean()))

    def probability(self, score: float, rank: int) -> float:
        z = self.intercept + self.coef[0] * score + self.coef[1] * math.log(rank)
        return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0

    def save(self, folder: Path) -> None:
        (Path(folder) / CALIBRATION_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path) -> Calibration | None:
        path = Path(folder) / CALIBRATION_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        data["features"] = tuple(data.get("features", cls.features))
        return cls(**data)


def expected_calibration_error(probabilities: np.ndarray, relevant: np.ndarray, bins: int = 10) -> tuple[float, list]:
    """ECE over equal-width bins, and each bin's (mean predicted, observed rate, count)."""
    probabilities, relevant = np.asarray(probabilities), np.asarray(relevant, dtype=float)
    edges = np.linspace(0, 1, bins + 1)
    which = np.clip(np.digitize(probabilities, edges[1:-1]), 0, bins - 1)
    table, ece = [], 0.0
    for b in range(bins):
        mask = which == b
        if not mask.any():
            continue
        predicted, observed = float(probabilities[mask].mean()), float(relevant[mask].mean())
        ece += mask.mean() * abs(predicted - observed)
        table.append(
            {
                "bin": [round(edges[b], 2), round(edges[b + 1], 2)],
                "predicted": predicted,
                "observed": observed,
                "count": int(mask.sum()),
            }
        )
    return float(ece), table
