"""``POST /v1/rerank`` and ``/v2/rerank``: the served cross-encoder on a caller's own candidates, in
Cohere's request and reply shape, so that a RAG stack already written against Cohere's rerank (its
official client pointed here) scores with this reranker: on CUDA the same batches, and with
``serve --workers N`` the same reranker process, as searches.

What is Cohere's and what is ours: ``query``, ``documents`` (strings, or objects with ``text`` whose
other fields come back as sent), ``top_n``, ``return_documents`` and ``rank_fields`` (which of an
object's fields are ranked, joined in that order) are Cohere's; ``model`` is taken and ignored (this
server serves one reranker, named in ``/health``), as is ``max_chunks_per_doc`` (a document is read
up to the reranker's window, as in a search). Scores are the model's own in [0, 1].
"""

from __future__ import annotations

import uuid
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from engine.documents import MAX_QUERY_CHARS

PATHS = ("/v1/rerank", "/v2/rerank")  # Cohere's client calls v1 (Client) or v2 (ClientV2)
MAX_DOCUMENTS = 1000  # Cohere's advice for one call; more is a 422, not a minute's wait
Text = Annotated[str, StringConstraints(min_length=1)]


class RerankDocument(BaseModel):
    """A document as an object: its ``text`` (Cohere requires it), other fields kept as sent and read
    where ``rank_fields`` names them."""

    model_config = ConfigDict(extra="allow")

    text: str


class RerankRequest(BaseModel):
    """Cohere's rerank request (v1 and v2)."""

    model_config = ConfigDict(extra="forbid")

    query: Annotated[str, StringConstraints(min_length=1, max_length=MAX_QUERY_CHARS)] = Field(
        description="what the documents are ranked for"
    )
    documents: list[Text | RerankDocument] = Field(
        min_length=1, max_length=MAX_DOCUMENTS, description="the candidates: strings, or objects with text"
    )
    top_n: int | None = Field(None, ge=1, description="how many results (default: every document)")
    return_documents: bool = Field(False, description="each result carries its document")
    rank_fields: list[Text] | None = Field(None, min_length=1, description="an object's fields ranked, in order")
    model: str | None = Field(None, description="taken and ignored: this server serves one reranker")
    max_chunks_per_doc: int | None = Field(None, ge=1, description="taken and ignored: a document is read up to the window")

    def texts(self) -> list[str]:
        """What the reranker reads of each document: its text, or the ``rank_fields`` it has, in
        that order, each as ``name: value`` (a field a document lacks is left out)."""
        if not self.rank_fields:
            return [d if isinstance(d, str) else d.text for d in self.documents]
        return [d if isinstance(d, str) else _ranked(d, self.rank_fields) for d in self.documents]


def _ranked(document: RerankDocument, fields: list[str]) -> str:
    values = {"text": document.text, **(document.model_extra or {})}
    return "\n".join(f"{name}: {values[name]}" for name in fields if values.get(name) is not None)


class RerankResult(BaseModel):
    index: int = Field(description="the document's position in the request")
    relevance_score: float
    document: dict | None = Field(None, description="with return_documents: the document as sent ({text} for a string)")


class RerankReply(BaseModel):
    id: str
    results: list[RerankResult] = Field(description="best first, at most top_n")
    meta: dict


def reply(request: RerankRequest, scores: list[float], version: str) -> RerankReply:
    """The ranked results of ``scores`` (one a document), Cohere's way."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: request.top_n]
    results = [
        RerankResult(index=i, relevance_score=scores[i], document=_as_sent(request.documents[i]) if request.return_documents else None)
        for i in order
    ]
    meta = {"api_version": {"version": version}, "billed_units": {"search_units": 1}}
    return RerankReply(id=str(uuid.uuid4()), results=results, meta=meta)


def _as_sent(document: str | RerankDocument) -> dict:
    return {"text": document} if isinstance(document, str) else document.model_dump(exclude_none=True)
