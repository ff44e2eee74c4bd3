"""A result's provenance, written by a real ``python -m`` run in a real git repository."""

import json
import os
import re
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


RESULTS = ROOT / "benchmarks" / "results"
SHA = re.compile(r"\b[0-9a-f]{7,40}\b")


def _named_in_file(result: object) -> bool:
    """``command`` and ``commit`` at the top (a hand-written or later-completed file) or in the
    ``provenance`` block :func:`write_result` adds."""
    if not isinstance(result, dict):
        return False
    for where in (result, result.get("provenance")):
        if isinstance(where, dict) and where.get("command") and SHA.fullmatch(str(where.get("commit") or "")):
            return True
    return False


def _named_in_docs(doc: str) -> list[str]:
    """The paths (globs, under benchmarks/results/) that docs/benchmarks.md's tables of every
    committed result give a command and a commit: the files older than ``write_result``."""
    section = doc.split("## Every committed result", 1)[1]
    named = []
    for row in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]] if row.startswith("| `") else []
        if len(cells) < 4 or not cells[2] or not SHA.search(cells[3]):
            continue
        folder = ""
        for name in re.findall(r"`([^`]+)`", cells[0]):
            folder = name.rsplit("/", 1)[0] + "/" if "/" in name else folder  # `a/x.json`, `y.json`: a/y.json
            for expanded in _braces(name if "/" in name else folder + name):
                named.append(expanded)
    return named


def _braces(name: str) -> list[str]:
    """``a{,-b}.{json,png}``: a.json, a.png, a-b.json, a-b.png."""
    found = re.search(r"\{([^{}]*)\}", name)
    if not found:
        return [name]
    return [x for alt in found[1].split(",") for x in _braces(name[: found.start()] + alt + name[found.end() :])]


def _unnamed(results: Path, doc: str) -> list[str]:
    import fnmatch

    globs = _named_in_docs(doc)
    missing = []
    for path in sorted(results.rglob("*.json")):
        rel = path.relative_to(results).as_posix()
        if not _named_in_file(json.loads(path.read_text())) and not any(fnmatch.fnmatch(rel, g) for g in globs):
            missing.append(rel)
    return missing


def test_every_committed_result_names_its_command_and_commit():
    """Each JSON under benchmarks/results/ says how it was made and on what code: in the file (its
    provenance block, or ``command`` and ``commit`` at the top), or, for files older than
    ``write_result``, in docs/benchmarks.md's table of every committed result."""
    assert _unnamed(RESULTS, (ROOT / "docs" / "benchmarks.md").read_text()) == []


def test_a_result_without_its_command_or_commit_is_caught(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "made.json").write_text(
        json.dumps({"x": 1, "provenance": {"command": "python -m b", "commit": "0" * 40}})
    )
    (tmp_path / "hand.json").write_text(json.dumps({"command": "python -m b", "commit": "abc1234", "x": 1}))
    (tmp_path / "bare.json").write_text(json.dumps({"x": 1}))
    (tmp_path / "no-commit.json").write_text(json.dumps({"provenance": {"command": "python -m b", "commit": None}}))
    (tmp_path / "rows.json").write_text(json.dumps([{"x": 1}]))
    for name in ("a.json", "b-2.json", "c.json"):
        (tmp_path / "old" / name).write_text("{}")
    doc = "# x\n## Every committed result\n\n| file | measures | command | commit | machine |\n| --- |\n"
    doc += "| `old/{a,b-*}.json` | m | `python -m b a\\|b` | 1234abc | 2 CPU |\n"
    doc += "| `rows.json` | m | `python -m b` | | |\n"
    assert _unnamed(tmp_path, doc) == ["bare.json", "no-commit.json", "old/c.json", "rows.json"]
