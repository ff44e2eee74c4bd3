"""Models on ONNX Runtime: tracing, sessions, and the query encoder (the same embeddings as
sentence-transformers, faster a query; with int8 weights faster again, the embeddings a little
further from fp32's); the cross-encoder's session is the reranker's own
(:mod:`engine.rerank.onnx`: the same scores as eager torch, faster on a CPU). The figures:
docs/configuration.md, "Why these defaults".

A model is traced once into ``onnx/<file>`` beside its weights, or in the user's cache when that
folder is read-only, and re-traced when the weights are newer or the trace was made by an older
recipe (``TRACE`` in the file's metadata). With ``quantize="int8"`` the reranker's trace is quantized
once more into ``<trace>-int8.onnx`` beside it (engine/rerank/int8.py), smoothed on pairs from ``calibration``
when the caller has text to give (the engine: its index's documents).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)
ONNX_DIR = "onnx"
ONNX_FILE = "model.onnx"
# A name of its own: a sentence-transformers folder may ship an ``onnx/model.onnx`` (the hub's MiniLM
# does), with other outputs, which a trace must neither be mistaken for nor overwrite.
ENCODER_FILE = "query-encoder.onnx"
# The query encoder with int8 weights, made from the fp32 trace beside it (:func:`quantized_encoder`).
ENCODER_INT8_FILE = "query-encoder-int8.onnx"
# Its recipe: ONNX Runtime's MatMulNBits, 8-bit symmetric weights in blocks of 16 along each weight's
# input dimension, accuracy level 4 (int8 products, the activations quantized per block). A ~10-token
# query reads every weight once, so fp32 costs what memory delivers (42 MB of MiniLM's matrices);
# int8 reads a quarter. Per-tensor dynamic int8 was faster still but moved the embeddings far more;
# blocks of 16 kept them the closest to fp32's of the recipes that paid (docs/experiments.md, "The
# query encoder in int8").
ENCODER_INT8_RECIPE = "matmul-nbits-8bit-block16-accuracy4"
SOURCE_KEY = "hybrid_search_made_from"  # the fp32 trace an int8 copy was made from: "size:mtime_ns"
# The recipe of a trace; a model traced by another one is traced again. "eager-attention": attention
# written out as plain matrix products. Traced through PyTorch's SDPA, every layer carried the
# NaN-guarding Where and IsNaN of its mask over the whole score tensor, a share of a 3-layer model's
# time on a CPU worth removing for the same scores (docs/cpu-reranking.md, what each ms was).
TRACE = "eager-attention"
TRACE_KEY = "hybrid_search_trace"
# Intra-op threads of one query's encoding: none but the caller's. A query is ~10 tokens, a few small
# products: on 2 cores a pool of 2 saved little for a lone caller at best, and on the cores shared with
# other work it was slower even alone (docs/experiments.md, "The query encoder on ONNX Runtime"). Its
# worker spins after each run beside the stages that follow (the reranker's own pool), and with several
# requests in flight each caller's thread already fills a core, so a pool would put more threads than
# cores to work.
QUERY_THREADS = 1
# How close to the model a checked fp32 trace must have embedded the probe for documents to be
# embedded by it (an fp32 trace gives 1.0 to float noise; the query encoder's own bar is looser)
DOCUMENT_COSINE = 0.99999


def onnx_path(source: str, file: str = ONNX_FILE) -> Path:
    """Where the traced model ``file`` of ``source`` (a folder or a hub id) lives."""
    folder = Path(source)
    if folder.is_dir() and os.access(folder, os.W_OK):
        return folder / ONNX_DIR / file
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hybrid-search" / ONNX_DIR
    return cache / hashlib.sha1(str(folder.resolve() if folder.is_dir() else source).encode()).hexdigest() / file


def current(path: Path, source: str, recipe: str = TRACE) -> bool:
    """Whether the trace at ``path`` serves as it is: made by ``recipe``, after ``source``'s weights."""
    weights = [p.stat().st_mtime for p in Path(source).glob("*.safetensors")] if Path(source).is_dir() else []
    return path.is_file() and path.stat().st_mtime >= max(weights, default=0) and recorded(path, TRACE_KEY) == recipe


def export_onnx(transformer, example: Mapping, output: str, path: Path, head=None, recipe: str = TRACE) -> None:
    """Trace ``head`` (a module over the Hugging Face ``transformer``; default the transformer itself,
    its first output) to ONNX atomically (a temp file of this process + rename), the output named
    ``output`` and inputs shaped like ``example`` (the tokenizer's tensors); the attention is written
    out in plain operators (``TRACE``), whatever the model serves torch with; ``recipe``: what the
    file records it was made by (a head's own recipe builds on ``TRACE``)."""
    import onnx
    import torch

    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in example]
    axes = {n: {0: "batch", 1: "length"} for n in names} | {output: {0: "batch"}}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    transformer.eval()
    if head is not None:
        head.eval()
    serving = transformer.config._attn_implementation
    transformer.set_attn_implementation("eager")
    try:
        with warnings.catch_warnings():  # the tracer's notes on shapes; the tests compare the outputs
            warnings.simplefilter("ignore")
            torch.onnx.export(
                head or transformer,
                (),
                str(partial),
                kwargs={n: example[n] for n in names},
                dynamo=False,  # the TorchScript tracer handles BERT's dynamic shapes without onnxscript
                input_names=names,
                output_names=[output],
                dynamic_axes=axes,
                opset_version=17,
            )
    finally:
        transformer.set_attn_implementation(serving)
    traced = onnx.load(str(partial))
    onnx.helper.set_model_props(traced, {TRACE_KEY: recipe})
    onnx.save(traced, str(partial))
    partial.replace(path)
    log.info("traced to ONNX: %s", path)


def recorded(path: Path, key: str) -> str | None:
    """The value the ONNX file ``path`` records under ``key`` in its metadata, if any."""
    return metadata(path).get(key)


def metadata(path: Path) -> dict[str, str]:
    """Everything the ONNX file ``path`` records in its metadata."""
    import onnx

    return {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}


def quantized_encoder(trace: Path) -> Path:
    """The int8 copy of the query encoder's fp32 ``trace``, made beside it once (:data:`ENCODER_INT8_RECIPE`),
    again when the trace changed (its size and mtime, recorded in the copy) or the recipe did;
    atomically, as a trace is."""
    target = trace.with_name(ENCODER_INT8_FILE)
    made_from = made_as(trace)
    wanted = {TRACE_KEY: ENCODER_INT8_RECIPE, SOURCE_KEY: made_from}
    if target.is_file() and wanted.items() <= metadata(target).items():
        return target
    import onnx

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    root.handlers[:], root.level = handlers, level  # its import calls logging.basicConfig(level=INFO)
    config = DefaultWeightOnlyQuantConfig(block_size=16, is_symmetric=True, accuracy_level=4, bits=8)
    quantizer = MatMulNBitsQuantizer(onnx.load(str(trace)), algo_config=config)
    chatty = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")  # a line per graph node
    kept = chatty.level
    chatty.setLevel(logging.WARNING)
    try:
        quantizer.process()
    finally:
        chatty.setLevel(kept)
    model = quantizer.model.model
    onnx.helper.set_model_props(model, {TRACE_KEY: ENCODER_INT8_RECIPE, SOURCE_KEY: made_from})
    partial = target.with_suffix(f".{os.getpid()}.partial")
    try:
        onnx.save(model, str(partial))
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    log.info("query encoder quantized to int8: %s", target)
    return target


def fast_tokenizer(spec: str, pad_token: str | None = None):
    """The fast tokenizer of the pipeline ``spec`` (a ``tokenizer.json``) in transformers' wrapper,
    which the pair and text tokenizers take: what a model's own gives them, made without the model
    (or torch, which transformers' AutoTokenizer imports)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(spec), pad_token=pad_token)


def open_session(path: Path, device: str, threads: int):
    """An ONNX Runtime session of ``path`` on ``threads`` intra-op threads; on CUDA when asked and
    this ONNX Runtime has the provider, else on the CPU (with a warning)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    providers = ["CPUExecutionProvider"]
    if device == "cuda":
        providers.insert(0, "CUDAExecutionProvider")
    session = ort.InferenceSession(str(path), options, providers=providers)
    if device == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        log.warning("ONNX Runtime has no CUDA provider here (install onnxruntime-gpu): %s runs on the CPU", path)
    return session


class OnnxQueryEncoder:
    """One text's embedding as ``SentenceTransformer.encode(..., normalize_embeddings=True)`` gives it:
    the transformer traced with sentence-transformers' mean pooling and L2 normalisation in the graph
    (:func:`mean_pooled`), fed by the fast tokenizer itself.

    Thread-safe without a lock: an ONNX Runtime session takes concurrent runs, and the tokenizer is
    this object's own copy, its truncation set once (the Hugging Face wrapper re-sets truncation and
    padding whenever a call asks for others, which can fail a concurrent call with "Already
    borrowed"). ``QUERY_THREADS`` says why one thread a run.

    A trace checked against the model once (:meth:`record_check`) keeps, beside it, what it was
    checked at and what feeds it (the tokenizer, the length), so that later loads open it without
    the model: :meth:`checked`.
    """

    def __init__(self, path: Path, tokenizer: str, max_length: int, device: str, int8: bool) -> None:
        from tokenizers import Tokenizer

        self.runtime = "onnx-int8" if int8 else "onnx"
        self.tokenizer = Tokenizer.from_str(tokenizer)
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length)
        self.session = open_session(path, device, QUERY_THREADS)
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.path, self._fed = path, {"tokenizer": tokenizer, "max_length": max_length}

    @classmethod
    def made(cls, model, source: str, device: str, int8: bool = False) -> OnnxQueryEncoder:
        """The encoder of ``model``, the served ``SentenceTransformer`` of ``source`` (its tokenizer
        and, when no current trace exists, its weights, traced in fp32 on the CPU whatever the
        served copy is). ``int8``: run the trace's int8 copy (:func:`quantized_encoder`)."""
        path = onnx_path(source, ENCODER_FILE)
        if not current(path, source):
            transformer = model[0].auto_model
            if device != "cpu":
                transformer = copy.deepcopy(transformer).float().cpu()
            example = model.tokenizer(["a query"], return_tensors="pt")
            export_onnx(transformer, example, "sentence_embedding", path, mean_pooled(transformer))
        if int8:
            path = quantized_encoder(path)
        return cls(path, model.tokenizer.backend_tokenizer.to_str(), model.max_seq_length, device, int8)

    @classmethod
    def checked(cls, source: str, device: str, int8: bool = False) -> OnnxQueryEncoder | None:
        """The encoder of ``source``'s trace as an earlier load checked it, or None (:func:`checked_trace`)."""
        found = checked_trace(source, int8)
        if found is None:
            return None
        path, record = found
        return cls(path, record["tokenizer"], int(record["max_length"]), device, int8)

    def record_check(self, cosine: float) -> None:
        """Keep beside the trace that it passed the check at ``cosine`` (atomically; a folder that
        cannot take it leaves the next load to check again)."""
        target = _check_file(self.path)
        partial = target.with_suffix(f".{os.getpid()}.partial")
        try:
            trace = self.path.with_name(ENCODER_FILE)  # an int8 copy's trace is recorded too
            made = {"file": made_as(self.path), "trace": made_as(trace)}
            partial.write_text(json.dumps(made | {"probe_cosine": cosine, **self._fed}))
            partial.replace(target)
        except OSError as exc:
            log.info("could not record the query encoder's check beside %s: %s", self.path, exc)

    def __call__(self, text: str) -> np.ndarray:
        """The (1, dim) float32 embedding of ``text``."""
        e = self.tokenizer.encode(text)
        return self.session.run(None, _feed([e], self.inputs))[0]


def checked_trace(source: str, int8: bool = False) -> tuple[Path, dict] | None:
    """``source``'s trace (its int8 copy) and the check an earlier load recorded beside it, or None:
    no check recorded for the file as it is now (made again since, or never checked; an int8 copy,
    also for the trace it was made from), or a trace that is not current (:func:`current`)."""
    trace = onnx_path(source, ENCODER_FILE)
    if not current(trace, source):
        return None
    path = trace.with_name(ENCODER_INT8_FILE) if int8 else trace
    try:
        record = json.loads(_check_file(path).read_text())
        checked_as = (record.get("file"), record.get("trace"))
        if checked_as != (made_as(path), made_as(trace)):  # an int8 copy of an earlier trace: made again
            return None
    except (OSError, ValueError):
        return None
    return path, record


class OnnxDocumentEncoder:
    """Batches of texts embedded as ``SentenceTransformer.encode(..., normalize_embeddings=True)``
    embeds them, by the query encoder's fp32 trace once a load has checked it against the model to
    ``DOCUMENT_COSINE``: a writer on a CPU then opens without importing sentence-transformers (most
    of its start), and its vectors differ from torch's by float noise, as a batch's padding already
    makes torch's own differ. Each batch is padded to its longest text and run on ``threads``
    (a batch, unlike a query, fills them; 0: ONNX Runtime's default)."""

    def __init__(self, path: Path, tokenizer: str, max_length: int, device: str, threads: int = 0) -> None:
        from tokenizers import Tokenizer

        self.spec = tokenizer
        self.tokenizer = Tokenizer.from_str(tokenizer)
        padding = json.loads(tokenizer).get("padding") or {}
        self.tokenizer.enable_padding(pad_id=padding.get("pad_id", 0), pad_token=padding.get("pad_token", "[PAD]"))
        self.tokenizer.enable_truncation(max_length)
        self.session = open_session(path, device, threads)
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.dimension = int(self.session.get_outputs()[0].shape[-1])

    @classmethod
    def checked(cls, source: str, device: str, threads: int = 0) -> OnnxDocumentEncoder | None:
        """The encoder of ``source``'s fp32 trace, or None: none checked (:func:`checked_trace`), or
        checked further from the model than ``DOCUMENT_COSINE``."""
        found = checked_trace(source)
        if found is None or float(found[1].get("probe_cosine", 0)) < DOCUMENT_COSINE:
            return None
        path, record = found
        return cls(path, record["tokenizer"], int(record["max_length"]), device, threads)

    def encode(self, texts: list[str], batch_size: int) -> np.ndarray:
        """The (n, dim) float32 embeddings of ``texts``, ``batch_size`` at a time in the given order."""
        out = np.zeros((len(texts), self.dimension), dtype=np.float32)
        for start in range(0, len(texts), batch_size):
            encoded = self.tokenizer.encode_batch(texts[start : start + batch_size])
            out[start : start + len(encoded)] = self.session.run(None, _feed(encoded, self.inputs))[0]
        return out


# an encoder graph's inputs, as the fast tokenizer's ``Encoding`` names them
_COLUMNS = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}


def _feed(encoded: list, inputs: list[str]) -> dict[str, np.ndarray]:
    """The (rows, length) int64 inputs of an encoder graph from equally long tokenizer ``Encoding``s."""
    return {name: np.asarray([getattr(e, _COLUMNS[name]) for e in encoded], dtype=np.int64) for name in inputs}


def _check_file(trace: Path) -> Path:
    return trace.with_suffix(".checked.json")


def made_as(path: Path) -> str:
    """A file as it is now: its size and modification time (a trace made again changes both)."""
    stat = path.stat()
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def mean_pooled(transformer):
    """``transformer`` followed by the arithmetic of sentence-transformers' ``Pooling`` (mean over the
    tokens the mask keeps, count floored at 1e-9) and ``Normalize`` (L2, norm floored at 1e-12)."""
    import torch

    class MeanPooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = transformer

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            hidden = self.transformer(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2, dim=-1)

    return MeanPooled()
