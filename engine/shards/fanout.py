"""A call to every shard, and what a search does when a shard cannot answer.

In one process the shards answer one after another. Remote shards (``serving/remotes.py``) are
asked all at once and waited for together; a shard that fails its call after its retry raises
:class:`ShardUnavailable`. With ``partial`` results allowed, the search goes on with the shards
that answered and the shards missing are noted for the answer to say (:func:`missing_shards`);
otherwise the search fails with a 503.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from typing import Any

from engine.errors import ServiceError

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


class Shards:
    """The shards of one index, asked together: ``ask(name, *args)`` calls ``name`` on each."""

    def __init__(self, shards: Sequence[Any], partial: bool = False) -> None:
        self.shards, self.partial = list(shards), partial

    def __len__(self) -> int:
        return len(self.shards)

    def ask(self, name: str, *args: Any) -> list[Any]:
        """Each shard's answer to ``name(*args)``; None for a shard missing from a partial search."""
        return self.answers(name, [args] * len(self.shards))

    def ask_each(self, name: str, args: Sequence[tuple | None]) -> list[Any]:
        """Shard ``i``'s answer to ``name(*args[i])`` (None in ``args``: not asked, None answered)."""
        return self.answers(name, args)

    def one(self, shard: int, name: str, *args: Any) -> Any:
        """Shard ``shard``'s answer (a document's: no other shard holds it)."""
        return self.answers(name, [args if i == shard else None for i in range(len(self.shards))])[shard]

    def answers(self, name: str, args: Sequence[tuple | None]) -> list[Any]:
        """Here, one shard after another; remote shards override it to ask them all at once."""
        calls = zip(self.shards, args, strict=True)
        return [None if a is None else getattr(shard, name)(*a) for shard, a in calls]

    def status(self) -> list[dict]:
        """Each shard's chunks, or why it does not answer (what /health shows)."""
        return [{"shard": i, "chunks": n} for i, n in enumerate(self.ask("size"))]

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
