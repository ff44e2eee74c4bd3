"""The one typed configuration of the project.

Values come, lowest priority first, from the defaults below, a TOML file named by
``HYBRID_SEARCH_CONFIG``, environment variables ``HYBRID_SEARCH_<FIELD>`` and finally CLI flags
(the CLI passes them as keyword arguments).
"""

from __future__ import annotations

import os
from contextvars import ContextVar
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from engine.documents import MAX_QUERY_CHARS

DEFAULT_ENCODER = "sentence-transformers/all-MiniLM-L6-v2"
CUDA_RERANK_DEPTH = 100
CUDA_RERANK_BATCH, CPU_RERANK_BATCH = 128, 32
CPU_RERANK_DEPTH = 20
CPU_RERANK_MAX_LENGTH = 96
_CONFIG_FILE: ContextVar[Path | None] = ContextVar("config_file", default=None)  # what Settings.load was given


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HYBRID_SEARCH_", extra="forbid", validate_assignment=True)

    # where things are
    data_dir: Path = Field(Path("../shared/datasets/nfcorpus"), description="BEIR dataset folder")
    index_dir: Path = Field(Path("indexes/nfcorpus"), description="index directory built by `build`")

    # building
    encoder: str = Field(DEFAULT_ENCODER, description="sentence-transformers model id or folder")
    dense_index: Literal["flat", "hnsw"] = Field(
        "flat", description="flat = exact inner product (right below ~1M docs); hnsw = approximate, for large corpora"
    )
    hnsw_m: int = Field(32, ge=4, description="HNSW graph degree")
    encode_batch_size: int = Field(64, ge=1)

    # retrieval and fusion
    bm25_k1: float = Field(0.9, gt=0)
    bm25_b: float = Field(0.4, ge=0, le=1)
    bm25_depth: int = Field(100, ge=1, description="BM25 candidates fused")
    dense_depth: int = Field(100, ge=1, description="dense candidates fused")
    rrf_k: float = Field(10.0, gt=0, description="reciprocal rank fusion constant (tuned on dev)")
    bm25_weight: float = Field(1.0, ge=0)
    dense_weight: float = Field(1.0, ge=0)
    hnsw_ef_search: int = Field(128, ge=1)
    query_encoder_runtime: Literal["auto", "torch", "onnx"] = Field(
        "auto",
        description="what encodes a query: auto = ONNX Runtime on a CPU (the same embeddings, 3-4x faster), torch"
        " on CUDA; batches (build, ingest) stay on torch",
    )
    memory_split: str | None = Field(
        "auto",
        description="train judgments the judgment memory learns from (auto: train.graded, else train; none: off)",
    )
    memory: bool = Field(True, description="fuse the judgment memory when the index has one")
    memory_neighbors: int = Field(10, ge=1, description="similar training queries that vote")
    memory_depth: int = Field(100, ge=1, description="judgment-memory candidates fused")
    memory_weight: float = Field(1.5, ge=0, description="judgment-memory weight in RRF (tuned on dev)")
    fusion: Literal["auto", "learned", "rrf"] = Field(
        "auto",
        description="auto = the learned fusion when the index has one (`build` trains it from train judgments),"
        " else RRF; learned = require it; rrf = RRF only (and `build` trains none)",
    )

    # reranking
    rerank: bool = Field(True, description="rerank fused candidates with the cross-encoder")
    reranker: str | None = Field(None, description="CrossEncoder id or folder; default <index_dir>/reranker")
    rerank_depth: int | None = Field(
        None, ge=1, description="fused candidates the cross-encoder rescores (default: 100 on CUDA, 20 on CPU)"
    )
    rerank_blend: float = Field(
        0.5,
        ge=0,
        le=1,
        description="reranker's share of the head's order: 1 = the reranker alone, 0 = fusion alone; between, a"
        " weighted sum of the two z-scored scores (0.5 tuned on dev)",
    )
    rerank_batch_size: int | None = Field(
        None,
        ge=1,
        description="pairs a reranker pass scores (default 128 on CUDA, one pass for a query's 100; 32 on CPU)",
    )
    rerank_runtime: Literal["auto", "torch", "onnx"] = Field(
        "auto", description="auto = ONNX Runtime on a CPU (same scores, ~1.6x faster), torch fp16 on CUDA"
    )
    rerank_quantize: Literal["auto", "none", "int8"] = Field(
        "auto",
        description="int8 = ONNX Runtime's dynamic int8 reranker, smoothed on the index's text: 1.2-1.5x the"
        " pairs per second on a CPU for ~0.001 dev nDCG@10 (the README's CPU reranking table); auto = int8 on a"
        " CPU for a distilled CPU student (its model card says so), else none",
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
        " with, at most 96 on a CPU; training: 256)",
    )
    rerank_batch_wait_ms: float = Field(
        3.0, ge=0, description="on CUDA, how long a query waits for others to share a rerank batch; 0 = off"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = CUDA when available")

    # live documents
    refresh_interval_s: float = Field(
        1.0, gt=0, le=3600, description="longest an acknowledged write waits before searches see it"
    )
    checkpoint_bytes: int = Field(
        64 << 20, ge=0, description="write-ahead log bytes that trigger a checkpoint (0: after every refresh)"
    )
    chunk_words: int = Field(200, ge=16, le=4000, description="words a chunk holds when `ingest` splits a file")
    chunk_overlap_words: int = Field(40, ge=0, description="words two neighbouring chunks share (whole sentences)")
    max_body_bytes: int = Field(8 << 20, ge=1024, description="largest request body the HTTP doors accept")
    mcp_writes: bool = Field(False, description="offer the MCP tools that add and delete documents")

    # agent message protocol
    trace_db: Path = Field(Path("traces/traces.sqlite"), description="SQLite file of stored message traces")
    trace_max_age_days: float = Field(7.0, gt=0, description="traces older than this are dropped")
    trace_max_messages: int = Field(100_000, ge=100, description="at most this many stored messages")
    agent_keys: Path | None = Field(None, description="TOML of agent keys (hashed); without it: loopback only")
    agent_rate: str = Field("120/minute", description="default per-agent message rate (limits' syntax)")
    max_message_bytes: int = Field(256 << 10, ge=1024, description="largest message body except ingestion")
    key_all_doors: bool = Field(
        False, description="put the benchmark's doors (REST, MCP, A2A) behind the agent keys too (open by default)"
    )
    llm_url: str | None = Field(None, description="OpenAI-compatible server for answers, e.g. http://127.0.0.1:8080/v1")
    llm_model: str = Field("default", description="model name sent to that server (generation_params.model wins)")
    llm_api_key: str | None = Field(None, description="its key, if it wants one (set HYBRID_SEARCH_LLM_API_KEY)")
    llm_fallback: bool = Field(True, description="answer extractively (and say so) when the LLM server fails")

    # serving
    host: str = "127.0.0.1"
    mcp_port: int = Field(8000, ge=0, le=65535, description="MCP + REST port")
    a2a_port: int = Field(9010, ge=0, le=65535, description="A2A purple agent port")
    public_url: str | None = Field(None, description="A2A URL advertised in the agent card")
    tls_cert: Path | None = Field(None, description="PEM certificate (chain): every door serves HTTPS")
    tls_key: Path | None = Field(None, description="PEM private key of --tls-cert")
    tls_client_ca: Path | None = Field(None, description="PEM CA bundle: clients must present a certificate it signed")
    otlp_endpoint: str | None = Field(
        None,
        description="OpenTelemetry collector (OTLP/HTTP), e.g. http://127.0.0.1:4318: spans are exported there"
        " (batched, masked); off by default",
    )
    otlp_query_text: bool = Field(False, description="export each search's query text (masked); off: its length only")
    query_timeout_s: float = Field(30.0, gt=0, description="longest a query may take before it fails")
    max_query_chars: int = Field(MAX_QUERY_CHARS, ge=1)
    max_in_flight: int = Field(
        4, ge=1, description="requests doing engine work at once per process (searches, answers, writes); more wait"
    )
    max_queue_s: float = Field(
        2.0, ge=0, description="longest a request waits for a slot before a fast 503 with Retry-After (0: none)"
    )

    # scale-out on Ray (`serve --ray`, `build --ray`)
    ray_address: str | None = Field(None, description="Ray cluster to join, e.g. 10.0.0.5:6379 (default: start one)")
    ray_search_replicas: tuple[int, int] = Field(
        (1, 1), description="search replicas (the doors and retrieval): N, or MIN-MAX to autoscale between"
    )
    ray_reranker_replicas: tuple[int, int] = Field((1, 1), description="reranker replicas: N, or MIN-MAX")
    ray_replica_cpus: float = Field(1.0, gt=0, description="CPUs a search or reranker replica reserves")
    ray_batch_size: int = Field(8, ge=1, description="queries the reranker deployment scores in one batch")
    ray_batch_wait_ms: float | None = Field(
        None, ge=0, description="how long a batch waits to fill (default: --rerank-batch-wait-ms on a GPU, 0 on a CPU)"
    )

    @field_validator("ray_search_replicas", "ray_reranker_replicas", mode="before")
    @classmethod
    def _replica_bounds(cls, value: object) -> object:
        """``3`` or ``"3"`` -> (3, 3); ``"1-4"`` -> (1, 4): autoscaling bounds."""
        if isinstance(value, int) and not isinstance(value, bool):
            value = (value, value)
        elif isinstance(value, str):
            low, _, high = value.partition("-")
            try:
                value = (int(low), int(high or low))
            except ValueError:
                raise ValueError(f"expected N or MIN-MAX replicas, e.g. 2 or 1-4, got {value!r}") from None
        if isinstance(value, tuple | list) and len(value) == 2 and not 1 <= value[0] <= value[1]:
            raise ValueError(f"replicas must be at least 1 and MIN <= MAX, got {value[0]}-{value[1]}")
        return value

    @field_validator(
        "reranker",
        "public_url",
        "memory_split",
        "agent_keys",
        "llm_url",
        "llm_api_key",
        "ray_address",
        "tls_cert",
        "tls_key",
        "tls_client_ca",
        "otlp_endpoint",
        mode="before",
    )
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if value in ("", "none") else value

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"expected an http:// or https:// URL of an OTLP/HTTP collector, got {value!r}")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml_file = _CONFIG_FILE.get() or os.environ.get("HYBRID_SEARCH_CONFIG")
        sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
        if toml_file:
            sources += (TomlConfigSettingsSource(settings_cls, toml_file=toml_file),)
        return sources

    @classmethod
    def load(cls, config: Path | None = None, **overrides: object) -> Settings:
        """``overrides`` (the flags) over ``HYBRID_SEARCH_*`` over the TOML file ``config`` (default:
        the one ``HYBRID_SEARCH_CONFIG`` names)."""
        token = _CONFIG_FILE.set(config)
        try:
            return cls(**overrides)
        finally:
            _CONFIG_FILE.reset(token)

    def rerank_depth_for(self, device: str) -> int:
        """On a CPU the cross-encoder is the cost: the top 20 at 96 tokens (the README's CPU table)
        keep a query near 0.3 s with the trained reranker; a GPU scores 100 pairs in milliseconds."""
        return self.rerank_depth or (CUDA_RERANK_DEPTH if device == "cuda" else CPU_RERANK_DEPTH)

    def rerank_batch_for(self, device: str) -> int:
        """On an H100 a query's 100 pairs in one pass of 128 took the rerank stage from 38 to 25 ms
        (batches of 32 launch every kernel four times); a CPU gains nothing from larger batches."""
        return self.rerank_batch_size or (CUDA_RERANK_BATCH if device == "cuda" else CPU_RERANK_BATCH)

    def rerank_length_cap(self, device: str) -> int | None:
        """On a CPU, unless ``max_length`` says otherwise, no more than 96 tokens a pair: every pair
        fills the window (abstracts run ~400 tokens), and 96 of a 128-token model's tokens score the
        same dev nDCG@10 (0.4480 against 0.4481) for 1.3x the pairs per second."""
        return CPU_RERANK_MAX_LENGTH if device == "cpu" and self.max_length is None else None

    @property
    def reranker_path(self) -> str:
        """The configured reranker, or the one `train-reranker` saved into the index directory."""
        return self.reranker or str(self.index_dir / "reranker")
