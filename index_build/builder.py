"""Build an index directory from a BEIR dataset, a folder of files, or nothing (an empty index to
ingest into): one index (:mod:`index_build.one_index`), or in shards (:mod:`index_build.shards`)."""

from __future__ import annotations

from engine.settings import EngineSettings
from engine.store.index_dir import Manifest
from index_build.adapt import FULL_MISSING, AdaptError
from index_build.adapt.generated import QueryWriter
from index_build.corpus import Corpus
from index_build.one_index import build_one_index
from index_build.settings import BuildSettings
from index_build.shards import build_sharded


def build_index(
    settings: EngineSettings,
    build: BuildSettings,
    corpus: Corpus | None = None,
    progress: bool = True,
    ray: str | None = None,
    questions: QueryWriter | None = None,
    release: bool = False,
) -> Manifest:
    """The index ``build`` describes at ``settings.index_dir``, built into a work folder beside it and
    swapped in whole, resumable when stopped (:func:`~index_build.one_index.build_one_index` says
    what each argument means); ``build.shards`` above 1: in that many shards."""
    if build.adapt == "full":
        raise AdaptError(FULL_MISSING)
    if build.shards > 1:
        return build_sharded(settings, build, corpus, progress, ray, release)  # adapts nothing: no questions
    return build_one_index(settings, build, corpus, progress, ray, questions, release)
