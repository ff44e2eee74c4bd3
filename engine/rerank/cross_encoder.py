"""Cross-encoder reranking with sentence-transformers' ``CrossEncoder``, loaded only where it runs
(torch) or has to be traced: a start on ONNX Runtime with its trace current reads the tokenizer and
the facts kept beside the trace (:class:`~engine.rerank.onnx.ModelFacts`)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from engine.onnx import onnx_path
from engine.rerank.backends import OnnxBackend, TorchBackend
from engine.rerank.onnx import ACTIVATIONS, ModelFacts, OnnxCrossEncoder, Pairs, trace_model
from engine.rerank.pair_assembly import PairAssembler, PassageTokens
from engine.rerank.pair_cache import PairCache
from engine.rerank.pair_tokens import PairRow, PairTokenizer
from engine.rerank.plan import RerankerError, native_bf16, plan_reranker
from engine.rerank.token_rows import TokenRows
from engine.retrieval.encoder import resolve_model
from engine.store.tokens import CHARS_PER_TOKEN, TextTokenizer

log = logging.getLogger(__name__)
CARD_FILE = "model_card.json"  # written by `train-reranker`; a model from elsewhere may have none


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
    rows: TokenRows
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
        # CrossEncoder.predict cost many times the GPU's own work in CPU (docs/gpu.md, where a query's
        # time went)
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
        return self.start_together(prepared)()

    def start_together(self, prepared: Sequence[PreparedPairs]) -> Callable[[], list[list[float]]]:
        """:meth:`finish_together` in two halves: the model started now (on CUDA, queued on the GPU),
        the scores when the callable returned is called, so that a batcher prepares its next batch
        while this one runs."""
        rows = TokenRows.joined([p.rows for p in prepared])
        started = self._start(rows, [n for p in prepared for n in p.lengths]) if len(rows) else list
        return lambda: self._handed_out(prepared, started())

    def _handed_out(self, prepared: Sequence[PreparedPairs], computed: list[float]) -> list[list[float]]:
        """Each query's scores: the cache's, and the ``computed`` ones in their places (kept in the cache)."""
        fresh = iter(computed)
        scores = []
        for p in prepared:
            mine = [next(fresh) for _ in range(len(p.rows))]
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
        made = TokenRows.of(rows)
        return PreparedPairs(found, [keys[i] for i in todo] if keys else [], made, [len(q) + len(p) for q, p in texts])

    def _scores(self, rows: TokenRows, lengths: list[int]) -> list[float]:
        """The model's scores of ``rows`` (``lengths``: the characters they are sorted by)."""
        raise NotImplementedError

    def _start(self, rows: TokenRows, lengths: list[int]) -> Callable[[], list[float]]:
        """:meth:`_scores` started; the callable gives them (here computed at once)."""
        scores = self._scores(rows, lengths)
        return lambda: scores


class Reranker(PairPreparer):
    """Scores (query, document) pairs jointly, in length-sorted batches, as its plan says
    (:func:`~engine.rerank.plan.plan_reranker`: the backend, precision and compile decided once
    from ``device``, ``runtime``, ``quantize``, ``compile_model`` and the model's card).

    ``runtime``: ``torch`` (fp16 on CUDA), ``onnx`` (ONNX Runtime, same scores, faster on a CPU), or
    ``auto``: ONNX Runtime on a CPU when it can trace the model (torch when bf16 is chosen), else
    torch. ``quantize="int8"``: ONNX Runtime's dynamic int8 model, smoothed on the pairs
    ``calibration`` gives when it has to be made; ``"bf16"``: torch in bfloat16 on a CPU; ``"auto"``:
    see the plan. ``cache``: scores of pairs seen lately. ``length_cap``: at most this many tokens a
    pair, whatever the model was trained with. ``compile_model``: on CUDA with torch, the model
    compiled over a few shapes and warmed now (:mod:`engine.rerank.compiled`), eager if that fails.
    ``batch_tokens``: the largest batch a caller gathers (CUDA's one-pass buckets hold it);
    ``cuda_graphs``: on CUDA, uncompiled torch replays its passes from CUDA graphs.
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
        batch_tokens: int = 0,
        cuda_graphs: bool = True,
    ) -> None:
        source = resolve_model(name)
        if Path(name).exists() and not (Path(name) / "config.json").is_file():
            raise RerankerError(f"{name}: not a model folder (no config.json)")
        card = _read_card(Path(source) / CARD_FILE)
        bf16_native = device == "cpu" and native_bf16()
        plan = plan_reranker(device, runtime, quantize, compile_model, card["cpu_quantize"], bf16_native, cuda_graphs)
        self.name, self.source, self._asked_length = name, source, max_length
        self._model, self._loading = None, threading.Lock()
        self._model_device = "cpu" if plan.backend == "onnx" else device  # ONNX Runtime traces on the CPU
        facts = ModelFacts.recorded(source) if plan.backend == "onnx" else None
        if facts is None or (max_length is None and facts.max_seq_length is None):
            facts, tokenizer = None, self.model.tokenizer  # loads the model
        else:
            tokenizer = facts.fast_tokenizer()
        own = max_length or (facts.max_seq_length if facts else self.model.max_seq_length)
        sizes = facts.sizes if facts else ModelFacts.sizes_of(self.model)
        # unset: the length the model was saved with (what `train-reranker` trained), within its positions
        positions = sizes.get("max_position_embeddings") or 512
        super().__init__(tokenizer, min(own or positions, positions, length_cap or positions), cache)
        if self._model is not None:
            self._model.max_seq_length = self.max_length
        self.backend: OnnxBackend | TorchBackend
        if plan.backend == "onnx":
            try:
                path = onnx_path(source, facts.trace) if facts else self._traced(None if max_length else own)
                onnx = OnnxCrossEncoder(
                    path, self.tokenize, device, "int8" if plan.precision == "int8" else "none", calibration
                )
                self.backend = OnnxBackend(onnx, plan, batch_size, self.tokenize.pad_id)
            except Exception as exc:  # tracing or the runtime failed: say so, and why
                if not plan.torch_if_onnx_fails:
                    raise RerankerError(f"cannot run reranker {name!r} on ONNX Runtime: {exc}") from exc
                plan = plan.on_torch(f"{type(exc).__name__}: {str(exc).strip()[:200]}")
        if plan.backend == "torch":
            model, pad_id = self.model.transformers_model, self.tokenize.pad_id
            self.backend = TorchBackend(model, plan, batch_size, self.max_length, pad_id, batch_tokens)
        for note in plan.notes:
            log.warning("reranker %s: %s", name, note)
        self.sizes = sizes
        self.activation = ACTIVATIONS.get(facts.activation if facts else type(self.model.activation_fn).__name__)
        self.plan = plan
        self.runtime = plan.runtime
        self.memory_context: int = card["memory_context"]

    @property
    def model(self):
        """The sentence-transformers ``CrossEncoder``, loaded now if not yet (once, whoever asks
        first): the torch backend runs it; on ONNX Runtime only a start without facts kept needs it."""
        if self._model is None:
            with self._loading:
                if self._model is None:
                    self._model = _load(self.name, self.source, self._model_device, self._asked_length)
                    if hasattr(self, "max_length"):
                        self._model.max_seq_length = self.max_length
        return self._model

    def _traced(self, window: int | None) -> Path:
        """The model's current trace (made now if none is), its facts kept beside it; ``window``:
        the model's own (None: a window was asked for, so the one kept before stands)."""
        path = trace_model(self.model, self.source)
        known = ModelFacts.recorded(self.source)
        facts = ModelFacts.of(self.model, path, window if window is not None else known and known.max_seq_length)
        if facts is not None and facts != known:
            facts.keep(self.source)
        return path

    @property
    def device(self) -> str:
        """Where the model runs now (a GPU out of memory at batch size 1 moves it to the CPU)."""
        return self.backend.device

    @property
    def batch_size(self) -> int:
        return self.backend.batch_size

    @property
    def compile_state(self) -> str:
        return self.backend.compile_state

    @property
    def gflop_per_pair(self) -> float | None:
        """A pair's work at the window, in GFLOP: each token through every layer's weights, and the
        attention's two products over the window (the embeddings are lookups); what depth x window
        costs a query (docs/gpu.md). None for a model whose config does not give its sizes."""
        sizes, length = self.sizes, self.max_length
        if not {"hidden_size", "intermediate_size", "num_hidden_layers"} <= sizes.keys():
            return None
        width = sizes["hidden_size"]
        per_token = 4 * width * width + 2 * width * sizes["intermediate_size"]
        return round(2 * sizes["num_hidden_layers"] * (per_token * length + 2 * length * length * width) / 1e9, 3)

    @property
    def running(self) -> dict:
        """The plan as carried out: what ``/health`` shows."""
        shown = self.plan.shown() | {"compile": self.compile_state, "batch_size": self.batch_size}
        return shown | {"one_pass": self.backend.passes_state}

    def _scores(self, rows: TokenRows, lengths: list[int]) -> list[float]:
        return self._start(rows, lengths)()

    def _start(self, rows: TokenRows, lengths: list[int]) -> Callable[[], list[float]]:
        logits = self.backend.launch(rows, lengths)
        if self.activation is not None:
            return lambda: self.activation(logits()).tolist()
        import torch

        return lambda: [float(s) for s in self.model.activation_fn(torch.from_numpy(logits()))]

    def logits(self, pairs: list[tuple[str, str]]) -> list[float]:
        """Raw scores before the activation (what distillation compares)."""
        if not pairs:
            return []
        cut = self.max_length * CHARS_PER_TOKEN
        texts = [(query, passage[:cut]) for query, passage in pairs]
        return self._logits(TokenRows.of(self.tokenize.rows(texts)), [len(q) + len(p) for q, p in texts])

    def _logits(self, rows: TokenRows, lengths: list[int]) -> list[float]:
        return [float(s) for s in self.backend.logits(rows, lengths)]


def _load(name: str, source: str, device: str, max_length: int | None):
    """The ``CrossEncoder`` of ``source`` (one score a pair) on ``device``."""
    from sentence_transformers import CrossEncoder

    try:
        return CrossEncoder(source, device=device, max_length=max_length, num_labels=1)
    except Exception as exc:  # the libraries raise many kinds; the user needs the name and cause
        raise RerankerError(f"cannot load reranker {name!r}: {exc}") from exc


def pair_tokenizer(source: str):
    """The tokenizer the reranker at ``source`` makes its pairs with, for a process that leaves the
    model to another: from the facts kept beside its trace where there are some (no torch), else
    loaded from its folder."""
    facts = ModelFacts.recorded(source)
    if facts is not None:
        return facts.fast_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


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
