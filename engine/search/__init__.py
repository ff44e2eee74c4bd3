"""The search pipeline: loading an index (:mod:`.hybrid`), the stages a query runs (:mod:`.stages`),
and what comes back (:mod:`.results`)."""

from engine.search.hybrid import HybridEngine
from engine.search.results import AS_LOADED, Hit, SearchOptions, StageResult

__all__ = ["AS_LOADED", "Hit", "HybridEngine", "SearchOptions", "StageResult"]
