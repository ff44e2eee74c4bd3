"""The layers of docs/architecture.md, held against the code: no module imports a layer above its
own, nor a room beside it on the same floor."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# floor of each top-level package: data flows up, imports point down
PACKAGES = {"engine": 1, "offline": 2, "index_build": 3, "agents": 3, "serving": 4, "cli": 5, "benchmarks": 6}
# inside the engine: the ground (models and plumbing), storage, the stages, live writes, an index in
# shards searched as one, the pipeline
ENGINE = {
    **dict.fromkeys(("settings", "documents", "errors", "text", "health", "telemetry", "threads", "onnx"), 0),
    "store": 1,
    "retrieval": 2,
    "rerank": 3,
    "fusion": 3,
    "live": 3,
    "shards": 4,
    "search": 5,
    "": 6,  # engine/__init__.py hands the engine's face on
}


def room(module: str) -> tuple[str, int, int]:
    """(room, floor, engine floor) of a dotted module name."""
    parts = module.split(".")
    if parts[0] != "engine":
        return parts[0], PACKAGES[parts[0]], 0
    inner = parts[1] if len(parts) > 1 else ""
    return f"engine.{inner}".rstrip("."), PACKAGES["engine"], ENGINE[inner]


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of the project's own packages in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from engine import telemetry`` imports the module engine.telemetry
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "engine" else [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in PACKAGES]
    return found


def violations(root: Path) -> list[str]:
    """Every import that points up a floor, or sideways into another room on the same floor."""
    wrong = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative.parts[0] not in PACKAGES:
            continue
        module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        here, floor, inner = room(module)
        for line, name in imported(path):
            if name == "engine" or (name.split(".")[0] == "engine" and name.split(".")[1] not in ENGINE):
                name = "engine"  # engine's face, or a name it hands on
            there, other_floor, other_inner = room(name)
            if there == here:
                continue
            if (other_floor, other_inner) >= (floor, inner):
                wrong.append(
                    f"{relative}:{line}: {here} imports {there} (floor {other_floor}.{other_inner} >= {floor}.{inner})"
                )
    return wrong


def test_no_layer_imports_one_above_it_or_beside_it():
    assert violations(ROOT) == []


def test_an_upward_import_is_caught(tmp_path):
    (tmp_path / "engine" / "store").mkdir(parents=True)
    (tmp_path / "engine" / "store" / "docstore.py").write_text("from engine.search import HybridEngine\n")
    (tmp_path / "agents").mkdir()
    (tmp_path / "agents" / "router.py").write_text("import serving.app\nfrom index_build import builder\n")
    found = violations(tmp_path)
    assert len(found) == 3, found
    assert any("engine.store imports engine.search" in v for v in found)
    assert any("agents imports serving" in v for v in found) and any("agents imports index_build" in v for v in found)


def test_the_map_names_every_module():
    """docs/architecture.md's map names each module of the layers (a new module is placed there)."""
    import re

    named = set(re.findall(r"\w+", (ROOT / "docs" / "architecture.md").read_text()))
    layers = ("engine", "offline", "index_build", "agents", "serving", "cli")
    modules = [p for layer in layers for p in (ROOT / layer).rglob("*.py") if not p.name.startswith("__")]
    assert [str(p.relative_to(ROOT)) for p in modules if p.stem not in named] == []
