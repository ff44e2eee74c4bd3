import json

import pytest

from offline.dataset import DatasetError, fingerprint, load_dataset
from tests.helpers import write_beir


def test_loads_crlf_files_and_missing_titles(beir_dir):
    ds = load_dataset(beir_dir)
    assert len(ds.corpus) == 32 and len(ds.queries) == 16
    assert ds.corpus["D-soy-3"].title == ""
    assert ds.corpus["D-soy-0"].contents.startswith("Soy report 0 soy isoflavones")
    assert ds.qrels("dev")["Q-dev-soy"] == {"D-soy-0": 2, "D-soy-1": 1}
    assert set(ds.split_queries("dev")) == {
        f"Q-dev-{t}" for t in ("vitamin", "statin", "soy", "coffee", "broccoli", "arsenic", "meat", "berries")
    }
    assert ds.splits() == ["dev", "train"]
    assert len(fingerprint(beir_dir)) == 64


def _broken(tmp_path, file, content):
    root = write_beir(tmp_path / "ds")
    with open(root / file, "a", newline="") as fh:
        fh.write(content)
    return root


@pytest.mark.parametrize(
    "file, line, message",
    [
        ("corpus.jsonl", "{not json\n", "malformed JSON"),
        ("corpus.jsonl", json.dumps({"_id": "D-soy-0", "text": "again"}) + "\n", "duplicate document id 'D-soy-0'"),
        ("corpus.jsonl", json.dumps({"_id": "D-empty", "title": "", "text": "  "}) + "\n", "empty text"),
        ("corpus.jsonl", json.dumps({"title": "x", "text": "y"}) + "\n", "has no '_id'"),
        ("corpus.jsonl", "[1, 2]\n", "expected a JSON object"),
        ("queries.jsonl", json.dumps({"_id": "Q-dev-soy", "text": "dup"}) + "\n", "duplicate query id"),
    ],
)
def test_bad_jsonl_names_file_line_and_problem(tmp_path, file, line, message):
    root = _broken(tmp_path, file, line)
    with pytest.raises(DatasetError) as err:
        load_dataset(root)
    assert message in str(err.value)
    assert f"{file}:" in str(err.value)


@pytest.mark.parametrize(
    "row, message",
    [
        ("Q-dev-soy\tD-nope\t1\r\n", "unknown document id 'D-nope'"),
        ("Q-nope\tD-soy-0\t1\r\n", "unknown query id 'Q-nope'"),
        ("Q-dev-soy\tD-soy-0\thigh\r\n", "is not an integer"),
        ("Q-dev-soy\tD-soy-0\r\n", "expected 3 tab-separated columns"),
    ],
)
def test_bad_judgments_name_file_and_line(tmp_path, row, message):
    root = _broken(tmp_path, "qrels/dev.tsv", row)
    ds = load_dataset(root)
    with pytest.raises(DatasetError) as err:
        ds.qrels("dev")
    assert message in str(err.value) and "dev.tsv:18" in str(err.value)


def test_missing_things_are_named(tmp_path, beir_dir):
    with pytest.raises(DatasetError, match="dataset folder not found"):
        load_dataset(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="corpus.jsonl: file not found"):
        load_dataset(tmp_path / "empty")
    with pytest.raises(DatasetError, match=r"no judgments for split 'test' \(present: dev, train\)"):
        load_dataset(beir_dir).qrels("test")


def test_a_streamed_corpus_reads_the_same_documents_from_the_file(beir_dir):
    held, streamed = load_dataset(beir_dir), load_dataset(beir_dir, stream=True)
    assert list(streamed.corpus) == list(held.corpus) and len(streamed.corpus) == len(held.corpus)
    assert list(streamed.corpus.values()) == list(held.corpus.values())  # CRLF lines and missing titles alike
    assert streamed.corpus["D-soy-3"] == held.corpus["D-soy-3"] and "D-nothing" not in streamed.corpus
    assert streamed.corpus.rows(5, 9) == list(held.corpus.values())[5:9] and streamed.corpus.rows(3, 3) == []
    assert streamed.qrels("dev") == held.qrels("dev")  # judgments checked against the ids alone


def test_a_streamed_corpus_refuses_what_a_held_one_does(tmp_path):
    root = _broken(tmp_path, "corpus.jsonl", json.dumps({"_id": "D-soy-0", "text": "again"}) + "\n")
    with pytest.raises(DatasetError, match=r"corpus.jsonl:\d+: duplicate document id 'D-soy-0'"):
        load_dataset(root, stream=True)
    (root / "corpus.jsonl").write_bytes(b'{"_id": "D-x", "text": "caf\xe9"}\n')
    with pytest.raises(DatasetError, match=r"corpus.jsonl:1: not UTF-8"):
        load_dataset(root, stream=True)


def test_a_records_metadata_is_kept_its_date_as_date_range_reads_it(tmp_path):
    root = _broken(tmp_path, "corpus.jsonl", json.dumps({"_id": "D-m", "text": "t", "metadata": {"date": "2024-5-1"}}))
    assert load_dataset(root).corpus["D-m"].metadata == {"date": "2024-5-1"}  # not a date: kept, never in a range
    (root / "corpus.jsonl").write_text(
        json.dumps({"_id": "D-m", "text": "t", "metadata": {"date": "2024-05-01T08:00Z", "document_type": "review"}})
        + "\n"
    )
    for stream in (False, True):
        assert load_dataset(root, stream=stream).corpus["D-m"].metadata == {
            "date": "2024-05-01",
            "document_type": "review",
        }
