"""Trial: does fine-tuning the dense encoder on the train judgments pay on dev? (It did not.)

    python -m benchmarks.dense_finetune --steps 200

A bounded contrastive fine-tune of the index's encoder (sentence-transformers'
``MultipleNegativesRankingLoss``: each training query against its positive, one hard negative and
the rest of the batch), hard negatives being unjudged documents at dense ranks 6-60 (the very top
unjudged ones are the likeliest unlabelled positives). Then a whole index is built with the new
encoder (its learned fusion retrained as ``build`` does) and every stage is scored on dev against
the current index, without reranking. The encoder also embeds the queries the judgment memory
compares, so the trial shows both effects. Writes ``benchmarks/results/dense-finetune-dev.json``;
the encoder and the index live in a temporary folder (no weights are kept).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from engine.retrieval.encoder import load_encoder, pick_device
from engine.search import HybridEngine
from engine.settings import EngineSettings
from index_build.builder import build_index
from index_build.corpus import beir_corpus
from index_build.schedule import warmup_linear
from index_build.settings import BuildSettings
from offline.dataset import load_dataset
from offline.evaluation import evaluate_run, paired_test, stage_runs
from offline.records import write_result

NEGATIVE_RANKS = slice(5, 60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index-dir", type=Path, default=EngineSettings().index_dir, help="the index to compare with")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (200: ~18 minutes on 2 CPU cores)")
    parser.add_argument("--batch", type=int, default=32, help="training queries per step")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--max-length", type=int, default=128, help="tokens per text while training")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/dense-finetune-dev.json"))
    args = parser.parse_args()
    settings = EngineSettings(index_dir=args.index_dir, rerank=False)
    dataset = load_dataset(BuildSettings().data_dir)
    base = HybridEngine(settings)
    dev, dev_queries = dataset.qrels("dev"), dataset.split_queries("dev")
    before = stage_runs(base, dev_queries, progress=False)
    with tempfile.TemporaryDirectory() as work:
        started = time.perf_counter()
        losses = _fine_tune(base, dataset, Path(work) / "encoder", args)
        trained = round(time.perf_counter() - started, 1)
        tuned = settings.model_copy(update={"index_dir": Path(work) / "index"})
        build_index(tuned, BuildSettings(encoder=str(Path(work) / "encoder")), beir_corpus(dataset))
        after = stage_runs(HybridEngine(tuned), dev_queries, progress=False)
    report = {
        stage: {"before": evaluate_run(dev, before[stage]), "after": evaluate_run(dev, after[stage])}
        for stage in before
    }
    for stage, row in report.items():
        row["after vs before"] = paired_test(dev, after[stage], before[stage])
    body = {
        "base_encoder": base.manifest.encoder,
        "loss": "MultipleNegativesRankingLoss, 1 positive (sampled by grade) + 1 hard negative per query",
        "train_seconds": trained,
        "loss_first_20": float(np.mean(losses[:20])),
        "loss_last_20": float(np.mean(losses[-20:])),
        "dev": report,
    }
    write_result(args.output, body, vars(args))
    for stage, row in report.items():
        print(f"{stage:8} nDCG@10 {row['before']['nDCG@10']:.4f} -> {row['after']['nDCG@10']:.4f}")


def _fine_tune(engine: HybridEngine, dataset, folder: Path, args) -> list[float]:
    """Train a copy of ``engine``'s encoder and save it to ``folder``; returns the per-step losses."""
    import torch
    from sentence_transformers.losses import MultipleNegativesRankingLoss

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    split = dataset.training_split() or "train"
    qrels = dataset.qrels(split)
    query_ids = sorted(q for q, docs in qrels.items() if any(g > 0 for g in docs.values()))
    negatives = {}
    for qid in tqdm(query_ids, desc="mining negatives", unit="query"):
        found = engine.dense.search(engine.dense.encode_query(dataset.queries[qid]), NEGATIVE_RANKS.stop)
        negatives[qid] = [d for d, _ in found[NEGATIVE_RANKS] if d not in qrels[qid]]
    query_ids = [q for q in query_ids if negatives[q]]
    model = load_encoder(engine.manifest.encoder, pick_device(engine.settings.device))
    model.float()  # trained in fp32 even on CUDA, where load_encoder halves it for serving
    serving_length, model.max_seq_length = model.max_seq_length, args.max_length
    loss_fn = MultipleNegativesRankingLoss(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = warmup_linear(optimizer, args.steps)
    order: list[str] = []
    losses = []
    model.train()
    for _ in tqdm(range(args.steps), desc="fine-tuning encoder", unit="step"):
        batch = []
        while len(batch) < args.batch:
            order = order or rng.sample(query_ids, len(query_ids))
            batch.append(order.pop())
        positives = []
        for qid in batch:
            judged = {d: g for d, g in qrels[qid].items() if g > 0}
            positives.append(rng.choices(list(judged), weights=list(judged.values()))[0])
        columns = [
            [dataset.queries[q] for q in batch],
            [dataset.corpus[d].contents for d in positives],
            [dataset.corpus[rng.choice(negatives[q])].contents for q in batch],
        ]
        loss = loss_fn([_features(model, texts) for texts in columns], None)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    model.max_seq_length = serving_length
    model.save(str(folder))
    return losses


def _features(model, texts: list[str]) -> dict:
    return {k: v.to(model.device) if hasattr(v, "to") else v for k, v in model.preprocess(texts).items()}


if __name__ == "__main__":
    main()
