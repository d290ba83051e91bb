"""``dataset = "hf:NAME"``: a Hugging Face dataset streamed with ``datasets`` (offline here: a local Parquet folder),
each peer reading the shards in its own order, documents packed into training windows."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from peerd.data.corpus import ByteTokenizer, DataError
from peerd.data.hf_stream import HfBatches, open_stream, parse_hf_spec, peer_documents
from peerd.data.shards import shard_order
from peerd.run_config import RunConfig

pytestmark = pytest.mark.timeout(120)


def test_each_peer_streams_the_shards_of_a_parquet_folder_in_its_own_order(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # nothing from this machine's cache
    folder = tmp_path / "corpus"
    folder.mkdir()
    for f in range(4):
        pq.write_table(pa.table({"text": [f"file {f} doc {i}." for i in range(10)]}), folder / f"part-{f}.parquet")
    assert parse_hf_spec(f"hf:{folder}") == str(folder) and parse_hf_spec("shakespeare") is None
    assert RunConfig(dataset=f"hf:{folder}").dataset == f"hf:{folder}"

    stream = open_stream(str(folder))
    assert stream.num_shards == 4
    firsts = {}
    for peer in ("peer-a", "peer-b", "peer-c"):
        docs = peer_documents(stream, peer, 0)
        texts = [next(docs) for _ in range(41)]
        files = [int(t.split()[1]) for t in texts[::10]]
        assert files[:4] == shard_order(4, peer, 0)  # whole shards, one after another, in this peer's order
        assert sorted(texts[:40]) == sorted(f"file {f} doc {i}." for f in range(4) for i in range(10))
        assert texts[40] == texts[0]  # the next epoch starts over in the same order
        firsts[peer] = tuple(files[:4])
    assert len(set(firsts.values())) > 1

    batches = HfBatches(str(folder), ByteTokenizer, seq_len=8, batch_size=3, peer_id="peer-a", seed=0)
    x, y = batches.next_batch()
    assert x.shape == y.shape == (3, 8) and bool((x[:, 1:] == y[:, :-1]).all())
    first = shard_order(4, "peer-a", 0)[0]
    text = "".join(f"file {first} doc {i}.\n\n" for i in range(3))  # packed: each document, then the separator
    assert [ByteTokenizer.decode(row) for row in x] == [text[k * 9:k * 9 + 8] for k in range(3)]
    with pytest.raises(DataError):
        open_stream(str(tmp_path / "missing"))
