"""A benchmark's command line: the settings it shares with ``hybrid-search`` as the flags the CLI
generates from them (:mod:`cli.flags`: ``--index-dir``, ``--data``, ``--reranker``, with the
setting's own type, default and description, and ``--config`` and ``HYBRID_SEARCH_*`` under them),
and the benchmark-only flags several benchmarks repeat, defined once here."""

from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import ValidationError

from cli.flags import add_settings, setting_problems, settings_from
from offline.latency import machine_name
from serving.settings import PART_OF, Settings

WHERE = ("index_dir", "data_dir")  # the index measured, and the dataset whose queries and judgments it is measured on
RESULTS = Path(__file__).resolve().parent / "results"


def parser(
    doc: str, *settings: str, split: bool = False, num_queries: bool = False, output: str = "", help=None, **kwargs
) -> argparse.ArgumentParser:
    """``doc``'s first paragraph as the description, the rest below the flags; the flags of
    :func:`add`; ``--split`` and ``--num-queries`` when asked; ``--output``, by default ``output``
    under benchmarks/results, its ``{machine}`` and ``{flag}`` filled in by :func:`resolve`."""
    head, _, rest = doc.strip().partition("\n\n")
    kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
    p = argparse.ArgumentParser(description=head, epilog=rest, **kwargs)
    if settings:
        add(p, *settings, help=help)
    if split:
        p.add_argument("--split", default="dev", help="the split whose judged queries are run (default dev)")
    if num_queries:
        p.add_argument("--num-queries", type=int, help="sample N judged queries of the split (default: all)")
    if output:
        p.add_argument(
            "--output", type=Path, default=RESULTS / output, help=f"JSON file (default benchmarks/results/{output})"
        )
    return p


def add(p: argparse.ArgumentParser, *settings: str, help: dict[str, str] | None = None) -> None:
    """A flag for each of ``settings``, as ``hybrid-search`` makes it (``help`` replaces a
    description), and ``--config``."""
    p.add_argument("--config", type=Path, metavar="TOML", help="settings file, as hybrid-search --config reads it")
    add_settings(p, settings, help)


def load(p: argparse.ArgumentParser, argv: list[str] | None = None) -> tuple[argparse.Namespace, Settings]:
    """The flags, and the settings with them on top (:func:`resolve`)."""
    args = p.parse_args(argv)
    return args, resolve(args)


def resolve(args: argparse.Namespace) -> Settings:
    """The settings with the flags on top; each setting's flag then holds the value the settings
    resolved (its default, the TOML file's, the environment's), as results record it, and
    ``--output``'s default is filled in."""
    try:
        settings = settings_from(args)
    except ValidationError as exc:
        raise SystemExit(f"invalid settings: {setting_problems(exc)}") from None
    for name in vars(args).keys() & PART_OF.keys():
        setattr(args, name, getattr(getattr(settings, PART_OF[name]), name))
    if "{" in str(getattr(args, "output", "")):
        machine = machine_name() if "{machine}" in str(args.output) else None
        args.output = Path(str(args.output).format(**vars(args), machine=machine))
    return settings
