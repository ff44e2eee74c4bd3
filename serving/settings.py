"""The whole configuration of a process: each layer's part, composed, and read from one place.

Values come, lowest priority first, from the defaults, a TOML file (``--config`` or
``HYBRID_SEARCH_CONFIG``), environment variables and finally the CLI's flags. Every setting keeps
one flat name wherever it is given: ``rerank_depth = 30`` at the top of the TOML file (or under its
part's table, ``[engine]``), ``HYBRID_SEARCH_RERANK_DEPTH=30``, ``--rerank-depth 30``; in code it
is ``settings.engine.rerank_depth``. Names are unique across the parts, so a flat name says where it
belongs.
"""

from __future__ import annotations

import os
import sys
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from agents.settings import AgentSettings
from engine.documents import MAX_QUERY_CHARS
from engine.settings import EngineSettings, MaybePath, MaybeStr
from index_build.settings import BuildSettings

ENV_PREFIX = "HYBRID_SEARCH_"
MAX_WORKERS = 256  # a worker's index fits one byte of its A2A task ids (serving/a2a_tasks.py)


def _worker_count(value: object) -> int | str:
    """``--workers``: auto, or a whole number from 0 to :data:`MAX_WORKERS` (one message for both)."""
    if value == "auto":
        return value
    try:
        count = int(value)  # a TOML or flag's text, or a number
    except (TypeError, ValueError):
        raise ValueError(f"workers is auto or a whole number from 0 to {MAX_WORKERS}, not {value!r}") from None
    if not 0 <= count <= MAX_WORKERS or count != value and not isinstance(value, str):
        raise ValueError(f"workers is auto or a whole number from 0 to {MAX_WORKERS}, not {value!r}")
    return count
_CONFIG_FILE: ContextVar[Path | None] = ContextVar("config_file", default=None)  # what Settings.load was given


class ServingSettings(BaseModel):
    """Where the doors listen and how much work they take at once."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    host: str = Field("127.0.0.1", description="interface to bind (0.0.0.0 in containers)")
    mcp_port: int = Field(8000, ge=0, le=65535, description="MCP + REST port")
    a2a_port: int = Field(9010, ge=0, le=65535, description="A2A purple agent port")
    public_url: MaybeStr = Field(None, description="A2A URL advertised in the agent card (default http(s)://HOST:PORT)")
    a2a_tasks_kept: int = Field(
        10_000, ge=1, description="A2A tasks kept for tasks/get (per process), the most recent; older ones are dropped"
    )
    query_timeout_s: float = Field(30.0, gt=0, description="seconds a query may take before it fails")
    max_query_chars: int = Field(MAX_QUERY_CHARS, ge=1, description="longest query a door accepts, in characters")
    max_in_flight: int = Field(
        4, ge=1, description="requests doing engine work at once per process (searches, answers, writes); more wait"
    )
    max_queue_s: float = Field(
        2.0, ge=0, description="seconds a request may wait for a slot before a fast 503 with Retry-After (0: none)"
    )
    mcp_resume_bytes: int = Field(
        64 << 20,
        ge=0,
        description="bytes of MCP stream events kept in memory (their JSON, all sessions together) so that a client"
        " whose stream dropped can resume with Last-Event-ID; the oldest go first (0: none kept)",
    )
    max_body_bytes: int = Field(8 << 20, ge=1024, description="largest HTTP request body (more gets 413)")
    max_message_bytes: int = Field(256 << 10, ge=1024, description="largest /v1 message body except ingestion")
    snapshots_dir: MaybePath = Field(
        None,
        description="folder POST /snapshots takes snapshots into (default: <index-dir>.snapshots beside the index;"
        " on its filesystem, files that never change are linked, not copied)",
    )
    mcp_writes: bool = Field(False, description="offer the MCP tools that add and delete documents")
    mcp: bool = Field(True, description="the MCP endpoint (/mcp); off: REST and /health still answer on --mcp-port")
    a2a: bool = Field(True, description="the A2A agent on --a2a-port; off: only MCP + REST")
    mcp_url: MaybeStr = Field(None, description="the A2A agent searches through this MCP server, not in-process")
    read_only: bool = Field(False, description="refuse document writes (POST/DELETE /documents, the write tools)")
    build_if_missing: bool = Field(False, description="serve: build the index from --data first if it is absent")
    indexes: MaybePath = Field(
        None,
        description="serve every index folder in this directory as a collection named by its folder, beside"
        " --index-dir's one index (which this replaces); aliases are kept in DIR/aliases.json (docs/collections.md)",
    )
    default_collection: MaybeStr = Field(
        None,
        description="with --indexes: the collection or alias that today's routes and search_nfcorpus serve"
        " (default: the alias 'default' when there is one, else the only collection)",
    )
    workers: Annotated[int | Literal["auto"], BeforeValidator(_worker_count)] = Field(
        1,
        description="processes serving the index on the same ports: one writes, the others follow its checkpoints;"
        " each gets cores / N threads; auto (or 0) = one for every two cores (8 on 16). Past one, MCP is stateless, rate"
        " limits are per process, and each holds its own copy of the engine (docs/configuration.md)",
    )
    shared_reranker: Literal["auto", "on", "off"] = Field(
        "auto",
        description="with --workers N > 1 and a reranker: on = one process owns the model and scores every"
        " worker's pairs, batched by --rerank-batch-tokens (one copy of the model, no N processes taking turns on a"
        " GPU); off = each worker loads its own; auto = on with CUDA, off on a CPU, where the worker's own"
        " reranker answered faster (docs/configuration.md)",
    )
    shared_query_encoder: Literal["off", "on"] = Field(
        "off",
        description="with the shared reranker process: on = it also encodes every worker's queries on its device,"
        " batched (the GPU's one owner runs both models, the workers only search vectors); off = each worker"
        " encodes its own, on the CPU (ONNX) when the reranker process holds the GPU (docs/gpu.md)",
    )

    def worker_count(self) -> int:
        """``workers``, with 0 resolved from the cores this process may use."""
        if self.workers in ("auto", 0):
            return min(MAX_WORKERS, max(1, len(os.sched_getaffinity(0)) // 2))
        return self.workers


class SecuritySettings(BaseModel):
    """Who may talk to the doors, and over what."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    tls_cert: MaybePath = Field(None, description="PEM certificate (chain): every door serves HTTPS")
    tls_key: MaybePath = Field(None, description="PEM private key of --tls-cert")
    tls_client_ca: MaybePath = Field(
        None, description="PEM CA bundle: clients must present a certificate it signed (mutual TLS)"
    )
    agent_keys: MaybePath = Field(
        None, description="TOML of agent keys (hashed) for /v1 (default: loopback clients only)"
    )
    agent_rate: str = Field("120/minute", description="default messages an agent may send (limits' syntax)")
    key_all_doors: bool = Field(False, description="put REST, MCP and A2A behind the agent keys too (open by default)")


class TelemetrySettings(BaseModel):
    """OpenTelemetry: every door makes spans; these say where they go."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    otlp_endpoint: MaybeStr = Field(
        None,
        description="OpenTelemetry collector (OTLP/HTTP), e.g. http://127.0.0.1:4318: spans are exported there"
        " (batched, masked); off by default",
    )
    otlp_query_text: bool = Field(False, description="export each search's query text (masked); off: its length only")

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"expected an http:// or https:// URL of an OTLP/HTTP collector, got {value!r}")
        return value


class ScaleOutSettings(BaseModel):
    """Ray: `serve --ray` and `build --ray` (pip install 'hybrid-search[ray]')."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    ray: bool = Field(False, description="serve: deploy on Ray Serve instead of in this process")
    ray_address: MaybeStr = Field(
        None, description="Ray cluster to join, e.g. 10.0.0.5:6379 (default: start a local one)"
    )
    ray_search_replicas: tuple[int, int] = Field(
        (1, 1), description="search replicas (the doors and retrieval): N, or MIN-MAX to autoscale between"
    )
    ray_reranker_replicas: tuple[int, int] = Field((1, 1), description="reranker replicas: N, or MIN-MAX")
    ray_replica_cpus: float = Field(
        1.0, gt=0, description="CPUs (threads) a search, shard or reranker replica reserves"
    )
    ray_shard_replicas: int = Field(
        2, ge=1, description="a sharded index: replicas of each shard (2 or more: a replica lost fails no search)"
    )
    ray_shard_timeout_s: float = Field(
        5.0,
        gt=0,
        description="a sharded index: seconds a shard has to answer a call (asked twice) before it counts as down",
    )
    ray_shard_failure: Literal["partial", "fail"] = Field(
        "fail",
        description="a sharded index, when every replica of a shard is down: fail = answer 503 (Retry-After);"
        " partial = answer from the other shards, the reply's missing_shards naming those left out",
    )
    ray_batch_size: int = Field(8, ge=1, description="queries the reranker deployment scores in one batch")
    ray_batch_wait_ms: float | None = Field(
        None, ge=0, description="ms a reranker batch waits to fill (default: 3 on a GPU, 0 on a CPU)"
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


PARTS: dict[str, type[BaseModel]] = {
    "engine": EngineSettings,
    "build": BuildSettings,
    "agents": AgentSettings,
    "serving": ServingSettings,
    "security": SecuritySettings,
    "telemetry": TelemetrySettings,
    "scale_out": ScaleOutSettings,
}
PART_OF: dict[str, str] = {name: part for part, model in PARTS.items() for name in model.model_fields}
RENAMED: dict[str, str] = {}  # old flat name -> today's, still accepted with a deprecation line


def nest(values: dict[str, Any]) -> dict[str, Any]:
    """Flat names (``rerank_depth``) moved under their part (``engine``); parts given whole stay.
    An unknown name is kept where it is, for validation to name it."""
    nested: dict[str, Any] = {}
    for key, value in values.items():
        if key in RENAMED:
            print(f"hybrid-search: setting {key!r} is now {RENAMED[key]!r}; the old name will go", file=sys.stderr)
            key = RENAMED[key]
        if key in PARTS and isinstance(value, dict):  # a part given whole: [engine] in TOML
            nested.setdefault(key, {}).update(value)
        elif key in PART_OF:
            nested.setdefault(PART_OF[key], {})[key] = value
        else:
            nested[key] = value
    return nested


class _Nested(PydanticBaseSettingsSource):
    """Another source's values with flat names moved under their parts, so sources merge part by part."""

    def __init__(self, settings_cls: type[BaseSettings], source: PydanticBaseSettingsSource) -> None:
        super().__init__(settings_cls)
        self.source = source

    def get_field_value(self, field, field_name):  # pragma: no cover - __call__ is what pydantic-settings uses
        return self.source.get_field_value(field, field_name)

    def __call__(self) -> dict[str, Any]:
        return nest(self.source())


class _FlatEnv(PydanticBaseSettingsSource):
    """``HYBRID_SEARCH_<NAME>`` for every setting of every part (and the renamed ones' old names)."""

    def get_field_value(self, field, field_name):  # pragma: no cover
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        found = {}
        for name in [*PART_OF, *RENAMED]:
            value = os.environ.get(ENV_PREFIX + name.upper())
            if value is not None:
                found[name] = value
        return nest(found)


class Settings(BaseSettings):
    """Every part a process may need; commands and servers read the parts they use."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_assignment=True)

    engine: EngineSettings = Field(
        default_factory=EngineSettings, description="engine settings: the index, retrieval, fusion, reranking"
    )
    build: BuildSettings = Field(
        default_factory=BuildSettings, description="build settings: the data, its chunks, the dense index"
    )
    agents: AgentSettings = Field(
        default_factory=AgentSettings, description="agent protocol settings: traces, the answering LLM"
    )
    serving: ServingSettings = Field(
        default_factory=ServingSettings, description="serving settings: ports, limits, admission"
    )
    security: SecuritySettings = Field(
        default_factory=SecuritySettings, description="security settings: TLS, agent keys"
    )
    telemetry: TelemetrySettings = Field(
        default_factory=TelemetrySettings, description="telemetry settings: OpenTelemetry"
    )
    scale_out: ScaleOutSettings = Field(
        default_factory=ScaleOutSettings, description="scale-out settings: Ray (pip install 'hybrid-search[ray]')"
    )

    @model_validator(mode="after")
    def _collections_in_one_process(self) -> Settings:
        """Collections (``--indexes``) are served by one process: their registry, aliases and build
        jobs live in it, so ``--workers N`` and ``--ray`` are refused, naming what to use instead."""
        if self.serving.indexes is not None and (self.scale_out.ray or self.serving.workers != 1):
            flag = "--ray" if self.scale_out.ray else f"--workers {self.serving.workers}"
            raise ValueError(
                f"--indexes serves its collections in one process, not with {flag}: leave out {flag} (or serve one"
                " index with it: --index-dir DIR/NAME)"
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml_file = _CONFIG_FILE.get() or os.environ.get(ENV_PREFIX + "CONFIG")
        sources: tuple[PydanticBaseSettingsSource, ...] = (_Nested(settings_cls, init_settings), _FlatEnv(settings_cls))
        if toml_file:
            sources += (_Nested(settings_cls, TomlConfigSettingsSource(settings_cls, toml_file=toml_file)),)
        return sources

    @classmethod
    def load(cls, config: Path | None = None, **overrides: object) -> Settings:
        """``overrides`` (flat names, as the flags give them) over ``HYBRID_SEARCH_*`` over the TOML
        file ``config`` (default: the one ``HYBRID_SEARCH_CONFIG`` names)."""
        token = _CONFIG_FILE.set(config)
        try:
            return cls(**overrides)
        finally:
            _CONFIG_FILE.reset(token)

    @staticmethod
    def part_fields(part: str) -> list[str]:
        """The flat names of one part's settings."""
        return list(PARTS[part].model_fields)

    def with_values(self, **values: object) -> Settings:
        """A copy with some settings changed, by their flat names, validated as given."""
        updated = self.model_dump()
        for part, fields in nest(values).items():
            if part not in PARTS:
                raise ValueError(f"unknown setting {part!r}")
            updated[part].update(fields)
        return type(self).model_validate(updated)
