"""Faults: damaged index files refused naming the file, a full disk refused (507) with nothing
acknowledged lost, a failing reranker and LLM server falling back and saying so, kill -9 while
writing, SIGTERM under load. The scenarios are ``benchmarks/reliability/faults/``'s, run small."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from benchmarks.reliability.faults import corruptions, degraded, drivers, sigterm, workers, writes
from benchmarks.reliability.faults.results import (
    CorruptionOutcome,
    FailedConnections,
    KillWindow,
    Opened,
    SigkillRounds,
    WriteCounts,
)
from offline.server_process import ROOT

pytestmark = pytest.mark.slow  # kills, fills and corrupts on purpose: servers started and stopped per test


@pytest.fixture(scope="module")
def crashed(index_dir, tmp_path_factory):
    """The tiny index as a server killed right after acknowledging three writes leaves it."""
    return corruptions.crashed_copy(index_dir, tmp_path_factory.mktemp("crashed") / "index")


@pytest.mark.parametrize("case", corruptions.CORRUPTIONS, ids=lambda case: case.name.replace(" ", "-"))
def test_a_damaged_file_is_refused_by_name_and_a_torn_log_tail_recovers(case, index_dir, crashed, tmp_path):
    outcome = corruptions.corruption_outcome(case, index_dir, tmp_path, crashed)
    if case.recovers:  # a torn tail: the whole records before it are replayed
        assert not outcome.opened.refused and outcome.opened.logged_present == len(corruptions.LOGGED) - 1, outcome
    else:
        assert outcome.opened.refused and outcome.names_file, outcome


def test_the_cli_refuses_a_damaged_index_in_one_line(index_dir, tmp_path):
    manifest = next(c for c in corruptions.CORRUPTIONS if c.name == "manifest damaged")  # refused before models load
    outcome = corruptions.corruption_outcome(manifest, index_dir, tmp_path, via_cli=True)
    opened = outcome.opened
    assert opened.refused and opened.exit_code == 2 and not opened.traceback, outcome
    assert outcome.names_file and opened.message is not None and opened.message.endswith("rebuild the index")


def test_a_failed_append_is_cut_back_and_the_log_stays_appendable(tmp_path):
    """Out of room mid-record (a file-size limit in a child process): StorageFull, the file back to
    its whole records, and once there is room again appends and reads work."""
    script = textwrap.dedent(
        """
        import resource, sys
        from pathlib import Path
        from engine.store.wal import StorageFull, WriteAheadLog

        wal = WriteAheadLog(Path(sys.argv[1]))
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))  # CPython ignores SIGXFSZ: writes get EFBIG
        seq = 0
        try:
            while True:
                wal.append({"seq": seq + 1, "pad": "x" * 150})
                seq += 1
        except StorageFull as exc:
            print(exc, file=sys.stderr)
        whole = wal.size
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        wal.append({"seq": seq + 1, "pad": "after"})
        print(seq, whole, [r["seq"] for r in wal.records()] == list(range(1, seq + 2)))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "wal.log")], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    # five 176-byte records fit under 1,000 bytes; the sixth was cut back, and the one after it reads
    assert run.stdout.split() == ["5", "880", "True"] and "no room to log the write" in run.stderr


def test_a_full_disk_refuses_writes_and_loses_none(index_dir, tmp_path):
    figures = writes.disk_full(index_dir, tmp_path, limit_bytes=256 << 10)
    assert figures.refused_status == 507 and "wal.log: no room" in figures.refused_error, figures
    assert figures.acknowledged_before > 10 and figures.searches_while_full == 5, figures
    assert figures.logged_not_yet_searchable > 0, figures  # ?refresh=wait_for once SQLite could not grow
    assert figures.exit_code_while_full == 0, figures
    assert figures.lost == figures.half_applied == figures.refused_present == 0, figures


def test_a_failing_reranker_and_llm_server_fall_back_and_say_so(index_dir, reranker_dir, tmp_path):
    figures = degraded.reranker_failure(index_dir, tmp_path, reranker_dir)
    assert figures.answered == figures.queries and figures.served_fused_order, figures
    assert figures.health_shows and figures.metrics_show and figures.recovers, figures
    assert figures.health["last_error"] == "RuntimeError: injected fault: the cross-encoder failed"
    assert figures.llm_answered and figures.llm_health_shows and figures.llm_metrics_show, figures


def test_every_acknowledged_write_survives_sigkill(index_dir, tmp_path):
    figures = writes.sigkill_rounds(index_dir, tmp_path, rounds=2)
    written = figures.writes
    assert written.acknowledged >= 6 and written.acknowledged_deletes and figures.replayed_records, figures
    assert written.lost == written.half_applied == written.resurrected == 0, figures


def test_sigterm_answers_searches_in_flight_and_refuses_new_ones(index_dir, tmp_path):
    figures = sigterm.sigterm_drain(index_dir, tmp_path)
    assert figures.exit_code == 0 and not figures.traceback, figures
    assert figures.in_flight > 0 and figures.ok == figures.in_flight, figures  # every one answered 200
    assert figures.refused_after > 0 and figures.refused_until_exit, figures


def test_a_writer_killed_under_load_loses_no_write_and_the_other_worker_answers(index_dir, tmp_path):
    """``serve --workers 2``: the writer killed while searches and writes through every door arrive
    (the follower's kill: tests/test_workers.py)."""
    figures = workers.workers_killed_under_load(index_dir, tmp_path, readers=2, settle_s=2, roles=("writer",))
    assert figures.exit_code == 0 and not figures.traceback and figures.health_after == "ok", figures
    written = figures.writes
    assert written.acknowledged > 0 and written.acknowledged_deletes > 0, figures
    assert written.lost == written.half_applied == written.resurrected == 0, figures
    phases = {phase.phase: phase for phase in figures.phases}
    assert set(phases["writer down"].searches["other worker"]) == {"ok"}, phases  # reads went on
    for name in ("before", "after the writer is back"):
        assert {kind for kinds in phases[name].searches.values() for kind in kinds} == {"ok"}, phases[name]
    for door in drivers.WRITE_DOORS:  # refused while the writer was down (503 + Retry-After), acknowledged after
        assert phases["writer down"].writes[door].get("refused"), (door, phases["writer down"])
        assert phases["after the writer is back"].writes[door].get("acked"), (door, phases)
    kill = figures.kills["writer"]
    assert kill.first_write_acknowledged_s is not None and kill.first_write_acknowledged_s >= kill.sockets_closed_s


def test_the_typed_results_write_the_results_files_keys():
    """reliability-faults.json keeps its keys (old results stay comparable): a field that does not
    apply is absent, and spread fields lend their keys to their parent."""
    refused = CorruptionOutcome("c", "wal.log", Opened(True, message="wal.log: damaged"), True, True)
    assert list(refused.to_json()) == ["case", "file", "refused", "message", "names_file", "as_expected"]
    served = CorruptionOutcome(
        "c", "wal.log", Opened(False, logged_present=2, exit_code=0, traceback=False), False, True
    )
    keys = ["case", "file", "refused", "logged_present", "exit_code", "traceback", "names_file", "as_expected"]
    assert list(served.to_json()) == keys
    counts = WriteCounts(acknowledged=3, acknowledged_deletes=1, in_doubt=1, lost=0, half_applied=0, resurrected=0)
    assert list(SigkillRounds(2, counts, 9, 1.5).to_json().items()) == [
        ("rounds", 2),
        *vars(counts).items(),
        ("replayed_records", 9),
        ("seconds", 1.5),
    ]
    waited = {"leader a zombie": FailedConnections(8, 8, 8), "every thread gone": FailedConnections(8, 0, 0)}
    assert KillWindow(40, waited, 0).to_json() == {
        "connections_per_kill": 40,
        "leader a zombie": {"kills": 8, "kills_with_a_failure": 8, "failed": 8},
        "every thread gone": {"kills": 8, "kills_with_a_failure": 0, "failed": 0},
        "exit_code": 0,
    }
