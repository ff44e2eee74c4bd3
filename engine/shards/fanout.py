"""A call to every shard, and what a search does when a shard cannot answer.

In one process the shards answer one after another. Remote shards (``serving/remotes.py``) are
asked all at once and waited for together; a shard that fails its call after its retry raises
:class:`ShardUnavailable`. With ``partial`` results allowed, the search goes on with the shards
that answered and the shards missing are noted for the answer to say (:func:`missing_shards`);
otherwise the search fails with a 503.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from engine.errors import ServiceError

if TYPE_CHECKING:
    from engine.documents import Filters
    from engine.retrieval.protocol import Query, Ranking
    from engine.shards.bm25 import ShardStatistics
    from engine.store.docstore import Chunk

_missing: contextvars.ContextVar[set[int] | None] = contextvars.ContextVar("missing_shards", default=None)


class ShardUnavailable(ServiceError):
    """A shard failed to answer (every replica down or past the query's time): 503, Retry-After."""

    status = 503

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": "5"}

    def __init__(self, shards: Sequence[int], cause: str = "") -> None:
        names = ", ".join(map(str, shards))
        super().__init__(f"shard {names} of the index did not answer{f' ({cause})' if cause else ''}; try again")
        self.shards = list(shards)


def track_missing() -> contextvars.Token:
    """Start noting the shards a search goes without (the stages call it once per search)."""
    return _missing.set(set())


def gone() -> set[int]:
    """The shards this search has gone without so far (not asked again in it)."""
    return set(_missing.get() or ())


def missing_shards(token: contextvars.Token) -> list[int]:
    """The shards the search went without, and stop noting them."""
    found = sorted(_missing.get() or ())
    _missing.reset(token)
    return found


class Shard(Protocol):
    """What a sharded search asks a shard, in the phases of Elasticsearch's ``dfs_query_then_fetch``
    (:class:`engine.search.shard.LocalShard` answers; elsewhere, through any carrier, by these
    names). Every argument and answer is plain data."""

    def statistics(self, text: str) -> ShardStatistics:
        """dfs: the query's terms, how many of the shard's chunks hold each, and its size."""
        ...

    def bm25(self, query: Query, k: int, filters: Filters | None, weighted: list, average: float) -> Ranking:
        """query: the top ``k`` by ``weighted`` terms, lengths normalised by ``average`` (the corpus's)."""
        ...

    def dense(self, query: Query, k: int, filters: Filters | None) -> list[tuple[str, float, int]]:
        """query: the top ``k`` by the query's vector, as (unit id, score, row)."""
        ...

    def chunks(self, unit_ids: Sequence[str]) -> dict[str, Chunk]:
        """fetch: the texts of the hits merged."""
        ...

    def similarity(self, vector: np.ndarray, unit_ids: Sequence[str]) -> dict[str, float]: ...

    def holding(self, unit_ids: Sequence[str], filters: Filters | None) -> list[bool]: ...

    def document(self, document_id: str) -> dict | None: ...

    def sample(self, n: int) -> list[Chunk]: ...

    def size(self) -> int: ...


Call = Callable[..., Any]  # a method of :class:`Shard`, named by itself rather than by a string


class Shards:
    """The shards of one index, asked together: ``ask(Shard.size)`` calls ``size`` on each."""

    def __init__(self, shards: Sequence[Any], partial: bool = False) -> None:
        self.shards, self.partial = list(shards), partial

    def __len__(self) -> int:
        return len(self.shards)

    def ask(self, call: Call, *args: Any) -> list[Any]:
        """Each shard's answer to ``call(*args)``; None for a shard missing from a partial search."""
        return self.answers(call.__name__, [args] * len(self.shards))

    def ask_each(self, call: Call, args: Sequence[tuple | None]) -> list[Any]:
        """Shard ``i``'s answer to ``call(*args[i])`` (None in ``args``: not asked, None answered)."""
        return self.answers(call.__name__, args)

    def one(self, shard: int, call: Call, *args: Any) -> Any:
        """Shard ``shard``'s answer (a document's: no other shard holds it)."""
        asked = [args if i == shard else None for i in range(len(self.shards))]
        return self.answers(call.__name__, asked)[shard]

    def answers(self, name: str, args: Sequence[tuple | None]) -> list[Any]:
        """Here, one shard after another; remote shards override it to ask them all at once."""
        calls = zip(self.shards, args, strict=True)
        return [None if a is None else getattr(shard, name)(*a) for shard, a in calls]

    def status(self) -> list[dict]:
        """Each shard's chunks, or why it does not answer (what /health shows)."""
        return [{"shard": i, "chunks": n} for i, n in enumerate(self.ask(Shard.size))]

    def went_without(self, failed: Sequence[int], cause: str) -> None:
        """``failed`` did not answer: noted for a partial answer, else the search fails (503)."""
        if not self.partial or len(set(failed) | gone()) == len(self.shards):
            raise ShardUnavailable(failed, cause)
        noted = _missing.get()
        if noted is not None:
            noted.update(failed)

    def close(self) -> None:
        for shard in self.shards:
            shard.close()
