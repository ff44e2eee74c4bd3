"""The target's limits and the stages ``run`` can run, with what each is expected to take there."""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
TRANSFER_BYTES = 64 * MIB  # the working tree that travels with one command, carried parts included
TREE_ALLOWANCE = 16 * MIB  # the project's tracked files (14.3 MiB when measured) travel every time
PART_BYTES = TRANSFER_BYTES - TREE_ALLOWANCE - 1 * MIB
COMMAND_CHARS = 2000  # one command line
COMMAND_SECONDS = 600  # one command's run
RESULT_FILES, RESULT_BYTES = 8, 16 * MIB  # what comes back from one command
KIT_DIR = ".gpukit"  # ignored by git; parts and manifest live here
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Stage:
    name: str
    minutes: float  # expected on an H100, installation excluded
    what: str


STAGES = (  # minutes as measured on an H100 on 2026-11-24 (benchmarks/results/h100/)
    Stage("check", 0.4, "the GPU, driver, torch and what was installed"),
    Stage("tests", 0.5, "the GPU tests (tests/test_gpu.py) on the real CUDA path"),
    Stage("train", 6.1, "train-reranker with the GPU recipe: every training query, 256 tokens"),
    Stage("evaluate", 3.1, "evaluate --split dev with the GPU-trained reranker: the dev table"),
    Stage("rerank", 1.5, "reranker pairs/s: fp32, tf32, bf16, fp16, torch.compile, CUDA graphs, rank agreement"),
    Stage("bench", 1.4, "per-stage latency at rerank depth 0-200, queries/s at 1-128 clients, in-process"),
    Stage("http", 3.7, "end to end through REST and A2A at 1, 8 and 64 clients"),
    # not yet run on a GPU: minutes estimated from the CPU rehearsal's steps (`rehearse`, docs/gpu.md)
    Stage("compiled", 1.5, "the served reranker eager and torch.compile'd over its buckets: ms a query, warm-up"),
    Stage("workers", 2.5, "serve --workers 4, each worker with its own reranker: REST at 1, 8 and 64 clients"),
    Stage("shared", 2.5, "serve --workers 4, one reranker process batching every worker's pairs: the same"),
)
INSTALL_MINUTES = 0.2
# Four commands after the parts arrive, each well inside COMMAND_SECONDS.
BATCHES = (("check", "tests", "train"), ("evaluate", "rerank", "bench"), ("http",), ("compiled", "workers", "shared"))
REHEARSED = ("compiled", "workers", "shared")  # the stages `rehearse` runs on a CPU, small


def stage(name: str) -> Stage:
    for known in STAGES:
        if known.name == name:
            return known
    raise ValueError(f"unknown stage {name!r}: one of {', '.join(s.name for s in STAGES)}")


def device_command(stages: tuple[str, ...]) -> str:
    """The command line of one call on the GPU machine (run in the repo root): it takes the part that
    call carries, installs once all have arrived, then runs ``stages``."""
    wanted = f" --stages {','.join(stages)}" if stages else ""
    return f"PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu_kit run{wanted} --out $OUT"


def carry(part: int) -> list[str]:
    """The ignored paths one call carries: its part and the manifest that checks it."""
    return [f"{KIT_DIR}/{MANIFEST}", f"{KIT_DIR}/part-{part}"]


def describe(parts: int) -> str:
    """The plan ``run`` prints first: one line a call, with its expected minutes."""
    lines = [f"GPU kit: {parts} part(s) of at most {PART_BYTES // MIB} MiB; {parts + len(BATCHES) - 1} calls"]
    for part in range(1, parts + len(BATCHES)):
        batch = BATCHES[part - parts] if part >= parts else ()
        minutes = 0.5 + sum(stage(s).minutes for s in batch) + (INSTALL_MINUTES if part == parts else 0)
        took = f"carry {' '.join(carry(part))}; " if part <= parts else ""
        lines.append(f"  call {part}: {took}{device_command(batch)}  (~{minutes:.1f} min)")
        lines.extend(f"      {s}: {stage(s).what} (~{stage(s).minutes:.1f} min)" for s in batch)
    lines.append("  the calls must follow each other within the machine's 30 s idle time: /tmp is lost after it")
    return "\n".join(lines)
