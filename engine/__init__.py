"""The online engine: hybrid BM25 + dense retrieval, fusion and cross-encoder reranking."""

from engine.config import Settings
from engine.search import Hit, HybridEngine

__all__ = ["HybridEngine", "Hit", "Settings"]
