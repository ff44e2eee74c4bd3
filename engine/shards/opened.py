"""A sharded index's view: its shards (here or remote) searched as one index, and what each
shard's own engine opens."""

from __future__ import annotations

from pathlib import Path

from engine.live.view import IndexView
from engine.settings import EngineSettings
from engine.shards.bm25 import ShardedBM25
from engine.shards.dense import ShardedDense
from engine.shards.fanout import Shards
from engine.shards.store import ShardedStore
from engine.store.index_dir import Manifest, shard_dir

SHARD_ONLY = {"memory": False, "fusion": "rrf", "rerank": False, "reranker": None, "adapted": False}


def shard_settings(settings: EngineSettings, index_dir: Path, shard: int) -> EngineSettings:
    """What shard ``shard``'s engine opens: its directory, retrieval only (memory, fusion and
    reranker are the top's)."""
    return settings.model_copy(update={"index_dir": shard_dir(index_dir, shard), **SHARD_ONLY})


def sharded_view(
    index_dir: Path, manifest: Manifest, shards: Shards, encoder, query_encoder, backend: str
) -> IndexView:
    """The view of a sharded index over ``shards`` (here or remote)."""
    return IndexView(
        index_dir,
        manifest,
        ShardedStore(shards),
        ShardedBM25(shards),
        ShardedDense(shards, encoder, query_encoder, backend),
        0,
    )
