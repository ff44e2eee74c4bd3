"""The target's limits and the stages ``run`` can run, with what each is expected to take there."""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
TRANSFER_BYTES = 64 * MIB  # the working tree that travels with one command, carried parts included
TREE_ALLOWANCE = 17 * MIB  # the project's tracked files (16.0 MiB on 2026-11-28) travel every time
PART_BYTES = TRANSFER_BYTES - TREE_ALLOWANCE - 1 * MIB
COMMAND_CHARS = 2000  # one command line
COMMAND_SECONDS = 600  # one command's run
RESULT_FILES, RESULT_BYTES = 8, 16 * MIB  # what comes back from one command
KIT_DIR = ".gpukit"  # ignored by git; parts and manifest live here
MANIFEST = "manifest.json"


MACHINE_START_MINUTES = 1.5  # the first call's wait for a machine, counted in the session's time
GAP_MINUTES = 0.2  # between one call's end and the next call's start (the machine idles, counted)
CALL_MINUTES = 0.3  # a call's transfers and Python start, besides its stages
LEASE_MINUTES = 13  # the plan's whole, start and gaps included: a 15-minute machine with room to spare


@dataclass(frozen=True)
class Stage:
    name: str
    minutes: float  # expected on an H100, installation excluded
    timeout_s: int  # the stage is stopped (its process group killed) past this; the next one runs
    what: str


STAGES = (  # minutes as measured on an H100: 2026-11-24 (benchmarks/results/h100/), 2026-11-26 (h100-serving/),
    # 2026-11-27 (h100-1127/); micro and no-rerank estimated (never run on a GPU before 2026-11-28)
    Stage("micro", 2.5, 240, "the reranker's passes, random MiniLM shapes: split, one pass, graphs, a profile"),
    Stage("shared", 2.0, 200, "serve --workers auto, the served reranker's shape and window: REST at 1, 64, 8"),
    # (since 2026-11-26 the workers of `shared` encode and search on the CPU: the layout measured best)
    Stage("no-rerank", 0.7, 100, "serve --workers auto --no-rerank at 64 clients: the host's own ceiling"),
    Stage("compiled", 0.7, 100, "the served reranker eager and compiled: model ms apart from pairs, graphs a bucket"),
    Stage("shared-gpu-encoder", 1.1, 140, "shared, the reranker process also encoding every worker's queries"),
    Stage("workers", 1.3, 165, "serve --workers 4, each worker with its own reranker: REST at 1, 64 and 8 clients"),
    Stage("check", 0.4, 60, "the GPU, driver, torch and what was installed"),
    Stage("tests", 1.9, 180, "the GPU tests (tests/test_gpu.py) on the real CUDA path"),
    Stage("train", 6.1, 480, "train-reranker with the GPU recipe: every training query, 256 tokens"),
    Stage("evaluate", 3.1, 300, "evaluate --split dev with the GPU-trained reranker: the dev table"),
    Stage("rerank", 1.5, 180, "reranker pairs/s: fp32, tf32, bf16, fp16, torch.compile, CUDA graphs (needs train)"),
    Stage("bench", 1.4, 180, "per-stage latency at rerank depth 0-200, queries/s at 1-128 clients, in-process"),
    Stage("http", 3.7, 300, "end to end through REST and A2A at 1, 8 and 64 clients"),
    Stage("dense", 4.2, 360, "dense search at 1M and 10M vectors: torch and faiss-gpu against the CPU's IVF"),
)
INSTALL_MINUTES = 0.2
# The first call measures the reranker's passes with the image's packages alone (BARE), before a
# part is in; after the parts, the serving figures (the call that also installs), then the checks;
# the rest only when a lease has time left (OPTIONAL: not in the plan's total; shared-gpu-encoder
# there since it was measured and not adopted, compiled and workers since they were measured).
BARE = ("micro",)
BATCHES = (("shared", "no-rerank"), ("check", "tests"))
OPTIONAL = (
    ("compiled", "workers"),
    ("train",),
    ("evaluate", "rerank"),
    ("bench", "http"),
    ("dense",),
    ("shared-gpu-encoder",),
)
REHEARSED = ("compiled", "workers", "shared", "no-rerank", "shared-gpu-encoder", "dense")  # `rehearse`: on a CPU, small


def plan_minutes(parts: int) -> list[float]:
    """Each call's expected minutes, the machine's start and the gaps included: the parts' calls
    (the first runs :data:`BARE` too), then :data:`BATCHES` (the last part rides with the first batch)."""
    calls = [CALL_MINUTES + GAP_MINUTES] * (parts - 1)
    for i, batch in enumerate(BATCHES):
        install = INSTALL_MINUTES if i == 0 else 0
        calls.append(CALL_MINUTES + GAP_MINUTES + install + sum(stage(s).minutes for s in batch))
    calls[0] += MACHINE_START_MINUTES + sum(stage(s).minutes for s in BARE)
    return calls


def stage(name: str) -> Stage:
    for known in STAGES:
        if known.name == name:
            return known
    raise ValueError(f"unknown stage {name!r}: one of {', '.join(s.name for s in STAGES)}")


def device_command(stages: tuple[str, ...]) -> str:
    """The command line of one call on the GPU machine (run in the repo root): it takes the part that
    call carries, runs the :data:`BARE` stages among ``stages`` at once, installs once all parts have
    arrived, then runs the others."""
    wanted = f" --stages {','.join(stages)}" if stages else ""
    return f"PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu_kit run{wanted} --out $OUT"


def carry(part: int) -> list[str]:
    """The ignored paths one call carries: its part and the manifest that checks it."""
    return [f"{KIT_DIR}/{MANIFEST}", f"{KIT_DIR}/part-{part}"]


def describe(parts: int) -> str:
    """The plan ``run`` prints first: one line a call, with its expected minutes."""
    minutes = plan_minutes(parts)
    lines = [
        f"GPU kit: {parts} part(s) of at most {PART_BYTES // MIB} MiB; {len(minutes)} calls,"
        f" ~{sum(minutes):.1f} min with the machine's start and the gaps (at most {LEASE_MINUTES})"
    ]
    for call in range(1, len(minutes) + 1):
        batch = (BARE if call == 1 else ()) + (BATCHES[call - parts] if call >= parts else ())
        took = f"carry {' '.join(carry(call))}; " if call <= parts else ""
        lines.append(f"  call {call}: {took}{device_command(batch)}  (~{minutes[call - 1]:.1f} min)")
        for name in batch:
            known = stage(name)
            lines.append(f"      {name}: {known.what} (~{known.minutes:.1f} min, stopped at {known.timeout_s} s)")
    for batch in OPTIONAL:
        took = sum(stage(s).minutes for s in batch)
        lines.append(f"  optional, with time left: {device_command(batch)}  (~{took:.1f} min)")
    lines.append("  the calls must follow each other within the machine's 30 s idle time: /tmp is lost after it")
    return "\n".join(lines)
