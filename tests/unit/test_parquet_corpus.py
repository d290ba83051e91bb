"""Parquet corpora: the ``text`` column, streamed one row group at a time into the same bytes and caches as the
other local formats; a file without a usable ``text`` column is a DataError naming it."""

import json

import pyarrow as pa  # the data and test extras
import pyarrow.parquet as pq
import pytest
import torch

import peerd.data.corpus
from peerd.data.corpus import DataError, load_corpus

pytestmark = pytest.mark.timeout(60)

DOCS = [f"Doc {i}: to be, or not to be \u2713 \u6f22\u5b57\r\nthat is the question." for i in range(40)]


def test_parquet_rows_are_documents_streamed_by_row_group(tmp_path, monkeypatch):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": list(range(40)), "text": DOCS}), path, row_group_size=7)  # 6 row groups
    assert pq.ParquetFile(path).num_row_groups == 6
    jsonl = tmp_path / "same.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": d}) for d in DOCS) + "\n")
    in_memory = load_corpus(str(path))
    as_jsonl = load_corpus(str(jsonl))
    assert torch.equal(in_memory.train, as_jsonl.train) and torch.equal(in_memory.eval, as_jsonl.eval)
    monkeypatch.setattr(peerd.data.corpus, "PIECE_BYTES", 61)
    streamed = load_corpus(str(path), tmp_path / "cache")  # through the memory-mapped byte cache
    assert torch.equal(streamed.train, in_memory.train) and torch.equal(streamed.eval, in_memory.eval)
    groups = []
    real = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, i, **k: groups.append(i) or real(self, i, **k))
    load_corpus(str(path))
    assert groups == list(range(6))  # one row group at a time, in order


def test_a_parquet_file_without_a_text_column_names_the_file(tmp_path):
    cases = {
        "body.parquet": (pa.table({"body": ["a", "b"]}), "no column 'text' \\(columns: body\\)"),
        "ints.parquet": (pa.table({"text": [1, 2]}), "column 'text' holds int64"),
        "null.parquet": (pa.table({"text": ["a", None, "c"]}), "row 1 of column 'text' is null"),
    }
    for name, (table, why) in cases.items():
        pq.write_table(table, tmp_path / name)
        with pytest.raises(DataError, match=f"{name}: {why}"):
            load_corpus(str(tmp_path / name))
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="broken.parquet as Parquet"):
        load_corpus(str(tmp_path / "broken.parquet"))
