"""Fine-tune the project's cross-encoder on a corpus's train judgments.

Recipe: each training query's RRF top candidates are retrieved as for a new query (the judgment
memory leaves the query out); one judged positive among them (sampled in proportion to its grade)
and ``group_size - 1`` unjudged ones form a group, and the loss is a softmax cross-entropy over the
group (listwise "localized contrastive estimation", Gao et al. 2021). That is exactly the decision
reranking makes. For comparison, ``loss="pairwise"`` scores the same groups with a logistic loss on
the positive's margin over each negative (RankNet), ``loss="pointwise"`` with binary cross-entropy
(positive 1, negatives 0). With ``memory_context`` (default 5) each document is read after the
training queries that cited it, nearest the query first, the query itself left out: on NFCorpus dev
that turns a reranker that barely moved the learned fusion into a clear gain. Checkpoints are chosen
by dev nDCG@10 through the real engine pipeline, never by loss.

Distillation (``distil_from``): a smaller student, by default the teacher itself with only
``student_layers`` of its layers kept (evenly spaced, head included, as DistilBERT starts), learns
the teacher's scores over the same groups: a KL divergence between the two softmaxes over each group,
weighted ``distil_weight`` against the judgment loss above. The student is what a CPU can afford.
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.rerank.cross_encoder import CARD_FILE, Reranker
from engine.rerank.loading import load_reranker
from engine.retrieval.encoder import pick_device, resolve_model
from engine.search import HybridEngine, SearchOptions
from engine.settings import EngineSettings
from engine.store.index_dir import RERANKER_DIR
from index_build.negatives import mine_candidates
from index_build.schedule import warmup_linear
from offline.dataset import Dataset
from offline.evaluation import evaluate_run, served_stage, stage_runs
from offline.progress import track

log = logging.getLogger(__name__)
TRAIN_MAX_LENGTH = 256
HEAD_LR_FACTOR = 10
LOSSES = {
    "listwise": "listwise softmax cross-entropy",
    "pairwise": "pairwise logistic (RankNet) loss",
    "pointwise": "pointwise binary cross-entropy",
}


class TrainOptions(BaseModel):
    """How ``train-reranker`` trains: its flags are these fields (``cli/train.py``)."""

    model_config = ConfigDict(extra="forbid")

    base: str = Field(
        description="model to start from (default: the teacher when distilling, else the offline all-MiniLM-L6-v2)"
    )
    split: str | None = Field(None, description="training judgments (default train.graded if present, else train)")
    max_steps: int | None = Field(None, ge=1, description="optimizer steps (default: one pass over the queries)")
    queries: int | None = Field(None, ge=1, description="sample this many training queries")
    batch_queries: int = Field(8, ge=1, description="queries per step")
    group_size: int = Field(8, ge=2, description="1 positive + N-1 hard negatives per query")
    lr: float = Field(3e-5, gt=0, description="learning rate")
    eval_every: int | None = Field(None, ge=1, description="steps between dev checkpoints (default: 4 per run)")
    eval_queries: int | None = Field(None, ge=1, description="dev queries per checkpoint (default all)")
    eval_split: str = Field("dev", description="the judgments checkpoints are chosen on")
    mine_depth: int = Field(
        100, ge=2, description="positives and negatives come from each query's RRF top N (docs/experiments.md)"
    )
    freeze_layers: int = Field(0, ge=0, description="keep the embeddings and the first N layers fixed (CPU runs: 2)")
    seed: int = Field(13, description="the sampling and initialisation seed")
    loss: Literal["listwise", "pairwise", "pointwise"] = Field(
        "listwise",
        description="listwise: softmax over each query's group; pairwise: logistic loss on the positive's margin over"
        " each negative; pointwise: binary cross-entropy per pair",
    )
    memory_context: int = Field(
        5,
        ge=0,
        description="prefix each document with the N training queries nearest the query that cited it (the judgment"
        " memory's, the query itself left out), as serving does (0: plain documents; docs/experiments.md)",
    )
    distil_from: str | None = Field(
        None,
        description="the teacher: a trained reranker folder (not <index-dir>/reranker, which the student replaces)",
    )
    distil_weight: float = Field(
        0.75,
        ge=0,
        le=1,
        description="share of the loss that follows the teacher (KL over each group); the rest follows the judgments",
    )
    student_layers: int | None = Field(
        None, ge=1, description="keep N of the base's transformer layers, evenly spaced (default: all)"
    )


DISTILLATION = ("distil_from", "student_layers", "distil_weight")  # the flags' own group


def student_options(teacher: str, steps: int = 300) -> TrainOptions:
    """The CPU student recipe the README's table measured: 3 of the teacher's 6 layers (2 fell below
    the fused order), the 96 tokens a CPU serves (train with ``max_length=RERANK_MAX_LENGTH``), 300
    steps of 8 groups at 2e-4, checkpoints every 100 (its time on 2 cores: docs/cpu-reranking.md)."""
    return TrainOptions(
        base=teacher, distil_from=teacher, student_layers=3, max_steps=steps, lr=2e-4, eval_every=max(1, steps // 3)
    )


def train(settings: EngineSettings, options: TrainOptions, dataset: Dataset, progress: bool = True) -> dict:
    """Train, keep the best dev checkpoint in ``<index_dir>/reranker`` and return its model card."""
    import torch

    target = Path(settings.index_dir) / RERANKER_DIR
    if options.distil_from and Path(options.distil_from).resolve() == target.resolve():
        raise ValueError(
            f"--distil-from {options.distil_from} is the folder the student would replace: copy the teacher elsewhere"
        )
    if options.mine_depth < options.group_size:
        raise ValueError(f"--mine-depth {options.mine_depth} cannot hold a group of {options.group_size} documents")
    started = time.perf_counter()
    device = pick_device(settings.device)
    teacher = (  # loaded first: a wrong folder fails before minutes of mining
        Reranker(
            options.distil_from,
            device,
            batch_size=settings.rerank_batch_for(device),
            runtime=settings.rerank_runtime,
            quantize="none",  # the student learns the teacher's own scores, even from a student
        )
        if options.distil_from
        else None
    )
    rng = random.Random(options.seed)
    torch.manual_seed(options.seed)
    split = options.split or dataset.training_split() or "train"
    qrels = dataset.qrels(split)
    train_ids = sorted(q for q, docs in qrels.items() if any(g > 0 for g in docs.values()))
    if options.queries:
        train_ids = rng.sample(train_ids, min(options.queries, len(train_ids)))
    eval_qrels = dataset.qrels(options.eval_split)
    eval_queries = dataset.split_queries(options.eval_split)
    if options.eval_queries:
        eval_queries = dict(list(eval_queries.items())[: options.eval_queries])

    engine = HybridEngine(settings.model_copy(update={"rerank": False}))
    missing = engine.missing_memory_context() if options.memory_context else None
    if missing:
        raise ValueError(f"--memory-context {options.memory_context}: {missing} (or pass --memory-context 0)")
    mined = mine_candidates(engine, {q: dataset.queries[q] for q in train_ids}, qrels, options.mine_depth, progress)
    positives, negatives = mined.positives, mined.negatives
    train_ids = [q for q in train_ids if positives[q] and len(negatives[q]) >= options.group_size - 1]
    if not train_ids:
        raise ValueError(
            f"no {split} query has a judged document and {options.group_size - 1} unjudged ones"
            f" among its top {options.mine_depth} candidates"
        )

    from sentence_transformers import CrossEncoder

    max_length = settings.max_length or TRAIN_MAX_LENGTH  # saved with the model: serving reads it back
    model = CrossEncoder(resolve_model(options.base), num_labels=1, max_length=max_length, device=device)
    _keep_layers(model.transformers_model, options.student_layers)
    _freeze_lower_layers(model.transformers_model, options.freeze_layers)
    steps = options.max_steps or math.ceil(len(train_ids) / options.batch_queries)
    eval_every = options.eval_every or max(1, steps // 4)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(_param_groups(model.transformers_model, options.lr), weight_decay=0.01)
    schedule = warmup_linear(optimizer, steps)
    use_amp = device == "cuda"
    work = Path(tempfile.mkdtemp(prefix="reranker-train-"))
    best = {"step": 0, "ndcg@10": -1.0, "metrics": {}}
    baseline = evaluate_run(eval_qrels, stage_runs(engine, eval_queries, progress=False)[served_stage(engine)])
    history, losses, order = [], [], []
    bar = track(range(1, steps + 1), "training reranker", "step", enabled=progress)
    for step in bar:
        model.train()
        batch = []
        for _ in range(options.batch_queries):
            if not order:
                order = train_ids[:]
                rng.shuffle(order)
            batch.append(order.pop())
        loss = _group_loss(model, teacher, engine, dataset, batch, positives, negatives, options, rng, use_amp)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        bar.note(loss=f"{_mean(losses[-20:]):.3f}")
        if step % eval_every == 0 or step == steps:
            metrics = _dev_metrics(model, work / "candidate", engine, settings, options, eval_qrels, eval_queries)
            history.append({"step": step, "loss": _mean(losses[-eval_every:]), **metrics})
            log.info("step %d: dev nDCG@10 %.4f (fused %.4f)", step, metrics["nDCG@10"], baseline["nDCG@10"])
            if metrics["nDCG@10"] > best["ndcg@10"]:
                shutil.rmtree(work / "best", ignore_errors=True)
                (work / "candidate").rename(work / "best")
                best = {"step": step, "ndcg@10": metrics["nDCG@10"], "metrics": metrics}
    card = {
        "base_model": options.base,
        "data": str(Path(dataset.root).resolve()),
        "train_split": split,
        "train_queries": len(train_ids),
        "loss": f"{LOSSES[options.loss]}, 1 positive + {options.group_size - 1} hard negatives"
        f" from the RRF top {options.mine_depth} (memory leave-one-out)"
        + (f"; distilled: {options.distil_weight} x KL to the teacher's softmax over each group" if teacher else ""),
        "options": options.model_dump(),
        "layers": model.transformers_model.config.num_hidden_layers,
        **({"teacher": _teacher_summary(teacher)} if teacher else {}),
        "max_length": max_length,
        **_serving_fields(options),
        "steps": steps,
        "best_step": best["step"],
        "loss_first": _mean(losses[: max(1, len(losses) // 5)]),
        "loss_last": _mean(losses[-max(1, len(losses) // 5) :]),
        "device": device,
        "seconds": round(time.perf_counter() - started, 1),
        "eval_split": options.eval_split,
        "eval_queries": len(eval_queries),
        "eval_rerank": {
            "depth": settings.rerank_depth_for(device),
            "blend": settings.rerank_blend,
            "quantize": settings.rerank_quantize,
            "max_length": min(max_length, settings.rerank_length_cap or max_length),
        },
        "dev_fused": baseline,
        "dev_reranked": best["metrics"],
        "history": history,
    }
    (work / "best" / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    shutil.move(str(work / "best"), target)
    shutil.rmtree(work, ignore_errors=True)
    return card


def _serving_fields(options: TrainOptions) -> dict:
    """What serving reads of the card (engine/rerank/cross_encoder.py): a distilled student is made for CPUs, so a
    CPU serves it in int8 unless told otherwise."""
    return {"memory_context": options.memory_context, "cpu_quantize": "int8" if options.distil_from else "none"}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _teacher_summary(teacher: Reranker) -> dict:
    """What the student learned from: the teacher's folder and, from its own card, how it was made."""
    card = Path(teacher.name) / CARD_FILE
    own = json.loads(card.read_text()) if card.is_file() else {}
    return {
        "path": str(Path(teacher.name).resolve()),
        "base_model": own.get("base_model"),
        "layers": teacher.model.transformers_model.config.num_hidden_layers,
        "max_length": teacher.max_length,
        "memory_context": teacher.memory_context,
        "dev_reranked": own.get("dev_reranked"),
    }


def _encoder_layers(model, option: str):
    """The transformer blocks of a BERT-style encoder (MiniLM, BERT, ELECTRA...)."""
    base = model.base_model
    blocks = getattr(getattr(base, "encoder", None), "layer", None)
    if blocks is None or not hasattr(base, "embeddings"):
        raise ValueError(f"{option} needs a BERT-style encoder; {type(model).__name__} is not one")
    return blocks


def _keep_layers(model, layers: int | None) -> None:
    """Keep ``layers`` transformer blocks, evenly spaced from the first to the last: the student starts
    as the base with layers dropped, so it inherits embeddings, head and the ends of the stack."""
    if not layers:
        return
    import torch

    blocks = _encoder_layers(model, "--student-layers")
    if layers > len(blocks):
        raise ValueError(f"--student-layers {layers}: the model has only {len(blocks)} layers")
    keep = sorted({round(i * (len(blocks) - 1) / max(layers - 1, 1)) for i in range(layers)})
    model.base_model.encoder.layer = torch.nn.ModuleList(blocks[i] for i in keep)
    model.config.num_hidden_layers = layers


def _freeze_lower_layers(model, layers: int) -> None:
    """Freeze the embeddings and the first ``layers`` transformer layers: on a CPU the backward pass
    then stops early (more pairs a second: docs/configuration.md, "Why these defaults") and a short
    run moves less."""
    if layers <= 0:
        return
    blocks = _encoder_layers(model, "--freeze-layers")
    if layers >= len(blocks):
        raise ValueError(f"--freeze-layers {layers}: the model has only {len(blocks)} layers")
    for module in [model.base_model.embeddings, *blocks[:layers]]:
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


def _group_loss(model, teacher, engine, dataset, batch, positives, negatives, options: TrainOptions, rng, use_amp):
    """The positive sits at index 0 of each query's group: softmax cross-entropy over the group
    (listwise), log(1 + e^(negative - positive)) per negative (pairwise) or binary cross-entropy per
    pair (pointwise). Documents read as serving will read them (memory context left one out). With a
    teacher, its softmax over the group is a soft target too (KL divergence), each model reading the
    documents as it was trained to."""
    import torch

    group_size = options.group_size
    pairs, teacher_pairs = [], []
    for qid in batch:
        docs = positives[qid]
        pos = rng.choices(list(docs), weights=list(docs.values()))[0]
        group = [pos, *rng.sample(negatives[qid], group_size - 1)]
        query = dataset.queries[qid]
        passages = engine.rerank_passages(query, group, options.memory_context, exclude=qid)
        pairs += [(query, p) for p in passages]
        if teacher is not None:
            if teacher.memory_context != options.memory_context:
                passages = engine.rerank_passages(query, group, teacher.memory_context, exclude=qid)
            teacher_pairs += [(query, p) for p in passages]
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
    hard = _judgment_loss(logits, options.loss)
    if teacher is None:
        return hard
    target = torch.tensor(teacher.logits(teacher_pairs), device=logits.device).view(len(batch), group_size)
    log_softmax = torch.nn.functional.log_softmax
    soft = torch.nn.functional.kl_div(
        log_softmax(logits, -1), log_softmax(target, -1), log_target=True, reduction="batchmean"
    )
    return options.distil_weight * soft + (1 - options.distil_weight) * hard


def _judgment_loss(logits, loss: str):
    """Loss against the judgments, the positive at column 0 of each group."""
    import torch

    if loss == "pointwise":
        targets = torch.zeros_like(logits)
        targets[:, 0] = 1.0
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, targets)
    if loss == "pairwise":
        return torch.nn.functional.softplus(logits[:, 1:] - logits[:, :1]).mean()
    return torch.nn.functional.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long, device=logits.device))


def _dev_metrics(model, folder: Path, engine, settings, options: TrainOptions, qrels, queries) -> dict[str, float]:
    """Save the model, load it the way serving does, and score the real pipeline on dev."""
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(str(folder))
    (folder / CARD_FILE).write_text(json.dumps(_serving_fields(options)))  # the full card comes last
    served = settings.model_copy(update={"rerank_compile": False})  # as served, but a checkpoint is scored once
    checkpoint = SearchOptions(reranker=load_reranker(served, str(folder), engine.device, cache=False))
    stage = served_stage(engine)
    runs = stage_runs(engine, queries, progress=False, reranked=(stage,), options=checkpoint)
    return evaluate_run(qrels, runs[f"{stage}+rerank"])
