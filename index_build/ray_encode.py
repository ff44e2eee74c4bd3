"""``build --ray``: the corpus encoded by a Ray cluster's workers with Ray Data, GPUs when present.

The texts are cut into the batches that :func:`engine.retrieval.dense.encode` cuts (longest first), and each
batch is one item of the dataset, so a worker pads and encodes exactly what a local build would:
the index written is the local build's.
"""

from __future__ import annotations

import logging

import numpy as np

from engine.retrieval.java import jvm_signals_kept

log = logging.getLogger(__name__)


class _Encoder:
    """A Ray Data actor: the sentence encoder loaded once, one batch of texts per call."""

    def __init__(self, name: str, device: str, batch_size: int) -> None:
        from engine.retrieval.encoder import load_encoder

        self.model, self.batch_size = load_encoder(name, device), batch_size

    def __call__(self, batch: dict) -> dict:
        rows, texts = batch["rows"][0], list(batch["texts"][0])
        vectors = self.model.encode(
            texts, batch_size=self.batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
        )
        return {"row": np.asarray(rows, dtype=np.int64), "vector": vectors.astype(np.float32)}


def encode_on_ray(texts: list[str], encoder: str, device: str, batch_size: int, address: str) -> np.ndarray:
    """Normalised float32 embeddings of ``texts`` by ``encoder``, computed across the cluster at
    ``address`` ("local": start one): one encoder a GPU (unless ``device`` is cpu), or one a CPU
    where the cluster has no GPU."""
    import ray

    if not texts:
        raise ValueError("no texts to encode")
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
    size = batch_size
    order = np.argsort([-len(text) for text in texts])
    items = [
        {"rows": order[start : start + size].tolist(), "texts": [texts[i] for i in order[start : start + size]]}
        for start in range(0, len(texts), size)
    ]
    log.info("encoding %d texts on Ray: %d %s workers", len(texts), workers, "GPU" if gpus else "CPU")
    encoded = ray.data.from_items(items).map_batches(
        _Encoder,
        fn_constructor_args=(encoder, "cuda" if gpus else "cpu", size),
        batch_size=1,
        concurrency=workers,
        num_gpus=1 if gpus else 0,
        num_cpus=1,
    )
    parts = list(encoded.iter_batches(batch_size=None, batch_format="numpy"))
    vectors = np.zeros((len(texts), parts[0]["vector"].shape[1]), dtype=np.float32)
    for part in parts:
        vectors[part["row"]] = part["vector"]
    return vectors
