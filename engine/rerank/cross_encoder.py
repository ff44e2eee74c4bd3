"""Cross-encoder reranking with sentence-transformers' ``CrossEncoder``."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from engine.rerank.compiled import CompiledPasses
from engine.rerank.onnx import OnnxCrossEncoder, Pairs
from engine.rerank.pair_assembly import PairAssembler, PassageTokens
from engine.rerank.pair_cache import PairCache
from engine.rerank.pair_tokens import PairRow, PairTokenizer, pad_rows
from engine.retrieval.encoder import resolve_model
from engine.store.tokens import CHARS_PER_TOKEN, TextTokenizer

log = logging.getLogger(__name__)
CARD_FILE = "model_card.json"  # written by `train-reranker`; a model from elsewhere may have none


class RerankerError(RuntimeError):
    """The reranker folder or id cannot be loaded."""


class Scorer(Protocol):
    """What the engine needs of a reranker: a :class:`Reranker`, its micro-batcher, or a client of
    one served elsewhere (a Ray deployment)."""

    name: str
    device: str
    runtime: str
    max_length: int
    memory_context: int

    def score(self, query: str, passages: list[str]) -> list[float]: ...


@runtime_checkable
class PairScorer(Scorer, Protocol):
    """A scorer that makes its pairs apart from scoring them, from token ids where it can (a
    :class:`Reranker`, its micro-batcher, or a :class:`PairPreparer` whose model is in another process)."""

    text_tokens: TextTokenizer | None  # the tokenizer whose ids ``prepare`` reads (None: it reads texts)

    def prepare(self, query: str, passages: list[str], tokens: Sequence[PassageTokens] | None = None) -> Any:
        """The pairs as the model takes them (the ``pairs`` stage); ``tokens``: each passage's ids."""

    def finish(self, prepared: Any) -> list[float]:
        """Their scores (the ``rerank`` stage), in the order of the passages."""


@dataclass
class PreparedPairs:
    """A query's pairs ready for the model: the scores the cache held (None where it did not), and
    for the others their cache keys, model inputs, and the characters their batches are sorted by."""

    scores: list[float | None]
    keys: list[bytes]
    rows: list[PairRow]
    lengths: list[int]


class PairPreparer:
    """The half of a reranker that makes its pairs and keeps their scores: the tokenizer, the window
    (``max_length`` tokens a pair), the stored ids' assembler and the score cache, without the model.
    :class:`Reranker` adds the model; a worker whose reranker lives in another process (``serve
    --workers N`` with a shared reranker) holds this half alone and sends the rows there.
    Subclasses give :meth:`_scores`."""

    def __init__(self, tokenizer, max_length: int, cache: PairCache | None = None) -> None:
        self.max_length = max_length
        # the torch path reads the same token arrays as ONNX Runtime: tokenizing 100 pairs through
        # CrossEncoder.predict took ~200 ms of CPU a query on the H100 machine, 20x the GPU's work
        self.tokenize = PairTokenizer(tokenizer, max_length)
        self.assembler = PairAssembler.create(tokenizer, max_length)
        self.text_tokens = self.assembler.tokenizer if self.assembler is not None else None
        self.cache = cache

    def score(self, query: str, passages: list[str], tokens: Sequence[PassageTokens] | None = None) -> list[float]:
        """One relevance score per passage, in the order given (``tokens``: as for :meth:`prepare`)."""
        return self.finish(self.prepare(query, passages, tokens))

    def score_pairs(self, pairs: list[tuple[str, str]]) -> list[float]:
        """Scores for (query, passage) pairs (the model's activation of its logits), from the cache
        for pairs it holds."""
        return self.finish(self._prepared(pairs))

    def prepare(self, query: str, passages: list[str], tokens: Sequence[PassageTokens] | None = None) -> PreparedPairs:
        """The model inputs of the pairs the cache lacks. With ``tokens`` (each passage's ids), pairs
        are made from them (:mod:`engine.rerank.pair_assembly`): the same inputs as from the texts,
        without tokenizing the passages; a pair that cannot be made so is tokenized."""
        pairs = [(query, p) for p in passages]
        if tokens is None or self.assembler is None:
            return self._prepared(pairs)
        return self._prepared(pairs, lambda todo: self.assembler.rows(query, [tokens[i] for i in todo]))

    def finish(self, prepared: PreparedPairs) -> list[float]:
        return self.finish_together([prepared])[0]

    def finish_together(self, prepared: Sequence[PreparedPairs]) -> list[list[float]]:
        """Several queries' prepared pairs scored together; each gets its own scores."""
        rows = [row for p in prepared for row in p.rows]
        fresh = iter(self._scores(rows, [n for p in prepared for n in p.lengths]) if rows else [])
        scores = []
        for p in prepared:
            mine = [next(fresh) for _ in p.rows]
            if self.cache is not None:
                self.cache.keep(p.keys, mine)
            computed = iter(mine)
            scores.append([s if s is not None else next(computed) for s in p.scores])
        return scores

    def _prepared(
        self, pairs: list[tuple[str, str]], assemble: Callable[[list[int]], list[PairRow | None]] | None = None
    ) -> PreparedPairs:
        """``pairs`` prepared: the cache's scores, and rows for the others from ``assemble`` (given the
        pairs' positions) where it makes them, else tokenized."""
        keys, found = self.cache.lookup(pairs) if self.cache is not None else ([], [None] * len(pairs))
        todo = [i for i, score in enumerate(found) if score is None]
        cut = self.max_length * CHARS_PER_TOKEN
        texts = [(pairs[i][0], pairs[i][1][:cut]) for i in todo]
        rows = assemble(todo) if assemble is not None and todo else [None] * len(todo)
        left = [j for j, row in enumerate(rows) if row is None]
        for j, row in zip(left, self.tokenize.rows([texts[j] for j in left]) if left else [], strict=True):
            rows[j] = row
        return PreparedPairs(found, [keys[i] for i in todo] if keys else [], rows, [len(q) + len(p) for q, p in texts])

    def _scores(self, rows: list[PairRow], lengths: list[int]) -> list[float]:
        """The model's scores of ``rows`` (``lengths``: the characters they are sorted by)."""
        raise NotImplementedError


class Reranker(PairPreparer):
    """Scores (query, document) pairs jointly, in length-sorted batches.

    ``runtime``: ``torch`` (fp16 on CUDA), ``onnx`` (ONNX Runtime, same scores, faster on a CPU), or
    ``auto``: ONNX Runtime on a CPU when it can trace the model (torch when bf16 is chosen), else
    torch. ``quantize="int8"``: ONNX Runtime's dynamic int8 model (needs ONNX Runtime), smoothed on
    the pairs ``calibration`` gives when it has to be made; ``"bf16"``: torch in bfloat16 on a CPU
    (fast where the CPU multiplies bf16 itself); ``"auto"``: see :func:`_auto_precision`. ``cache``:
    scores of pairs seen lately. ``length_cap``: at most this many tokens a pair, whatever the model
    was trained with. ``compile_model``: on CUDA with torch, the
    model compiled over a few shapes and warmed now (:mod:`engine.rerank.compiled`); else ignored.
    """

    def __init__(
        self,
        name: str,
        device: str,
        max_length: int | None = None,
        batch_size: int = 32,
        runtime: str = "auto",
        quantize: str = "auto",
        cache: PairCache | None = None,
        length_cap: int | None = None,
        calibration: Callable[[], Pairs] | None = None,
        compile_model: bool = False,
    ) -> None:
        from sentence_transformers import CrossEncoder

        source = resolve_model(name)
        if Path(name).exists() and not (Path(name) / "config.json").is_file():
            raise RerankerError(f"{name}: not a model folder (no config.json)")
        card = _read_card(Path(source) / CARD_FILE)
        if quantize == "auto":
            quantize = _auto_precision(card["cpu_quantize"], device, runtime)
        if quantize == "bf16" and device != "cpu":  # a setting carried to a GPU machine keeps its reranker
            log.warning("--rerank-quantize bf16 is for a CPU; on %s the reranker runs in fp16", device)
            quantize = "none"
        if quantize == "bf16":
            if runtime == "onnx":
                raise RerankerError("--rerank-quantize bf16 needs the torch runtime, not onnx")
            if not native_bf16():
                log.warning("this CPU has no native bf16 (AVX512-BF16 or AMX): bf16 reranking will be slow")
            wanted = "torch"
        else:
            wanted = runtime if runtime != "auto" else ("onnx" if device == "cpu" or quantize != "none" else "torch")
        if quantize == "int8" and wanted != "onnx":
            raise RerankerError(f"--rerank-quantize {quantize} needs the ONNX runtime, not {runtime}")
        try:
            self.model = CrossEncoder(
                source, device="cpu" if wanted == "onnx" else device, max_length=max_length, num_labels=1
            )
        except Exception as exc:  # the libraries raise many kinds; the user needs the name and cause
            raise RerankerError(f"cannot load reranker {name!r}: {exc}") from exc
        # unset: the length the model was saved with (what `train-reranker` trained), within its positions
        positions = getattr(self.model.transformers_model.config, "max_position_embeddings", 512)
        self.model.max_seq_length = min(self.model.max_seq_length or positions, positions, length_cap or positions)
        super().__init__(self.model.tokenizer, self.model.max_seq_length, cache)
        self.onnx: OnnxCrossEncoder | None = None
        if wanted == "onnx":
            try:
                self.onnx = OnnxCrossEncoder(self.model, source, device, self.max_length, quantize, calibration)
            except Exception as exc:  # tracing or the runtime failed: say so, and why
                if runtime == "onnx" or quantize != "none":
                    raise RerankerError(f"cannot run reranker {name!r} on ONNX Runtime: {exc}") from exc
                log.warning("ONNX Runtime cannot run %s (%s); scoring with torch", name, exc)
                self.model.to(device)
        self.compiled: CompiledPasses | None = None
        if quantize == "bf16":  # eager attention: PyTorch's SDPA is the slower kernel in bf16 on a CPU
            import torch

            self.model.transformers_model.set_attn_implementation("eager")
            self.model.to(torch.bfloat16)
        # on a CPU torch runs the last layer for [CLS] alone where the architecture allows (CUDA keeps
        # the whole model, compiled)
        self.first_token = None
        if self.onnx is None and device == "cpu":
            from engine.rerank.first_token import FirstTokenLogits  # torch, imported where it is used

            self.first_token = FirstTokenLogits.of(self.model.transformers_model)
            if self.first_token is not None and quantize == "bf16":
                self.first_token.head_in_fp32()
        self.compile_state = "off"  # what /health shows: off, compiled, or eager and why
        if self.onnx is None and device == "cuda":
            self.model.half()
            if compile_model:  # only here: a CPU never compiles
                model, pad_id = self.model.transformers_model, self.tokenize.pad_id
                self.compiled = CompiledPasses(model, pad_id, batch_size, self.max_length)
        self.runtime = ("onnx" if quantize == "none" else f"onnx-{quantize}") if self.onnx is not None else "torch"
        if quantize == "bf16":
            self.runtime = "torch-bf16"
        self.name = name
        self.device = device
        self.batch_size = batch_size
        self.memory_context: int = card["memory_context"]
        if self.compiled is not None:
            try:
                self.compiled.warm()
                self.compile_state = "compiled"
            except Exception as exc:  # no compiler, a Triton error...: the eager model serves
                self._eager_from_now(exc)

    def _eager_from_now(self, exc: Exception) -> None:
        """A compiled pass that failed (at warm-up or later, not for memory) leaves the model eager for
        good, said once in the log and in ``compile_state``."""
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
        log.warning("the compiled reranker failed (%s); it runs eager from now on", reason)
        self.compiled = None
        self.compile_state = f"eager: compiling failed ({reason})"

    def _scores(self, rows: list[PairRow], lengths: list[int]) -> list[float]:
        import torch

        return [float(s) for s in self.model.activation_fn(torch.tensor(self._logits(rows, lengths)))]

    def logits(self, pairs: list[tuple[str, str]]) -> list[float]:
        """Raw scores before the activation (what distillation compares)."""
        if not pairs:
            return []
        cut = self.max_length * CHARS_PER_TOKEN
        texts = [(query, passage[:cut]) for query, passage in pairs]
        return self._logits(self.tokenize.rows(texts), [len(q) + len(p) for q, p in texts])

    def _logits(self, rows: list[PairRow], lengths: list[int]) -> list[float]:
        """The model's logits for ``rows``, in batches of rows of similar ``lengths``.

        A GPU out-of-memory error never fails the request: the batch is halved until it fits (and
        stays that size), and at batch size 1 the model moves to the CPU for good.
        """
        import torch

        if self.onnx is not None:
            logits = np.empty(len(rows), dtype=np.float32)
            for batch in _batches(lengths, self.batch_size):
                logits[batch] = self.onnx.run(pad_rows([rows[i] for i in batch], self.tokenize.pad_id))
            return [float(s) for s in logits]
        batch = self.batch_size
        while True:
            try:
                return self._torch_logits(rows, lengths, batch)
            except torch.cuda.OutOfMemoryError:
                self.compiled = None  # eager from now on: its compiled buckets were for the larger batches
                torch.cuda.empty_cache()
                if batch > 1:
                    batch //= 2
                    log.warning("GPU out of memory: reranking in batches of %d from now on", batch)
                    self.batch_size = batch
                    continue
                log.warning("GPU out of memory at batch size 1: reranking on the CPU from now on")
                self.model.to("cpu").float()
                self.device = "cpu"

    def _torch_logits(self, rows: list[PairRow], lengths: list[int], batch: int) -> list[float]:
        """The model's logits for ``rows`` in length-sorted batches of ``batch``."""
        import torch

        model = self.model.transformers_model
        device = next(model.parameters()).device
        logits = np.empty(len(rows), dtype=np.float32)
        with torch.inference_mode():
            for part in _batches(lengths, batch):
                features = pad_rows([rows[i] for i in part], self.tokenize.pad_id)
                if self.compiled is not None:
                    try:
                        logits[part] = self.compiled(features)
                        continue
                    except torch.cuda.OutOfMemoryError:
                        raise
                    except Exception as exc:
                        self._eager_from_now(exc)
                inputs = {name: torch.from_numpy(array).to(device) for name, array in features.items()}
                out = self.first_token(**inputs) if self.first_token is not None else model(**inputs).logits
                logits[part] = out[:, 0].float().cpu().numpy()
        return logits.tolist()


def _batches(lengths: list[int], size: int) -> Iterator[list[int]]:
    """Positions in batches of ``size``, shortest first (padding costs less)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    for start in range(0, len(order), size):
        yield order[start : start + size]


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX), where a bf16 model runs
    ~1.8x the pairs per second of fp32; elsewhere bf16 is emulated and slower than fp32."""
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch's own CPU probes (2.x)
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def _auto_precision(card_quantize: str, device: str, runtime: str) -> str:
    """``--rerank-quantize auto``: a distilled CPU student as its card says (int8); with the runtime
    left to auto too, on a CPU with native bf16, bf16 (the same ranking within 0.001 dev nDCG@10,
    docs/cpu-reranking.md); anything else runs as trained."""
    if device != "cpu":
        return "none"
    if card_quantize != "none":
        return card_quantize if runtime in ("auto", "onnx") else "none"
    return "bf16" if runtime == "auto" and native_bf16() else "none"


def _read_card(card: Path) -> dict:
    """What serving reads of a model card: ``memory_context``, how many citing training queries the
    model reads before each document (0: plain documents), and ``cpu_quantize``, how it is served on
    a CPU unless told otherwise (``int8`` for a distilled CPU student). A model without a card: 0, none."""
    fields = {"memory_context": 0, "cpu_quantize": "none"}
    if not card.is_file():
        return fields
    try:
        written = json.loads(card.read_text())
        fields |= {key: written[key] for key in fields if key in written}
    except (ValueError, TypeError) as exc:
        raise RerankerError(f"{card}: not a model card ({exc})") from exc
    context = fields["memory_context"]
    if not isinstance(context, int) or context < 0:
        raise RerankerError(f"{card}: memory_context must be a whole number >= 0, not {context!r}")
    if fields["cpu_quantize"] not in ("none", "int8"):
        raise RerankerError(f"{card}: cpu_quantize must be none or int8, not {fields['cpu_quantize']!r}")
    return fields
