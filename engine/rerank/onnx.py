"""The cross-encoder on ONNX Runtime: the same scores as eager torch, faster on a CPU, and int8 where
asked (:mod:`engine.rerank.int8`), smoothed on the caller's text. The figures: docs/configuration.md,
"Why these defaults".

Loading the model through sentence-transformers is most of a reranker's start (the library pulls in
torch, transformers and scikit-learn). A load that traces the model, or finds its trace current,
keeps beside the trace what the model said that serving needs (:class:`ModelFacts`), so that later
starts on ONNX Runtime read that and the tokenizer, and never load the model.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from engine import threads
from engine.onnx import ONNX_FILE, TRACE, current, export_onnx, fast_tokenizer, made_as, onnx_path, open_session
from engine.rerank.int8 import SMOOTHED, quantize_int8, recipe
from engine.rerank.pair_tokens import PairTokenizer

log = logging.getLogger(__name__)
Pairs = Sequence[tuple[str, str]]
# The reranker's recipe: TRACE with the last layer run for [CLS] alone (engine/rerank/first_token.py),
# in a file of its own, so that code of another version sharing the folder keeps its own trace
FIRST_TOKEN_TRACE = f"{TRACE}+first-token"
FIRST_TOKEN_FILE = "model-first-token.onnx"
FACTS_FILE = "reranker-facts.json"  # beside the traces: :class:`ModelFacts`


def _sigmoid(logits: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for x < -88: the score is 0, as torch gives
        return 1.0 / (1.0 + np.exp(-logits))


# the activations of the logits a CrossEncoder may load with, by torch's name, as numpy runs them
ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"Sigmoid": _sigmoid, "Identity": lambda x: x}
_SIZES = ("hidden_size", "num_hidden_layers", "intermediate_size", "max_position_embeddings")


@dataclass(frozen=True)
class ModelFacts:
    """What serving needs of a cross-encoder that loading it says: its trace (the file and the file
    as it was made, ``size:mtime``), the window it loads with when none is asked (None: not known
    yet), its activation of the logits (a name of :data:`ACTIVATIONS`), its sizes (what a pair
    costs, the positions it holds), and its tokenizer (the pipeline and the padding token)."""

    trace: str
    made: str
    max_seq_length: int | None
    activation: str
    sizes: dict[str, int]
    tokenizer: str
    pad_token: str | None

    @classmethod
    def of(cls, cross_encoder, trace: Path, window: int | None) -> ModelFacts | None:
        """The facts of the loaded ``cross_encoder`` traced to ``trace`` (``window``: its own, when
        known), or None when its activation is none numpy runs (such a model is always loaded)."""
        activation = type(cross_encoder.activation_fn).__name__
        if activation not in ACTIVATIONS:
            return None
        tokenizer = cross_encoder.tokenizer
        spec, pad = tokenizer.backend_tokenizer.to_str(), tokenizer.pad_token
        return cls(trace.name, made_as(trace), window, activation, cls.sizes_of(cross_encoder), spec, pad)

    @staticmethod
    def sizes_of(cross_encoder) -> dict[str, int]:
        """The model's sizes its config gives (of :data:`_SIZES`)."""
        config = cross_encoder.transformers_model.config
        return {key: value for key in _SIZES if isinstance(value := getattr(config, key, None), int)}

    @classmethod
    def recorded(cls, source: str) -> ModelFacts | None:
        """The facts kept for ``source``, or None: none kept, unreadable, or kept for a trace that is
        not there as it was (made again, or out of date: :func:`~engine.onnx.current`)."""
        try:
            facts = cls(**json.loads(onnx_path(source, FACTS_FILE).read_text()))
            trace = onnx_path(source, facts.trace)
            recipe_of = {FIRST_TOKEN_FILE: FIRST_TOKEN_TRACE, ONNX_FILE: TRACE}
            if facts.trace not in recipe_of or facts.activation not in ACTIVATIONS:
                return None
            if not current(trace, source, recipe_of[facts.trace]) or made_as(trace) != facts.made:
                return None
        except (OSError, ValueError, TypeError):
            return None
        return facts

    def fast_tokenizer(self):
        """The model's tokenizer, made from the pipeline kept (:func:`~engine.onnx.fast_tokenizer`)."""
        return fast_tokenizer(self.tokenizer, self.pad_token)

    def keep(self, source: str) -> None:
        """Kept beside the trace (atomically; a folder that cannot take it leaves the next start to load the model)."""
        target = onnx_path(source, FACTS_FILE)
        partial = target.with_suffix(f".{os.getpid()}.partial")
        try:
            partial.write_text(json.dumps(asdict(self)))
            partial.replace(target)
        except OSError as exc:
            log.info("could not keep the reranker's facts beside %s: %s", target.parent, exc)


def trace_model(cross_encoder, source: str) -> Path:
    """The current trace of ``cross_encoder`` (loaded from ``source``), made now if there is none."""
    from engine.rerank.first_token import FirstTokenLogits

    model = cross_encoder.transformers_model
    head = FirstTokenLogits.of(model)  # the last layer for [CLS] alone, where the architecture allows
    trace = FIRST_TOKEN_TRACE if head is not None else TRACE
    path = onnx_path(source, FIRST_TOKEN_FILE if head is not None else ONNX_FILE)
    if not current(path, source, trace):
        example = cross_encoder.tokenizer(["query"], ["a passage"], return_tensors="pt")
        export_onnx(model, example, "logits", path, head, trace)
    return path


class OnnxCrossEncoder:
    """The model's logits (``CrossEncoder.predict`` without the activation) on ONNX Runtime, from its
    trace at ``path``; ``quantize="int8"``: from the trace's int8 copy, made (smoothed on the pairs
    ``calibration`` gives, tokenized by ``tokenize``) when it is missing or older than the trace."""

    def __init__(
        self,
        path: Path,
        tokenize: PairTokenizer,
        device: str,
        quantize: str = "none",
        calibration: Callable[[], Pairs] | None = None,
    ) -> None:
        if quantize == "int8":
            traced, path = path, path.with_name(f"{path.stem}-int8.onnx")
            stale = not path.is_file() or path.stat().st_mtime < traced.stat().st_mtime
            if stale or (calibration is not None and recipe(path) != SMOOTHED):
                pairs = list(calibration()) if calibration is not None else []
                quantize_int8(traced, path, [tokenize(pairs[i : i + 32]) for i in range(0, len(pairs), 32)])
        # a query's 20-100 pairs of ~100 tokens are worth the process's cores (docs/experiments.md)
        self.session = open_session(path, device, threads.share() or 0)
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.max_length = tokenize.max_length
        self.path = path

    def run(self, features: dict[str, np.ndarray]) -> np.ndarray:
        """The logits of one padded batch."""
        return self.session.run(None, {name: features[name] for name in self.inputs})[0][:, 0]
