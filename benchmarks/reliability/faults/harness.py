"""What every fault scenario stands on: a copy of the index to break (never the index itself), the
server's REST routes in this process for the checks after a fault (no ten-second start), the
documents the writers send, and the ledger that holds what a client was told against what the
server shows afterwards: the one place "lost", "half-applied" and "resurrected" are decided."""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from benchmarks.reliability.faults.results import WriteCounts

if TYPE_CHECKING:
    from starlette.testclient import TestClient

    from serving.search_service import SearchService

QUERIES = ["does vitamin D prevent falls", "statins and breast cancer", "soy and prostate cancer", "coffee and liver"]


def document(doc_id: str, text: str) -> dict[str, Any]:
    """A two-chunk document (a half-applied write would show one chunk, or a mix)."""
    return {
        "document_id": doc_id,
        "document_name": f"{doc_id}.txt",
        "chunks": [{"chunk_id": "c1", "content": text}, {"chunk_id": "c2", "content": f"{text} continued"}],
    }


def copy_index(index_dir: Path, target: Path) -> Path:
    """``index_dir`` copied to ``target`` (replacing what was there), without its writer lock."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(index_dir, target, ignore=shutil.ignore_patterns("writer.lock"))
    return target


@contextmanager
def in_process(
    index: Path, work_dir: Path, writable: bool = False, **settings: Any
) -> Iterator[tuple[TestClient, SearchService]]:
    """The REST routes of a server on ``index``, in this process (no ten-second start): a client
    for them and the SearchService behind it, closed (checkpointed) on exit."""
    from starlette.testclient import TestClient

    from serving.app import http_app
    from serving.search_service import SearchService
    from serving.settings import Settings

    config = Settings(index_dir=index, device="cpu", trace_db=work_dir / "traces.sqlite", **settings)
    service = SearchService(config, writable=writable)
    try:
        yield TestClient(http_app(service)), service
    finally:
        service.close()


@dataclass
class Ledger:
    """What a client was told: acknowledged documents (id -> the word only they hold), deletes, and
    writes a kill cut short (either outcome is right for those, but not half of one)."""

    acked: dict[str, str] = field(default_factory=dict)
    deleted: set[str] = field(default_factory=set)
    in_doubt: set[str] = field(default_factory=set)
    writes: int = 0
    lost: set[str] = field(default_factory=set)  # what checks found wrong, by document id
    half_applied: set[str] = field(default_factory=set)
    resurrected: set[str] = field(default_factory=set)

    def counts(self) -> WriteCounts:
        """What the results file says of the writes: how many were acknowledged, and how many went wrong."""
        return WriteCounts(
            acknowledged=self.writes,
            acknowledged_deletes=len(self.deleted),
            in_doubt=len(self.in_doubt),
            lost=len(self.lost),
            half_applied=len(self.half_applied),
            resurrected=len(self.resurrected),
        )

    def check(self, client: httpx.Client, search: Iterable[str]) -> None:
        """Note what the server lost: acknowledged documents it cannot show by id (``lost``) or not
        whole (``half_applied``: not two chunks), those of ``search`` their own word does not find
        (``lost``), and deleted ones that came back (``resurrected``)."""
        found = {d: client.get(f"/documents/{d}") for d in [*self.acked, *self.deleted, *self.in_doubt]}
        chunks = {d: len(r.json()["chunks"]) for d, r in found.items() if r.status_code == 200}
        self.lost |= {d for d in self.acked if d not in chunks}
        for doc_id in search:
            hits = client.post("/search", json={"query": self.acked[doc_id], "top_k": 5}).json()["results"]
            if doc_id not in {h["document_id"] for h in hits}:
                self.lost.add(doc_id)
        self.half_applied |= {d for d in [*self.acked, *self.in_doubt] if chunks.get(d, 2) != 2}
        self.resurrected |= {d for d in self.deleted if d in chunks}
