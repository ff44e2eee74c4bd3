"""BM25 over a Lucene index that can change while it serves.

The fields, analyzer, query and tie-breaking are Anserini's (what pyserini's ``LuceneIndexer`` and
``LuceneSearcher`` use: ``DefaultEnglishAnalyzer``, a bag-of-words query on ``contents``, ties
broken by ``id``), so scores are the same as an index pyserini builds. Unlike pyserini's
indexer, Lucene's own ``IndexWriter`` can replace and delete by term, and a near-real-time reader
opened from the writer sees changes at each ``refresh`` without a commit.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable
from pathlib import Path

from engine.retrieval.java import start_jvm
from engine.store.index_dir import IndexDirError

_TEXT_FIELD = "(Ljava/lang/String;Ljava/lang/CharSequence;Lorg/apache/lucene/index/IndexableFieldType;)V"
SEQ_KEY = "seq"  # commit user data: the last write-ahead-log record this commit holds


class _Java:
    """The Lucene and Anserini classes used here, loaded once the JVM runs."""

    def __init__(self) -> None:
        start_jvm()
        from jnius import autoclass

        for name in (
            "java.nio.file.Paths",
            "java.util.HashMap",
            "org.apache.lucene.store.FSDirectory",
            "org.apache.lucene.index.IndexWriter",
            "org.apache.lucene.index.IndexWriterConfig",
            "org.apache.lucene.index.IndexWriterConfig$OpenMode",
            "org.apache.lucene.index.DirectoryReader",
            "org.apache.lucene.index.IndexOptions",
            "org.apache.lucene.index.Term",
            "org.apache.lucene.index.SegmentInfos",
            "org.apache.lucene.document.Document",
            "org.apache.lucene.document.Field",
            "org.apache.lucene.document.Field$Store",
            "org.apache.lucene.document.FieldType",
            "org.apache.lucene.document.StringField",
            "org.apache.lucene.document.BinaryDocValuesField",
            "org.apache.lucene.util.BytesRef",
            "org.apache.lucene.search.IndexSearcher",
            "org.apache.lucene.search.BooleanQuery$Builder",
            "org.apache.lucene.search.BooleanClause$Occur",
            "org.apache.lucene.search.TermInSetQuery",
            "org.apache.lucene.search.Sort",
            "org.apache.lucene.search.SortField",
            "org.apache.lucene.search.SortField$Type",
            "org.apache.lucene.search.similarities.BM25Similarity",
            "io.anserini.analysis.DefaultEnglishAnalyzer",
            "io.anserini.search.query.BagOfWordsQueryGenerator",
            "java.util.ArrayList",
        ):
            setattr(self, name.rsplit(".", 1)[1].replace("$", "_"), autoclass(name))
        contents = self.FieldType()
        contents.setTokenized(True)
        contents.setIndexOptions(self.IndexOptions.DOCS_AND_FREQS_AND_POSITIONS)
        contents.freeze()
        self.contents_type = contents
        self.bytes_ref = lambda text: self.BytesRef(text, signature="(Ljava/lang/CharSequence;)V")
        self.analyzer = self.DefaultEnglishAnalyzer.newDefaultInstance()
        self.generator = self.BagOfWordsQueryGenerator()
        self.sort = self.Sort(self.SortField.FIELD_SCORE, self.SortField("id", self.SortField_Type.STRING_VAL))


def _root_cause(exc: Exception) -> str:
    """The innermost Java exception's line (``NoSuchFileException: <path>`` rather than its wrapper)."""
    lines = getattr(exc, "stacktrace", None) or [str(exc)]
    causes = [lines[i + 1] for i, line in enumerate(lines[:-1]) if line == "Caused by:"]
    return causes[-1] if causes else lines[0]


_java: _Java | None = None
_java_lock = threading.Lock()


def _lucene() -> _Java:
    global _java
    with _java_lock:
        if _java is None:
            _java = _Java()
        return _java


class LuceneIndex:
    """BM25 search, and (``writable``) replace/delete by document with near-real-time refresh.

    One writer per index directory (Lucene's write lock enforces it). Searches are thread-safe.
    """

    def __init__(
        self, path: str | Path, k1: float = 0.9, b: float = 0.4, writable: bool = False, create: bool = False
    ) -> None:
        """``create`` starts an empty index (a build); otherwise the index must be there and whole:
        a missing or damaged file raises IndexDirError naming it (a writer never starts afresh over
        it, which would delete the files it could not read)."""
        self.j = j = _lucene()
        from jnius import JavaException  # only once the JVM runs, with the options start_jvm sets

        self.path = Path(path)
        self._directory = j.FSDirectory.open(j.Paths.get(str(self.path.resolve())))
        self._similarity = j.BM25Similarity(float(k1), float(b))
        self._lock = threading.Lock()
        self._writer = None
        try:
            if writable:
                config = j.IndexWriterConfig(j.analyzer)
                mode = j.IndexWriterConfig_OpenMode.CREATE if create else j.IndexWriterConfig_OpenMode.APPEND
                config.setOpenMode(mode)
                config.setSimilarity(self._similarity)
                self._writer = j.IndexWriter(self._directory, config)
                self._reader = j.DirectoryReader.open(self._writer)
            else:
                self._reader = j.DirectoryReader.open(self._directory)
        except JavaException as exc:
            if self._writer is not None:
                self._writer.rollback()
            raise IndexDirError(
                f"{self.path}: unreadable Lucene index ({_root_cause(exc)}); rebuild the index"
            ) from None
        self._searcher = self._new_searcher(self._reader)

    def _new_searcher(self, reader):
        searcher = self.j.IndexSearcher(reader, signature="(Lorg/apache/lucene/index/IndexReader;)V")
        searcher.setSimilarity(self._similarity)
        return searcher

    @property
    def documents(self) -> int:
        return self._reader.numDocs()

    def search(self, query: str, k: int, allowed: Collection[str] | None = None) -> list[tuple[str, float]]:
        """Top ``k`` (unit id, BM25 score), best first; ``allowed`` (unit ids) filters inside Lucene."""
        if allowed is not None and not allowed:
            return []
        j = self.j
        bag = j.generator.buildQuery("contents", j.analyzer, query)
        if allowed is not None:
            terms = j.ArrayList()
            for unit in allowed:
                terms.add(j.bytes_ref(unit))
            builder = j.BooleanQuery_Builder()
            builder.add(bag, j.BooleanClause_Occur.MUST)
            builder.add(j.TermInSetQuery("id", terms), j.BooleanClause_Occur.FILTER)
            bag = builder.build()
        with self._lock:
            searcher = self._searcher
            top = searcher.search(bag, int(k), j.sort, True)
            stored = searcher.storedFields()
            return [(stored.document(hit.doc).get("id"), float(hit.score)) for hit in top.scoreDocs]

    # writing
    def add(self, document_id: str, units: Iterable[tuple[str, str]]) -> None:
        """Add (unit id, contents) chunks of a document (a build: nothing to replace)."""
        self._writer.addDocuments(self._docs(document_id, units))

    def replace(self, document_id: str, units: Iterable[tuple[str, str]]) -> None:
        """Atomically replace every chunk of ``document_id``: a reader sees all old or all new."""
        self._writer.updateDocuments(self.j.Term("document_id", document_id), self._docs(document_id, units))

    def delete(self, document_id: str) -> None:
        self._writer.updateDocuments(self.j.Term("document_id", document_id), self.j.ArrayList())  # replace by nothing

    def _docs(self, document_id: str, units: Iterable[tuple[str, str]]):
        j = self.j
        docs = j.ArrayList()
        for unit, contents in units:
            doc = j.Document()
            doc.add(j.StringField("id", unit, j.Field_Store.YES))
            doc.add(j.BinaryDocValuesField("id", j.bytes_ref(unit)))
            doc.add(j.StringField("document_id", document_id, j.Field_Store.NO))
            doc.add(j.Field("contents", contents, j.contents_type, signature=_TEXT_FIELD))
            docs.add(doc)
        return docs

    def refresh(self) -> None:
        """Make every change so far searchable (near-real-time: no commit, no fsync); read-only, the
        newest commit (another process's writer)."""
        reader = self.j.DirectoryReader
        newer = reader.openIfChanged(self._reader, self._writer) if self._writer else reader.openIfChanged(self._reader)
        if newer is not None:
            with self._lock:
                old, self._reader, self._searcher = self._reader, newer, self._new_searcher(newer)
            old.decRef()

    def commit(self, seq: int) -> None:
        """Durable Lucene commit recording the last log record it holds."""
        data = self.j.HashMap()
        data.put(SEQ_KEY, str(seq))
        self._writer.setLiveCommitData(data.entrySet())
        self._writer.commit()

    def committed_seq(self) -> int:
        data = self.j.SegmentInfos.readLatestCommit(self._directory).getUserData()
        value = data.get(SEQ_KEY)
        return int(value) if value is not None else 0

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.rollback()  # uncommitted changes are the log's to replay
                self._writer = None
            self._reader.decRef()
