"""How a reranker runs, decided once, before any model is loaded.

The device, the runtime and precision asked for (``--rerank-runtime``, ``--rerank-quantize``), the
compile switch and the model's card decide the backend (ONNX Runtime or torch), the precision, and
whether the model is compiled or runs its last layer for [CLS] alone. :func:`plan_reranker` is a
pure function of those, so the decision and its reasons can be shown (``/health``) and tested
without a model; :class:`~engine.rerank.cross_encoder.Reranker` carries it out with the backends of
:mod:`engine.rerank.backends`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal


class RerankerError(RuntimeError):
    """The reranker folder or id cannot be loaded, or cannot run as asked."""


@dataclass(frozen=True)
class RerankPlan:
    """What runs the model. ``notes``: each choice made for the user, said once in the log and
    shown in ``/health``; ``torch_if_onnx_fails``: the runtime was left to ``auto``, so torch
    serves when ONNX Runtime cannot trace or run the model."""

    device: str
    backend: Literal["onnx", "torch"]
    precision: Literal["fp32", "fp16", "bf16", "int8"]
    compile: bool
    first_token: bool  # torch on a CPU: the last layer for [CLS] alone, where the architecture allows
    graphs: bool = False  # torch on CUDA, not compiled: each one-pass bucket replayed from a CUDA graph
    torch_if_onnx_fails: bool = False
    notes: tuple[str, ...] = ()

    @property
    def runtime(self) -> str:
        """The runtime as the engine names it: onnx, onnx-int8, torch or torch-bf16."""
        if self.backend == "onnx":
            return "onnx-int8" if self.precision == "int8" else "onnx"
        return "torch-bf16" if self.precision == "bf16" else "torch"

    def on_torch(self, why: str) -> RerankPlan:
        """This plan with torch in place of ONNX Runtime, which could not serve (``why``)."""
        return replace(
            self,
            backend="torch",
            precision="fp16" if self.device == "cuda" else "fp32",
            first_token=self.device == "cpu",
            torch_if_onnx_fails=False,
            notes=(*self.notes, f"ONNX Runtime cannot run it ({why}); torch serves"),
        )

    def shown(self) -> dict:
        return {
            "device": self.device,
            "runtime": self.runtime,
            "precision": self.precision,
            "compile": self.compile,
            "first_token_only": self.first_token,
            "cuda_graphs": self.graphs,
            "notes": list(self.notes),
        }


def plan_reranker(
    device: str,
    runtime: str = "auto",
    quantize: str = "auto",
    compile_model: bool = False,
    card_quantize: str = "none",
    bf16_native: bool = False,
    cuda_graphs: bool = True,
) -> RerankPlan:
    """The plan for a reranker on ``device`` (cpu or cuda). ``runtime``: auto, torch or onnx;
    ``quantize``: auto, none, int8 or bf16; ``card_quantize``: how the model's card says it is
    served on a CPU; ``bf16_native``: whether this CPU multiplies bf16 itself (AVX512-BF16, AMX);
    ``cuda_graphs``: torch on CUDA replays its passes from CUDA graphs (not when compiled).
    Raises :class:`RerankerError` for a combination that cannot run."""
    notes: list[str] = []
    if quantize == "auto":
        quantize = _auto_precision(card_quantize, device, runtime, bf16_native)
    if quantize == "bf16" and device != "cpu":  # a setting carried to a GPU machine keeps its reranker
        notes.append(f"--rerank-quantize bf16 is for a CPU; on {device} the reranker runs in fp16")
        quantize = "none"
    if quantize == "bf16":
        if runtime == "onnx":
            raise RerankerError("--rerank-quantize bf16 needs the torch runtime, not onnx")
        if not bf16_native:
            notes.append("this CPU has no native bf16 (AVX512-BF16 or AMX): bf16 reranking will be slow")
        backend = "torch"
    else:
        backend = runtime if runtime != "auto" else ("onnx" if device == "cpu" or quantize != "none" else "torch")
    if quantize == "int8" and backend != "onnx":
        raise RerankerError(f"--rerank-quantize {quantize} needs the ONNX runtime, not {runtime}")
    compiled = compile_model and backend == "torch"
    if compile_model and not compiled:
        notes.append(f"compiling is for the torch runtime; with {backend} the model runs as is")
    precision = "int8" if quantize == "int8" else "bf16" if quantize == "bf16" else "fp32"
    if backend == "torch" and device == "cuda":
        precision = "fp16"
    return RerankPlan(
        device=device,
        backend=backend,
        precision=precision,
        compile=compiled,
        first_token=backend == "torch" and device == "cpu",
        graphs=cuda_graphs and backend == "torch" and device == "cuda" and not compiled,
        torch_if_onnx_fails=backend == "onnx" and runtime == "auto" and quantize == "none",
        notes=tuple(notes),
    )


def _auto_precision(card_quantize: str, device: str, runtime: str, bf16_native: bool) -> str:
    """``--rerank-quantize auto``: a distilled CPU student as its card says (int8); with the runtime
    left to auto too, on a CPU with native bf16, bf16 (the same dev ranking as fp32, faster:
    docs/cpu-reranking.md#bf16-on-a-cpu-that-multiplies-bf16); anything else runs as trained."""
    if device != "cpu":
        return "none"
    if card_quantize != "none":
        return card_quantize if runtime in ("auto", "onnx") else "none"
    return "bf16" if runtime == "auto" and bf16_native else "none"


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX), where a bf16 model runs
    more pairs a second than fp32 (docs/cpu-reranking.md); elsewhere bf16 is emulated and slower.
    On Linux the kernel's CPU flags say it; elsewhere torch's own probes are asked (importing torch)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), None)
    except OSError:
        flags = None
    if flags is not None:
        return bool({"avx512_bf16", "amx_bf16"} & set(flags))
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch's own CPU probes (2.x)
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)
