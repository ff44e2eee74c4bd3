"""What the protocol agents are told: where message traces are kept, and the LLM server that answers."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from engine.settings import MaybePath, MaybeStr


class AgentSettings(BaseModel):
    """The agent message protocol's traces and its answering model."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    trace_db: MaybePath = Field(
        None,
        description="SQLite file of stored message traces (default: <index-dir>.traces.sqlite, beside the index: kept"
        " across rebuilds and on a container's index volume, not wherever serve was started)",
    )
    trace_max_age_days: float = Field(7.0, gt=0, description="traces older than this many days are dropped")
    trace_max_messages: int = Field(100_000, ge=100, description="at most this many stored messages")
    llm_url: MaybeStr = Field(
        None,
        description="OpenAI-compatible chat server for answers, e.g. http://127.0.0.1:8080/v1 (default: extractive"
        " answers)",
    )
    llm_model: str = Field("default", description="model name sent to that server (generation_params.model wins)")
    llm_api_key: MaybeStr = Field(None, description="its key, if it wants one (set HYBRID_SEARCH_LLM_API_KEY)")
    llm_fallback: bool = Field(
        True,
        description="when the LLM server fails, answer extractively and say so (--no-llm-fallback: answer"
        " GENERATION_FAILED)",
    )


def trace_db_for(settings: AgentSettings, index_dir: Path) -> Path:
    """Where the traces of an index's server are kept: ``trace_db`` if set, else beside the index."""
    index_dir = Path(index_dir).resolve()  # "." has no name of its own
    return settings.trace_db or index_dir.with_name(f"{index_dir.name}.traces.sqlite")
