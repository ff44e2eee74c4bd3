"""The search pipeline: opening an index (:mod:`.opening`), the engine over it (:mod:`.hybrid`), the
stages a query runs (:mod:`.stages`), and what comes back (:mod:`.answers`, :mod:`.results`)."""

from engine.search.hybrid import HybridEngine
from engine.search.results import AS_LOADED, Hit, SearchOptions, StageResult

__all__ = ["AS_LOADED", "Hit", "HybridEngine", "SearchOptions", "StageResult"]
