"""The BM25 index on its own: rankings (ties by id, filters inside the search), and searches side by
side with each other, with writes and refreshes, and with ``close``."""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.retrieval.lucene import IndexClosedError, LuceneIndex
from offline.server_process import ROOT
from tests.helpers import retrieved

UNITS = 40


def _text(i: int, generation: int = 0) -> str:
    return f"common alpha{i} {'beta ' * (i % 4)} gen{generation}"


def _make(path, prefix: str = "d") -> LuceneIndex:
    """Units ``{prefix}-00`` … added in reverse order, so that docid order is not id order."""
    index = LuceneIndex(path, writable=True, create=True)
    for i in reversed(range(UNITS)):
        index.add(f"{prefix}-{i:02d}", [(f"{prefix}-{i:02d}", _text(i))])
    index.refresh()
    return index


def _run(workers: int, job, *args) -> None:
    with ThreadPoolExecutor(workers) as pool:
        for done in [pool.submit(job, *args) for _ in range(workers)]:
            done.result()


@pytest.fixture
def index(tmp_path):
    index = _make(tmp_path / "bm25")
    yield index
    index.close()


def test_ties_are_broken_by_id_and_a_filter_keeps_the_ranking(index):
    hits = retrieved(index, "common beta", UNITS)
    assert len(hits) == UNITS
    assert hits == sorted(hits, key=lambda hit: (-hit[1], hit[0]))  # ties by id, whatever the docid order
    groups = {}
    for unit, score in hits:
        groups.setdefault(score, []).append(unit)
    assert sorted(map(len, groups.values())) == [10, 10, 10, 10]  # ties were there to break
    allowed = {f"d-{i:02d}" for i in range(0, UNITS, 3)}
    assert retrieved(index, "common beta", 5, allowed) == [hit for hit in hits if hit[0] in allowed][:5]
    assert retrieved(index, "common beta", 5, set()) == []


def test_a_wide_filter_read_off_the_ranking_finds_what_the_filtered_query_does(index):
    queries = ("common beta", "alpha7 alpha12 beta", "gen0 alpha3")
    allowed_sets = [{f"d-{i:02d}" for i in range(UNITS) if i % m == r} for m, r in ((2, 0), (3, 1), (13, 5))]
    as_terms = {(q, i): retrieved(index, q, 6, allowed) for q in queries for i, allowed in enumerate(allowed_sets)}
    index.filter_terms = 0  # every filter is wide now: read off the unfiltered ranking
    for depth in (20_000, 6):  # deep enough, then so shallow that it falls back to the terms
        index.filter_depth = depth
        for (query, i), expected in as_terms.items():
            assert retrieved(index, query, 6, allowed_sets[i]) == expected, (query, i, depth)
    from engine.search.allowed import Allowed

    index.kept_query_share = 1.0  # a kept set (as a filter's is) of any width: its id query made once, reused
    kept = [Allowed({unit: row for row, unit in enumerate(sorted(a))}) for a in allowed_sets]
    for (query, i), expected in as_terms.items():
        assert retrieved(index, query, 6, kept[i]) == expected == retrieved(index, query, 6, kept[i]), (query, i)
    assert all(a.form("lucene", lambda: None) is not None for a in kept)
    # repeated, a kept filter's matches are cached by segment, even beside terms far rarer than it
    # and on a segment far smaller than Lucene's own cache takes: answered from the cache, the same
    cache = index._query_cache
    hits = cache.getHitCount()
    for (query, i), expected in as_terms.items():
        assert retrieved(index, query, 6, kept[i]) == expected, (query, i)
    assert cache.getCacheCount() >= len(kept) and cache.getHitCount() >= hits + len(as_terms)


def test_a_filter_on_the_chunks_own_fields_finds_what_the_allowed_ids_do(tmp_path):
    """Type, date and document id as Lucene terms: the same ranking as the store's allowed set."""
    import datetime

    import numpy as np

    from engine.documents import Filters
    from engine.retrieval.protocol import Query, Within
    from engine.search.allowed import Allowed

    index = LuceneIndex(tmp_path / "fields", writable=True, create=True, fields=("document_type", "date"))
    metadata = {}
    for i in reversed(range(UNITS)):
        metadata[f"d-{i:02d}"] = {
            "document_type": ("review", "trial", "note")[i % 3],
            "date": f"202{i % 5}-0{1 + i % 9}-01",
        }
        index.add(f"d-{i:02d}", [(f"d-{i:02d}", _text(i))], metadata[f"d-{i:02d}"] | {"source": i})
    # kept as sent, matched by no filter on type or date (as the store's expression indexes read them)
    index.add("d-odd", [("d-odd", _text(3))], {"document_type": ["review"], "date": "2022-02-30"})
    index.refresh()
    day = datetime.date.fromisoformat
    cases = [
        Filters(document_types=["review"]),
        Filters(document_types=["trial", "note"], date_range=[None, "2022-05-01"]),
        Filters(date_range=["2021-01-01", "2023-02-01"]),
        Filters(date_range=["2024-01-01", None], document_ids=["d-04", "d-09", "d-14"]),
    ]

    def allows(unit: str, f: Filters) -> bool:
        meta, (start, end) = metadata[unit], f.date_range or (None, None)
        return (
            (not f.document_types or meta["document_type"] in f.document_types)
            and (not start or day(meta["date"]) >= start)
            and (not end or day(meta["date"]) <= end)
            and (not f.document_ids or unit in f.document_ids)
        )

    try:
        for f in cases:
            allowed = {unit for unit in metadata if allows(unit, f)}
            query = Query("common beta alpha3", np.zeros(1, dtype=np.float32))
            assert index._clauses(f) is not None  # searched through the fields, not the ids
            live = Allowed({unit: row for row, unit in enumerate(sorted(allowed))})
            through_fields = index.retrieve(query, 7, Within(live, allowed, None, f))
            assert through_fields == retrieved(index, query.text, 7, allowed) and through_fields, f
        other_key = Filters(source=3)  # a metadata key Lucene does not hold: the allowed ids
        assert index._clauses(other_key) is None
        found = index.retrieve(query, 5, Within(Allowed({"d-03": 3}), {"d-03"}, None, other_key))
        assert [u for u, _ in found] == ["d-03"]
        index.commit(0)
    finally:
        index.close()
    unfielded = LuceneIndex(tmp_path / "fields")  # an index built before its chunks carried them
    assert unfielded._clauses(Filters(document_types=["review"])) is None
    assert unfielded._clauses(Filters(document_ids=["d-01"])) is not None  # always a chunk's term
    unfielded.close()


def test_filtered_searches_side_by_side_keep_their_own_filters(index):
    """Each thread's filter is its own (pyjnius once let threads swap the objects they called)."""
    expected = {r: retrieved(index, "common beta", 8, {f"d-{i:02d}" for i in range(r, UNITS, 4)}) for r in range(4)}
    turn = iter(range(1000))

    def search() -> None:
        r = next(turn) % 4
        for _ in range(60):
            assert retrieved(index, "common beta", 8, {f"d-{i:02d}" for i in range(r, UNITS, 4)}) == expected[r]

    _run(4, search)


def test_two_indexes_searched_side_by_side_answer_from_their_own(index, tmp_path):
    other = _make(tmp_path / "other", prefix="e")
    try:
        expected = {ix: retrieved(ix, "common alpha3", 10) for ix in (index, other)}
        turn = iter(range(1000))

        def search() -> None:
            mine = (index, other)[next(turn) % 2]
            for _ in range(100):
                assert retrieved(mine, "common alpha3", 10) == expected[mine]

        _run(4, search)
    finally:
        other.close()


def test_searches_see_whole_documents_while_another_thread_writes_and_refreshes(index):
    stop, errors = threading.Event(), []
    ids = {f"d-{i:02d}" for i in range(UNITS)}

    def write() -> None:
        for generation in range(1, 61):
            i = generation % UNITS
            index.replace(f"d-{i:02d}", [(f"d-{i:02d}", _text(i, generation))])
            if generation % 3 == 0:
                index.refresh()
        stop.set()

    def search() -> None:
        try:
            while not stop.is_set():
                hits = retrieved(index, "common", UNITS + 5)
                assert {unit for unit, _ in hits} == ids and len(hits) == UNITS  # replaced whole, never twice
                assert retrieved(index, "alpha5", 3)[0][0] == "d-05"
                assert {unit for unit, _ in retrieved(index, "common", 10, {"d-01", "d-02"})} == {"d-01", "d-02"}
        except BaseException as exc:
            errors.append(exc)
            raise

    writer = threading.Thread(target=write)
    writer.start()
    _run(3, search)
    writer.join()
    assert not errors
    index.refresh()
    assert retrieved(index, "gen60", 1)[0][0] == f"d-{60 % UNITS:02d}"
    assert index.documents == UNITS


def test_close_waits_for_searches_in_flight_and_later_ones_fail_clearly(tmp_path):
    index = _make(tmp_path / "bm25")
    started, outcomes = threading.Barrier(4), []

    def search() -> None:
        started.wait()
        try:
            while True:
                assert len(retrieved(index, "common beta", UNITS)) == UNITS
        except IndexClosedError:
            outcomes.append("closed")

    threads = [threading.Thread(target=search) for _ in range(3)]
    for thread in threads:
        thread.start()
    started.wait()
    index.close()
    for thread in threads:
        thread.join()
    assert outcomes == ["closed"] * 3  # no Java error from a reader closed under a search
    with pytest.raises(IndexClosedError, match="closed"):
        retrieved(index, "common", 3)
    with pytest.raises(IndexClosedError):
        index.refresh()
    index.close()  # twice is harmless


def test_the_jvms_signal_handlers_outlive_a_library_that_replaces_them():
    """Ray's ``init`` and ``shutdown`` put their own SIGSEGV handler, then the default, over the JVM's;
    the JVM faults on purpose at its safepoints, so a process left so dies at a random later moment.
    ``jvm_signals_kept`` puts the JVM's back. Here the replacing library is faulthandler (in a fresh
    process, so that this one's handlers stay as they are)."""
    code = """
import ctypes, faulthandler, signal
from engine.retrieval.java import _SigAction, jvm_signals_kept, start_jvm
libc = ctypes.CDLL(None)
def handler():
    action = _SigAction()
    libc.sigaction(signal.SIGSEGV, None, ctypes.byref(action))
    return action.handler
faulthandler.enable()
start_jvm()
jvm = handler()
with jvm_signals_kept():
    faulthandler.disable()  # puts back the handler from before the JVM: not the JVM's
    assert handler() != jvm
assert handler() == jvm, "the JVM's handler is back"
print("kept")
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "kept", run.stderr[-2000:]
