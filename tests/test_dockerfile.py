"""The GPU image's structure, checked without building it (``python -m benchmarks.container`` builds
and runs it for real): every package pyproject.toml installs reaches the image, one CUDA stack,
a non-root final stage without build tools, and an entrypoint and environment the CLI accepts."""

import fnmatch
import json
import re
import subprocess
import tomllib
from pathlib import Path
from types import SimpleNamespace

import yaml
from setuptools import find_namespace_packages

from cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "Dockerfile.cuda").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# torch's CUDA major, from the Linux wheel's METADATA (Requires-Dist: cuda-toolkit[...]==13.0.3,
# nvidia-cudnn-cu13): a new torch pin must be looked up again before the base image follows it.
TORCH_CUDA_MAJOR = {"2.13.0": 13}


def _stages() -> list[str]:
    return re.split(r"^(?=FROM )", DOCKERFILE, flags=re.M)[1:]


def _instruction(name: str, text: str = DOCKERFILE) -> list[str]:
    """Each ``name`` instruction's arguments, continuation lines joined."""
    joined = re.sub(r"\\\n(\s*#.*\n)*", " ", text)
    return [m.group(1).strip() for m in re.finditer(rf"^{name}\s+(.+)$", joined, re.M)]


def _ignored(path: str) -> bool:
    """.dockerignore's verdict on a path (last matching rule wins; a rule matches a path or a parent)."""
    verdict = False
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        rule = line.strip()
        if not rule or rule.startswith("#"):
            continue
        negate, pattern = rule.startswith("!"), rule.lstrip("!").rstrip("/")
        parts = path.split("/")
        if any(fnmatch.fnmatch("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)):
            verdict = not negate
    return verdict


def _installed_files() -> list[str]:
    """The tracked files setuptools installs: the modules of packages.find and the package data."""
    find = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    packages = find_namespace_packages(str(ROOT), include=find["include"])
    data = PYPROJECT["tool"]["setuptools"].get("package-data", {})
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    files = []
    for path in tracked:
        folder, name = path.rsplit("/", 1) if "/" in path else ("", path)
        package = folder.replace("/", ".")
        if package in packages and (
            name.endswith(".py") or any(fnmatch.fnmatch(name, g) for g in data.get(package, []))
        ):
            files.append(path)
    return files


def test_every_installed_package_is_copied_into_the_image():
    copied = [
        src for line in _instruction("COPY", _stages()[0]) for src in line.split()[:-1] if not src.startswith("--")
    ]
    files = _installed_files()
    tops = sorted({f.split("/")[0] for f in files})
    assert {"engine", "index_build", "agents", "serving", "benchmarks"} <= set(tops)
    missing = [t for t in tops if t not in copied]
    assert not missing, f"pyproject.toml installs {missing}, which Dockerfile.cuda does not COPY"
    ignored = [f for f in files if _ignored(f)]
    assert not ignored, f".dockerignore keeps out installed files: {ignored[:5]}"
    readme = PYPROJECT["project"]["readme"]
    assert readme in copied and "pyproject.toml" in copied and not _ignored(readme)


def test_dockerignore_keeps_out_what_the_image_must_not_hold():
    for path in (
        "indexes/nfcorpus/manifest.json",
        ".venv/bin/python",
        ".git/HEAD",
        "tests/test_cli.py",
        "benchmarks/results/container.json",
        "engine/__pycache__/pipeline.cpython-312.pyc",
        ".gpukit/x",
    ):
        assert _ignored(path), path


def test_one_cuda_stack_torchs():
    torch = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch=="))
    major = TORCH_CUDA_MAJOR[torch.split("==")[1]]
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE, re.M).group(1)
    assert re.fullmatch(rf"nvidia/cuda:{major}\.[\d.]+-[\w-]*ubuntu24\.04", base), base
    assert [f.split()[0] for f in _instruction("FROM")] == ["${BASE_IMAGE}", "${BASE_IMAGE}"]
    runs = " ".join(_instruction("RUN"))
    assert ".[gpu]" not in runs and "faiss-gpu" not in runs and "onnxruntime-gpu" not in runs
    assert not re.search(rf"cu(?!{major})\d\d", runs)


def test_final_stage_is_non_root_without_build_tools():
    build, final = _stages()
    assert re.match(r"FROM \$\{BASE_IMAGE\} AS build\b", build)
    assert "--from=build /opt/venv /opt/venv" in " ".join(_instruction("COPY", final))
    installs = " ".join(_instruction("RUN", final))
    for tool in ("build-essential", "gcc", "g++", "python3-pip", "python3-venv", "curl"):
        assert tool not in installs.split()
    assert not re.search(r"\b[\w.+]+-dev\b", installs)
    assert "rm -rf /var/lib/apt/lists" in installs and "pip uninstall -y pip" in " ".join(_instruction("RUN", build))
    assert _instruction("USER", final) == ["search"] and "--uid 10001" in installs
    assert _instruction("VOLUME", final) == ['["/data/indexes"]']
    # no compiler, so no torch.compile: the image says so itself, whatever the default becomes
    assert "HYBRID_SEARCH_RERANK_COMPILE=false" in final


def test_ports_healthcheck_and_entrypoint_match_the_cli():
    final = _stages()[-1]
    assert _instruction("EXPOSE", final) == ["8000 9010"]
    assert "http://127.0.0.1:8000/health" in final
    entrypoint = json.loads(_instruction("ENTRYPOINT", final)[0])  # exec form: a JSON list, no shell
    assert entrypoint[0] == "/usr/bin/tini" and entrypoint[-1] == "hybrid-search"
    args = build_parser().parse_args(json.loads(_instruction("CMD", final)[0]))
    assert args.command == "serve" and args.build_if_missing
    args = build_parser().parse_args(["serve", "--build-if-missing", "--public-url", "http://host:9010"])
    assert args.public_url == "http://host:9010"


def test_environment_names_real_settings():
    from serving.settings import PART_OF

    names = re.findall(r"HYBRID_SEARCH_([A-Z_]+)=", DOCKERFILE + (ROOT / "compose.yaml").read_text())
    assert names and all(n.lower() in PART_OF for n in names)
    assert (
        "HYBRID_SEARCH_DATA_DIR=/data/dataset" in DOCKERFILE
        and "HYBRID_SEARCH_INDEX_DIR=/data/indexes/nfcorpus" in DOCKERFILE
    )


def test_compose_runs_the_spec_scenario():
    service = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["hybrid-search"]
    assert service["build"]["dockerfile"] == "Dockerfile.cuda"
    assert {p.split(":")[-1] for p in service["ports"]} == {"8000", "9010"}
    assert "index:/data/indexes" in service["volumes"]
    assert any(v.endswith(":/data/dataset:ro") for v in service["volumes"])
    assert "HYBRID_SEARCH_PUBLIC_URL" in service["environment"]


def test_the_containers_command_reaches_the_index_build(monkeypatch, tmp_path):
    """``serve --build-if-missing`` builds through the typed build function, from serve's settings
    alone (it once called the command with build-only arguments missing)."""
    import index_build.builder
    import index_build.corpus
    from cli import index as commands
    from serving.settings import Settings

    built = []
    corpus = SimpleNamespace(skipped=[], files=1, chunks=1, dataset=SimpleNamespace(training_split=lambda: "train"))
    manifest = SimpleNamespace(documents=1, encoder="e", dimension=1, dense_index="flat", settings={"chunks": 1})
    monkeypatch.setattr(index_build.corpus, "open_corpus", lambda *a, **k: corpus)
    monkeypatch.setattr(index_build.builder, "build_index", lambda *a, **k: built.append(a) or manifest)
    args = build_parser().parse_args(json.loads(_instruction("CMD", _stages()[-1])[0]))
    assert args.build_if_missing
    assert commands.build_from(Settings(index_dir=tmp_path / "index", data_dir=tmp_path)) == 0 and built
    assert "mkdir -p /data/dataset" not in DOCKERFILE and "/data/dataset" not in " ".join(_instruction("RUN"))
