"""Progress off a terminal: a few summary lines, not one per tick; items pass through unchanged."""

import logging

from offline.progress import track


def test_logged_progress_is_a_few_lines(caplog):
    caplog.set_level(logging.INFO, logger="hybrid_search.progress")
    bar = track(range(1000), "indexing", "doc")
    seen = []
    for i in bar:
        seen.append(i)
        bar.note(loss=f"{i / 1000:.2f}")
    assert seen == list(range(1000))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5, lines
    assert lines[0] == "indexing: started (1,000 docs)"
    assert lines[2].startswith("indexing: 50% (500/1,000 docs), ") and lines[2].endswith(", loss 0.50")
    assert "/s, about " in lines[2] and " left" in lines[2]  # the rate and the time to go
    assert lines[-1].startswith("indexing: done, 1,000 docs in ")


def test_tiny_and_unsized_work_still_ends(caplog):
    caplog.set_level(logging.INFO, logger="hybrid_search.progress")
    assert list(track(iter(["a", "b"]), "reading", "file")) == ["a", "b"]
    assert list(track([1], "one", "step")) == [1]
    assert list(track([1, 2, 3], "quiet", enabled=False)) == [1, 2, 3]
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "reading: started"
    assert any(m.startswith("reading: done, 2 files") for m in messages)
    assert not any(m.startswith("quiet") for m in messages)
