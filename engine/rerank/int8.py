"""The int8 reranker: ONNX Runtime's dynamic quantization, smoothed first where text is at hand.

Dynamic quantization gives each activation one scale a batch, so the few channels of a transformer's
hidden states that run 10-100x larger than the rest leave the others a handful of levels.
SmoothQuant (Xiao et al., 2023) moves that range into the weights, which are quantized per output
channel: every product ``X @ W`` with a constant ``W`` becomes ``(X / s) @ (s * W)``, with
``s = max|X_j| ** ALPHA / max|W_j| ** (1 - ALPHA)`` per input channel ``j``, the ``max|X_j|`` read
from the fp32 model on calibration pairs (one ``Mul`` per activation, shared by the products that
read it). On the 3-layer student, smoothing brought the int8 ranking much closer to fp32's than
plain int8, for a few ms of Mul nodes (docs/cpu-reranking.md, smoothed int8).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from engine.onnx import recorded

log = logging.getLogger(__name__)
# Share of each channel's range moved into the weights: 0.5 (the paper's default for LLMs) lost
# agreement with fp32 here, and 0.9 agreed best of 0.7 to 1.0 (the sweep: docs/experiments.md,
# "2026-11-24 · CPU reranking: the trace, the tokenizer and smoothed int8").
ALPHA = 0.9
RECIPE_KEY = "hybrid_search_int8"
SMOOTHED = f"smoothquant-{ALPHA}"
PLAIN = "plain"

Feed = dict[str, np.ndarray]


def quantize_int8(traced: Path, path: Path, calibration: Sequence[Feed] = ()) -> str:
    """Quantize ``traced`` into ``path`` (atomically), smoothed on ``calibration`` (model inputs)
    when given; returns the recipe, which the file also records (:func:`recipe`).

    Only products with a constant weight are quantized, per output channel: the attention's own
    products stay fp32, and so do the embeddings (int8 tables cost rank agreement for no speed:
    docs/cpu-reranking.md, smoothed int8).
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(traced))
    made = PLAIN
    if calibration:
        products = _weighted_products(model)
        _smooth(model, products, _activation_maxima(model, products, calibration))
        made = SMOOTHED
    onnx.helper.set_model_props(model, {RECIPE_KEY: made})
    smoothed, partial = path.with_suffix(".smoothed"), path.with_suffix(".partial")
    onnx.save(model, str(smoothed))
    quiet = _Unadvised()
    logging.getLogger().addFilter(quiet)
    try:
        quantize_dynamic(
            str(smoothed), str(partial), weight_type=QuantType.QInt8, per_channel=True, op_types_to_quantize=["MatMul"]
        )
    finally:
        logging.getLogger().removeFilter(quiet)
        smoothed.unlink(missing_ok=True)
    partial.replace(path)
    log.info("reranker quantized to int8 (%s): %s", made, path)
    return made


def recipe(path: Path) -> str | None:
    """How ``path`` was quantized (None: before recipes were recorded)."""
    return recorded(path, RECIPE_KEY)


def _weighted_products(model) -> dict[str, list[int]]:
    """Positions of the ``MatMul`` nodes with a constant weight of their own, by the activation they
    multiply."""
    weights = {i.name for i in model.graph.initializer}
    uses = defaultdict(int)
    for node in model.graph.node:
        for name in node.input:
            uses[name] += 1
    products = defaultdict(list)
    for position, node in enumerate(model.graph.node):
        if node.op_type == "MatMul" and node.input[1] in weights and uses[node.input[1]] == 1:
            products[node.input[0]].append(position)
    return dict(products)


def _activation_maxima(model, products: dict[str, list], calibration: Sequence[Feed]) -> dict[str, np.ndarray]:
    """``max |x_j|`` per channel of each activation in ``products``, over the calibration inputs."""
    import onnx
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    names = list(products)
    probe.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    maxima: dict[str, np.ndarray] = {}
    for feed in calibration:
        outputs = session.run(names, {k: v for k, v in feed.items() if k in wanted})
        for name, value in zip(names, outputs, strict=True):
            peak = np.abs(value.reshape(-1, value.shape[-1])).max(axis=0)
            maxima[name] = np.maximum(maxima[name], peak) if name in maxima else peak
    return maxima


def _smooth(model, products: dict[str, list[int]], maxima: dict[str, np.ndarray]) -> None:
    """Rewrite each ``X @ W`` of ``products`` as ``(X * (1 / s)) @ (s * W)``, in place."""
    import onnx
    from onnx import numpy_helper

    weights = {i.name: i for i in model.graph.initializer}
    nodes = model.graph.node
    muls, inverses = {}, []
    for activation, positions in products.items():
        arrays = [numpy_helper.to_array(weights[nodes[p].input[1]]) for p in positions]
        weight_peak = np.max([np.abs(w).max(axis=1) for w in arrays], axis=0)
        scale = maxima[activation].clip(1e-5) ** ALPHA / weight_peak.clip(1e-5) ** (1 - ALPHA)
        scale = scale.clip(1e-5).astype(np.float32)
        inverse, smoothed = f"{activation}/smooth_scale", f"{activation}/smoothed"
        inverses.append(numpy_helper.from_array((1 / scale).astype(np.float32), inverse))
        for p, w in zip(positions, arrays, strict=True):
            weights[nodes[p].input[1]].CopyFrom(numpy_helper.from_array(w * scale[:, None], nodes[p].input[1]))
            nodes[p].input[0] = smoothed
        muls[positions[0]] = onnx.helper.make_node(
            "Mul", [activation, inverse], [smoothed], name=f"{activation}/smooth"
        )
    ordered = []
    for position, node in enumerate(nodes):  # each Mul just before its first reader: still topologically sorted
        if position in muls:
            ordered.append(muls[position])
        ordered.append(onnx.NodeProto())
        ordered[-1].CopyFrom(node)
    model.graph.initializer.extend(inverses)
    model.graph.ClearField("node")
    model.graph.node.extend(ordered)


class _Unadvised(logging.Filter):
    """Drops the quantizer's advice to pre-process the model (shape inference for static
    quantization: nothing here to act on)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "pre-processing before quantization" not in record.getMessage()
