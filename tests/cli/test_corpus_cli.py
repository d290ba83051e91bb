"""``peerd corpus split``: the creator's corpus into the node's shard store, and the run-config line naming it."""

import re

import pytest

from peerd.commands.main import main
from peerd.data.shards import ShardStore, split_corpus

pytestmark = pytest.mark.timeout(120)


def test_split_prints_the_dataset_line_of_the_stored_manifest(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Document {i}: to be or not to be.\n\n" for i in range(800)))
    node = tmp_path / "node"
    assert main(["corpus", "split", str(corpus), "--shard-mb", "0.004", "--checkpoint-dir", str(node)]) == 0
    out, err = capsys.readouterr()
    line = out.strip()
    match = re.fullmatch(r'dataset = "(shards:[0-9a-f]{64})"', line)
    assert match, out
    # the same manifest split_corpus makes, stored where the daemon serves it from
    expected = split_corpus(str(corpus), ShardStore(tmp_path / "check"), int(0.004 * (1 << 20)))
    assert match.group(1) == expected.spec
    store = ShardStore(node / "corpus-cache" / "shards")
    assert store.manifest(expected.digest) == expected
    assert all(store.has(d) for d, _ in expected.train + expected.eval)
    assert f"into {len(expected.train)} training shards" in err and str(store.root) in err


@pytest.mark.parametrize("args, code, needle", [
    (["corpus", "split", "{tmp}/missing.txt"], 1, "no text files match"),
    (["corpus", "split", "{tmp}/x.txt", "--shard-mb", "0"], 2, "--shard-mb"),
    (["corpus", "split", "{tmp}/x.txt", "--shard-mb", "lots"], 2, "--shard-mb"),
    (["corpus", "split"], 2, "PATH|GLOB"),
])
def test_a_bad_corpus_or_flag_exits_non_zero_in_one_line(tmp_path, capsys, args, code, needle):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args] + ["--checkpoint-dir", str(tmp_path / "node")]
    assert main(argv) == code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert not out and len(lines) == 1 and needle in lines[0] and lines[0].startswith("peerd corpus"), err
    assert not (tmp_path / "node" / "corpus-cache" / "shards").exists()
