"""Commands that learn from judgments: train-reranker, train-fusion."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from cli.flags import WHERE, add_model_flags, add_settings, model_from
from serving.settings import Settings

console = Console()

TRAIN_EPILOG = """examples:
  hybrid-search train-reranker                     # GPU: one pass over every training query
  hybrid-search train-reranker --max-steps 420 --lr 2e-4 --freeze-layers 2 --max-length 128 \\
      --eval-every 140                            # the bounded CPU recipe (its time: docs/experiments.md)
  hybrid-search train-reranker --distil-from teacher/ --student-layers 3 --max-length 96 \\
      --max-steps 300 --lr 2e-4 --eval-every 100  # the CPU student (its time: docs/cpu-reranking.md)"""


def _judgments_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--judgments",
        type=Path,
        metavar="DIR",
        help="for an index built from files: DIR/queries.jsonl and DIR/qrels/train.tsv (dev.tsv to choose"
        " checkpoints), judging the index's document ids (notes.md) or chunk ids (notes.md#c2)",
    )


def register(sub: argparse._SubParsersAction) -> None:
    from index_build.train_reranker import DISTILLATION, TrainOptions

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
    own = [name for name in TrainOptions.model_fields if name not in DISTILLATION]
    add_model_flags(p.add_argument_group("training"), TrainOptions, own)
    g = p.add_argument_group("distillation: a smaller student that learns a trained reranker's scores")
    add_model_flags(g, TrainOptions, DISTILLATION)
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
        " the card compares it with RRF on dev (its time: docs/configuration.md#why-these-defaults-the-figures).",
    )
    _judgments_option(p)
    p.add_argument("--queries", type=int, help="sample this many training queries (default all)")
    p.add_argument("--seed", type=int, default=0)
    add_settings(p, [*WHERE, "data_dir"])
    p.set_defaults(run=train_fusion)


def train_reranker(settings: Settings, args: argparse.Namespace) -> int:
    from index_build.train_reranker import TrainOptions, train

    base = args.base or args.distil_from or settings.build.encoder
    options = model_from(TrainOptions, args, base=base)
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
