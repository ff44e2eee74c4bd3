"""What a build is told: the data it reads, how files are cut into chunks, and the dense index it makes."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.settings import DEFAULT_ENCODER, MaybePath, MaybeStr


class BuildSettings(BaseModel):
    """Building an index: `build`, `init`, `ingest` and the training commands read these."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    data_dir: Path = Field(
        Path("../shared/datasets/nfcorpus"),
        description="a BEIR dataset (a folder with corpus.jsonl; its judgments train the memory and the fusion) or"
        " any folder of your files",
    )
    encoder: str = Field(
        DEFAULT_ENCODER, description="sentence-transformers id or folder (the default has an offline copy)"
    )
    dense_index: str = Field(
        "auto",
        description="the dense index: auto = exact below 200,000 chunks, ivf above (a scan, or a graph past 1,500,000"
        " chunks, where ivf would probe more than an eighth of its lists to find the probes' neighbours and their"
        " judged documents); flat = exact inner product; ivf = an inverted file of 8-bit"
        " codes, its lists from the size; hnsw = a graph; scan = every chunk's 4-bit codes scanned and the best"
        " re-scored exactly; or a FAISS index_factory string (IVF4096,PQ48). An approximate index's breadth is"
        " tuned at build to recall@100 0.95 against exact on the dataset's training queries, of all neighbours"
        " and of their judged documents (the manifest keeps it and why it was chosen)",
    )
    index_name: MaybeStr = Field(
        None, description="the index's name, as MCP's tools and the A2A card show it (default: the data folder's)"
    )
    index_description: MaybeStr = Field(
        None,
        description="a line saying what the documents are, for agents choosing a tool (default: from the folder's"
        " name)",
    )
    part_chunks: int = Field(
        50_000,
        ge=1,
        description="chunks encoded, tokenized and stored at a time: memory is bounded by a part, and a stopped build"
        " resumes from its last finished part",
    )
    bm25_workers: int = Field(
        0,
        ge=0,
        description="processes that index the parts' BM25 side by side, a JVM each (0: one a core, at most 8)",
    )
    vectors: MaybePath = Field(
        None,
        description="the chunks' vectors, made elsewhere, instead of encoding: a .npy (one row a record, in the"
        " corpus's order) or a .parquet with _id and vector columns; --encoder must name the model that made them",
    )
    shards: int = Field(
        1,
        ge=1,
        le=256,
        description="split the index into this many shards, each document in the one a hash of its id names: each"
        " shard a whole index (with --ray, built by a task of its own), searched together as one index, with equal"
        " rankings (docs/ray.md); 1: one index",
    )
    hnsw_m: int = Field(32, ge=4, description="HNSW graph degree (an hnsw dense index only)")
    memory_split: MaybeStr = Field(
        "auto",
        description="train judgments the judgment memory learns from (auto: train.graded, else train; none: no memory)",
    )
    chunk_words: int = Field(200, ge=16, le=4000, description="words a chunk holds when a file is split")
    chunk_overlap_words: int = Field(40, ge=0, description="words two neighbouring chunks share (whole sentences)")
    adapt: Literal["none", "fast", "full"] = Field(
        "fast",
        description="without training judgments, learn from the documents: fast = a corpus graph fitted and checked on"
        " pseudo-queries held out of the corpus, served only when it beats RRF there; none = plain RRF; full is not"
        " implemented (docs/own-documents.md)",
    )
    adapt_queries: int = Field(
        600, ge=30, description="pseudo-queries --adapt makes (a third each: headings, first and inner sentences)"
    )
    adapt_generated: int = Field(
        200, ge=1, description="with --llm-url: chunks the chat server writes a question for, as more pseudo-queries"
    )
    adapt_min_gain: float = Field(
        0.0, description="held-out pseudo-query nDCG@10 the adapted stage must beat RRF by to be served"
    )
