"""The online engine: hybrid BM25 + dense retrieval, fusion and cross-encoder reranking."""

from engine.search import Hit, HybridEngine
from engine.settings import EngineSettings

__all__ = ["EngineSettings", "Hit", "HybridEngine"]
