"""Real peers on a sharded corpus: the creator splits its corpus with `peerd corpus split` and starts the run; a
joiner (without the corpus) fetches the manifest and its shards from the creator and both average in each round."""

import re
import subprocess

import pytest

from peerd.identity.key import load_or_create_identity
from peerd.testing.localswarm import TINY, peerd_cmd

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # ~30 s quiet


def test_a_joiner_trains_on_shards_it_fetched_from_the_creator(swarm, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Verse {i}: shall I compare thee to a summer's day? Thou art more lovely.\n\n"
                              for i in range(3000)))
    creator_dir = swarm.workdir / "ckpt-creator"  # the creator's --checkpoint-dir (Swarm.start_peer)
    split = subprocess.run(peerd_cmd("corpus", "split", str(corpus), "--shard-mb", "0.01", "--checkpoint-dir",
                                     str(creator_dir)), capture_output=True, text=True, timeout=300)  # a safety net
    assert split.returncode == 0, split.stderr
    line = split.stdout.strip()
    assert re.fullmatch(r'dataset = "shards:[0-9a-f]{64}"', line), split.stdout
    text = TINY.read_text().replace('dataset = "shakespeare"', line).replace("min_group_size = 1",
                                                                                 "min_group_size = 2")
    assert line in text and "min_group_size = 2" in text
    config = tmp_path / "sharded.toml"
    config.write_text(text)

    swarm.start_bootstrap()
    creator = swarm.start_peer("creator", "sharded", config)
    joiner = swarm.start_peer("joiner", "sharded", None)  # reads the published config; holds no shard
    for peer in (creator, joiner):
        assert swarm.wait_exit(peer, 240) == 0, swarm.tails()
    creator_id = load_or_create_identity(swarm.workdir / "creator.key")
    fetched = [e for e in joiner.poll_events() if e.get("message", "").startswith("fetched shard")]
    assert len(fetched) >= 2 and all(e["message"].endswith(creator_id) for e in fetched), swarm.tails()
    assert not [e for e in creator.poll_events() if e.get("message", "").startswith("fetched shard")]
    held = {p.name for p in (swarm.workdir / "ckpt-joiner" / "corpus-cache" / "shards").iterdir()}
    assert len(held) >= 3  # the manifest, a held-out shard, training shards
    for peer in (creator, joiner):
        rounds = peer.of("outer_round")
        assert [e["outer_round"] for e in rounds] == [1, 2], swarm.tails()
        assert rounds[-1]["group_size"] == 2
    assert creator.digests()[2] == joiner.digests()[2]
