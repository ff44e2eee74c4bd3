"""Collections: every index folder of ``serve --indexes DIR`` served by its folder's name, beside
aliases that name a collection and swap atomically.

A request holds a *lease* on the collection it resolved to for as long as it runs: an alias swapped
meanwhile sends the next requests to the new collection while the running ones finish on the old,
and a collection dropped closes (and its folder goes) when its last lease ends. The models an
index loads (the bi-encoder, the query encoder, the reranker) are loaded once for every collection
that uses the same ones (:class:`SharedModels`), and handed to each engine through
:class:`~engine.search.HybridEngine`'s constructor. Aliases live in ``DIR/aliases.json``, written
whole and renamed into place, so a restart serves the same names.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp

from agents.settings import trace_db_for
from engine.documents import QueryRequest, SearchRequest
from engine.errors import INVALID_PARAMS, ServiceError
from engine.rerank.batching import RerankBatcher
from engine.rerank.loading import open_reranker
from engine.retrieval.encoder import DocumentEncoder, load_query_encoder, pick_device
from engine.search import HybridEngine
from engine.search.opening import Remotes
from engine.settings import EngineSettings
from engine.store.index_dir import MANIFEST_FILE, Manifest, read_manifest
from serving.presentation import Presentation
from serving.search_service import SearchService
from serving.settings import Settings

log = logging.getLogger(__name__)
ALIASES_FILE = "aliases.json"
DEFAULT_ALIAS = "default"  # the alias today's routes serve when --default-collection names none
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # a folder name, and a URL path segment as it is
MODEL_FILES = ("*.json", "*.safetensors", "*.bin", "*.txt", "*.model", "*.onnx")  # what a reranker's identity is


class UnknownCollection(ServiceError, LookupError):
    """No collection or alias of that name (404)."""

    status, jsonrpc_code = 404, INVALID_PARAMS


class CollectionConflict(ServiceError, RuntimeError):
    """The name is taken, or the collection is still needed (an alias points at it): 409."""

    status, jsonrpc_code = 409, INVALID_PARAMS


class BadName(ServiceError, ValueError):
    """A collection or alias name that cannot be a folder's (422)."""

    status, jsonrpc_code = 422, INVALID_PARAMS


class CollectionInfo(BaseModel):
    """A collection as ``GET /collections`` and MCP's ``list_collections`` describe it, from its manifest."""

    name: str
    title: str = Field(description="what its manifest calls the corpus")
    description: str = Field(description="what it holds, as its manifest says")
    aliases: list[str] = Field(description="the aliases that name it")
    default: bool = Field(description="whether today's routes and search_nfcorpus serve it")
    documents: int
    chunks: int
    bytes: int = Field(description="its folder's size on disk")
    encoder: str
    writable: bool
    status: str = Field(description="ok, or degraded (its /health says why)")
    searches_running: int


class SharedModel(BaseModel):
    kind: str = Field(description="encoder, query_encoder or reranker")
    id: str = Field(description="its name, or for a reranker's folder its files' digest")
    collections: list[str] = Field(description="the collections using this one copy")


class CollectionsReply(BaseModel):
    collections: list[CollectionInfo]
    aliases: dict[str, str] = Field(description="each alias and the collection it names")
    default: str | None = Field(description="the collection today's routes serve (None: none named)")
    models: list[SharedModel] = Field(description="each model loaded once, and the collections sharing it")


def checked_name(name: str, what: str = "collection") -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise BadName(f"{what} name {name!r}: 1-64 letters, digits, '_' or '-', starting with a letter or digit")
    return name


@dataclass
class Collection:
    """One served index: its engine, the service every door uses, and its REST routes."""

    name: str
    path: Path
    engine: HybridEngine
    service: SearchService
    app: ASGIApp
    opened_at: float = field(default_factory=time.time)
    leases: int = 0  # requests running on it now
    retired: bool = False  # dropped: closes when the last lease ends

    def close(self) -> None:
        self.service.close()
        self.engine.close()


class SharedModels:
    """The models collections share, each loaded once per identity: the bi-encoder and query
    encoder by the encoder's name and device, the reranker by its files' contents (two indexes
    holding copies of one reranker share it). Dropped when no collection uses it any more."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[tuple, object] = {}
        self._users: dict[tuple, set[str]] = {}

    def for_index(self, settings: EngineSettings, manifest: Manifest, user: str) -> dict[str, object]:
        """What :class:`HybridEngine` takes for the index ``settings`` names: ``encoder``,
        ``query_encoder`` and ``reranker`` (None: the index has none, and the engine finds none)."""
        device = pick_device(settings.device)
        near = device if settings.retrieval_device == "auto" else pick_device(settings.retrieval_device)
        name, runtime, quantize = manifest.encoder, settings.query_encoder_runtime, settings.query_encoder_quantize
        encoder = self._get(("encoder", name, near), lambda: DocumentEncoder(name, near), user)
        query_encoder = self._get(
            ("query_encoder", name, near, runtime, quantize),
            lambda: load_query_encoder(encoder, name, near, runtime, quantize),
            user,
        )
        models: dict[str, object] = {"encoder": encoder, "query_encoder": query_encoder}
        identity = _reranker_identity(settings)
        if identity is not None:
            models["reranker"] = self._get(("reranker", identity, device), lambda: _reranker(settings, device), user)
        return models

    def release(self, user: str) -> None:
        """``user`` is dropped: each model nobody else uses goes."""
        with self._lock:
            for key in [key for key, users in self._users.items() if users == {user}]:
                del self._users[key], self._models[key]
            for users in self._users.values():
                users.discard(user)

    def describe(self) -> list[SharedModel]:
        """Each model loaded, and the collections that use it."""
        with self._lock:
            return [
                SharedModel(kind=key[0], id=str(key[1]), collections=sorted(self._users[key]))
                for key, model in self._models.items()
                if model is not None
            ]

    def _get(self, key: tuple, load: Callable[[], object], user: str) -> object:
        with self._lock:  # held while one loads: two collections opening at once load it once
            if key not in self._models:
                self._models[key] = load()
            self._users.setdefault(key, set()).add(user)
            return self._models[key]


def _reranker_identity(settings: EngineSettings) -> str | None:
    """A reranker's folder by its model files' contents, a hub id by itself; None when the index
    serves none (the engine then finds none either)."""
    if not settings.rerank:
        return None
    path = Path(settings.reranker_path)
    if not path.is_dir():
        return settings.reranker  # a hub id, or None: no reranker
    digest = hashlib.sha256()
    for file in sorted({f for pattern in MODEL_FILES for f in path.glob(pattern) if f.is_file()}):
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return "sha256:" + digest.hexdigest()[:16]


def _reranker(settings: EngineSettings, device: str) -> object:
    """As the engine loads its own (``HybridEngine._load_reranker``): batched across requests on
    CUDA, so collections sharing it share its batches too."""
    reranker = open_reranker(settings, device)
    if reranker is not None and device == "cuda" and settings.rerank_batch_wait_ms > 0:
        return RerankBatcher(reranker, settings.rerank_batch_wait_ms / 1000, settings.rerank_batch_tokens)
    return reranker


class Collections:
    """The collections of ``--indexes DIR``, their aliases, and the leases requests hold on them."""

    def __init__(self, settings: Settings, writable: bool, app_for: Callable[[SearchService], ASGIApp]) -> None:
        """Open every index folder in the directory now (no request pays for loading); ``app_for``
        makes a collection's REST routes from its service."""
        root = settings.serving.indexes
        if root is None or not Path(root).is_dir():
            raise ValueError(
                f"--indexes {root}: not a directory (make it, then `hybrid-search init --index-dir DIR/NAME`)"
            )
        self.root = Path(root)
        self.settings, self.writable, self._app_for = settings, writable, app_for
        # what the doors validate with, as one collection's service does (the limits are the server's)
        self.search_request = SearchRequest.limited(settings.serving.max_query_chars)
        self.query_request = QueryRequest.limited(settings.serving.max_query_chars)
        self.models = SharedModels()
        self._lock = threading.Lock()  # the maps and the lease counts
        self._opening = threading.Lock()  # one collection opens at a time
        self._open: dict[str, Collection] = {}
        self._busy: set[str] = set()  # names being built or dropped: not discovered, not taken
        self.aliases: dict[str, str] = self._read_aliases()
        for name in self._folders():
            self._open_one(name)
        for alias, target in self.aliases.items():
            if target not in self._open:
                log.warning("alias %r names %r, which is not a collection here: it answers 404", alias, target)
        configured = settings.serving.default_collection
        if configured is not None and self._resolve(configured) not in self._open:
            raise ValueError(f"--default-collection {configured!r} is no collection or alias in {self.root}")

    # ------------------------------------------------------------------ names
    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._open)

    def default_name(self) -> str | None:
        """The collection today's routes serve: ``--default-collection``, else the alias
        ``default``, else the only collection; None when none of these names one."""
        with self._lock:
            return self._default_locked()

    def _default_locked(self) -> str | None:
        configured = self.settings.serving.default_collection
        if configured is not None:
            return self._resolve(configured)
        if DEFAULT_ALIAS in self.aliases:
            return self.aliases[DEFAULT_ALIAS]
        return next(iter(self._open)) if len(self._open) == 1 else None

    def _resolve(self, name: str) -> str:
        return self.aliases.get(name, name)

    def _folders(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if NAME.fullmatch(p.name) and (p / MANIFEST_FILE).is_file())

    # ------------------------------------------------------------------ leases
    @contextlib.asynccontextmanager
    async def leased(self, name: str | None = None) -> AsyncIterator[Collection]:
        """The collection ``name`` (or alias; None: the default) held for the caller's request: it
        stays open until the caller is done, whatever is swapped or dropped meanwhile. A folder
        made in DIR since the start (``hybrid-search init --index-dir DIR/NAME``) opens on first use."""
        try:
            collection = self._take(name)
        except UnknownCollection:
            if name is None or not await run_in_threadpool(self.discover, name):
                raise
            collection = self._take(name)
        try:
            yield collection
        finally:
            self._give_back(collection)

    @contextlib.contextmanager
    def lease(self, name: str | None = None) -> Iterator[Collection]:
        """:meth:`leased` for a thread (no discovery)."""
        collection = self._take(name)
        try:
            yield collection
        finally:
            self._give_back(collection)

    def _take(self, name: str | None) -> Collection:
        with self._lock:
            target = self._default_locked() if name is None else self._resolve(name)
            collection = self._open.get(target) if target is not None else None
            if collection is None:
                raise UnknownCollection(self._unknown(name, target))
            collection.leases += 1
            return collection

    def _unknown(self, name: str | None, target: str | None) -> str:
        if name is None:
            return (
                "no default collection: name one with --default-collection or PUT /aliases/default, or use"
                " /collections/{name}/..."
            )
        via = f" (alias of {target!r})" if target != name else ""
        return f"no collection {name!r}{via}; GET /collections lists them"

    def _give_back(self, collection: Collection) -> None:
        with self._lock:
            collection.leases -= 1
            last = collection.retired and collection.leases == 0
        if last:  # off this thread: a writable engine checkpoints as it closes
            threading.Thread(target=self._finish_drop, args=(collection,), name=f"drop-{collection.name}").start()

    # ------------------------------------------------------------------ opening
    def discover(self, name: str) -> bool:
        """Open the folder ``DIR/name`` when it holds an index not served yet; whether it is served now."""
        if not NAME.fullmatch(name) or not (self.root / name / MANIFEST_FILE).is_file():
            return False
        with self._lock:
            if name in self._busy or name in self.aliases:
                return False
        self._open_one(name)
        return True

    def _open_one(self, name: str) -> Collection:
        with self._opening:
            with self._lock:
                if name in self._open:
                    return self._open[name]
            path = self.root / name
            engine_settings = self.settings.engine.model_copy(update={"index_dir": path})
            models = self.models.for_index(engine_settings, read_manifest(path), name)
            try:
                reranker, remotes = models.pop("reranker", None), Remotes(**models)
                engine = HybridEngine(engine_settings, writable=self.writable, reranker=reranker, remotes=remotes)
            except BaseException:
                self.models.release(name)
                raise
            warm = engine.warm_up(engine_settings.warmup_searches)
            service = SearchService(self.settings.model_copy(update={"engine": engine_settings}), engine=engine)
            service.warmup = {"searches": engine_settings.warmup_searches, "seconds": round(warm, 2)}
            collection = Collection(name, path, engine, service, self._app_for(service))
            with self._lock:
                self._open[name] = collection
            log.info("collection %r: %s (%d chunks)", name, path, len(engine.dense.units))
            return collection

    # ------------------------------------------------------------------ create, build, drop
    def reserve(self, name: str) -> Path:
        """Claim ``name`` for a collection about to be made (:meth:`created` or :meth:`abandoned` ends it)."""
        checked_name(name)
        with self._lock:
            if name in self._open or name in self._busy:
                raise CollectionConflict(f"collection {name!r} exists already (or is being built or dropped)")
            if name in self.aliases:
                raise CollectionConflict(f"{name!r} is an alias (of {self.aliases[name]!r}); choose another name")
            if (self.root / name).exists():
                raise CollectionConflict(f"{self.root / name} exists already and is not an index being served")
            self._busy.add(name)
        return self.root / name

    def created(self, name: str) -> Collection:
        """The index now built at ``DIR/name``, opened and served."""
        try:
            return self._open_one(name)
        finally:
            self.abandoned(name)

    def abandoned(self, name: str) -> None:
        with self._lock:
            self._busy.discard(name)

    def drop(self, name: str) -> dict:
        """Stop serving the collection ``name`` (or the one an alias names: refused, as any
        collection an alias points at, 409) and delete its folder once its last request ends."""
        with self._lock:
            target = self._resolve(name)
            collection = self._open.get(target)
            if collection is None:
                raise UnknownCollection(self._unknown(name, target))
            pointing = sorted(alias for alias, to in self.aliases.items() if to == target)
            if pointing:
                many = len(pointing) > 1
                raise CollectionConflict(
                    f"alias{'es' * many} {', '.join(map(repr, pointing))} point{'s' * (not many)} at {target!r}:"
                    f" point {'them' if many else 'it'} elsewhere or delete {'them' if many else 'it'} first"
                    " (PUT or DELETE /aliases/{alias})"
                )
            if self.settings.serving.default_collection == target:
                raise CollectionConflict(f"{target!r} is this server's --default-collection")
            del self._open[target]
            self._busy.add(target)
            collection.retired, running = True, collection.leases
        if not running:
            self._finish_drop(collection)
        return {"dropped": target, "running": running}

    def _finish_drop(self, collection: Collection) -> None:
        try:
            collection.close()
            self.models.release(collection.name)
            shutil.rmtree(collection.path, ignore_errors=True)
            if self.settings.agents.trace_db is None:  # its own traces, beside it (a shared file stays)
                traces = trace_db_for(self.settings.agents, collection.path)
                for file in traces.parent.glob(f"{traces.name}*"):
                    file.unlink(missing_ok=True)
            log.info("collection %r dropped", collection.name)
        finally:
            self.abandoned(collection.name)

    # ------------------------------------------------------------------ aliases
    def set_alias(self, alias: str, collection: str) -> dict:
        """Point ``alias`` at ``collection`` (an alias there means the collection it names): the next
        lease taken by the alias is the new collection's; leases held go on with the old."""
        checked_name(alias, "alias")
        with self._lock:
            target = self._resolve(collection)
            if target not in self._open:
                raise UnknownCollection(self._unknown(collection, target))
            if alias in self._open or alias in self._busy:
                raise CollectionConflict(f"{alias!r} is a collection's name; an alias needs a name of its own")
            previous = self.aliases.get(alias)
            self.aliases = {**self.aliases, alias: target}
            self._write_aliases()
        return {"alias": alias, "collection": target, "previous": previous}

    def delete_alias(self, alias: str) -> dict:
        with self._lock:
            if alias not in self.aliases:
                raise UnknownCollection(f"no alias {alias!r}; GET /aliases lists them")
            if self.settings.serving.default_collection == alias:
                raise CollectionConflict(f"{alias!r} is this server's --default-collection")
            self.aliases = {name: to for name, to in self.aliases.items() if name != alias}
            self._write_aliases()
        return {"deleted": alias}

    def _read_aliases(self) -> dict[str, str]:
        path = self.root / ALIASES_FILE
        if not path.is_file():
            return {}
        try:
            found = json.loads(path.read_text())["aliases"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not an aliases file ({exc}); fix or remove it") from None
        return {checked_name(alias, "alias"): checked_name(to) for alias, to in found.items()}

    def _write_aliases(self) -> None:
        """Whole, then renamed over the old: a crash leaves the old file or the new, never half."""
        path = self.root / ALIASES_FILE
        tmp = path.with_name(f".{ALIASES_FILE}.{os.getpid()}.tmp")
        with open(tmp, "w") as fh:
            json.dump({"aliases": dict(sorted(self.aliases.items()))}, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    # ------------------------------------------------------------------ what is served
    def describe(self, name: str) -> CollectionInfo:
        """A collection as ``GET /collections`` lists it: name, description, size, health, aliases."""
        with self.lease(name) as collection:
            health = collection.service.health()
            shown = Presentation.of(collection.path)
            with self._lock:
                aliases = sorted(alias for alias, to in self.aliases.items() if to == collection.name)
                default = self._default_locked() == collection.name
            manifest = collection.engine.manifest
            return CollectionInfo(
                name=collection.name,
                title=shown.name,
                description=shown.description,
                aliases=aliases,
                default=default,
                documents=manifest.documents,
                chunks=health["documents"],
                bytes=_folder_bytes(collection.path),
                encoder=manifest.encoder,
                writable=health["writable"],
                status=health["status"],
                searches_running=collection.leases - 1,  # this lease is not a search
            )

    def listing(self) -> CollectionsReply:
        """Every collection, the aliases, the default, and the models they share."""
        for name in self._folders():  # folders made since (init, build): served from now on
            if name not in self._open:
                self.discover(name)
        collections = []
        for name in self.names():
            try:
                collections.append(self.describe(name))
            except UnknownCollection:  # dropped meanwhile
                continue
        with self._lock:
            aliases, default = dict(sorted(self.aliases.items())), self._default_locked()
        return CollectionsReply(
            collections=collections, aliases=aliases, default=default, models=self.models.describe()
        )

    def close(self) -> None:
        with self._lock:
            opened, self._open = list(self._open.values()), {}
        for collection in opened:
            collection.close()


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
