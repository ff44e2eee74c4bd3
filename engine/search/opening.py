"""One way to open an index for searching: ``open_view(settings, role, remotes)``.

An index is one folder, or shards (opened here or served elsewhere); its process is its writer, a
follower of a writer elsewhere, or a reader of a settled index. Those choices decide which stores a
search reads, what a filter allows, and who takes writes; nothing after opening asks them again.
What comes back, :class:`OpenIndex`, answers the same for every topology, so the engine above it
(memory, fusion, reranking: :class:`~engine.search.hybrid.HybridEngine`) and a shard's answers
(:class:`~engine.search.shard.LocalShard`) never ask which one they hold, as Lucene's
SearcherManager hands out a reader without saying how it was opened.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from engine.documents import Filters
from engine.retrieval.dense import DenseRetriever
from engine.retrieval.encoder import DocumentEncoder, QueryEncoder, load_query_encoder, pick_device
from engine.retrieval.lucene import LuceneIndex
from engine.retrieval.protocol import Query, Within
from engine.search.allowed import Allowed, AllowedSets
from engine.settings import EngineSettings
from engine.shards.fanout import Shards
from engine.shards.opened import shard_settings, sharded_view
from engine.shards.writes import ShardedWriter
from engine.store.docstore import DocStore
from engine.store.index_dir import BM25_DIR, DOCS_FILE, IndexDirError, Manifest, latest_dense, read_manifest

if TYPE_CHECKING:
    from engine.live.follower import Follower
    from engine.live.locks import ViewLock
    from engine.live.view import IndexView
    from engine.live.writer import LiveIndex, Writer
    from engine.search.pages import PinStore

Role = Literal["reader", "writer", "follower"]


@dataclass(frozen=True)
class Remotes:
    """What other processes serve in place of opening it here: the index's ``writer`` (a
    follower's), a sharded index's ``shards``, the models (``encoder`` embeds documents,
    ``query_encoder`` queries) when they are loaded once for several indexes or served elsewhere,
    and the ``pins`` that pages are read off when the engine's siblings share them."""

    writer: Writer | None = None
    shards: Shards | None = None
    encoder: object | None = None
    query_encoder: QueryEncoder | None = None
    pins: PinStore | None = None


LOCAL = Remotes()


@dataclass(eq=False)
class OpenIndex:
    """An opened index: its ``view`` (the stores a search reads together, and their lock), what a
    filter ``allowed``, its writer (``live``: this process's, or a remote one a follower takes
    writes through; None: read-only), the ``follower`` showing a remote writer's checkpoints, and a
    sharded index's ``shards``."""

    settings: EngineSettings
    manifest: Manifest
    view: IndexView
    allowed: Callable[[Filters], Allowed]
    retrieval_device: str
    live: LiveIndex | Writer | None = None
    follower: Follower | None = None
    shards: Shards | None = None

    @property
    def lock(self) -> ViewLock:
        return self.view.lock

    @property
    def reads_ahead(self) -> bool:
        """Whether the store may hold chunks the view does not show yet (a follower's store is
        the writer's, a shard's may have written or gone since it answered)."""
        return self.follower is not None or self.shards is not None

    def catch_up(self) -> None:
        """Show the writer's latest checkpoint, for a follower; nothing otherwise."""
        if self.follower is not None:
            self.follower.catch_up()

    def within(self, filters: Filters | None) -> Within:
        """What a search ``filters`` may return, in every form the retrievers take (under the view lock)."""
        if filters is None or filters.empty:
            return Within(self.view.dense.units)
        allowed = self.allowed(filters)
        return Within(allowed, allowed, allowed.rows, filters)

    def warm_up(self, searches: int) -> float:
        """Run ``searches`` BM25 searches on short snippets of the store's own chunks, discarding the
        hits, and return the seconds it took. A JVM compiles a method with its optimising compiler only
        after thousands of calls, and that compiler's thread spends CPU beside the searches meanwhile:
        served cold, the first ~2,000 queries each paid for it (docs/experiments.md). A sharded
        index's search calls Lucene once a shard: as many Lucene searches take that many fewer."""
        started = time.perf_counter()
        if self.shards is not None:
            searches //= len(self.shards)
        chunks = self.view.store.sample(min(searches, 2000)) if searches else []
        draw = random.Random(0)
        for i in range(searches if chunks else 0):
            words = chunks[i % len(chunks)].contents.split()
            start = draw.randrange(max(1, len(words) - 8))
            snippet = " ".join(words[start : start + draw.randint(2, 8)])
            self.view.bm25.retrieve(Query(snippet, None), self.settings.bm25_depth, Within())
        return time.perf_counter() - started

    def status(self) -> dict:
        """What health reports of the topology: each shard's answer, the follower's lag."""
        found: dict = {}
        if self.shards is not None:
            found["shards"] = self.shards.status()
        if self.follower is not None:
            found["follower"] = self.follower.status()
        return found

    def close(self) -> None:
        """Checkpoint this process's writes (if any) and release the index; a follower's writer is
        another's, and closes itself."""
        if self.live is not None and self.follower is None:
            self.live.close()
        if self.follower is not None:
            self.follower.close()
        self.view.bm25.close()
        self.view.store.close()


def open_view(settings: EngineSettings, role: Role = "reader", remotes: Remotes = LOCAL) -> OpenIndex:
    """``settings.index_dir`` opened as ``role``: its ``writer`` (taking the writer's lock; a
    sharded index's shards each take their own), a ``follower`` of ``remotes.writer``, or a
    ``reader``, which refuses an index with writes still in its log, since it could not show them."""
    from engine.live.follower import Follower
    from engine.live.locks import claim_writer
    from engine.live.view import IndexView
    from engine.live.writer import LiveIndex

    index_dir = Path(settings.index_dir)
    manifest = read_manifest(index_dir)
    if (role == "follower") != (remotes.writer is not None):
        raise ValueError(f"a follower, and only a follower, takes its writes through a remote writer ({role})")
    if manifest.shards and role == "follower" and remotes.shards is None:
        raise IndexDirError(
            f"{index_dir}: an index in {manifest.shards} shards is served by one process (`serve`) or on"
            " Ray (`serve --ray`), not by `serve --workers N`"
        )
    writer_lock = (
        claim_writer(index_dir) if role == "writer" and not manifest.shards else None
    )  # a shard claims its own
    retrieval_device = pick_device(
        settings.device if settings.retrieval_device == "auto" else settings.retrieval_device
    )
    encoder = remotes.encoder or DocumentEncoder(manifest.encoder, retrieval_device)
    if role == "writer" and isinstance(encoder, DocumentEncoder):
        encoder.prepare()  # it embeds what it is sent
    query_encoder = remotes.query_encoder or load_query_encoder(
        encoder, manifest.encoder, retrieval_device, settings.query_encoder_runtime, settings.query_encoder_quantize
    )
    if manifest.shards:
        shards = remotes.shards or _open_shards(settings, manifest, role, encoder, query_encoder)
        backend = getattr(shards.shards[0], "backend", "remote")
        view = sharded_view(index_dir, manifest, shards, encoder, query_encoder, backend)
        opened = OpenIndex(settings, manifest, view, view.dense.allowed, retrieval_device, shards=view.dense.shards)
        if role == "writer":  # each shard's engine writes its own
            opened.live = ShardedWriter([shard.index.live for shard in shards.shards])
        elif role == "follower":  # each shard follows its own writer
            opened.live = remotes.writer
        return opened
    store = DocStore(index_dir / DOCS_FILE)
    bm25 = LuceneIndex(
        index_dir / BM25_DIR, settings.bm25_k1, settings.bm25_b, role == "writer", fields=manifest.bm25_fields
    )
    try:
        checkpoint = latest_dense(index_dir)
        dense = DenseRetriever(checkpoint, encoder, query_encoder, settings.hnsw_ef_search, retrieval_device)
        view = IndexView(index_dir, manifest, store, bm25, dense, settings.encode_batch_size)
        opened = OpenIndex(settings, manifest, view, AllowedSets(store), retrieval_device)
        if role == "writer" and not dense.accepts_deletes:
            raise IndexDirError(
                f"{index_dir}: a {manifest.dense_index} dense index cannot drop vectors, so it takes no live"
                " writes; rebuild with --dense-index flat, or rebuild after changing the corpus"
            )
        if role == "writer":
            s = settings
            opened.live = LiveIndex(view, writer_lock, s.refresh_interval_s, s.checkpoint_bytes, s.followed)
        elif role == "follower":
            opened.live, opened.follower = remotes.writer, Follower(view)
        else:
            view.check_settled(checkpoint.seq)
            view.bind_units()
    except BaseException:  # nothing opened outlives a refusal: the writer's lock, Lucene's files
        bm25.close()
        store.close()
        if writer_lock is not None:
            writer_lock.close()
        raise
    return opened


def _open_shards(settings: EngineSettings, manifest: Manifest, role: Role, encoder, query_encoder) -> Shards:
    """Every shard opened here, as ``role``, sharing the top's encoders; those opened are closed
    again when one cannot open (its writer's lock and threads would otherwise outlive the failure)."""
    from engine.search.shard import LocalShard

    models = Remotes(encoder=encoder, query_encoder=query_encoder)
    opened: list[OpenIndex] = []
    try:
        for i in range(manifest.shards):
            opened.append(open_view(shard_settings(settings, Path(settings.index_dir), i), role, models))
    except BaseException:
        for shard in opened:
            shard.close()
        raise
    return Shards([LocalShard(shard) for shard in opened])
