import json
import os

import pytest

from cli.main import build_parser, main
from engine.settings import EngineSettings
from index_build.settings import BuildSettings
from serving.settings import Settings


def test_help_teaches_every_command(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for command in ("build", "search", "evaluate", "train-reranker", "serve", "mcp-stdio"):
        assert command in out
    assert "HYBRID_SEARCH_" in out
    for command in ("build", "search", "evaluate", "train-reranker", "serve", "mcp-stdio"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--index-dir" in capsys.readouterr().out


def test_search_prints_a_table_and_json(index_dir, capsys):
    assert (
        main(["search", "markerstatin2 cholesterol", "--top-k", "3", "--index-dir", str(index_dir), "--device", "cpu"])
        == 0
    )
    out = capsys.readouterr().out
    assert "D-statin-2" in out and "rank in that retriever" in out.replace("\n", " ")
    assert main(["search", "statins", "--top-k", "2", "--json", "--index-dir", str(index_dir), "--no-rerank"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert len(hits) == 2 and {"doc_id", "bm25_rank", "dense_rank", "fused_score"} <= set(hits[0])
    alone = ["--weights", "bm25=1,dense=0,memory=0", "--fusion", "rrf", "--no-rerank", "--explain"]
    assert main(["search", "statins", "--top-k", "3", "--json", "--index-dir", str(index_dir), *alone]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert [hit["bm25_rank"] for hit in hits] == [1, 2, 3]
    assert [hit["explanation"]["retrievers"]["bm25"]["rank"] for hit in hits] == [1, 2, 3]
    assert main(["search", "statins", "--top-k", "2", "--index-dir", str(index_dir), "--explain"]) == 0
    assert "-> rrf #" in capsys.readouterr().out
    asked = ["--filters", '{"not": {"document_ids": ["D-statin-0"]}}', "--group-size", "2", "--highlight", "1"]
    assert main(["search", "statins", "--top-k", "2", "--json", "--index-dir", str(index_dir), *asked]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert len(hits) == 2 and all(h["document_id"] != "D-statin-0" and len(h["highlights"]) == 1 for h in hits)
    assert all(h["text"][x["start"] : x["end"]] == x["text"] for h in hits for x in h["highlights"])


def test_evaluate_reports_every_stage(index_dir, beir_dir, tmp_path, capsys):
    args = [
        "evaluate",
        "--split",
        "dev",
        "--index-dir",
        str(index_dir),
        "--data",
        str(beir_dir),
        "--output",
        str(tmp_path),
    ]
    assert main(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["stages"]) == {"bm25", "dense", "memory", "rrf", "learned"}
    assert set(summary["gain_ndcg@10"]) == {"learned vs rrf"}
    assert summary["stages"]["rrf"]["queries"] == 8
    assert summary["provenance"]["machine"]["gflops"] > 0  # written through engine.records
    lines = (tmp_path / "run.rrf.trec").read_text().splitlines()
    assert lines[0].split()[1:4:2] == ["Q0", "1"] and len(lines) == 8 * 32


@pytest.mark.parametrize(
    "argv, message",
    [
        (["search", "x", "--top-k", "0"], "--top-k: Input should be greater than or equal to 1"),
        (["search", "x", "--index-dir", "/nonexistent/idx"], "no index directory here"),
        (["build", "--data", "/nonexistent/data", "--index-dir", "/tmp/never"], "/nonexistent/data: no such folder"),
        (["evaluate", "--split", "test"], "no judgments for split 'test'"),
        (["search", "x", "--rrf-k", "-1"], "invalid settings: rrf_k"),
        (["search", "x", "--weights", "bm25=-1"], "--weights.bm25: Input should be greater than or equal to 0"),
        (["search", "x", "--weights", "bm25"], "--weights 'bm25': expected NAME=WEIGHT"),
        (["search", "x", "--weights", "sparse=1"], "fusion.weights.sparse: no such retriever"),
        (["search", "x", "--neighbors", "9"], "--neighbors: Input should be less than or equal to 5"),
        (["search", "x", "--filters", '{"year": {"gte": true}}'], "--filters: Value error, filter 'year'"),
        (["serve", "--no-mcp", "--no-a2a"], "leave nothing to serve"),
        (["serve", "--ray", "--workers", "2"], "not --workers: leave out --workers"),
        (
            ["serve", "--workers", "-1"],
            "workers: Value error, workers is auto or a whole number from 0 to 256, not '-1'",
        ),
        (["train-reranker", "--mine-depth", "4"], "--mine-depth 4 cannot hold a group of 8"),
        (["train-reranker", "--distil-weight", "1.5"], "distil_weight: Input should be less than or equal to 1"),
        (["train-reranker", "--distil-from", "/nonexistent/teacher"], "cannot load reranker '/nonexistent/teacher'"),
        (["--config", "/nonexistent.toml", "search", "x"], "file not found"),
    ],
)
def test_bad_input_is_a_clear_cli_error(argv, message, capsys, index_dir, beir_dir):
    if argv[0] in ("evaluate", "train-reranker"):
        argv = argv + ["--index-dir", str(index_dir), "--data", str(beir_dir)]
    elif argv[0] == "search" and "--index-dir" not in argv:
        argv = argv + ["--index-dir", str(index_dir)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("door", ["mcp", "a2a"])
def test_a_taken_port_is_a_clear_cli_error_before_the_index_is_built(door, capsys, tmp_path, beir_dir):
    import socket

    from offline.server_process import free_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port, other = taken.getsockname()[1], free_port()
        ports = {"mcp": port, "a2a": other} if door == "mcp" else {"mcp": other, "a2a": port}
        argv = ["serve", "--build-if-missing", "--data", str(beir_dir), "--index-dir", str(tmp_path / "idx")]
        assert main(argv + ["--mcp-port", str(ports["mcp"]), "--a2a-port", str(ports["a2a"])]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and f"--{door}-port" in err and "Traceback" not in err
    assert not (tmp_path / "idx").exists()  # refused before the build


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--index-dir", "{missing}"], "no index directory here"),
        (["--index-dir", "{sharded}", "--workers", "2"], "not with --workers"),
        (["--index-dir", "{index}", "--key-all-doors"], "--key-all-doors needs --agent-keys"),
        (["--index-dir", "{index}", "--agent-keys", "{missing}"], "agent keys"),
        (["--index-dir", "{index}", "--tls-cert", "{missing}"], "--tls-cert and --tls-key go together"),
        (["--index-dir", "{index}", "--ray"], None),
    ],
    ids=["missing-index", "sharded-workers", "no-keys", "bad-keys", "tls", "ray"],
)
def test_a_bad_argument_is_named_before_a_taken_port(
    extra, message, capsys, monkeypatch, tmp_path, index_dir, sharded_index_dir
):
    """``serve``'s checks of its arguments and index run before it probes its ports: with both ports
    held by another server (as the README's ``serve`` holds 8000 and 9010), the mistake is named."""
    import socket
    import sys

    import serving

    paths = {"missing": tmp_path / "missing", "sharded": sharded_index_dir, "index": index_dir}
    argv = ["serve", "--device", "cpu"] + [a.format(**{k: str(v) for k, v in paths.items()}) for a in extra]
    if message is None:  # --ray without Ray installed: how to get it
        monkeypatch.setitem(sys.modules, "ray", None)
        monkeypatch.delitem(sys.modules, "serving.ray_app", raising=False)
        monkeypatch.delattr(serving, "ray_app", raising=False)  # imported by an earlier test
        message = "pip install 'hybrid-search[ray]'"
    with socket.socket() as mcp, socket.socket() as a2a:
        for taken in (mcp, a2a):
            taken.bind(("127.0.0.1", 0))
            taken.listen()
        ports = ["--mcp-port", str(mcp.getsockname()[1]), "--a2a-port", str(a2a.getsockname()[1])]
        assert main(argv + ports) == 2
    err = capsys.readouterr().err
    assert message in err and "cannot listen" not in err and "Traceback" not in err, err


def test_settings_layering(tmp_path, monkeypatch, index_dir):
    from cli.flags import settings_from

    toml = tmp_path / "hs.toml"
    toml.write_text("rrf_k = 10.0\nrerank_depth = 7\n")
    monkeypatch.setenv("HYBRID_SEARCH_CONFIG", str(toml))
    monkeypatch.setenv("HYBRID_SEARCH_RERANK_DEPTH", "9")
    args = build_parser().parse_args(["search", "q", "--bm25-depth", "33"])
    s = settings_from(args)
    assert (s.engine.rrf_k, s.engine.rerank_depth, s.engine.bm25_depth) == (10.0, 9, 33)
    assert BuildSettings().dense_index == "auto"
    # --config names the file for this command only: nothing is left in the environment
    monkeypatch.delenv("HYBRID_SEARCH_CONFIG")
    other = tmp_path / "other.toml"
    other.write_text("rrf_k = 25.0\n")
    s = settings_from(build_parser().parse_args(["--config", str(other), "search", "q"]))
    assert (s.engine.rrf_k, s.engine.rerank_depth) == (25.0, 9)
    assert "HYBRID_SEARCH_CONFIG" not in os.environ and EngineSettings().rrf_k != 25.0


def test_bench_engine_reports_stages_and_the_depth_each_budget_allows(index_dir, beir_dir, reranker_dir, tmp_path):
    args = ["bench", "engine", "--index-dir", str(index_dir), "--data", str(beir_dir), "--reranker", reranker_dir]
    args += ["--depths", "0,2,4", "--concurrency", "1,2", "--num-queries", "4", "--output", str(tmp_path)]
    assert main([*args, "--device", "cpu"]) == 0
    report = json.loads((tmp_path / "engine.json").read_text())
    assert (tmp_path / "engine.png").stat().st_size > 0
    assert set(report["depths"]) == {"0", "2", "4"} and "rerank" not in report["depths"]["0"]
    assert {"bm25", "encode", "dense", "fusion", "rerank", "total"} <= set(report["depths"]["4"])
    assert report["depths"]["4"]["total"]["p99"] >= report["depths"]["4"]["total"]["p50"] > 0
    assert set(report["concurrency"]) == {"1", "2"} and report["concurrency"]["2"]["qps"] > 0
    budget = report["rerank_budget"]
    assert budget["rerank_ms_per_pair"] is not None
    fits = budget["deepest_depth_within_p95_ms"]
    assert fits["1000"] in (0, 2, 4) and all(d is None or d <= fits["1000"] for d in fits.values())


def test_every_setting_a_server_reads_is_a_serve_flag_with_its_description(capsys):
    from serving.settings import PARTS

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    from cli.flags import FLAG_NAMES, SET_BY_SERVE, TABLES

    for part in ("engine", "serving", "security", "telemetry", "agents", "scale_out"):
        for name, field in PARTS[part].model_fields.items():
            flag = FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
            if name in SET_BY_SERVE + TABLES:  # serve sets it on the processes it starts, or a table: no flag
                assert flag not in out
                continue
            assert flag in out, f"serve has no {flag} for {part}.{name}"
            assert " ".join(field.description.split())[:40] in out, f"{flag}'s help is not its setting's"
    assert "--rerank-depth RERANK_DEPTH" in out and "(default 4)" in out  # max_in_flight's default, shown


def test_settings_in_toml_tables_and_a_clear_error_for_an_unknown_name(tmp_path, capsys):
    from cli.flags import settings_from

    toml = tmp_path / "hs.toml"
    toml.write_text("[engine]\nrerank_depth = 12\n[serving]\nmax_in_flight = 6\n")
    s = settings_from(build_parser().parse_args(["--config", str(toml), "serve", "--rerank-blend", "0.25"]))
    assert (s.engine.rerank_depth, s.serving.max_in_flight, s.engine.rerank_blend) == (12, 6, 0.25)
    toml.write_text("rerank_dept = 12\n")
    assert main(["--config", str(toml), "search", "q"]) == 2
    err = capsys.readouterr().err
    assert "invalid settings: rerank_dept: Extra inputs are not permitted" in err and "Traceback" not in err


def test_serve_runs_one_process_unless_told_and_workers_0_is_one_for_every_two_cores():
    cores = len(os.sched_getaffinity(0))
    assert Settings().serving.worker_count() == 1
    assert Settings().with_values(workers=0).serving.worker_count() == max(1, cores // 2)
    assert Settings().with_values(workers=3).serving.worker_count() == 3


def test_serves_switches_are_settings_from_toml_and_the_environment(tmp_path, monkeypatch):
    """--read-only, --no-mcp, --no-a2a, --ray, --build-if-missing and --mcp-url are settings like
    any other: a TOML file or HYBRID_SEARCH_* sets them, a flag overrides."""
    from cli.flags import settings_from
    from cli.main import build_parser

    (tmp_path / "serve.toml").write_text("[serving]\nread_only = true\na2a = false\n")
    monkeypatch.setenv("HYBRID_SEARCH_BUILD_IF_MISSING", "true")
    args = build_parser().parse_args(["--config", str(tmp_path / "serve.toml"), "serve", "--no-mcp", "--a2a"])
    settings = settings_from(args)
    s = settings.serving
    assert (s.read_only, s.mcp, s.a2a, s.build_if_missing, settings.scale_out.ray) == (True, False, True, True, False)
