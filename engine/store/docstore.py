"""The document store: texts, titles and metadata of every chunk, in SQLite (WAL mode).

Each chunk has a ``row``, its id in the dense index, so the store is also the map between what
FAISS returns and what results show. Filters are answered here once per query, and the same
allowed set is handed to every retriever, so all of them read a filter the same way.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from datetime import date, timedelta
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.documents import DATE, DOCUMENT_TYPE, Condition, Filters, filter_values, unit_id
from engine.errors import INVALID_PARAMS, ServiceError
from engine.store.chunk_cache import ChunkCache
from engine.store.index_dir import IndexDirError
from engine.store.tokens import TextTokens
from engine.store.unit_map import UnitMap
from engine.text import chunk_text

log = logging.getLogger(__name__)
# chunk_fields' value for metadata filters cannot read (an object...): a blob, which no filter's
# value equals, and which sorts after every number and string (found by a range on the key)
UNREADABLE = b""


class UnfilterableKey(ServiceError, ValueError):
    """A filter names a metadata key that some document holds in a shape filters cannot read: 422."""

    status, jsonrpc_code = 422, INVALID_PARAMS


_SCHEMA = """
CREATE TABLE IF NOT EXISTS documents (
    document_id TEXT PRIMARY KEY, name TEXT NOT NULL, metadata TEXT NOT NULL, embedding_model TEXT
);
CREATE TABLE IF NOT EXISTS chunks (
    row INTEGER PRIMARY KEY, unit_id TEXT NOT NULL UNIQUE, document_id TEXT NOT NULL, chunk_id TEXT NOT NULL,
    position INTEGER NOT NULL, title TEXT NOT NULL, content TEXT NOT NULL, metadata TEXT NOT NULL
);
DROP INDEX IF EXISTS chunks_by_document;
CREATE INDEX IF NOT EXISTS chunks_of_document ON chunks(document_id, unit_id);
CREATE INDEX IF NOT EXISTS documents_by_type ON documents(json_extract(metadata, '$.document_type'));
CREATE INDEX IF NOT EXISTS documents_by_date ON documents(json_extract(metadata, '$.date'));
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS chunk_fields (
    key TEXT NOT NULL, value NOT NULL, row INTEGER NOT NULL, PRIMARY KEY (key, value, row)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS fields_of_row ON chunk_fields(row);
CREATE TABLE IF NOT EXISTS passage_tokens (
    row INTEGER PRIMARY KEY, ids BLOB NOT NULL, width INTEGER NOT NULL, total INTEGER NOT NULL, overrun INTEGER NOT NULL
);
"""


@dataclass
class Chunk:
    """One retrievable unit with what results show about it."""

    unit_id: str
    document_id: str
    chunk_id: str
    title: str
    text: str
    source_document: str
    metadata: dict = field(default_factory=dict)
    row: int = -1
    tokens: TextTokens | None = None  # of ``contents``, by the tokenizer the manifest names (engine/store/tokens.py)

    @property
    def doc_id(self) -> str:
        return self.unit_id

    @property
    def contents(self) -> str:
        """What every stage reads of this chunk (:func:`engine.text.chunk_text`)."""
        return chunk_text(self.title, self.text)


QUICK_CHECK_BYTES = 256 << 20  # stores up to this size are checked page by page at open


class DocStore:
    """One SQLite file; a connection per thread (readers never block the one writer in WAL mode).

    Opening checks the file's structure (``PRAGMA quick_check``, one pass over its pages, ~0.1 s
    for NFCorpus), so a damaged store is refused at start rather than found by a query.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._local = threading.local()
        self._cache: ChunkCache[Chunk] = ChunkCache()
        try:
            conn = self._conn()
            conn.executescript(_SCHEMA)
            (empty,) = conn.execute("SELECT NOT EXISTS (SELECT 1 FROM chunks)").fetchone()
            if empty:  # a new store keeps chunk_fields from its first write
                conn.execute("INSERT OR IGNORE INTO meta VALUES ('fields_indexed', 1)")
            # every page read once: worth it for a small store, minutes for every worker's start at a
            # million chunks, where a damaged page is found by the query that reads it
            whole = self.path.stat().st_size <= QUICK_CHECK_BYTES
            check = "PRAGMA quick_check(5)" if whole else "SELECT 'ok' FROM meta LIMIT 0"
            problems = [p for (p,) in conn.execute(check) if p != "ok"]
        except sqlite3.DatabaseError as exc:
            problems = [str(exc)]
        if problems:
            detail = " ".join("; ".join(problems).split())  # quick_check reports over several lines
            raise IndexDirError(f"{self.path}: damaged SQLite store ({detail}); rebuild the index")

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            self._local.conn = conn
        return conn

    # reading
    def count(self) -> int:
        return self._conn().execute("SELECT count(*) FROM chunks").fetchone()[0]

    def unit_map(self) -> UnitMap:
        """Every chunk's row and unit id, as arrays (:class:`UnitMap`), read in slices."""
        cursor = self._conn().execute("SELECT row, unit_id FROM chunks ORDER BY row")
        return UnitMap.from_pairs(cursor)

    def units_of_rows(self, rows: Sequence[int]) -> tuple[list[int], list[str]]:
        """The rows of ``rows`` the store holds, and their unit ids."""
        found: list[int] = []
        units: list[str] = []
        wanted = [int(r) for r in rows]
        for start in range(0, len(wanted), 500):
            part = wanted[start : start + 500]
            query = f"SELECT row, unit_id FROM chunks WHERE row IN ({','.join('?' * len(part))})"
            for row, unit in self._conn().execute(query, part):
                found.append(row)
                units.append(unit)
        return found, units

    def chunks(self, unit_ids: Iterable[str]) -> dict[str, Chunk]:
        """The chunks of ``unit_ids`` the store holds, from the cache of those read lately where it
        has them (:mod:`engine.store.chunk_cache`); the others read in one snapshot with the version."""
        ids = list(dict.fromkeys(unit_ids))
        conn = self._conn()
        snapshot = not conn.in_transaction  # inside a write's transaction: that is the snapshot
        if snapshot:
            conn.execute("BEGIN")  # the version and the rows of one snapshot
        try:
            (version,) = conn.execute("SELECT coalesce(max(value), 0) FROM meta WHERE key = 'version'").fetchone()
            found = self._cache.found(ids, version)
            read: dict[str, Chunk] = {}
            missing = [unit for unit in ids if unit not in found]
            for start in range(0, len(missing), 500):
                part = missing[start : start + 500]
                query = _CHUNK_SELECT + f" WHERE c.unit_id IN ({','.join('?' * len(part))})"
                read.update((c.unit_id, c) for c in map(_chunk, conn.execute(query, part)))
        finally:
            if snapshot:
                conn.execute("COMMIT")
        self._cache.keep(read, version)
        return found | read

    def contents_by_row(self) -> list[tuple[int, str]]:
        """(row, contents) of every chunk, in row order."""
        query = "SELECT row, title, content FROM chunks ORDER BY row"
        return [(row, chunk_text(title, content)) for row, title, content in self._conn().execute(query)]

    def sample(self, n: int) -> list[Chunk]:
        """About ``n`` chunks spread evenly over the store, the same ones each time."""
        step = max(1, self.count() // max(n, 1))
        query = _CHUNK_SELECT + " WHERE c.row % ? = 0 ORDER BY c.row LIMIT ?"
        return [_chunk(record) for record in self._conn().execute(query, (step, n))]

    def document(self, document_id: str) -> dict | None:
        """A document as it was sent (chunks in order), or None."""
        conn = self._conn()
        head = conn.execute(
            "SELECT name, metadata, embedding_model FROM documents WHERE document_id = ?", (document_id,)
        ).fetchone()
        if head is None:
            return None
        rows = conn.execute(
            "SELECT chunk_id, content, metadata, unit_id FROM chunks WHERE document_id = ? ORDER BY position",
            (document_id,),
        )
        chunks = [{"chunk_id": c, "content": t, "metadata": json.loads(m), "doc_id": u} for c, t, m, u in rows]
        return {
            "document_id": document_id,
            "document_name": head[0],
            "metadata": json.loads(head[1]),
            "embedding_model": head[2],
            "chunks": chunks,
        }

    def rows_of(self, document_id: str) -> list[int]:
        query = "SELECT row FROM chunks WHERE document_id = ? ORDER BY row"
        return [r for (r,) in self._conn().execute(query, (document_id,))]

    def neighbors(self, unit: str, n: int) -> tuple[list[Chunk], list[Chunk]]:
        """The up to ``n`` chunks before and after ``unit`` in its document, nearest last and first,
        within its section (a chunk's metadata ``section``: the run stops where it changes)."""
        conn = self._conn()
        found = conn.execute("SELECT document_id, position FROM chunks WHERE unit_id = ?", (unit,)).fetchone()
        if found is None:
            return [], []
        document, position = found
        query = "SELECT position, unit_id FROM chunks WHERE document_id = ? AND position BETWEEN ? AND ?"
        near = dict(conn.execute(query, (document, position - n, position + n)))
        chunks = self.chunks([*near.values()])
        section = chunks[unit].metadata.get("section") if unit in chunks else None
        sides: tuple[list[Chunk], list[Chunk]] = ([], [])
        for side, step in zip(sides, (-1, 1), strict=True):
            at = position + step
            while at in near and (chunk := chunks.get(near[at])) and chunk.metadata.get("section") == section:
                side.append(chunk)
                at += step
        return sides[0][::-1], sides[1]

    def matching(self, filters: Filters) -> dict[str, int]:
        """unit id -> row of every chunk the filters allow; :class:`UnfilterableKey` for an equality
        on a key some chunk holds as an object (or another value :func:`filter_values` cannot read)."""
        self._readable(filters)
        return dict(self._conn().execute(*matching_sql(filters, bool(self.meta("fields_indexed")))))

    def _readable(self, filters: Filters) -> None:
        """:class:`UnfilterableKey` for a key of ``filters`` that some chunk holds in a shape they cannot read."""
        for key in sorted(filters.keys()):
            if self._conn().execute(_UNREADABLE_HELD, (key, UNREADABLE)).fetchone():
                raise UnfilterableKey(
                    f"filter {key!r}: some documents hold metadata.{key} as an object, a list of lists or objects"
                    " or an integer past 64 bits, which filters cannot read (they read strings, numbers, booleans"
                    " and lists of them)"
                )

    def facets(
        self, key: str, filters: Filters | None = None, rows: Sequence[int] | None = None, size: int | None = 100
    ) -> list[tuple[object, int, int]]:
        """(value, chunks, documents) of ``key``'s ``size`` (None: all) most held values among the
        chunks that ``filters`` allow (and, given, of ``rows``), most chunks first: read off
        ``chunk_fields`` by key (a list's members each count), in proportion to the chunks holding it."""
        args: list = [key]
        query = (
            "SELECT f.value, count(*), count(DISTINCT c.document_id) FROM chunk_fields f"
            " JOIN chunks c ON c.row = f.row WHERE f.key = ? AND f.value < ?"
        )
        args.append(UNREADABLE)
        if filters is not None and not filters.empty:
            self._readable(filters)
            where = _where(filters, bool(self.meta("fields_indexed")), inner := [])
            query += f" AND f.row IN (SELECT c.row FROM chunks c JOIN documents d USING (document_id) WHERE {where})"
            args += inner
        if rows is not None:
            query += f" AND f.row IN ({','.join('?' * len(rows))})"
            args += [int(r) for r in rows]
        query += " GROUP BY f.value ORDER BY count(*) DESC, f.value LIMIT ?"
        return [tuple(found) for found in self._conn().execute(query, [*args, -1 if size is None else size])]

    def plan(self, query: str, args: Sequence) -> list[str]:
        """SQLite's plan for ``query``: how it finds the rows (an index, or a scan of a table)."""
        return [detail for *_, detail in self._conn().execute(f"EXPLAIN QUERY PLAN {query}", args)]

    def meta(self, key: str, default: int = 0) -> int:
        found = self._conn().execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return found[0] if found else default

    # writing: one transaction each, so a crash leaves the store before or after, never between
    def write_document(
        self, document: dict, rows: list[int], seq: int | None = None, tokens: Sequence[TextTokens] | None = None
    ) -> None:
        """Replace ``document`` (a ``DocumentIn`` dump) whole; its chunks take ``rows`` in order, and
        ``tokens`` (of each chunk's contents) when given."""
        conn = self._conn()
        with _transaction(conn):
            _delete(conn, document["document_id"])
            _insert(conn, document, rows, tokens)
            _set_meta(conn, seq, max(rows) + 1 if rows else None)

    def write_documents(self, documents: Iterable[tuple[dict, list[int], Sequence[TextTokens] | None]]) -> None:
        """Bulk load for a build: each (document, rows, tokens), all in one transaction."""
        conn = self._conn()
        with _transaction(conn):
            top = -1
            for document, rows, tokens in documents:
                _insert(conn, document, rows, tokens)
                top = max([top, *rows])
            _set_meta(conn, None, top + 1)

    def delete_document(self, document_id: str, seq: int | None = None) -> None:
        conn = self._conn()
        with _transaction(conn):
            _delete(conn, document_id)
            _set_meta(conn, seq, None)

    def index_fields(self) -> int:
        """Fill ``chunk_fields`` in a store written before it (``compact`` does): the chunks
        indexed, 0 when they were already."""
        if self.meta("fields_indexed"):
            return 0
        conn, done = self._conn(), 0
        cursor = conn.execute("SELECT c.row, d.metadata, c.metadata FROM chunks c JOIN documents d USING (document_id)")
        with _transaction(conn):
            while batch := cursor.fetchmany(65536):
                _insert_fields(conn, ((row, json.loads(shared), json.loads(own)) for row, shared, own in batch))
                done += len(batch)
            conn.execute("INSERT OR REPLACE INTO meta VALUES ('fields_indexed', 1)")
        return done

    def checkpoint(self) -> None:
        """Fold SQLite's own WAL into the database file."""
        self._conn().execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            try:
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error as exc:  # a full disk: SQLite's own WAL keeps the writes, replayed at next open
                log.warning("%s: checkpoint at close failed (%s); SQLite replays its log at next open", self.path, exc)
            conn.close()
            self._local.conn = None


_UNREADABLE_HELD = "SELECT 1 FROM chunk_fields WHERE key = ? AND value >= ? LIMIT 1"
_CHUNK_SELECT = (
    "SELECT c.unit_id, c.document_id, c.chunk_id, c.title, c.content, d.name, d.metadata, c.metadata, c.row,"
    " t.ids, t.width, t.total, t.overrun"
    " FROM chunks c JOIN documents d USING (document_id) LEFT JOIN passage_tokens t ON t.row = c.row"
)


def matching_sql(filters: Filters, fields_indexed: bool = True) -> tuple[str, list]:
    """The query for :meth:`DocStore.matching`: document type and date through their expression
    indexes (``documents_by_type``, ``documents_by_date``; a date a valid YYYY-MM-DD, as Lucene's
    terms hold them: :func:`engine.documents.reserved_fields`), a document's chunks through
    ``chunks_of_document``, which holds what the query reads (no chunk's text is read), equality
    and operators on any other metadata key through ``chunk_fields`` (each chunk's scalars and lists'
    members, its own over its document's; :func:`_condition`), or, in a store written before that
    table, equality from every row too (the scalars its rows were limited to then); ``and``, ``or``
    and ``not`` as SQL's, a ``not`` of what a row lacks (a NULL) holding."""
    args: list = []
    query = "SELECT c.unit_id, c.row FROM chunks c JOIN documents d USING (document_id)"
    if where := _where(filters, fields_indexed, args):
        query += " WHERE " + where
    return query, args


def _where(filters: Filters, fields_indexed: bool, args: list) -> str:
    """``filters`` as one SQL condition on ``c`` and ``d`` ('' for none), its values added to ``args``."""
    where: list[str] = []
    if filters.document_types:
        where.append(
            f"json_extract(d.metadata, '$.{DOCUMENT_TYPE}') IN ({','.join('?' * len(filters.document_types))})"
        )
        args += filters.document_types
    if filters.date_range:
        start, end = filters.date_range
        day = f"json_extract(d.metadata, '$.{DATE}')"
        where.append(f"{day} IS NOT NULL AND date({day}, '+0 days') = {day}")  # not a date kept as sent
        if start:
            where.append(f"{day} >= ?")
            args.append(start.isoformat())
        if end:
            where.append(f"{day} <= ?")
            args.append(end.isoformat())
    if filters.document_ids:
        where.append(f"c.document_id IN ({','.join('?' * len(filters.document_ids))})")
        args += filters.document_ids
    for key, value in filters.equalities.items():
        fields = "c.row IN (SELECT row FROM chunk_fields WHERE key = ? AND value = ?)"
        if fields_indexed:
            where.append(fields)
            args += [key, value]
        else:
            path = "$." + json.dumps(key)
            where.append(f"(coalesce(json_extract(c.metadata, ?), json_extract(d.metadata, ?)) = ? OR {fields})")
            args += [path, path, value, key, value]
    for key, condition in filters.conditions.items():
        if not fields_indexed:
            raise UnfilterableKey(
                f"filter {key!r}: operators need the store's metadata index, which this store predates"
                " (`hybrid-search compact` writes it)"
            )
        where += _condition(key, condition, args)
    where += [f"({_where(f, fields_indexed, args) or '1'})" for f in filters.all_of]
    if filters.any_of:
        where.append("(" + " OR ".join(f"({_where(f, fields_indexed, args) or '1'})" for f in filters.any_of) + ")")
    if filters.none_of is not None:
        where.append(f"NOT coalesce(({_where(filters.none_of, fields_indexed, args) or '1'}), 0)")
    return " AND ".join(where)


def _condition(key: str, condition: Condition, args: list) -> list[str]:
    """One key's operators, each a lookup of ``chunk_fields`` by (key, value): ``in`` a set of values,
    a range one span of them. SQLite orders numbers before strings before blobs, so a numeric range
    stops below ``''`` and a date range keeps to strings that are dates (a bound day-only holds the
    whole day of a datetime). ``not_in`` and ``exists: false`` are the rows the lookup does not find."""
    held = "c.row IN (SELECT row FROM chunk_fields WHERE key = ?{})"
    found: list[str] = []
    if condition.eq is not None:
        found.append(held.format(" AND value = ?"))
        args += [key, condition.eq]
    for values, negated in ((condition.in_, ""), (condition.not_in, "NOT ")):
        if values:
            found.append(negated + held.format(f" AND value IN ({','.join('?' * len(values))})"))
            args += [key, *values]
    if bounds := condition.bounds:
        span, values = _span(bounds)
        found.append(held.format(span))
        args += [key, *values]
    if condition.exists is not None:
        found.append(("" if condition.exists else "NOT ") + held.format(""))
        args.append(key)
    return found


_OPERATORS = {"gt": ">", "gte": ">=", "lt": "<", "lte": "<="}


def _span(bounds: dict[str, int | float | str]) -> tuple[str, list]:
    """A range's SQL on ``value`` and its arguments (:func:`_condition`)."""
    if not any(isinstance(b, str) for b in bounds.values()):
        ops = [f" AND value {_OPERATORS[op]} ?" for op in bounds]
        return "".join(ops) + " AND value < ''", list(bounds.values())
    sql, values = "", []
    for op, bound in bounds.items():
        if len(str(bound)) == 10 and op in ("gt", "lte"):  # a day: past its end, or before it
            op, bound = ("gte" if op == "gt" else "lt"), str(date.fromisoformat(str(bound)) + timedelta(days=1))
        sql += f" AND value {_OPERATORS[op]} ?"
        values.append(str(bound))
    return sql + " AND value >= '' AND value < x'' AND date(value) IS NOT NULL", values


def _chunk(record: tuple) -> Chunk:
    unit, document_id, chunk_id, title, content, name, doc_meta, chunk_meta, row, *tokens = record
    metadata = {**json.loads(doc_meta), **json.loads(chunk_meta)}
    stored = TextTokens.from_blob(*tokens) if tokens[0] is not None else None
    return Chunk(unit, document_id, chunk_id, title, content, name, metadata, row, stored)


class _transaction:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind, *_: object) -> None:
        self.conn.execute("COMMIT" if kind is None else "ROLLBACK")


def _delete(conn: sqlite3.Connection, document_id: str) -> None:
    rows = "SELECT row FROM chunks WHERE document_id = ?"
    conn.execute(f"DELETE FROM passage_tokens WHERE row IN ({rows})", (document_id,))
    conn.execute(f"DELETE FROM chunk_fields WHERE row IN ({rows})", (document_id,))
    conn.execute("DELETE FROM chunks WHERE document_id = ?", (document_id,))
    conn.execute("DELETE FROM documents WHERE document_id = ?", (document_id,))


def _insert(
    conn: sqlite3.Connection, document: dict, rows: list[int], tokens: Sequence[TextTokens] | None = None
) -> None:
    doc_id, name = document["document_id"], document.get("document_name") or ""
    conn.execute(
        "INSERT INTO documents VALUES (?, ?, ?, ?)",
        (doc_id, name, json.dumps(document.get("metadata") or {}), document.get("embedding_model")),
    )
    conn.executemany(
        "INSERT INTO chunks VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [
            (
                row,
                unit_id(doc_id, c["chunk_id"]),
                doc_id,
                c["chunk_id"],
                position,
                c.get("title", name),
                c["content"],
                json.dumps(c.get("metadata") or {}),
            )
            for position, (c, row) in enumerate(zip(document["chunks"], rows, strict=True))
        ],
    )
    shared = document.get("metadata")
    _insert_fields(conn, ((row, shared, c.get("metadata")) for c, row in zip(document["chunks"], rows, strict=True)))
    if tokens is not None:
        conn.executemany(
            "INSERT INTO passage_tokens VALUES (?, ?, ?, ?, ?)",
            [(row, *t.blob()) for row, t in zip(rows, tokens, strict=True)],
        )


def _insert_fields(conn: sqlite3.Connection, chunks: Iterable[tuple[int, dict | None, dict | None]]) -> None:
    """``chunk_fields`` of each (row, its document's metadata, its own): the keys an equality
    filter can match, a string, number or boolean or each of a list's (:func:`filter_values`), the
    chunk's own over its document's (a null leaves the document's value, as ``coalesce`` did); a
    value filters cannot read is kept as :data:`UNREADABLE`."""

    def fields(row: int, shared: dict | None, own: dict | None) -> Iterator[tuple[str, object, int]]:
        merged = (shared or {}) | {k: v for k, v in (own or {}).items() if v is not None}
        for key, value in merged.items():
            if key.strip():
                values = filter_values(value)
                yield from ((key, v, row) for v in ([UNREADABLE] if values is None else values))

    conn.executemany(
        "INSERT OR IGNORE INTO chunk_fields VALUES (?, ?, ?)", [f for chunk in chunks for f in fields(*chunk)]
    )


def _set_meta(conn: sqlite3.Connection, seq: int | None, next_row: int | None) -> None:
    """A write's marks, in its transaction: the log's seq applied, the next free row, and the store's
    ``version`` (every write: what the chunk cache of every process checks)."""
    conn.execute("INSERT INTO meta VALUES ('version', 1) ON CONFLICT(key) DO UPDATE SET value = value + 1")
    if seq is not None:
        conn.execute("INSERT OR REPLACE INTO meta VALUES ('applied_seq', ?)", (seq,))
    if next_row is not None:
        conn.execute(
            "INSERT INTO meta VALUES ('next_row', ?) ON CONFLICT(key) DO UPDATE SET value = max(value, excluded.value)",
            (next_row,),
        )
