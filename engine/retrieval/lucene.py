"""BM25 over a Lucene index that can change while it serves.

The fields, analyzer, query and tie-breaking are Anserini's (what pyserini's ``LuceneIndexer`` and
``LuceneSearcher`` use: ``DefaultEnglishAnalyzer``, a bag-of-words query on ``contents``, ties
broken by ``id``), so scores are the same as an index pyserini builds. Unlike pyserini's
indexer, Lucene's own ``IndexWriter`` can replace and delete by term, and a near-real-time reader
opened from the writer sees changes at each ``refresh`` without a commit.

Searches run side by side. Each pins the current reader, counted as Lucene's ``SearcherManager``
counts (a refresh swaps in a new reader; the old one closes when its last search ends), and takes
its hits out of Java as arrays (Anserini's ``ScoredDocs``: ids and scores in three calls, where
reading each hit took four).

A filter on the fields each chunk carries as Lucene terms (its document's id and, in an index
built since they were, its document type and date: ``fields``) is a ``FILTER`` clause on them, so
Lucene scores only the chunks it lets through. Any other filter is the store's set of allowed ids:
a few a ``TermInSetQuery`` of cached ``BytesRef`` ids, many read off the unfiltered ranking.

pyjnius binds an instance method by storing the instance on the method object that every instance
of the class shares (the FIXME in its ``JavaMethod.__get__``), so two threads that call one method
on two objects can swap them: searches side by side once failed so (a ``NullPointerException`` from
another thread's stored fields), and two indexes searched at once answered from each other. Hence a
search calls ``IndexSearcher.search`` through a method handle (one object; the searcher is an
argument), calls on objects that are not one of a kind (readers, query builders) run under
``_calls``, and the writer's calls (one thread at a time, as before) share no method with a search's.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from engine.documents import DATE, DOCUMENT_TYPE, Filters, reserved_fields
from engine.retrieval.java import start_jvm
from engine.retrieval.protocol import Query, Ranking, Within, live_only
from engine.store.index_dir import IndexDirError

_TEXT_FIELD = "(Ljava/lang/String;Ljava/lang/CharSequence;Lorg/apache/lucene/index/IndexableFieldType;)V"
SEQ_KEY = "seq"  # commit user data: the last write-ahead-log record this commit holds
_ID_TERMS = 1 << 16  # unit ids kept as Java BytesRefs for filters: a pyjnius constructor costs ~10 us
_SEARCH = ".IndexSearcher.search(org.apache.lucene.search.Query,int,org.apache.lucene.search.Sort,boolean)"
_TERM_SET = "(Ljava/lang/String;[Lorg/apache/lucene/util/BytesRef;)V"
FILTER_TERMS = 1_000  # allowed ids past this are read off the ranking, not sent to Lucene a term each
FILTER_DEPTH = 20_000  # how far down the unfiltered ranking a wide filter is looked for
# a kept filter's ids (engine/search/allowed.py) up to this share of the index go to Lucene as one
# query made once, whose matches the query cache keeps by segment after a few uses; reading the
# ranking deeper costs in proportion to 1/share (docs/filters.md, "At a million chunks")
KEPT_QUERY_SHARE = 0.15
# The filters' matches kept by segment (Lucene's LRUQueryCache, a bit a chunk: 125 KB a filter at a
# million chunks). Lucene's default cache skips a filter clause that costs far more than the query's
# own terms (its skip factor), and small segments: ours caches every filter of every segment, since
# users repeat their filters and a filter beside a few rare terms is where its cost shows.
QUERY_CACHE_QUERIES, QUERY_CACHE_BYTES = 1_000, 64 << 20
_calls = threading.Lock()  # instance calls on objects that are not one of a kind (module docstring)
FILTER_FIELDS = (DOCUMENT_TYPE, DATE)  # document metadata kept as a chunk's terms (ISO dates sort as text)


class IndexClosedError(RuntimeError):
    """A search or refresh after ``close``."""


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
            "org.apache.lucene.search.TermQuery",
            "org.apache.lucene.search.BoostQuery",
            "org.apache.lucene.search.TermRangeQuery",
            "org.apache.lucene.search.LRUQueryCache",
            "java.util.function.Predicate",
            "org.apache.lucene.search.Sort",
            "org.apache.lucene.search.SortField",
            "org.apache.lucene.search.SortField$Type",
            "org.apache.lucene.search.similarities.BM25Similarity",
            "io.anserini.analysis.DefaultEnglishAnalyzer",
            "io.anserini.search.query.BagOfWordsQueryGenerator",
            "io.anserini.search.ScoredDocs",
            "java.util.ArrayList",
            "java.lang.Boolean",
            "java.lang.Integer",
            "java.lang.invoke.MethodHandles",
        ):
            setattr(self, name.rsplit(".", 1)[1].replace("$", "_"), autoclass(name))
        contents = self.FieldType()
        contents.setTokenized(True)
        contents.setIndexOptions(self.IndexOptions.DOCS_AND_FREQS_AND_POSITIONS)
        contents.freeze()
        self.contents_type = contents
        self.bytes_ref = lambda text: self.BytesRef(text, signature="(Ljava/lang/CharSequence;)V")
        self.id_term = functools.lru_cache(maxsize=_ID_TERMS)(self.bytes_ref)
        searcher = autoclass("java.lang.Class").forName("org.apache.lucene.search.IndexSearcher")
        (method,) = [m for m in searcher.getMethods() if _SEARCH in m.toString()]
        self.search_handle = self.MethodHandles.publicLookup().unreflect(method)
        self.with_scores = self.Boolean(True)  # doDocScores, boxed for the handle
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


class _View:
    """One point-in-time reader and its searcher, with Lucene's SearcherManager counting: one
    reference is the index's while the view is current, one each search's; the reader closes at 0."""

    def __init__(self, reader, searcher, documents: int) -> None:
        self.reader, self.searcher, self.documents, self.refs = reader, searcher, documents, 1
        self.matched: dict[float, object] = {}  # a corpus's average length -> a searcher scoring by it


class LuceneIndex:
    """BM25 search, and (``writable``) replace/delete by document with near-real-time refresh.

    One writer per index directory (Lucene's write lock enforces it). Searches are thread-safe and
    run side by side, also while a refresh swaps the reader; ``close`` waits for those in flight.
    """

    filter_terms = FILTER_TERMS
    kept_query_share = KEPT_QUERY_SHARE
    filter_depth = FILTER_DEPTH

    def __init__(
        self,
        path: str | Path,
        k1: float = 0.9,
        b: float = 0.4,
        writable: bool = False,
        create: bool = False,
        fields: Collection[str] = (),
    ) -> None:
        """``create`` starts an empty index (a build); otherwise the index must be there and whole:
        a missing or damaged file raises IndexDirError naming it (a writer never starts afresh over
        it, which would delete the files it could not read). ``fields``: the ``FILTER_FIELDS`` every
        chunk of the index carries (its manifest says), which filters on them use."""
        self.j = j = _lucene()
        from jnius import JavaException  # only once the JVM runs, with the options start_jvm sets

        self.path = Path(path)
        self.fields = frozenset(fields)
        self._directory = j.FSDirectory.open(j.Paths.get(str(self.path.resolve())))
        self.k1, self.b = float(k1), float(b)
        self._similarity = j.BM25Similarity(self.k1, self.b)
        every_segment = j.Predicate.isEqual(None).negate()
        self._query_cache = j.LRUQueryCache(QUERY_CACHE_QUERIES, QUERY_CACHE_BYTES, every_segment, float("inf"))
        self._writer = None
        try:
            if writable:
                config = j.IndexWriterConfig(j.analyzer)
                mode = j.IndexWriterConfig_OpenMode.CREATE if create else j.IndexWriterConfig_OpenMode.APPEND
                config.setOpenMode(mode)
                config.setSimilarity(self._similarity)
                self._writer = j.IndexWriter(self._directory, config)
                reader = j.DirectoryReader.open(self._writer)
            else:
                reader = j.DirectoryReader.open(self._directory)
        except JavaException as exc:
            if self._writer is not None:
                self._writer.rollback()
            raise IndexDirError(
                f"{self.path}: unreadable Lucene index ({_root_cause(exc)}); rebuild the index"
            ) from None
        self._state = threading.Condition()  # guards _view, _closed, _searches and every view's refs
        self._refreshing = threading.Lock()  # one refresh (or close) at a time; searches never take it
        self._view = self._open_view(reader)
        self._closed = False
        self._searches = 0

    def _open_view(self, reader) -> _View:
        searcher = self.j.IndexSearcher(reader, signature="(Lorg/apache/lucene/index/IndexReader;)V")
        with _calls:
            searcher.setSimilarity(self._similarity)
            searcher.setQueryCache(self._query_cache)  # one for every view: a segment's matches outlive a refresh
            return _View(reader, searcher, reader.numDocs())

    @property
    def documents(self) -> int:
        return self._view.documents

    @contextmanager
    def _pinned(self) -> Iterator[_View]:
        """The current view, open until the block ends however the index changes meanwhile."""
        with self._state:
            if self._closed:
                raise IndexClosedError(f"{self.path}: the BM25 index is closed")
            view = self._view
            view.refs += 1
            self._searches += 1
        try:
            yield view
        finally:
            with self._state:
                self._searches -= 1
                self._state.notify_all()
            self._unref(view)

    def _unref(self, view: _View) -> None:
        with self._state:
            view.refs -= 1
            if view.refs:
                return
        with _calls:
            view.reader.decRef()

    def _search_bag(
        self, bag, k: int, allowed: Collection[str] | None, average: float | None = None
    ) -> list[tuple[str, float]]:
        if allowed is not None and not allowed:
            return []
        if allowed is not None and len(allowed) > self.filter_terms:
            narrow = len(allowed) <= self.kept_query_share * self.documents
            if narrow and (form := getattr(allowed, "form", None)) is not None:  # a kept set: its query made once
                return self._top(self._restricted(bag, [form("lucene", lambda: self._ids(allowed))]), k, average)
            return self._ranked_within(bag, k, allowed, average)
        return self._top(self._filtered(bag, allowed) if allowed is not None else bag, k, average)

    def retrieve(
        self,
        query: Query,
        k: int,
        within: Within,
        weighted: Sequence[tuple[str, float]] | None = None,
        average: float | None = None,
    ) -> Ranking:
        """:class:`~engine.retrieval.protocol.Retriever`: the top ``k`` (unit id, BM25 score) by the
        query's text, best first, ties by id; within the filter through this index's own fields
        when they hold it, else within ``within.allowed`` (a few ids filter inside Lucene, a term
        each; many are read off the unfiltered ranking, further down until ``k`` of them are found:
        :meth:`_ranked_within`); only live chunks (Lucene's view lags the store's when its refresh
        failed). A shard (:class:`engine.shards.bm25.ShardedBM25`) is
        given its query's terms ``weighted`` as the whole corpus weighs them, in place of its text,
        and the corpus's ``average`` length to normalise lengths by (:meth:`_lengths_matched`)."""
        bag = self._bag(query.text, weighted)
        if within.filters is not None and (clauses := self._clauses(within.filters)) is not None:
            hits = self._top(self._restricted(bag, clauses), k, average)
        else:
            hits = self._search_bag(bag, k, within.allowed, average)
        return live_only(hits, within.live)

    def _bag(self, text: str, weighted: Sequence[tuple[str, float]] | None = None):
        """The bag-of-words query of ``text``, or of ``weighted`` terms (a term's boost its weight)."""
        j = self.j
        if weighted is None:
            return j.generator.buildQuery("contents", j.analyzer, text)
        with _calls:
            builder = j.BooleanQuery_Builder()
            for term, weight in weighted:
                clause = j.BoostQuery(j.TermQuery(j.Term("contents", term)), float(weight))
                builder.add(clause, j.BooleanClause_Occur.SHOULD)
            return builder.build()

    # the statistics a shard's BM25 is scored with as one index's (engine/shards/bm25.py)
    def query_terms(self, text: str) -> list[tuple[str, float]]:
        """``text``'s terms as the query generator weighs them (a repeated word, once, boosted)."""
        from jnius import cast

        j = self.j
        query = j.generator.buildQuery("contents", j.analyzer, text)
        with _calls:
            if not query.getClass().getName().endswith("BooleanQuery"):
                clauses = [query]
            else:
                bag = cast("org.apache.lucene.search.BooleanQuery", query)
                clauses = [
                    cast("org.apache.lucene.search.BooleanClause", c).getQuery() for c in bag.clauses().toArray()
                ]
            found = []
            for clause in clauses:
                boost = 1.0
                if clause.getClass().getName().endswith("BoostQuery"):
                    boosted = cast("org.apache.lucene.search.BoostQuery", clause)
                    clause, boost = boosted.getQuery(), boosted.getBoost()
                found.append((cast("org.apache.lucene.search.TermQuery", clause).getTerm().text(), float(boost)))
            return found

    def frequencies(self, terms: Sequence[str]) -> list[int]:
        """How many chunks hold each of ``terms``."""
        j = self.j
        with self._pinned() as view, _calls:
            return [int(view.reader.docFreq(j.Term("contents", term))) for term in terms]

    def collection(self) -> tuple[int, int]:
        """The chunks holding text, and their length in terms all together (BM25's average length)."""
        with self._pinned() as view, _calls:
            stats = view.searcher.collectionStatistics("contents")
            return (0, 0) if stats is None else (int(stats.docCount()), int(stats.sumTotalTermFreq()))

    def _lengths_matched(self, view: _View, average: float):
        """``view``'s searcher normalising lengths by ``average`` (a whole corpus's) rather than the
        view's own: BM25 with ``k1' = k1 (1 - b + b r)`` and ``b' = b r / (1 - b + b r)``, ``r`` the
        view's average over ``average``, equals BM25(k1, b) at that average for every length. A
        searcher of its own, so that searches side by side never score with each other's; made once
        for an average (which moves only with writes) and kept with the view."""
        found = view.matched.get(average)
        if found is not None:
            return found
        j = self.j
        with _calls:
            stats = view.searcher.collectionStatistics("contents")
            docs, length = (0, 0) if stats is None else (int(stats.docCount()), int(stats.sumTotalTermFreq()))
            r = length / docs / average if docs and average else 1.0
            scale = 1 - self.b + self.b * r
            searcher = j.IndexSearcher(view.reader, signature="(Lorg/apache/lucene/index/IndexReader;)V")
            searcher.setSimilarity(j.BM25Similarity(float(self.k1 * scale), float(self.b * r / scale)))
            searcher.setQueryCache(self._query_cache)
        view.matched = {average: searcher}  # the latest average only
        return searcher

    def _clauses(self, filters: Filters) -> list | None:
        """``filters`` as Lucene queries on the chunks' own terms, or None where one condition is on
        a field this index does not carry (any other metadata key) or combines others (and, or, not)."""
        if not filters.plain or (filters.document_types and DOCUMENT_TYPE not in self.fields):
            return None
        if filters.date_range and DATE not in self.fields:
            return None
        j, clauses = self.j, []
        if filters.document_ids:
            clauses.append(
                j.TermInSetQuery("document_id", *map(j.bytes_ref, filters.document_ids), signature=_TERM_SET)
            )
        if filters.document_types:
            types = map(j.bytes_ref, filters.document_types)
            clauses.append(j.TermInSetQuery(DOCUMENT_TYPE, *types, signature=_TERM_SET))
        if filters.date_range:
            start, end = (None if day is None else day.isoformat() for day in filters.date_range)
            clauses.append(j.TermRangeQuery.newStringRange(DATE, start, end, True, True))
        return clauses

    def _top(self, query, k: int, average: float | None = None) -> list[tuple[str, float]]:
        j = self.j
        with self._pinned() as view:
            searcher = view.searcher if average is None else self._lengths_matched(view, average)
            top = j.search_handle.invokeWithArguments(searcher, query, j.Integer(int(k)), j.sort, j.with_scores)
            hits = j.ScoredDocs.fromTopDocs(top, searcher)  # each hit's stored id, read in Java
            return list(zip(hits.docids, hits.scores, strict=True))

    def _ranked_within(
        self, bag, k: int, allowed: Collection[str], average: float | None = None
    ) -> list[tuple[str, float]]:
        """A wide filter's top ``k``: a filter adds nothing to a score, so the filtered ranking is
        the unfiltered one with the others left out. It is read to a depth that should hold ``k``
        allowed hits at the filter's share of the index, four times deeper while it does not, and
        past ``filter_depth`` (a query whose best hits the filter avoids) the ids go to Lucene."""
        share, deepest = len(allowed) / max(self.documents, 1), self.filter_depth
        depth = min(deepest, max(k, int(1.5 * k / max(share, 1e-9))))
        while True:
            hits = self._top(bag, depth, average)
            kept = [hit for hit in hits if hit[0] in allowed]
            if len(kept) >= k or len(hits) < depth:
                return kept[:k]
            if depth >= deepest:
                return self._top(self._filtered(bag, allowed), k, average)
            depth = min(deepest, depth * 4)

    def _filtered(self, bag, allowed: Collection[str]):
        """``bag`` restricted to ``allowed``: one Java call for the id set, its BytesRefs cached."""
        return self._restricted(bag, [self._ids(allowed)])

    def _ids(self, allowed: Collection[str]):
        """The query matching ``allowed``'s ids (Lucene's query cache keeps its matches by segment
        once it is asked again)."""
        j = self.j
        return j.TermInSetQuery("id", *map(j.id_term, allowed), signature=_TERM_SET)

    def _restricted(self, bag, clauses: list):
        """``bag`` scored over the chunks every clause matches (``FILTER``: they add no score)."""
        j = self.j
        with _calls:
            builder = j.BooleanQuery_Builder()
            builder.add(bag, j.BooleanClause_Occur.MUST)
            for clause in clauses:
                builder.add(clause, j.BooleanClause_Occur.FILTER)
            return builder.build()

    # writing
    def add(self, document_id: str, units: Iterable[tuple[str, str]], metadata: dict | None = None) -> None:
        """Add (unit id, contents) chunks of a document (a build: nothing to replace); its
        ``metadata``'s ``FILTER_FIELDS`` become each chunk's terms where filters read them
        (:func:`~engine.documents.reserved_fields`)."""
        self._writer.addDocuments(self._docs(document_id, units, metadata))

    def replace(self, document_id: str, units: Iterable[tuple[str, str]], metadata: dict | None = None) -> None:
        """Atomically replace every chunk of ``document_id``: a reader sees all old or all new."""
        self._writer.updateDocuments(self.j.Term("document_id", document_id), self._docs(document_id, units, metadata))

    def absorb(self, paths: Sequence[Path]) -> None:
        """Add the whole indexes at ``paths`` (a build's parts): their segments copied, then merged
        into one (:meth:`merge_into_one`)."""
        j = self.j
        directories = [j.FSDirectory.open(j.Paths.get(str(Path(p).resolve()))) for p in paths]
        try:
            self._writer.addIndexes(*directories)
        finally:
            for directory in directories:
                directory.close()
        self.merge_into_one()

    def merge_into_one(self) -> None:
        """Merge a build's segments into one, waited for (a rollback at ``close`` would abort it):
        a query then reads each term's postings once, not once a segment, as pyserini's indexer does
        with ``-optimize``. Live writes add segments after it, which Lucene's merge policy merges as
        they come. Figures: docs/experiments.md, "2026-11-29 · BM25 in one segment"."""
        self._writer.forceMerge(1)

    def delete(self, document_id: str) -> None:
        self._writer.updateDocuments(self.j.Term("document_id", document_id), self.j.ArrayList())  # replace by nothing

    def _docs(self, document_id: str, units: Iterable[tuple[str, str]], metadata: dict | None):
        j = self.j
        terms = reserved_fields(metadata or {}).items()
        docs = j.ArrayList()
        for unit, contents in units:
            doc = j.Document()
            doc.add(j.StringField("id", unit, j.Field_Store.YES))
            doc.add(j.BinaryDocValuesField("id", j.bytes_ref(unit)))
            doc.add(j.StringField("document_id", document_id, j.Field_Store.NO))
            for key, value in terms:
                doc.add(j.StringField(key, value, j.Field_Store.NO))
            doc.add(j.Field("contents", contents, j.contents_type, signature=_TEXT_FIELD))
            docs.add(doc)
        return docs

    def refresh(self) -> None:
        """Make every change so far searchable (near-real-time: no commit, no fsync); read-only, the
        newest commit (another process's writer). Searches in flight finish on the reader they began
        with, which closes after the last of them."""
        with self._refreshing:
            if self._closed:
                raise IndexClosedError(f"{self.path}: the BM25 index is closed")
            old, reader = self._view, self.j.DirectoryReader
            newer = reader.openIfChanged(old.reader, self._writer) if self._writer else reader.openIfChanged(old.reader)
            if newer is None:
                return
            view = self._open_view(newer)
            with self._state:
                self._view = view
            self._unref(old)

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

    def last_commit(self) -> tuple[int, list[str]]:
        """The last commit's position (the last log record it holds) and its files, by name in the
        index's folder: what a snapshot links, since Lucene never changes a file once written and
        keeps a commit's files until the next commit."""
        with _calls:
            infos = self.j.SegmentInfos.readLatestCommit(self._directory)
            value = infos.getUserData().get(SEQ_KEY)
            files = sorted(str(name) for name in infos.files(True).toArray())
        return (int(value) if value is not None else 0), files

    def close(self) -> None:
        """Wait for the searches in flight, then release the index; a later search raises
        IndexClosedError. Uncommitted changes are rolled back: they are the log's to replay."""
        with self._refreshing:
            with self._state:
                if self._closed:
                    return
                self._closed = True
                self._state.wait_for(lambda: not self._searches)
            if self._writer is not None:
                self._writer.rollback()
                self._writer = None
            self._unref(self._view)
