"""Commands that learn from judgments: train-reranker, train-fusion."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from cli.flags import WHERE, add_settings
from serving.settings import Settings

console = Console()

TRAIN_EPILOG = """examples:
  hybrid-search train-reranker                     # GPU: one pass over every training query
  hybrid-search train-reranker --max-steps 420 --lr 2e-4 --freeze-layers 2 --max-length 128 \\
      --eval-every 140                            # bounded CPU run: ~36 minutes on 2 cores
  hybrid-search train-reranker --distil-from teacher/ --student-layers 3 --max-length 96 \\
      --max-steps 300 --lr 2e-4 --eval-every 100  # the CPU student: ~35 minutes on 2 cores"""


def _judgments_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--judgments",
        type=Path,
        metavar="DIR",
        help="for an index built from files: DIR/queries.jsonl and DIR/qrels/train.tsv (dev.tsv to choose"
        " checkpoints), judging the index's document ids (notes.md) or chunk ids (notes.md#c2)",
    )


def register(sub: argparse._SubParsersAction) -> None:
    from index_build.train_reranker import LOSSES

    p = sub.add_parser(
        "train-reranker",
        help="fine-tune the project's cross-encoder on the train judgments",
        description="Fine-tune a cross-encoder on the corpus's train judgments (1 judged positive + hard negatives"
        " from our own retrievers per query, listwise loss); the checkpoint with the best dev nDCG@10 through"
        " the real pipeline is saved into <index-dir>/reranker with a model card, and the engine uses it.",
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _judgments_option(p)
    p.add_argument(
        "--base", help="model to start from (default: the teacher when distilling, else the offline all-MiniLM-L6-v2)"
    )
    p.add_argument("--split", default=None, help="training judgments (default train.graded if present, else train)")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default: one pass over the queries)")
    p.add_argument("--queries", type=int, default=None, help="sample this many training queries")
    p.add_argument("--batch-queries", type=int, default=8, help="queries per step (default 8)")
    p.add_argument("--group-size", type=int, default=8, help="1 positive + N-1 hard negatives per query (default 8)")
    p.add_argument(
        "--mine-depth",
        type=int,
        default=100,
        help="positives and negatives come from each query's RRF top N (default 100; trained slightly better"
        " than 30 on dev)",
    )
    p.add_argument("--lr", type=float, default=3e-5, help="learning rate (default 3e-5)")
    p.add_argument("--eval-every", type=int, default=None, help="steps between dev checkpoints (default: 4 per run)")
    p.add_argument("--eval-queries", type=int, default=None, help="dev queries per checkpoint (default all)")
    p.add_argument(
        "--freeze-layers", type=int, default=0, help="keep the embeddings and the first N layers fixed (CPU runs: 2)"
    )
    p.add_argument("--seed", type=int, default=13)
    p.add_argument(
        "--loss",
        choices=list(LOSSES),
        default="listwise",
        help="listwise: softmax over each query's group (default); pairwise: logistic loss on the"
        " positive's margin over each negative; pointwise: binary cross-entropy per pair",
    )
    p.add_argument(
        "--memory-context",
        type=int,
        default=5,
        metavar="N",
        help="prefix each document with the N training queries nearest the query that cited it (the judgment"
        " memory's, the query itself left out), so the model learns which of them ask the same thing;"
        " serving does the same (default 5: on dev far better than plain documents; 0: plain documents)",
    )
    g = p.add_argument_group("distillation: a smaller student that learns a trained reranker's scores")
    g.add_argument(
        "--distil-from",
        metavar="DIR",
        help="the teacher: a trained reranker folder (not <index-dir>/reranker, which the student replaces)",
    )
    g.add_argument(
        "--student-layers",
        type=int,
        metavar="N",
        help="keep N of the base's transformer layers, evenly spaced (default: all)",
    )
    g.add_argument(
        "--distil-weight",
        type=float,
        default=0.75,
        help="share of the loss that follows the teacher (KL over each group); the rest follows the judgments"
        " (default 0.75)",
    )
    add_settings(
        p,
        [*WHERE, "data_dir", "max_length"],
        {"max_length": "tokens per pair (default 256; CPU runs: 128), saved with the model for serving"},
    )
    p.set_defaults(run=train_reranker)

    p = sub.add_parser(
        "train-fusion",
        help="(re)train the learned fusion of an existing index (`build` already trains one)",
        description="Train a LightGBM LambdaMART fusion over every retriever's ranks and scores on the train"
        " judgments (each training query left out of the judgment memory) and save it into <index-dir>/fusion;"
        " the card compares it with RRF on dev. About 3 minutes on NFCorpus on 2 CPU cores.",
    )
    _judgments_option(p)
    p.add_argument("--queries", type=int, help="sample this many training queries (default all)")
    p.add_argument("--seed", type=int, default=0)
    add_settings(p, [*WHERE, "data_dir"])
    p.set_defaults(run=train_fusion)


def train_reranker(settings: Settings, args: argparse.Namespace) -> int:
    from index_build.train_reranker import TrainOptions, train

    options = TrainOptions(
        base=args.base or args.distil_from or settings.build.encoder,
        split=args.split,
        max_steps=args.max_steps,
        queries=args.queries,
        batch_queries=args.batch_queries,
        group_size=args.group_size,
        mine_depth=args.mine_depth,
        lr=args.lr,
        eval_every=args.eval_every,
        eval_queries=args.eval_queries,
        freeze_layers=args.freeze_layers,
        seed=args.seed,
        loss=args.loss,
        memory_context=args.memory_context,
        distil_from=args.distil_from,
        distil_weight=args.distil_weight,
        student_layers=args.student_layers,
    )
    card = train(settings.engine, options, _judgments(settings, args))
    console.print_json(json.dumps(card))
    return 0


def train_fusion(settings: Settings, args: argparse.Namespace) -> int:
    from index_build.train_fusion import train_fusion as train

    card = train(settings.engine, _judgments(settings, args), queries=args.queries, seed=args.seed)
    console.print_json(json.dumps(card))
    return 0


def _judgments(settings: Settings, args: argparse.Namespace):
    """``--judgments DIR`` for an index built from files (its chunks are the corpus), else the BEIR
    dataset in --data."""
    if args.judgments is None:
        from offline.dataset import load_dataset

        return load_dataset(settings.build.data_dir)
    from index_build.corpus import index_dataset

    return index_dataset(settings.engine.index_dir, args.judgments)
