"""Run ids on real processes: the creator of a run started with a plain name advises joiners to use
``name@<its PeerID prefix>``; a joiner that does so trains in the same group (DHT keys derive from the name alone),
while a joiner naming another creator is refused (exit 1, a line naming both PeerIDs)."""

import re

import pytest

from peerd.identity.key import load_or_create_identity
from peerd.testing.localswarm import TINY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_the_advised_named_run_id_joins_the_creators_run_and_another_creator_is_refused(swarm, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(TINY.read_text().replace("max_outer_rounds = 2", "max_outer_rounds = 5")
                      .replace("inner_steps = 10", "inner_steps = 40").replace("eval_batches = 4", "eval_batches = 0"))
    swarm.start_bootstrap()
    creator = swarm.start_peer("creator", "demo", config)
    swarm.wait_for(lambda: bool(creator.of("config_published")), 120, "the creator to publish the run config")
    creator_id = load_or_create_identity(tmp_path / "creator.key")
    message = creator.of("config_published")[0]["message"]
    advised = re.search(r"give the run id (\S+) accept", message).group(1)
    assert advised == f"demo@{creator_id[:24]}", message

    joiner = swarm.start_peer("joiner", advised, None)
    other_id = load_or_create_identity(tmp_path / "other.key")
    wrong = swarm.start_peer("wrong", f"demo@{other_id}", None)

    assert swarm.wait_exit(wrong, 120) == 1, swarm.tails()
    refusal = [line for line in wrong.log.read_text().splitlines() if "accepts only a configuration" in line]
    assert len(refusal) == 1 and other_id in refusal[0] and creator_id in refusal[0], swarm.tails()
    for peer in (creator, joiner):
        assert swarm.wait_exit(peer, 200) == 0, swarm.tails()
    joined = [e["outer_round"] for e in joiner.of("outer_round") if e["group_size"] == 2]
    assert joined, swarm.tails()
    for round_ in joined:  # the same group: bit-identical theta_outer after each round they averaged together
        assert creator.digests()[round_] == joiner.digests()[round_], round_
    assert joiner.digests()[5] == creator.digests()[5]
