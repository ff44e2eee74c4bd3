"""The store's cache of chunks read lately: what a search reads is what the store holds now, after a
write through the same store or through another connection (another process's writer), and rows
read before a write are never kept after it."""

from __future__ import annotations

from engine.store.chunk_cache import ChunkCache
from engine.store.docstore import DocStore


def _document(document_id: str, text: str) -> dict:
    return {
        "document_id": document_id,
        "document_name": f"{document_id}.txt",
        "metadata": {},
        "embedding_model": "test",
        "chunks": [{"chunk_id": "p1", "content": text, "metadata": {}}],
    }


def test_a_write_through_this_store_or_another_is_read_at_once(tmp_path):
    path = tmp_path / "docs.sqlite"
    store, writer = DocStore(path), DocStore(path)  # the writer: another connection, as another process's
    store.write_document(_document("a", "first words"), [0])
    unit = next(iter(store.chunks(c.unit_id for c in store.sample(10))))
    assert store.chunks([unit])[unit].text == "first words"
    assert store.chunks([unit])[unit] is store.chunks([unit])[unit]  # served from the cache
    writer.write_document(_document("a", "second words"), [1])
    assert store.chunks([unit])[unit].text == "second words"
    store.write_document(_document("a", "third words"), [2])
    assert store.chunks([unit])[unit].text == "third words"
    writer.delete_document("a")
    assert store.chunks([unit]) == {}


def test_rows_read_at_an_older_version_are_neither_served_nor_kept():
    cache: ChunkCache[str] = ChunkCache(size=2)
    cache.found(["x"], version=3)
    cache.keep({"x": "at 3"}, version=3)
    cache.keep({"y": "at 2"}, version=2)  # read before the write that made version 3
    assert cache.found(["x", "y"], version=3) == {"x": "at 3"}
    assert cache.found(["x"], version=2) == {}  # a reader on an older snapshot: nothing from a newer one
    assert cache.found(["x"], version=4) == {}  # a newer version empties it
    cache.keep({"a": "1", "b": "2", "c": "3"}, version=4)
    assert list(cache.found(["a", "b", "c"], version=4)) == ["b", "c"]  # the least recently read out first
