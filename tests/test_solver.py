"""The benchmark solver: policy, history, formats, through real HTTP and the A2A client; property
tests for the formatter and the policy evaluator."""

from __future__ import annotations

import json
import string
import subprocess

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.formatter import format_answer, items_from_text
from agents.policy import PolicyDoc, evaluate
from offline.server_process import ROOT
from tests.helpers import a2a_v1_send, jsonrpc_send

PATH = "/api/a2a/purple-agent"
A2A_V03_PYTHON = ROOT / ".venv-a2a03" / "bin" / "python"
NO_DOSING = {
    "rules": [
        {
            "id": "r1",
            "type": "deny",
            "description": "No dosing advice",
            "keywords": ["dose", "dosage"],
            "pattern": r"mg\s*/\s*day",
        }
    ],
    "default_action": "allow",
}


def _solve(server, **body):
    return httpx.post(server["mcp"] + PATH, json={"task_id": "t-1", **body}, timeout=120)


def test_describe_and_answer_a_compliant_task(server):
    card = httpx.get(server["mcp"] + PATH).json()
    assert card["status"] == "ready" and "policy-rules" in card["capabilities"]
    reply = _solve(server, task="do soy isoflavones change prostate cancer risk?", policy_doc=NO_DOSING)
    assert reply.status_code == 200
    body = reply.json()
    assert body["task_id"] == "t-1" and body["answers"] == sorted(set(body["answers"])) and body["answers"]
    meta = body["metadata"]
    assert meta["policy_compliant"] and meta["policy_violations"] == [] and meta["applied_rules"] == []
    assert meta["citations"] and all(c.startswith("D-") for c in meta["citations"])
    assert any("soy" in a for a in body["answers"])


def test_a_violating_task_is_not_answered(server):
    body = _solve(server, task="What dose of soy is safe? 50 mg / day?", policy_doc=NO_DOSING).json()
    assert body["answers"] == [] and not body["metadata"]["policy_compliant"]
    assert body["metadata"]["policy_violations"][0]["rule_id"] == "r1"
    require = {"rules": [{"id": "cite", "type": "require", "keywords": ["randomized"]}]}
    missing = _solve(server, task="coffee and the liver", policy_doc=require).json()["metadata"]
    assert missing["policy_violations"][0]["reason"] == "required but not found"
    present = _solve(server, task="coffee and the liver", context="a randomized trial", policy_doc=require).json()
    assert present["metadata"]["policy_compliant"] and present["metadata"]["applied_rules"] == ["cite"]
    closed = {"rules": [{"id": "topic", "type": "allow", "keywords": ["coffee"]}], "default_action": "deny"}
    assert _solve(server, task="coffee effects", policy_doc=closed).json()["metadata"]["policy_compliant"]
    assert not _solve(server, task="arsenic in rice", policy_doc=closed).json()["metadata"]["policy_compliant"]


def test_long_history_is_compressed_and_used(server):
    history = [
        {
            "role": "user" if i % 2 == 0 else "assistant",
            "content": f"We discussed arsenic in rice, turn {i}. Brown rice holds more arsenic than white.",
        }
        for i in range(12)
    ]
    history.append({"role": "user", "content": "tell me about arsenic in brown rice"})
    body = _solve(server, task="and for children?", history=history, expected_format="single").json()
    meta = body["metadata"]
    assert meta["memory_compressed"] and "arsenic" in meta["memory_summary"]
    assert len(body["answers"]) == 1 and any(c.startswith("D-arsenic") for c in meta["citations"])
    structured = _solve(server, task="broccoli sulforaphane", expected_format="json").json()["answers"][0]
    assert set(structured) == {"answer", "items", "citations"} and structured["citations"]


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({"task": ""}, "task"),
        ({"task": "x", "expected_format": "table"}, "expected_format"),
        ({"task": "x", "policy_doc": {"rules": [{"id": "bad", "type": "deny", "pattern": "(unclosed"}]}}, "'bad'"),
        ({"task": "x", "policy_doc": {"rules": [{"id": "empty", "type": "deny"}]}}, "empty"),
        ({"task": "x", "history": [{"role": "robot", "content": "hi"}]}, "history.0.role"),
    ],
)
def test_bad_tasks_are_422_naming_the_problem(server, body, names):
    reply = _solve(server, **body)
    assert reply.status_code == 422 and names in reply.json()["error"]


def test_the_solver_through_the_official_a2a_clients(server):
    from a2a.helpers.proto_helpers import new_data_part
    from a2a.types.a2a_pb2 import TaskState
    from google.protobuf.json_format import MessageToDict

    task = {"task_id": "v1", "task": "broccoli sulforaphane", "expected_format": "single", "policy_doc": NO_DOSING}
    done = a2a_v1_send(server["a2a"], [new_data_part(task)])
    assert done.status.state == TaskState.TASK_STATE_COMPLETED
    data = MessageToDict(done.artifacts[0].parts[0].data)
    assert data["task_id"] == "v1" and len(data["answers"]) == 1 and data["metadata"]["citations"]
    if not A2A_V03_PYTHON.exists():
        pytest.skip("run .ci/run once to create .venv-a2a03")
    violating = json.dumps({**task, "task_id": "v03", "task": "what dosage of broccoli?"})
    out = subprocess.run(
        [str(A2A_V03_PYTHON), str(ROOT / "tests" / "a2a_v03_client.py"), server["a2a"], violating],
        capture_output=True,
        text=True,
        timeout=120,
    )
    reply = json.loads(out.stdout.strip().splitlines()[-1])
    assert reply["state"] == "completed" and reply["parsed"]["task_id"] == "v03"
    assert reply["parsed"]["answers"] == [] and not reply["parsed"]["metadata"]["policy_compliant"]


def test_the_solver_is_a_second_a2a_skill(server):
    card = httpx.get(server["a2a"] + "/.well-known/agent-card.json").json()
    assert [s["id"] for s in card["skills"]] == ["nfcorpus_retrieval", "benchmark_solver"]
    rpc = jsonrpc_send({"task_id": "a2a-1", "task": "coffee and liver enzymes", "policy_doc": NO_DOSING})
    result = httpx.post(server["a2a"] + "/", json=rpc, timeout=120).json()["result"]
    assert result["status"]["state"] == "completed"
    data = result["artifacts"][0]["parts"][0]["data"]
    assert data["task_id"] == "a2a-1" and data["answers"] and data["metadata"]["policy_compliant"]


# ---------------------------------------------------------------- properties

words = st.text(alphabet=string.ascii_letters + " -'", min_size=1, max_size=30).filter(lambda s: s.strip())


@settings(max_examples=200, deadline=None)
@given(st.lists(words, max_size=12))
def test_list_format_is_sorted_distinct_and_loses_nothing(items):
    formatted = format_answer(items, "list")
    assert formatted == sorted(set(formatted)) and set(formatted) == {i.strip() for i in items}


@settings(max_examples=200, deadline=None)
@given(st.lists(words, min_size=1, max_size=12), st.booleans())
def test_a_json_array_is_read_back_even_in_a_fence(items, fenced):
    text = json.dumps(items)
    if fenced:
        text = f"Here you go:\n```json\n{text}\n```"
    assert items_from_text(text) == [i.strip() for i in items]


@settings(max_examples=200, deadline=None)
@given(st.from_regex(r"[a-z]{3,8}", fullmatch=True), st.lists(st.from_regex(r"[a-z]{1,8}", fullmatch=True)))
def test_a_deny_keyword_decides_exactly_when_it_appears_as_a_word(keyword, others):
    policy = PolicyDoc.model_validate({"rules": [{"id": "k", "type": "deny", "keywords": [keyword]}]})
    text = " ".join(others)
    assert evaluate(policy, [text]).compliant == (keyword not in others)
    assert not evaluate(policy, [f"{text} {keyword.upper()}."]).compliant


def test_a_failing_llm_without_fallback_is_a_502(index_dir, tmp_path):
    import shutil

    from offline.server_process import free_port, serve_args, start_server, stop_server

    shutil.copytree(index_dir, tmp_path / "index")
    port, dead = free_port(), free_port()  # nothing listens on `dead`
    llm = ["--llm-url", f"http://127.0.0.1:{dead}/v1", "--no-llm-fallback"]
    args = serve_args(tmp_path / "index", port, "--read-only", *llm, "--trace-db", str(tmp_path / "t.sqlite"))
    proc = start_server(args, f"http://127.0.0.1:{port}/health", tmp_path / "serve.log")
    try:
        reply = httpx.post(f"http://127.0.0.1:{port}{PATH}", json={"task_id": "x", "task": "soy"}, timeout=60)
        assert reply.status_code == 502 and "LLM server failed" in reply.json()["error"]
        assert "llm-answers" in httpx.get(f"http://127.0.0.1:{port}{PATH}").json()["capabilities"]
    finally:
        assert stop_server(proc) == 0


def test_a_task_past_the_query_timeout_is_the_doors_own_504(index_dir, tmp_path):
    """The solver is held to the same limit as a search: a task whose answer is still being written
    (a chat server that stalls) is answered 504 at the limit and counted as the solver's timeout."""
    import shutil
    import time

    from offline.server_process import free_port, serve_args, start_server, stop_server
    from tests.helpers import chat_completions_server

    def stalls(body: dict) -> str:
        time.sleep(6)
        return "too late [1]"

    shutil.copytree(index_dir, tmp_path / "index")
    with chat_completions_server(stalls) as (url, _, _):
        port = free_port()
        llm = ["--llm-url", url, "--no-llm-fallback", "--query-timeout", "2"]
        args = serve_args(tmp_path / "index", port, "--read-only", *llm, "--trace-db", str(tmp_path / "t.sqlite"))
        proc = start_server(args, f"http://127.0.0.1:{port}/health", tmp_path / "serve.log")
        try:
            started = time.perf_counter()
            reply = httpx.post(f"http://127.0.0.1:{port}{PATH}", json={"task_id": "x", "task": "soy"}, timeout=60)
            assert reply.status_code == 504 and "took longer than 2 s" in reply.json()["error"]
            assert time.perf_counter() - started < 5
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            assert 'search_errors_total{door="solver",kind="timeout"} 1.0' in metrics
        finally:
            assert stop_server(proc) == 0
