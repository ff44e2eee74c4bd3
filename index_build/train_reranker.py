"""Fine-tune the project's cross-encoder on a corpus's train judgments.

Recipe: each training query's fused top candidates are retrieved as for a new query (the judgment
memory leaves the query out); one judged positive among them (sampled in proportion to its grade)
and ``group_size - 1`` unjudged ones form a group, and the loss is a softmax cross-entropy over the
group (listwise "localized contrastive estimation", Gao et al. 2021). That is exactly the decision
reranking makes. By default the reranker is fusion-aware: each document's logit gets a learned
``weight * -log(fused rank)`` before the softmax, so the model learns what the fused order gets wrong
instead of relearning what it already knows (on NFCorpus the fusion carries the train-judgment
memory, which no text model can see), and serving adds the same prior. Checkpoints are chosen by dev
nDCG@10 through the real engine pipeline, never by loss.
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from engine.config import Settings
from engine.dataset import Dataset, load_dataset
from engine.evaluation import evaluate_run, stage_runs
from engine.index_dir import RERANKER_DIR
from engine.models import pick_device, resolve_model
from engine.pipeline import HybridEngine
from engine.fusion import rank_prior
from engine.rerank import PRIOR_FILE, Reranker
from index_build.negatives import Mined, mine_candidates

log = logging.getLogger(__name__)
CARD_FILE = "model_card.json"
TRAIN_MAX_LENGTH = 256
HEAD_LR_FACTOR = 10
PRIOR_LR = 1e-2
PRIOR_FIT_SAMPLES = 4


@dataclass
class TrainOptions:
    base: str
    split: str | None = None
    max_steps: int | None = None
    queries: int | None = None
    batch_queries: int = 8
    group_size: int = 8
    lr: float = 3e-5
    eval_every: int | None = None
    eval_queries: int | None = None
    eval_split: str = "dev"
    mine_depth: int = 30
    freeze_layers: int = 0
    fused_prior: bool = True
    seed: int = 13


def train(settings: Settings, options: TrainOptions, dataset: Dataset | None = None, progress: bool = True) -> dict:
    """Train, keep the best dev checkpoint in ``<index_dir>/reranker`` and return its model card."""
    import torch

    started = time.perf_counter()
    rng = random.Random(options.seed)
    torch.manual_seed(options.seed)
    dataset = dataset or load_dataset(settings.data_dir)
    split = options.split or ("train.graded" if "train.graded" in dataset.splits() else "train")
    qrels = dataset.qrels(split)
    train_ids = sorted(q for q, docs in qrels.items() if any(g > 0 for g in docs.values()))
    if options.queries:
        train_ids = rng.sample(train_ids, min(options.queries, len(train_ids)))
    eval_qrels = dataset.qrels(options.eval_split)
    eval_queries = dataset.split_queries(options.eval_split)
    if options.eval_queries:
        eval_queries = dict(list(eval_queries.items())[: options.eval_queries])

    engine = HybridEngine(settings.model_copy(update={"rerank": False}))
    mined = mine_candidates(engine, {q: dataset.queries[q] for q in train_ids}, qrels, options.mine_depth, progress)
    train_ids = [q for q in train_ids if mined.positives[q] and len(mined.negatives[q]) >= options.group_size - 1]
    if not train_ids:
        raise ValueError(
            f"no {split} query has a judged document and {options.group_size - 1} unjudged ones"
            f" among its top {options.mine_depth} candidates"
        )

    device = pick_device(settings.device)
    from sentence_transformers import CrossEncoder

    max_length = settings.max_length or TRAIN_MAX_LENGTH  # saved with the model: serving reads it back
    # served scores are the raw logits the loss trained (no sigmoid), so the prior adds to what it was fitted with
    model = CrossEncoder(
        resolve_model(options.base), num_labels=1, max_length=max_length, device=device, activation_fn=torch.nn.Identity()
    )
    _freeze_lower_layers(model.transformers_model, options.freeze_layers)
    steps = options.max_steps or math.ceil(len(train_ids) / options.batch_queries)
    eval_every = options.eval_every or max(1, steps // 4)
    groups = _param_groups(model.transformers_model, options.lr)
    prior = None  # the prior's weight (fitted to the fused order alone first) and the logits' log scale
    if options.fused_prior:
        weight = _fit_prior_weight(mined, train_ids, options.group_size, rng)
        prior = {"weight": torch.nn.Parameter(torch.tensor(weight)), "log_scale": torch.nn.Parameter(torch.tensor(0.0))}
        groups.append({"params": list(prior.values()), "lr": PRIOR_LR, "weight_decay": 0.0})
    trainable = [p for g in groups for p in g["params"]]
    optimizer = torch.optim.AdamW(groups, weight_decay=0.01)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (steps - s) / max(1, steps - warmup)))
    )
    use_amp = device == "cuda"
    work = Path(tempfile.mkdtemp(prefix="reranker-train-"))
    best = {"step": 0, "ndcg@10": -1.0, "metrics": {}}
    baseline = evaluate_run(eval_qrels, stage_runs(engine, eval_queries, progress=False)["rrf"])
    history, losses, order = [], [], []
    bar = tqdm(range(1, steps + 1), desc="training reranker", unit="step", disable=not progress)
    for step in bar:
        model.train()
        batch = []
        for _ in range(options.batch_queries):
            if not order:
                order = train_ids[:]
                rng.shuffle(order)
            batch.append(order.pop())
        loss = _group_loss(model, dataset, batch, mined, prior, options.group_size, rng, use_amp)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        weight = prior["weight"].item() if prior is not None else None
        bar.set_postfix(loss=f"{_mean(losses[-20:]):.3f}", prior=weight)
        if step % eval_every == 0 or step == steps:
            metrics = _dev_metrics(model, prior, work / "candidate", engine, settings, device, eval_qrels, eval_queries)
            history.append({"step": step, "loss": _mean(losses[-eval_every:]), "prior_weight": weight, **metrics})
            log.info("step %d: dev nDCG@10 %.4f (fused %.4f)", step, metrics["nDCG@10"], baseline["nDCG@10"])
            if metrics["nDCG@10"] > best["ndcg@10"]:
                shutil.rmtree(work / "best", ignore_errors=True)
                (work / "candidate").rename(work / "best")
                best = {"step": step, "ndcg@10": metrics["nDCG@10"], "metrics": metrics, "prior_weight": weight}
    card = {
        "base_model": options.base,
        "data": str(Path(dataset.root).resolve()),
        "train_split": split,
        "train_queries": len(train_ids),
        "loss": f"listwise softmax cross-entropy, 1 positive + {options.group_size - 1} hard negatives"
        f" from the top {options.mine_depth} candidates (memory leave-one-out)"
        + (", scaled logits plus a learned weight times -log(fused rank)" if options.fused_prior else ""),
        "prior_weight": best.get("prior_weight"),
        "options": asdict(options),
        "max_length": max_length,
        "steps": steps,
        "best_step": best["step"],
        "loss_first": _mean(losses[: max(1, len(losses) // 5)]),
        "loss_last": _mean(losses[-max(1, len(losses) // 5) :]),
        "device": device,
        "seconds": round(time.perf_counter() - started, 1),
        "eval_split": options.eval_split,
        "eval_queries": len(eval_queries),
        "dev_fused": baseline,
        "dev_reranked": best["metrics"],
        "history": history,
    }
    (work / "best" / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
    target = Path(settings.index_dir) / RERANKER_DIR
    shutil.rmtree(target, ignore_errors=True)
    shutil.move(str(work / "best"), target)
    shutil.rmtree(work, ignore_errors=True)
    return card


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _freeze_lower_layers(model, layers: int) -> None:
    """Freeze the embeddings and the first ``layers`` transformer layers: on a CPU the backward pass
    then stops early (MiniLM-L6, 3 frozen: 1.6x the pairs per second) and a short run moves less."""
    if layers <= 0:
        return
    base = model.base_model
    blocks = getattr(getattr(base, "encoder", None), "layer", None)
    if blocks is None or not hasattr(base, "embeddings"):
        raise ValueError(f"--freeze-layers needs a BERT-style encoder; {type(model).__name__} is not one")
    if layers >= len(blocks):
        raise ValueError(f"--freeze-layers {layers}: the model has only {len(blocks)} layers")
    for module in [base.embeddings, *blocks[:layers]]:
        module.requires_grad_(False)


def _param_groups(model, lr: float) -> list[dict]:
    """A bi-encoder base (MiniLM) has no scoring head: the new classifier and the pooler feeding it
    learn at ``HEAD_LR_FACTOR`` times the body's rate, so a short run is not spent waking them up."""
    fresh = not any(a.endswith("ForSequenceClassification") for a in model.config.architectures or [])
    head, body = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (head if fresh and (name.startswith("classifier.") or ".pooler." in name) else body).append(param)
    return [{"params": body, "lr": lr}, {"params": head, "lr": lr * HEAD_LR_FACTOR}]


def _sample_group(mined: Mined, qid: str, group_size: int, rng: random.Random) -> list[str]:
    """One judged positive (drawn in proportion to its grade) first, then ``group_size - 1`` negatives."""
    docs = mined.positives[qid]
    pos = rng.choices(list(docs), weights=list(docs.values()))[0]
    return [pos, *rng.sample(mined.negatives[qid], group_size - 1)]


def _fit_prior_weight(mined: Mined, train_ids: list[str], group_size: int, rng: random.Random) -> float:
    """The weight at which ``weight * -log(fused rank)`` alone best predicts the positive of sampled
    training groups: where the fusion-aware model starts, so its first steps learn text, not the prior."""
    import numpy as np

    groups = [_sample_group(mined, q, group_size, rng) for q in train_ids for _ in range(PRIOR_FIT_SAMPLES)]
    owners = [q for q in train_ids for _ in range(PRIOR_FIT_SAMPLES)]
    prior = np.array([[rank_prior(mined.ranks[q][d]) for d in g] for q, g in zip(owners, groups, strict=True)])

    def loss(weight: float) -> float:
        logits = weight * prior
        top = logits.max(axis=1)
        return float(np.mean(top + np.log(np.exp(logits - top[:, None]).sum(axis=1)) - logits[:, 0]))

    return min(np.arange(0.0, 5.0, 0.05), key=loss).item()


def _group_loss(model, dataset, batch, mined, prior, group_size, rng, use_amp):
    """Softmax cross-entropy with the positive at index 0 of each query's group. With a ``prior``, the
    logits are scaled by a learned factor (a temperature: a fresh head's logits start nearly equal, and
    without it they take hundreds of steps to outweigh the prior) and the weighted fused-rank prior is added."""
    import torch

    pairs, ranks = [], []
    for qid in batch:
        group = _sample_group(mined, qid, group_size, rng)
        pairs += [(dataset.queries[qid], dataset.corpus[d].contents) for d in group]
        ranks += [mined.ranks[qid][d] for d in group]
    features = model.tokenizer(
        [q for q, _ in pairs],
        [d for _, d in pairs],
        padding=True,
        truncation="only_second",
        max_length=model.max_seq_length,
        return_tensors="pt",
    ).to(model.device)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_amp):
        logits = model.transformers_model(**features).logits.view(len(batch), group_size).float()
    if prior is not None:
        fused = torch.tensor([rank_prior(r) for r in ranks], device=logits.device).view_as(logits)
        logits = logits * prior["log_scale"].exp() + prior["weight"] * fused
    return torch.nn.functional.cross_entropy(logits, torch.zeros(len(batch), dtype=torch.long, device=logits.device))


def _save(model, prior, folder: Path) -> None:
    """Save the model as serving loads it: a fusion-aware model's logit scale folded into its scoring
    layer (so it scores exactly as trained) and its prior weight beside it."""
    import torch

    shutil.rmtree(folder, ignore_errors=True)
    if prior is None:
        model.save_pretrained(str(folder))
        return
    layer = [m for m in model.transformers_model.modules() if isinstance(m, torch.nn.Linear)][-1]
    scale = prior["log_scale"].exp().item()
    with torch.no_grad():
        layer.weight.mul_(scale)
        layer.bias.mul_(scale)
        model.save_pretrained(str(folder))
        layer.weight.div_(scale)
        layer.bias.div_(scale)
    weight = prior["weight"].item()
    (folder / PRIOR_FILE).write_text(json.dumps({"feature": "-log(fused rank)", "weight": weight, "logit_scale": scale}) + "\n")


def _dev_metrics(model, prior, folder: Path, engine, settings, device, qrels, queries) -> dict[str, float]:
    """Save the model, load it the way serving does, and score the real pipeline on dev."""
    _save(model, prior, folder)
    engine.reranker = Reranker(
        str(folder), device, settings.max_length, settings.rerank_batch_size, settings.rerank_runtime
    )
    try:
        return evaluate_run(qrels, stage_runs(engine, queries, progress=False, reranked=("rrf",))["rrf+rerank"])
    finally:
        engine.reranker = None
