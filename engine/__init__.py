"""The online engine: hybrid BM25 + dense retrieval, fusion and cross-encoder reranking.

Its names load on first use, so that a module of one room (``engine.rerank.cuda_passes`` on a GPU
machine with torch alone, say) imports without the whole engine's dependencies."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.search import Hit, HybridEngine
    from engine.settings import EngineSettings

__all__ = ["EngineSettings", "Hit", "HybridEngine"]
_HOMES = {"EngineSettings": "engine.settings", "Hit": "engine.search", "HybridEngine": "engine.search"}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
