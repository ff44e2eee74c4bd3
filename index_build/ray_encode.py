"""``build --ray``: the parts' vectors encoded by a Ray cluster's actors and written by them.

One Ray Data pipeline runs over every part still without vectors. A reader cuts each part's texts
into the batches :func:`engine.retrieval.encoder.encode` cuts (longest first, within the part), so an
actor pads and encodes exactly what a local build would, and the index is the local build's. The
encoder actors (one a GPU, or one a CPU where the cluster has none) load the model once and write
each batch's vectors into the build folder's vectors file themselves: nothing but counts comes
back to the driver, which marks a part done once all its rows are written and flushed, so a
stopped build resumes by part as a local one does. The build folder must be where every node of
the cluster can open it (one machine, or storage they all mount).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from engine.retrieval.java import jvm_signals_kept
from index_build.corpus import chunk_texts
from index_build.parts import BuildFolder, Part
from offline.progress import track

log = logging.getLogger(__name__)


class _Batches:
    """A Ray Data reader: a part's texts, read from the corpus handed over once, as the batches a
    local build encodes."""

    def __init__(self, docs: Sequence[dict], batch_size: int) -> None:
        self.docs, self.batch_size = docs, batch_size

    def __call__(self, item: dict) -> list[dict]:
        part_docs = self.docs[slice(item["first_doc"], item["end_doc"])]
        texts = chunk_texts(part_docs)
        order = np.argsort([-len(text) for text in texts])
        return [
            {
                "part": item["part"],
                "rows": (item["first_row"] + order[at : at + self.batch_size]).tolist(),
                "texts": [texts[i] for i in order[at : at + self.batch_size]],
            }
            for at in range(0, len(texts), self.batch_size)
        ]


class _Encoder:
    """A Ray Data actor: the encoder loaded once; each batch's vectors written into the vectors file."""

    def __init__(self, name: str, device: str, batch_size: int, vectors: str) -> None:
        from engine.retrieval.encoder import load_encoder

        self.model, self.batch_size = load_encoder(name, device), batch_size
        self.vectors = np.load(vectors, mmap_mode="r+")

    def __call__(self, batch: dict) -> dict:
        rows, texts = np.asarray(batch["rows"][0], dtype=np.int64), list(batch["texts"][0])
        self.vectors[rows] = self.model.encode(
            texts, batch_size=self.batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
        )
        self.vectors.flush()
        return {"part": np.asarray([batch["part"][0]]), "count": np.asarray([len(rows)])}


def encode_on_ray(
    work: BuildFolder,
    parts: list[Part],
    docs: Sequence[dict],
    chunks: int,
    dimension: int,
    encoder: str,
    device: str,
    batch_size: int,
    address: str,
    progress: bool = True,
) -> None:
    """The vectors of ``parts`` (of ``docs``, ``chunks`` rows in all) written into ``work``'s vectors
    file across the cluster at ``address`` ("local": start one), each part marked done once whole."""
    import ray

    with jvm_signals_kept():  # this process built Lucene's index: its JVM runs here
        ray.init(
            address=None if address == "local" else address,
            include_dashboard=False,
            log_to_driver=False,
            ignore_reinit_error=True,
        )
    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0)) if device != "cpu" else 0
    workers = gpus or max(1, int(resources.get("CPU", 1)))
    path = work.vectors_file(chunks, dimension)
    log.info("encoding %d parts on Ray: %d %s workers", len(parts), workers, "GPU" if gpus else "CPU")
    items = [
        {"part": p.number, "first_doc": p.docs.start, "end_doc": p.docs.stop, "first_row": p.rows.start} for p in parts
    ]
    encoded = (
        ray.data.from_items(items)
        .flat_map(_Batches, fn_constructor_args=(docs, batch_size), concurrency=1)
        .map_batches(
            _Encoder,
            fn_constructor_args=(encoder, "cuda" if gpus else "cpu", batch_size, str(path)),
            batch_size=1,
            concurrency=workers,
            num_gpus=1 if gpus else 0,
            num_cpus=1,
        )
    )
    left = {p.number: len(p.rows) for p in parts}
    done = (part for part in _finished(encoded.iter_rows(), left))
    for part in track(done, f"vectors of {chunks:,} chunks on Ray", "part", len(parts), enabled=progress):
        work.mark_vectors(part)
    if any(left.values()):  # a row reported twice or never: the cluster's answer cannot be trusted
        raise RuntimeError(f"Ray wrote {sum(left.values()):,} rows fewer than the parts hold; run the build again")


def _finished(rows, left: dict[int, int]):
    """Each part as the last of its rows is reported written."""
    for row in rows:
        part = int(row["part"])
        left[part] -= int(row["count"])
        if not left[part]:
            yield part
