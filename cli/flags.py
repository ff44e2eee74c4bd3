"""The settings' flags, generated: each setting a command takes becomes ``--its-name`` with the
setting's own type, choices and description, grouped by the part it belongs to. Nothing is
restated here but where a flag's name or help differs from the setting's (kept from earlier
releases, or said in a command's terms)."""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from serving.settings import PART_OF, PARTS, Settings

# flags whose names predate the settings' (both spellings work in TOML and the environment: the setting's)
FLAG_NAMES = {
    "data_dir": "--data",
    "query_timeout_s": "--query-timeout",
    "max_queue_s": "--max-queue",
    "refresh_interval_s": "--refresh-interval",
    "ray_address": "--address",
    "ray_search_replicas": "--search-replicas",
    "ray_reranker_replicas": "--reranker-replicas",
    "ray_replica_cpus": "--replica-cpus",
    "ray_shard_replicas": "--shard-replicas",
    "ray_shard_failure": "--shard-failure",
    "ray_shard_timeout_s": "--shard-timeout",
}
METAVARS = {
    "tls_cert": "PEM",
    "tls_key": "PEM",
    "tls_client_ca": "PEM",
    "ray_address": "HOST:PORT",
    "distil_from": "DIR",
    "memory_context": "N",
    "student_layers": "N",
    "request_controls": "CONTROL,...",
}
M = typing.TypeVar("M", bound=BaseModel)

# what each kind of command takes, by part (every field) or by name
WHERE = ("index_dir", "device")
LIVE = ("encode_batch_size", "refresh_interval_s", "checkpoint_bytes")
SET_BY_SERVE = ("followed", "page_pins_file")  # a process's part in a served whole, not the user's to choose
TABLES = ("retrievers",)  # a table by name: given in TOML or the environment, not as a flag
SEARCH = tuple(n for n in PARTS["engine"].model_fields if n not in LIVE + SET_BY_SERVE + TABLES)


def add_settings(parser: argparse.ArgumentParser, names: Iterable[str], help: dict[str, str] | None = None) -> None:
    """A flag for each setting in ``names``, in its part's group; ``help`` replaces a setting's
    description for this command."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name in dict.fromkeys(names):
        part = PART_OF[name]
        if part not in groups:
            groups[part] = parser.add_argument_group(Settings.model_fields[part].description)
        _add(groups[part], name, PARTS[part].model_fields[name], (help or {}).get(name))


def add_model_flags(group: argparse._ArgumentGroup, model: type[BaseModel], names: Iterable[str]) -> None:
    """A flag for each of ``model``'s fields in ``names``, made as a setting's is (a command's own
    options: ``train-reranker``'s ``TrainOptions``)."""
    for name in names:
        _add(group, name, model.model_fields[name], None)


def model_from(model: type[M], args: argparse.Namespace, **given: object) -> M:
    """``model`` from the flags given (an unset flag leaves the field's default) and ``given``."""
    flags = {name: getattr(args, name) for name in model.model_fields if getattr(args, name, None) is not None}
    return model.model_validate({**flags, **given})


def _add(group: argparse._ArgumentGroup, name: str, field: FieldInfo, help: str | None) -> None:
    flag = FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
    kind = _plain(field.annotation)
    text = help or field.description or ""
    default = None if field.is_required() else field.get_default(call_default_factory=True)
    if default is not None and "default" not in text:
        text += f" (default {_shown(default)})"
    options: dict = {"dest": name, "default": None, "help": text.replace("%", "%%")}
    if kind is bool:
        options["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(kind) is typing.Literal:
        options["choices"] = list(typing.get_args(kind))
    elif kind in (int, float, Path, str):
        options["type"] = kind
        options["metavar"] = METAVARS.get(name, "DIR" if name.endswith("_dir") else None)
    else:  # e.g. replica bounds: the setting parses the text ("2", "1-4")
        options["metavar"] = METAVARS.get(name, "N")
    if options.get("metavar") is None:
        options.pop("metavar", None)
    group.add_argument(flag, **options)


def _plain(annotation: object) -> object:
    """``int | None`` -> int: what a flag's value is when given."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        return kinds[0] if len(kinds) == 1 else str
    return annotation


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        low, high = value
        return str(low) if low == high else f"{low}-{high}"
    return str(value)


def settings_from(args: argparse.Namespace) -> Settings:
    """The settings with the flags given on top (an unset flag is None: it leaves the value alone)."""
    overrides = {k: v for k, v in vars(args).items() if k in PART_OF and v is not None}
    return Settings.load(args.config, **overrides)


def setting_problems(exc: ValidationError) -> str:
    """A settings error in the names the user gave (``rrf_k``, not ``engine.rrf_k``)."""
    named = []
    for error in exc.errors():
        loc = error["loc"][1:] if error["loc"] and error["loc"][0] in PARTS else error["loc"]
        named.append(f"{'.'.join(map(str, loc)) or 'settings'}: {error['msg']}")
    return "; ".join(named)
