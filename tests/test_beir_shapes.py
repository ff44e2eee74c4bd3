"""BEIR datasets as published: records shaped like each dataset's build, their metadata kept and
returned with their hits; scalars filter by equality, lists by membership, other shapes are refused
by name; a query's metadata (evidence objects, narratives) is never read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.main import main
from engine.documents import Filters
from engine.settings import EngineSettings
from engine.store.docstore import UnfilterableKey
from offline.dataset import DatasetError, load_dataset

# dataset: (corpus records, query records), each shaped as the dataset publishes its own; ids that
# look like numbers, titles left empty, metadata empty, flat, of lists, nested, numbers as strings
PUBLISHED: dict[str, tuple[list[dict], list[dict]]] = {
    "scifact": (
        [
            {
                "_id": "13734012",
                "title": "Zinc finger nucleases",
                "text": "zinc finger nucleases edit genomes",
                "metadata": {},
            }
        ],
        [
            {
                "_id": "2",
                "text": "zinc finger nucleases edit plant genomes",
                "metadata": {"13734012": [{"sentences": [4], "label": "SUPPORT"}]},
            }
        ],
    ),
    "fever": (
        [{"_id": "Nikolaj_Coster-Waldau", "title": "Nikolaj Coster-Waldau", "text": "danish actor and producer"}],
        [{"_id": "75397", "text": "a danish actor worked with fox", "metadata": {"label": "SUPPORTS", "evidence": []}}],
    ),
    "trec-covid": (
        [
            {
                "_id": "ug7v899j",
                "title": "Clinical features of coronavirus",
                "text": "coronavirus pneumonia clinical features fever cough",
                "metadata": {"url": "https://www.ncbi.nlm.nih.gov/pmc/articles/PMC35282/", "pubmed_id": "11472636"},
            }
        ],
        [{"_id": "1", "text": "coronavirus origin", "metadata": {"query": "coronavirus origin", "narrative": "…"}}],
    ),
    "cqadupstack": (
        [
            {
                "_id": "110886",
                "title": "Mount an external disk",
                "text": "mount an external usb disk on a macbook terminal",
                "metadata": {"tags": ["mac", "macbook", "mount"]},
            },
            {"_id": "007", "title": "", "text": "usb disk formatting on linux", "metadata": {"tags": ["linux"]}},
        ],
        [{"_id": "11457", "text": "how to mount a usb disk", "metadata": {"tags": ["mount", "usb"]}}],
    ),
    "scidocs": (
        [
            {
                "_id": "632589828c8b9fca2c3a59e97451fde8fa7d188d",
                "title": "A hybrid approach to retrieval",
                "text": "hybrid lexical and dense retrieval ranking",
                "metadata": {"authors": ["1725986", "1695689"], "year": 2011, "cited_by": [], "references": ["1e3"]},
            }
        ],
        [
            {
                "_id": "78495383450e02c5fe817e408726134b3084905d",
                "text": "dense retrieval ranking",
                "metadata": {"authors": ["1725986"], "year": 2018, "cited_by": ["12"], "references": []},
            }
        ],
    ),
    "webis-touche2020": (
        [
            {
                "_id": "c67482ba-2019-04-18T13:32:05Z-00000-000",
                "title": "Teachers and tenure",
                "text": "teacher tenure protects academic freedom in schools",
                "metadata": {"stance": "CON", "url": "https://www.debate.org/debates/Teachers-tenure/1/"},
            }
        ],
        [{"_id": "49", "text": "should teachers get tenure", "metadata": {"description": "…", "narrative": "…"}}],
    ),
    "hotpotqa": (
        [
            {
                "_id": "12",
                "title": "Anarchism",
                "text": "anarchism political philosophy",
                "metadata": {"url": "x?curid=12"},
            }
        ],
        [
            {
                "_id": "5ab6d31155429954757d3384",
                "text": "which philosophy rejects hierarchy",
                "metadata": {"answer": "anarchism", "supporting_facts": [["Anarchism", 0]], "type": "bridge"},
            }
        ],
    ),
    "nested-and-odd": (  # shapes no filter reads, and reserved keys holding what they do not mean
        [
            {
                "_id": "1e5",
                "title": "Soy and bone",
                "text": "soy isoflavones bone density in women",
                "metadata": {
                    "source": {"journal": "Bone", "volume": "12"},
                    "year": "2011",
                    "grades": [[1, 2]],
                    "extra": {},
                    "date": "Tue, 04 Jun 2019",
                    "document_type": ["review", "trial"],
                    "section": {"heading": "Results", "number": 3},
                },
            }
        ],
        [{"_id": "0", "text": "soy and bone density"}],
    ),
}


def write_published(root: Path, datasets: list[str]) -> Path:
    """A BEIR folder holding ``datasets``' records; each query judged against its dataset's first record."""
    (root / "qrels").mkdir(parents=True)
    corpus = [record for name in datasets for record in PUBLISHED[name][0]]
    queries = [(q, PUBLISHED[name][0][0]["_id"]) for name in datasets for q in PUBLISHED[name][1]]
    (root / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in corpus))
    (root / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q, _ in queries))
    judged = "".join(f"{q['_id']}\t{first}\t1\n" for q, first in queries)
    (root / "qrels" / "dev.tsv").write_text("query-id\tcorpus-id\tscore\n" + judged)
    return root


@pytest.mark.parametrize("dataset", sorted(PUBLISHED))
def test_each_datasets_records_load_as_published(tmp_path, dataset):
    root = write_published(tmp_path / dataset, [dataset])
    for stream in (False, True):
        loaded = load_dataset(root, stream=stream)
        for record in PUBLISHED[dataset][0]:
            assert loaded.corpus[record["_id"]].metadata == record.get("metadata", {})  # no ISO date to normalise
        assert {q["_id"]: q["text"] for q in PUBLISHED[dataset][1]} == loaded.queries
        assert loaded.qrels("dev")


@pytest.fixture(scope="module", params=[1, 2], ids=["one-index", "2-shards"])
def built(request, tmp_path_factory) -> Path:
    """Every dataset's records in one corpus, built by the CLI as a user would, whole and in shards
    (each shard's store answers for its own chunks)."""
    root = write_published(tmp_path_factory.mktemp("beir") / "every", sorted(PUBLISHED))
    index = root.parent / "index"
    argv = ["build", "--data", str(root), "--index-dir", str(index), "--device", "cpu"]  # no judgments: --adapt
    assert main([*argv, "--shards", str(request.param)]) == 0
    return index


@pytest.fixture(scope="module")
def shaped(built):
    from engine.search import HybridEngine

    engine = HybridEngine(EngineSettings(index_dir=built, device="cpu", rerank=False))
    yield engine
    engine.close()


def test_every_shape_builds_kept_and_returned_with_its_hits(shaped):
    for name, (corpus, _) in PUBLISHED.items():
        for record in corpus:
            assert shaped.store.document(record["_id"])["metadata"] == record.get("metadata", {}), name
    hit = shaped.search("usb disk macbook mount", 1)[0]
    assert hit.doc_id == "110886" and hit.metadata == {"tags": ["mac", "macbook", "mount"]}
    odd = shaped.search("soy isoflavones bone", 1)[0]
    assert odd.doc_id == "1e5" and odd.metadata["source"] == {"journal": "Bone", "volume": "12"}


def test_scalars_filter_by_equality_lists_by_membership_other_shapes_by_a_refusal(shaped, built, capsys):
    def found(**filters) -> set[str]:
        return {h.doc_id for h in shaped.search("disk tenure soy retrieval", 10, Filters(**filters))}

    assert found(tags="mount") == {"110886"} and found(tags="linux") == {"007"}  # a value among a list's
    assert found(authors="1695689") == {"632589828c8b9fca2c3a59e97451fde8fa7d188d"}
    assert found(stance="CON") == {"c67482ba-2019-04-18T13:32:05Z-00000-000"}
    assert found(year=2011) == {"632589828c8b9fca2c3a59e97451fde8fa7d188d"} and found(year="2011") == {"1e5"}
    assert found(cited_by="12") == set() and found(tags="mac", stance="CON") == set()
    # reserved keys holding what they do not mean are kept, and matched by neither of their filters
    assert found(document_types=["review"]) == set() == found(date_range=["2019-01-01", "2019-12-31"])
    for key in ("source", "grades", "extra"):
        with pytest.raises(UnfilterableKey, match=rf"filter '{key}': .*metadata\.{key}"):
            found(**{key: "Bone"})
    argv = ["search", "soy", "--filter", "source=Bone", "--index-dir", str(built), "--no-rerank"]
    assert main(argv) == 2 and "filter 'source'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"_id": "9", "text": "x", "metadata": NaN}\n', r"corpus.jsonl:\d+: document '9' has metadata that is not"),
        (
            '{"_id": "9", "text": "x", "metadata": {"score": [NaN]}}\n',
            r"corpus.jsonl:\d+: document '9': metadata.score",
        ),
        (
            '{"_id": "9", "text": "x", "metadata": ["tag"]}\n',
            r"corpus.jsonl:\d+: document '9' has metadata that is not",
        ),
        ('{"_id": 9, "text": "x"}\n', r"corpus.jsonl:\d+: document has no '_id'"),
        ('{"_id": "9", "metadata": {}}\n', r"corpus.jsonl:\d+: document '9' has empty text"),
        ('{"_id": "9", "text": "x"\n', r"corpus.jsonl:\d+: malformed JSON"),
    ],
)
def test_a_truly_malformed_record_still_names_file_line_and_field(tmp_path, capsys, line, message):
    root = write_published(tmp_path / "bad", ["scifact"])
    with open(root / "corpus.jsonl", "a") as fh:
        fh.write(line)
    with pytest.raises(DatasetError, match=message):
        load_dataset(root)
    assert main(["build", "--data", str(root), "--index-dir", str(tmp_path / "never")]) == 2
    assert "Traceback" not in capsys.readouterr().err
