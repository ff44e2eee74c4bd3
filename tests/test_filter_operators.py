"""Filters beyond equality (issue 64): operators on any metadata key (eq, in, not_in, ranges on
numbers and ISO dates, exists) combined by and, or and not find, through the store's chunk_fields
index, exactly the chunks a plain reading of each chunk's metadata finds; bad ones are a 422 naming
the field, and search_nfcorpus keeps its filters as they were."""

from __future__ import annotations

import dataclasses
import operator
import random
from datetime import date, timedelta

import pytest
from pydantic import ValidationError

from engine.documents import Condition, Filters, QueryRequest, SearchFilters, SearchRequest, problems, unit_id
from engine.store.docstore import DocStore, matching_sql

KINDS = ["review", "guideline", "trial", "note"]


def _metadata(rng: random.Random) -> dict:
    """Metadata of every shape filters read: numbers, ISO dates and datetimes, strings, lists, nulls, absent keys."""
    day = date(2015, 1, 1) + timedelta(days=rng.randrange(3000))
    choices = {
        "year": rng.choice([day.year, float(day.year) + 0.5, None, [day.year, day.year + 1]]),
        "published": rng.choice([day.isoformat(), f"{day.isoformat()}T{rng.randrange(24):02d}:00:00", "soon", None]),
        "document_type": rng.choice(KINDS),
        "source": rng.choice(["x", "y", "z", ["x", "y"], None]),
        "score": rng.choice([rng.randrange(-5, 6), "high", None]),
    }
    return {k: v for k, v in choices.items() if rng.random() < 0.85}


def _values(meta: dict, key: str) -> list:
    value = meta.get(key)
    return [] if value is None else [v for v in value if v is not None] if isinstance(value, list) else [value]


def _in_range(value: object, bounds: dict) -> bool:
    """A range read in Python: numbers (not booleans) by value; ISO dates and datetimes as strings,
    a day-only bound holding its whole day."""
    ops = {"gt": operator.gt, "gte": operator.ge, "lt": operator.lt, "lte": operator.le}
    if isinstance(next(iter(bounds.values())), str):
        try:
            date.fromisoformat(value[:10]) if isinstance(value, str) else None
        except ValueError:
            return False
        if not isinstance(value, str):
            return False
        day = {op: value[:10] if len(b) == 10 and op in ("gt", "lte") else value for op, b in bounds.items()}
        return all(ops[op](day[op], b) for op, b in bounds.items())
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return all(ops[op](value, b) for op, b in bounds.items())


def _holds(meta: dict, document_id: str, f: dict) -> bool:
    """The reference: a filter read off one chunk's merged metadata, condition by condition."""
    for key, want in f.items():
        if key == "and":
            ok = all(_holds(meta, document_id, g) for g in want)
        elif key == "or":
            ok = any(_holds(meta, document_id, g) for g in want)
        elif key == "not":
            ok = not _holds(meta, document_id, want)
        elif key == "document_ids":
            ok = document_id in want
        elif isinstance(want, dict):
            values = _values(meta, key)
            bounds = {op: want[op] for op in ("gt", "gte", "lt", "lte") if op in want}
            ok = (
                ("eq" not in want or want["eq"] in values)
                and ("in" not in want or any(v in want["in"] for v in values))
                and ("not_in" not in want or not any(v in want["not_in"] for v in values))
                and (not bounds or any(_in_range(v, bounds) for v in values))
                and ("exists" not in want or bool(values) == want["exists"])
            )
        else:
            ok = want in _values(meta, key)
        if not ok:
            return False
    return True


def _predicate(rng: random.Random, depth: int = 0) -> dict:
    roll = rng.random()
    if depth < 2 and roll < 0.3:
        op = rng.choice(["and", "or", "not"])
        if op == "not":
            return {"not": _predicate(rng, depth + 1)}
        return {op: [_predicate(rng, depth + 1) for _ in range(rng.randint(1, 3))]}
    leaf = rng.randrange(9)
    if leaf == 0:
        low = rng.randrange(2014, 2024)
        return {"year": {"gte": low, "lt": low + rng.randint(1, 4)}}
    if leaf == 1:
        return {"year": {rng.choice(["gt", "lte"]): rng.randrange(2014, 2024) + rng.choice([0, 0.5])}}
    if leaf == 2:
        day = (date(2015, 1, 1) + timedelta(days=rng.randrange(3000))).isoformat()
        return {"published": {rng.choice(["gt", "gte", "lt", "lte"]): day}}
    if leaf == 3:
        return {"document_type": {"in": rng.sample(KINDS, rng.randint(1, 3))}}
    if leaf == 4:
        return {"source": {"not_in": rng.sample(["x", "y", "z"], rng.randint(1, 2))}}
    if leaf == 5:
        return {rng.choice(["source", "year", "published"]): {"exists": rng.random() < 0.5}}
    if leaf == 6:
        return {"score": {"gte": rng.randrange(-5, 5)}, "source": rng.choice(["x", "y"])}
    if leaf == 7:
        return {"document_ids": rng.sample([f"d{i}" for i in range(60)], 10)}
    return {"score": {"eq": rng.choice([0, 1, "high"])}}


def test_operators_find_what_reading_each_chunk_finds(tmp_path) -> None:
    rng = random.Random(64)
    store = DocStore(tmp_path / "docs.sqlite")
    truth: dict[str, tuple[str, dict]] = {}
    rows = iter(range(10_000))
    for seq, i in enumerate(list(range(60)) + rng.sample(range(60), 15), 1):  # some rewritten with new metadata
        shared = _metadata(rng)
        chunks = [{"chunk_id": f"c{j}", "content": f"t{j}", "metadata": _metadata(rng) if j else {}} for j in range(3)]
        store.write_document(
            {"document_id": f"d{i}", "document_name": "", "metadata": shared, "chunks": chunks},
            [next(rows) for _ in chunks],
            seq=seq,
        )
        for c in chunks:
            own = {k: v for k, v in c["metadata"].items() if v is not None}
            truth[unit_id(f"d{i}", c["chunk_id"])] = (f"d{i}", shared | own)
    for i in range(0, 60, 7):
        store.delete_document(f"d{i}")
        truth = {u: t for u, t in truth.items() if t[0] != f"d{i}"}
    for _ in range(300):
        raw = _predicate(rng)
        found = set(store.matching(SearchFilters.model_validate(raw)))
        assert found == {u for u, (d, meta) in truth.items() if _holds(meta, d, raw)}, raw
    assert store.matching(SearchFilters.model_validate({"year": {"gte": 2016}}))  # the cases match something


def test_operators_are_served_by_the_metadata_index(tmp_path) -> None:
    store = DocStore(tmp_path / "docs.sqlite")
    chunks = [{"chunk_id": "a", "content": "t"}]
    store.write_document({"document_id": "a", "metadata": {"year": 2021}, "chunks": chunks}, [0], seq=1)
    for raw in (
        {"year": {"gte": 2020, "lt": 2022}},
        {"published": {"gte": "2020-01-01"}},
        {"document_type": {"in": ["review", "guideline"]}},
        {"or": [{"year": {"gt": 2020}}, {"source": "x"}]},
    ):
        plan = " ".join(store.plan(*matching_sql(SearchFilters.model_validate(raw))))
        assert "chunk_fields" in plan and "SCAN c " not in plan + " " and "SCAN chunk_fields" not in plan, (raw, plan)
    assert set(store.matching(SearchFilters.model_validate({"year": {"gte": 2020, "lt": 2022}}))) == {"a"}


@pytest.mark.parametrize(
    ("filters", "names"),
    [
        ({"year": {"gte": True}}, "year"),
        ({"year": {"between": 3}}, "between"),
        ({"year": {}}, "year"),
        ({"year": {"gte": 1, "lt": "2020-01-01"}}, "year"),
        ({"published": {"gt": "last week"}}, "published"),
        ({"and": []}, "filters.and"),
        ({"or": [{"tags": [1]}]}, "filters.or.0"),
    ],
)
def test_bad_operators_name_the_field(filters, names) -> None:
    with pytest.raises(ValidationError) as caught:
        SearchRequest.model_validate({"query": "q", "filters": filters})
    assert names in problems(caught.value)


@pytest.mark.parametrize("bound", [2020, -1.5, "2020-01-02", "2020-01-02T03:04:05Z", "2020-01-02t03:04:05.25+01:00"])
def test_a_range_bound_the_schema_allows_is_taken(bound) -> None:
    """The published schema's bound (a number, an ISO date, an RFC 3339 date-time), checked with
    formats as schemathesis checks it, is what a filter takes; other strings are refused by both."""
    import jsonschema_rs

    schema = jsonschema_rs.validator_for(
        Condition.model_json_schema(by_alias=True)["properties"]["gte"], validate_formats=True
    )
    assert schema.is_valid(bound)
    assert SearchRequest.model_validate({"query": "q", "filters": {"k": {"gte": bound}}}).filters
    for other in ("last week", "2020-13-01"):
        assert not schema.is_valid(other)
        with pytest.raises(ValidationError):
            SearchRequest.model_validate({"query": "q", "filters": {"k": {"gte": other}}})


def test_search_nfcorpus_keeps_todays_filters() -> None:
    with pytest.raises(ValidationError):
        QueryRequest.model_validate({"query": "q", "filters": {"year": {"gte": 2020}}})
    schema = QueryRequest.model_json_schema()
    assert schema["$defs"]["Filters"]["additionalProperties"] == {"type": ["string", "number", "boolean"]}
    assert "and" not in schema["$defs"]["Filters"]["properties"]
    assert isinstance(SearchRequest.model_validate({"query": "q", "filters": {"source": "x"}}).filters, Filters)


def test_a_filter_leaves_chunks_out_of_the_ranking_and_never_reorders_it(index_dir, tmp_path) -> None:
    """Filtered hits are the unfiltered ranking's chunks that hold the filter, in its order; where
    those hold the hits asked for, they are what the search within the filter would add them to."""
    import shutil

    from engine.documents import DocumentIn
    from engine.search import HybridEngine
    from engine.search.results import SearchOptions
    from engine.search.spare import SpareThreads
    from engine.settings import EngineSettings

    shutil.copytree(index_dir, tmp_path / "live")
    engine = HybridEngine(EngineSettings(index_dir=tmp_path / "live", device="cpu", rerank=False), writable=True)
    rng, shortcuts = random.Random(5), 0
    shallow = SearchOptions(depths=dict.fromkeys(("bm25", "dense", "memory"), 12))  # the second pass finds more
    whole = dataclasses.replace(shallow, whole_ranking=True)
    try:
        for i in range(30):
            chunks = [{"chunk_id": "c", "content": f"vitamin statin soy coffee note {i} " * rng.randint(1, 3)}]
            meta = {"year": 2000 + i % 25, "source": rng.choice(["x", "y", "z"])}
            engine.live.upsert(DocumentIn.model_validate({"document_id": f"m{i}", "chunks": chunks, "metadata": meta}))
        engine.live.refresh()
        for raw in (
            {"year": {"gte": 2010}},
            {"or": [{"source": "x"}, {"year": {"lt": 2005}}]},
            {"not": {"source": {"in": ["y", "z"]}}},
            {"document_ids": ["m1", "m2", "m3", "D-soy-0"]},
        ):
            filters = SearchFilters.model_validate(raw)
            allowed = engine.store.matching(filters)
            for query in ("vitamin statin note", "soy coffee"):
                hits = [h.doc_id for h in engine.search(query, 10, filters)]
                ranked = [d for d, _ in engine.stages(query, 10).ranked if d in allowed]
                assert hits == ranked[:10] or (len(ranked) < 10 and hits[: len(ranked)] == ranked), (raw, query)
                head = engine.stages(query, 10, filters=filters, options=shallow)
                every = engine.stages(query, 10, filters=filters, options=whole)
                assert head.fused[:10] == every.fused[:10], (raw, query)
                for name, found in head.retrieved.items():  # as the search within the filter ranks them
                    assert found == every.retrieved[name][: len(found)], (raw, query, name)
                shortcuts += len(head.fused) < len(every.fused)
                engine.spare, spare = SpareThreads(0), engine.spare  # the second pass after the first
                try:
                    after = engine.stages(query, 10, filters=filters, options=shallow)
                finally:
                    engine.spare = spare
                assert after.fused == head.fused and after.retrieved == head.retrieved, (raw, query)
    finally:
        engine.close()
    assert shortcuts  # some filters' first pass held the ten asked for: no second pass


def test_spare_threads_take_a_call_only_while_one_is_idle() -> None:
    """A narrow filter's second pass goes to a spare thread only while one is idle; busy, the query
    runs it itself (no queue behind the spare threads)."""
    import contextvars
    import threading

    from engine.search.spare import SpareThreads

    spare, release = SpareThreads(1), threading.Event()
    try:
        busy = spare.start(release.wait)
        assert busy is not None and spare.start(lambda: 1) is None
        release.set()
        assert busy.result(timeout=10) is True
        again = spare.start(lambda: 2)
        assert again is not None and again.result(timeout=10) == 2
        assert SpareThreads(0).start(lambda: 3) is None
        asked = contextvars.ContextVar("asked")
        asked.set(4)  # the caller's context reaches the spare thread (a trace, the shards missing)
        with spare.query():  # one query in progress: work that pays only on an idle core goes too
            alone = spare.start(asked.get, alone=True)
            assert alone is not None and alone.result(timeout=10) == 4
            with spare.query():  # two: the cores are busy, the query runs it itself
                assert spare.start(lambda: 5, alone=True) is None
                shared = spare.start(lambda: 6)
                assert shared is not None and shared.result(timeout=10) == 6
    finally:
        spare.close()
