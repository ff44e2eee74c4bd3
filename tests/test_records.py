"""A result's provenance, written by a real ``python -m`` run in a real git repository."""

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from offline.records import write_result

ROOT = Path(__file__).resolve().parents[1]
PROBE = """import sys
from pathlib import Path

from offline.records import write_result

write_result(Path("benchmarks/results/probe.json"), {"figure": 1.5}, {"depth": int(sys.argv[-1])})
"""


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "notes.txt").write_text("first\n")
    (tmp_path / ".gitignore").write_text("__pycache__/\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "probe")
    return tmp_path


def _probe(repo: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRID_SEARCH_")}
    env |= {"PYTHONPATH": str(ROOT), "GIT_CEILING_DIRECTORIES": str(repo.parent)}
    env |= {"HYBRID_SEARCH_RRF_K": "60", "HYBRID_SEARCH_LLM_API_KEY": "secret"}
    subprocess.run([sys.executable, "-m", "probe", "--depth", "20"], cwd=repo, env=env, check=True)
    return json.loads((repo / "benchmarks/results/probe.json").read_text())


def test_a_result_names_its_command_commit_settings_and_machine(repo):
    result = _probe(repo)
    assert result["figure"] == 1.5
    made = result["provenance"]
    assert made["command"] == "HYBRID_SEARCH_LLM_API_KEY=*** HYBRID_SEARCH_RRF_K=60 python -m probe --depth 20"
    assert made["commit"] == _git(repo, "rev-parse", "HEAD")
    assert made["dirty"] is False and made["changed"] == []  # the result itself is no change
    assert made["settings"] == {"depth": 20}
    assert abs(datetime.fromisoformat(made["utc"]) - datetime.now(UTC)) < timedelta(minutes=5)
    box = made["machine"]
    assert box["cores"] == os.cpu_count() and box["memory_gib"] > 0 and box["gflops"] > 0
    assert box["cpu"] and "gpu" in box

    (repo / "notes.txt").write_text("edited\n")
    again = _probe(repo)["provenance"]
    assert again["dirty"] is True and again["changed"] == ["notes.txt"]
    assert again["commit"] == made["commit"]


def test_parts_run_again_keep_the_others_with_the_provenance_they_were_made_under(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    path = tmp_path / "parts.json"
    write_result(path, {"fuzz": 1, "load": 2}, {"parts": "fuzz,load"})
    first = json.loads(path.read_text())["provenance"]
    assert first["commit"] is None and first["dirty"] is None  # no git: null, not an error

    write_result(path, {"fuzz": 3}, {"parts": "fuzz"}, update=True)
    second = json.loads(path.read_text())
    assert (second["fuzz"], second["load"]) == (3, 2)
    assert second["provenance"]["settings"] == {"parts": "fuzz"}
    assert second["provenance"]["kept"] == {"load": first}

    write_result(path, {"fuzz": 4}, {"parts": "fuzz"}, update=True)
    assert json.loads(path.read_text())["provenance"]["kept"] == {"load": first}
