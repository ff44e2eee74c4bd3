"""No Docker engine runs here, so the CUDA image's structure is checked against the CLI instead."""

import json
import re
from pathlib import Path

from serving.cli import build_parser

DOCKERFILE = (Path(__file__).resolve().parents[1] / "Dockerfile.cuda").read_text()


def _instruction(name: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(rf"^{name}\s+(.+)$", DOCKERFILE, re.M)]


def test_cuda_base_gpu_extra_and_non_root_user():
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:[\w.-]+-runtime-", DOCKERFILE, re.M)
    assert _instruction("FROM") == ["${CUDA_IMAGE}"]
    assert any(".[gpu]" in run for run in _instruction("RUN"))
    assert _instruction("USER") == ["search"]


def test_ports_healthcheck_and_entrypoint_match_the_cli():
    assert _instruction("EXPOSE") == ["8000 9010"]
    assert "http://127.0.0.1:8000/health" in DOCKERFILE
    assert json.loads(_instruction("ENTRYPOINT")[0]) == ["hybrid-search"]
    command = json.loads(_instruction("CMD")[0])
    args = build_parser().parse_args(command)  # the container's command parses as a real subcommand
    assert args.command == "serve" and args.build_if_missing


def test_environment_names_real_settings():
    from engine.config import Settings

    names = re.findall(r"HYBRID_SEARCH_([A-Z_]+)=", DOCKERFILE)
    assert names and all(n.lower() in Settings.model_fields for n in names)
