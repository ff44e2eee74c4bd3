"""The shards' document stores read as one: a chunk from the shard that holds it, a document from
the shard its id hashes to."""

from __future__ import annotations

from collections.abc import Iterable

from engine.shards.fanout import Shard, Shards
from engine.store.docstore import Chunk
from engine.store.index_dir import shard_of


class ShardedStore:
    """What a search and the doors read of the store, asked of the shards."""

    def __init__(self, shards: Shards) -> None:
        self.shards = shards

    def chunks(self, unit_ids: Iterable[str]) -> dict[str, Chunk]:
        ids = list(dict.fromkeys(unit_ids))
        found: dict[str, Chunk] = {}
        for answer in self.shards.ask(Shard.chunks, ids) if ids else ():
            found.update(answer or {})
        return found

    def document(self, document_id: str) -> dict | None:
        return self.shards.one(shard_of(document_id, len(self.shards)), Shard.document, document_id)

    def sample(self, n: int) -> list[Chunk]:
        each = -(-n // len(self.shards))
        return [chunk for found in self.shards.ask(Shard.sample, each) for chunk in found or ()][:n]

    def count(self) -> int:
        return sum(n or 0 for n in self.shards.ask(Shard.size))

    def close(self) -> None:
        self.shards.close()
