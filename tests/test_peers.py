"""The peers benchmark's measuring and table on a 5-document corpus, with stand-in searches (the
peers themselves are an optional extra and need an index)."""

from benchmarks.peers import CONCURRENCY, Peer, markdown, measure, rotated

DOCS = ["d1", "d2", "d3", "d4", "d5"]
QUERIES = {"q1": "vitamin d", "q2": "soy", "q3": "statins"}
QRELS = {"q1": {"d1": 2, "d2": 1}, "q2": {"d3": 1}, "q3": {"d5": 1}}


def test_each_peer_goes_first_in_turn():
    peers = [Peer(name, "", list) for name in "abc"]
    assert [[p.name for p in rotated(peers, turn)] for turn in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]


def test_rows_score_each_peer_on_the_same_queries_and_the_table_shows_them():
    asked: list[str] = []

    def perfect(query: str) -> list[str]:
        asked.append(query)
        qid = next(q for q, text in QUERIES.items() if text == query)
        return sorted(QRELS[qid], key=QRELS[qid].get, reverse=True)

    peers = [Peer("perfect", "the judgments", perfect), Peer("fixed", "always d4 first", lambda q: DOCS[3:] + DOCS[:3])]
    rows = measure(peers, QUERIES, QRELS)
    assert [r["system"] for r in rows] == ["perfect", "fixed"]
    assert rows[0]["nDCG@10"] == 1.0 and 0 < rows[1]["nDCG@10"] < 1
    assert rows[1]["vs_first"]["gain"] < 0 and rows[0]["vs_first"]["gain"] == 0
    assert all(r["queries"] == 3 and r["latency_ms"]["n"] == 3 for r in rows)
    assert set(rows[0]["qps"]) == {str(c) for c in CONCURRENCY}
    # warm-up, the timed pass, then one pass a concurrency: every query each time
    assert sorted(asked) == sorted(list(QUERIES.values()) * (2 + len(CONCURRENCY)))

    table = markdown({"rows": rows}).splitlines()
    assert len(table) == 4 and table[0].count("|") == table[1].count("|") == table[2].count("|")
    assert table[2].startswith("| perfect | 1.0000 |") and table[3].endswith("| always d4 first |")
