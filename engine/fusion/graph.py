"""Corpus-graph smoothing: the fused candidates reordered with their nearest neighbours' fused scores.

A candidate whose nearest documents in the corpus (by the dense vectors, computed once at build)
were ranked high too rises: ``(1 - w) * f(d) + w * mean_n sim(d, n) * f(n)`` over its ``k``
neighbours, ``f`` the fused score over the list's best. It reorders the fused list, adds nothing to
it, and needs no judgments: `build --adapt` fits ``w`` on pseudo-queries held out of the corpus and
stores it only when it beats RRF there (:mod:`index_build.adapt`); the engine serves it when the
index has it and no learned fusion.

A chunk written live after the build has no neighbours (its own score stands) until `hybrid-search
adapt` makes the graph again; a deleted chunk's row is in no live ranking, so it lends no score.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from engine.store.unit_map import UnitMap

Ranking = list[tuple[str, float]]
CARD_FILE = "adapt.json"  # the decision and its figures; written last, so a folder with it is complete
CARD_SHOWN = ("mode", "served", "decision", "heldout", "generation")  # what /health shows of it
GRAPH_FILE = "graph.npz"  # neighbours (store rows) and their cosines, one row per chunk at build


class AdaptedStageError(RuntimeError):
    """An index's adapted stage is unreadable."""


class CorpusGraph:
    """The neighbours of every chunk (store rows, best first) and the weight their scores get."""

    def __init__(self, neighbours: np.ndarray, similarities: np.ndarray, weight: float) -> None:
        if neighbours.shape != similarities.shape or neighbours.ndim != 2:
            raise AdaptedStageError(f"neighbours {neighbours.shape} and similarities {similarities.shape} differ")
        self.neighbours = neighbours.astype(np.int64, copy=False)
        self.similarities = np.clip(similarities.astype(np.float32, copy=False), 0.0, None)
        self.weight = float(weight)

    @property
    def k(self) -> int:
        return int(self.neighbours.shape[1])

    def save(self, folder: Path) -> None:
        np.savez(folder / GRAPH_FILE, neighbours=self.neighbours, similarities=self.similarities)

    @classmethod
    def load(cls, folder: Path, weight: float) -> CorpusGraph:
        try:
            with np.load(folder / GRAPH_FILE) as data:
                return cls(data["neighbours"], data["similarities"], weight)
        except (OSError, KeyError, ValueError) as exc:
            raise AdaptedStageError(
                f"{folder / GRAPH_FILE}: unreadable corpus graph ({exc}); run `hybrid-search adapt`"
            ) from None

    def rerank(self, fused: Ranking, units: UnitMap) -> Ranking:
        """``fused`` (best first) reordered; ``units``: the live chunks' store rows."""
        if not fused:
            return []
        top = fused[0][1] or 1.0
        rows = units.rows_of([unit for unit, _ in fused]).tolist()
        by_row = {row: score / top for row, (_, score) in zip(rows, fused, strict=True) if row >= 0}
        known = len(self.neighbours)
        smoothed = []
        for row, (_, score) in zip(rows, fused, strict=True):
            own = score / top
            if row < 0 or row >= known:
                smoothed.append(own)
                continue
            sims = self.similarities[row]
            total = float(sims.sum())
            pairs = zip(self.neighbours[row], sims, strict=True)
            lent = sum(float(s) * by_row.get(int(n), 0.0) for n, s in pairs) / (total or 1.0)
            smoothed.append((1.0 - self.weight) * own + self.weight * lent)
        order = sorted(range(len(fused)), key=lambda i: (-smoothed[i], i))
        return [(fused[i][0], smoothed[i]) for i in order]


def read_card(folder: Path) -> dict | None:
    """The adaptation's card (None when the index was never adapted)."""
    path = folder / CARD_FILE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdaptedStageError(f"{path}: unreadable ({exc}); run `hybrid-search adapt`") from None


def load_adapted(folder: Path) -> tuple[CorpusGraph | None, dict | None]:
    """The stage an adapted index serves (None: RRF, the held-out check did not pay) and its card."""
    card = read_card(folder)
    if card is None or not card.get("served"):
        return None, card
    return CorpusGraph.load(folder, card["weight"]), card
