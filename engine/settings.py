"""What the online engine is told: where its index is, how it retrieves, fuses and reranks, and how
live writes become searchable. The server's whole configuration composes this part with the other
layers' (:mod:`serving.settings`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field

DEFAULT_ENCODER = "sentence-transformers/all-MiniLM-L6-v2"
CUDA_RERANK_DEPTH = 100
CUDA_RERANK_BATCH, CPU_RERANK_BATCH = 128, 32
CPU_RERANK_DEPTH = 20
RERANK_MAX_LENGTH = 96  # the served window, on any device (the frontier: docs/configuration.md)
RERANK_BATCH_TOKENS = 1024 * 256  # the micro-batcher's earlier cap, 1,024 pairs, at the GPU recipe's 256 tokens


def _unset(value: object) -> object:
    """An empty value, or the word none, as a TOML file or a variable can give it, means unset."""
    return None if value in ("", "none") else value


MaybeStr = Annotated[str | None, BeforeValidator(_unset)]
MaybePath = Annotated[Path | None, BeforeValidator(_unset)]

# what a request may change of the served fusion, reranking and depths (engine/documents.py: SearchRequest)
CONTROLS = ("fusion.method", "fusion.k", "fusion.weights", "rerank.enabled", "rerank.depth", "retrievers.depth")
BUILT_IN = ("bm25", "dense", "memory")  # retrievers whose depth and weight are settings of their own names


def _json(value: object) -> object:
    """A table given as text (an environment variable): JSON."""
    return json.loads(value) if isinstance(value, str) else value


def _listed(value: object) -> object:
    """A list given as text (a flag, a variable): comma-separated; empty for none."""
    return [part.strip() for part in value.split(",") if part.strip()] if isinstance(value, str) else value


class RetrieverSettings(BaseModel):
    """One first-stage retriever's part in fusion."""

    model_config = ConfigDict(extra="forbid")

    depth: int = Field(100, ge=1, description="candidates it hands to fusion")
    weight: float = Field(1.0, ge=0, description="its weight in RRF (0: its candidates are not fused)")


class EngineSettings(BaseModel):
    """Retrieval, fusion and reranking: what every command that searches an index reads."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    index_dir: Path = Field(Path("indexes/nfcorpus"), description="index directory built by `build`")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where models run (auto: CUDA when present)")
    retrieval_device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="where the query encoder and dense search run (auto: --device). cpu under `serve --workers N`"
        " on a GPU leaves the GPU to the one reranker process: no worker opens a CUDA context of its own",
    )
    encode_batch_size: int = Field(64, ge=1, description="texts the encoder embeds at once (build, ingest)")

    # retrieval and fusion
    bm25_k1: float = Field(0.9, gt=0, description="BM25 term-frequency saturation")
    bm25_b: float = Field(0.4, ge=0, le=1, description="BM25 length normalisation")
    bm25_depth: int = Field(100, ge=1, description="BM25 candidates to fuse")
    dense_depth: int = Field(100, ge=1, description="dense candidates to fuse")
    rrf_k: float = Field(10.0, gt=0, description="reciprocal rank fusion constant k (tuned on dev)")
    bm25_weight: float = Field(1.0, ge=0, description="BM25 weight in RRF")
    dense_weight: float = Field(1.0, ge=0, description="dense weight in RRF")
    hnsw_ef_search: int = Field(
        128, ge=1, description="HNSW search breadth, at least (an hnsw index searches as wide as its build tuned)"
    )
    warmup_searches: int = Field(
        5000,
        ge=0,
        description="BM25 searches a server runs at start on snippets of its own documents, so that the JVM has"
        " compiled Lucene's search path before the first request instead of during the first thousands (0: none)",
    )
    query_encoder_runtime: Literal["auto", "torch", "onnx"] = Field(
        "auto",
        description="what encodes a query: auto = ONNX Runtime on a CPU (the same embeddings, faster a query), torch"
        " on CUDA; batches (build, ingest) stay on torch (docs/configuration.md#why-these-defaults-the-figures)",
    )
    query_encoder_quantize: Literal["none", "int8"] = Field(
        "none",
        description="int8 = the ONNX query encoder with int8 weights (8-bit blocks of 16): faster a query on a CPU,"
        " its embedding checked against fp32's at load; not the default, since some dev stages moved more than a"
        " default may (docs/configuration.md#why-these-defaults-the-figures); none = fp32",
    )
    memory: bool = Field(True, description="fuse the judgment memory when the index has one")
    memory_neighbors: int = Field(10, ge=1, description="similar training queries that vote in the judgment memory")
    memory_depth: int = Field(100, ge=1, description="judgment-memory candidates to fuse")
    memory_weight: float = Field(1.5, ge=0, description="judgment-memory weight in RRF (tuned on dev)")
    retrievers: Annotated[dict[str, RetrieverSettings], BeforeValidator(_json)] = Field(
        default_factory=dict,
        description="depth and weight of each retriever registered beside bm25, dense and memory, by name ([engine."
        "retrievers.NAME] in TOML); those three read their own settings (--bm25-depth, --bm25-weight, ...)",
    )
    request_controls: Annotated[list[Literal[CONTROLS]], BeforeValidator(_listed)] = Field(
        list(CONTROLS),
        description="what a search request may change, comma-separated (default: all of "
        + ", ".join(CONTROLS)
        + "); the others stay as served, and a request setting one is refused by name",
    )
    max_request_depth: int | None = Field(
        None, ge=1, description="deepest a request may set a retriever's depth (default: the request's own limit, 1000)"
    )
    max_request_rerank_depth: int | None = Field(
        None, ge=1, description="deepest a request may set the rerank depth (default: the request's own limit, 200)"
    )
    spare_threads: int = Field(
        1,
        ge=0,
        validation_alias=AliasChoices("spare_threads", "filter_threads"),  # its name until 2026-11-29
        description="spare threads a query's work runs on beside it while one is idle (the dense search beside"
        " BM25 and the memory; a narrow filter's second pass beside its first); busy, the query runs it itself"
        " (0: always in turn)",
    )
    page_pins: int = Field(
        256, ge=1, description="rankings pinned at once for their next pages (a request's paginate), the oldest dropped"
    )
    page_pin_seconds: float = Field(
        600.0, gt=0, description="how long a pinned ranking answers its page tokens (after that: 410, search again)"
    )
    page_pins_file: Path | None = Field(
        None,
        description="the SQLite file holding pinned rankings and their key, shared by the workers of one server"
        " (set by serve --workers; none: in this process's memory)",
    )
    adapted: bool = Field(
        True,
        description="serve what `build --adapt` learned from the documents when its held-out check paid (an index"
        " without judgments; --no-adapted: plain RRF)",
    )
    fusion: Literal["auto", "learned", "rrf"] = Field(
        "auto",
        description="auto = the index's learned fusion when it has one (`build` trains it from train judgments),"
        " else RRF; learned = require it; rrf = RRF only (and `build` trains none)",
    )

    # reranking
    rerank: bool = Field(True, description="rerank fused candidates with the cross-encoder (--no-rerank: fused order)")
    reranker: MaybeStr = Field(
        None, description="CrossEncoder id or folder (default <index-dir>/reranker when present)"
    )
    rerank_depth: int | None = Field(
        None, ge=1, description="fused candidates the cross-encoder rescores (default: 100 on CUDA, 20 on CPU)"
    )
    rerank_blend: float = Field(
        0.5,
        ge=0,
        le=1,
        description="reranker's share of the head's order: 1 = the reranker alone, 0 = fusion alone; between, a"
        " weighted sum of the two z-scored scores (tuned on dev)",
    )
    rerank_batch_size: int | None = Field(
        None,
        ge=1,
        description="pairs a reranker pass scores (default 128 on CUDA, one pass for a query's 100; 32 on CPU)",
    )
    rerank_runtime: Literal["auto", "torch", "onnx"] = Field(
        "auto",
        description="auto = ONNX Runtime on a CPU (the same scores, faster), torch fp16 on CUDA"
        " (docs/configuration.md#why-these-defaults-the-figures)",
    )
    rerank_quantize: Literal["auto", "none", "int8", "bf16"] = Field(
        "auto",
        description="int8 = ONNX Runtime's dynamic int8 reranker, smoothed on the index's text: more pairs per"
        " second on a CPU (most with VNNI) at a small cost in dev nDCG@10; bf16 = torch in bfloat16 on a CPU with"
        " native bf16 (AVX512-BF16 or AMX): more pairs per second than fp32 there, the same dev ranking; auto ="
        " int8 for a distilled CPU student (its model card says so), else bf16 on a CPU with native bf16, else"
        " none (docs/configuration.md#why-these-defaults-the-figures)",
    )
    rerank_cache_size: int = Field(
        20_000, ge=0, description="(query, document) scores kept for repeated questions; 0 = no cache"
    )
    rerank_cache_s: float = Field(600.0, gt=0, description="seconds a cached reranker score stays valid")
    max_length: int | None = Field(
        None,
        ge=16,
        le=512,
        description="cross-encoder tokens per (query, document) pair (default: the length the reranker was trained"
        " with, at most 96: on dev as good as 128 at every depth, for 26% less work a pair)",
    )
    rerank_batch_wait_ms: float = Field(
        3.0,
        ge=0,
        description="ms a query waits for others to share a rerank batch, on CUDA or in the shared reranker"
        " process of --workers N (a query alone never waits); 0 = no wait (in-process on CUDA: no batching)",
    )
    rerank_batch_tokens: int = Field(
        RERANK_BATCH_TOKENS,
        ge=1,
        description="token budget of one cross-request rerank batch (text-embeddings-inference's max-batch-tokens):"
        " concurrent queries' pairs are gathered until their tokens would pass it, then scored together (on CUDA"
        " in one pass, elsewhere in length-sorted passes of --rerank-batch-size pairs); tokens, not pairs, because"
        " a pair's cost grows with its length. More: fuller GPU passes under load, each query waiting on a longer"
        " batch. Default: 1,024 pairs of 256 tokens",
    )
    rerank_cuda_graphs: bool = Field(
        True,
        description="on CUDA, each gathered rerank batch runs as one pass replayed from a CUDA graph captured at"
        " start for its size bucket (no compiler needed); off: the same one pass, eager. A capture that fails"
        " leaves it eager, and /health says why",
    )
    rerank_compile: bool = Field(
        False,
        description="the torch reranker compiled (torch.compile) for a few length and batch buckets and"
        " warmed over them at start, each pass padded up to its bucket; a compile that fails leaves it eager"
        " (/health says why). Off by default: in the served path it did not pay on an H100 (docs/gpu.md), and"
        " it needs a C compiler at run time. Ignored by the ONNX runtime (a CPU's default: --rerank-runtime torch to"
        " compile there)",
    )

    # live documents
    refresh_interval_s: float = Field(
        1.0, gt=0, le=3600, description="longest an acknowledged write waits before searches see it, in seconds"
    )
    checkpoint_bytes: int = Field(
        64 << 20, ge=0, description="write-ahead log bytes that trigger a checkpoint (0: after every refresh)"
    )
    followed: bool = Field(
        False,
        description="other processes follow this writer (set by serve --workers and --ray, not a flag): each"
        " refresh that applied writes commits Lucene and publishes its position for them",
    )

    def retriever(self, name: str) -> RetrieverSettings:
        """``name``'s depth and weight: bm25, dense and memory from their own settings, another from
        ``retrievers`` (by default 100 candidates of weight 1)."""
        if name in BUILT_IN:
            return RetrieverSettings(depth=getattr(self, f"{name}_depth"), weight=getattr(self, f"{name}_weight"))
        return self.retrievers.get(name) or RetrieverSettings()

    def rerank_depth_for(self, device: str) -> int:
        """On a CPU the cross-encoder is the cost: the top 20 at 96 tokens keep a query with the
        trained reranker interactive, and a GPU scores 100 pairs in less time than that (the figures:
        docs/configuration.md, "Why these defaults")."""
        return self.rerank_depth or (CUDA_RERANK_DEPTH if device == "cuda" else CPU_RERANK_DEPTH)

    def rerank_batch_for(self, device: str) -> int:
        """On CUDA a query's 100 pairs go in one pass of 128, not four of 32 that launch every kernel
        four times, so the rerank stage ran faster on an H100 (docs/configuration.md, "Why these
        defaults"); a CPU gains nothing from larger batches."""
        return self.rerank_batch_size or (CUDA_RERANK_BATCH if device == "cuda" else CPU_RERANK_BATCH)

    @property
    def rerank_length_cap(self) -> int | None:
        """Unless ``max_length`` says otherwise, no more than 96 tokens a pair, on a CPU and on CUDA:
        every pair fills the window (an abstract runs far longer), and on dev the served reranker at
        96 of its 128 trained tokens scored what it scores at 128 at every depth (0.4612 against
        0.4610 nDCG@10 at depth 100, the CUDA default) for 26% less work a pair (docs/configuration.md,
        "Why these defaults")."""
        return RERANK_MAX_LENGTH if self.max_length is None else None

    @property
    def reranker_wanted(self) -> bool:
        """Reranking is on and there is a reranker to load: one named, or one saved in the index."""
        return self.rerank and (self.reranker is not None or Path(self.reranker_path).is_dir())

    @property
    def reranker_path(self) -> str:
        """The configured reranker, or the one `train-reranker` saved into the index directory."""
        return self.reranker or str(self.index_dir / "reranker")
