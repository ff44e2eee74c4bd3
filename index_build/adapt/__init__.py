"""Day one on a corpus without judgments (:mod:`index_build.adapt.fitting` says how): pseudo-queries
from the chunks, a held-out view to check in, the corpus graph fitted and served only when it pays."""

from index_build.adapt.card import summary
from index_build.adapt.fitting import FULL_MISSING, AdaptError, adapt_index
from index_build.adapt.graph import nearest
from index_build.adapt.heldout import HeldOutView

__all__ = ["FULL_MISSING", "AdaptError", "HeldOutView", "adapt_index", "nearest", "summary"]
