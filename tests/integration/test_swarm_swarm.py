"""Real SWARM peers (hivemind DHT + p2pd, one process each): 2 stages x 2 servers of the tiny model on Shakespeare,
one of the stage-0 servers the trainer. The loss falls, a stage's replicas agree after a stage round, and after a
stage-1 server is SIGKILLed training goes on through its replica with the retried / dropped counts reported."""

import os
import signal
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

RUN = Path(__file__).resolve().parents[2] / "node_configs" / "runs" / "swarm-tiny.toml"


def _mean(xs):
    return sum(xs) / len(xs)


def test_two_stages_of_two_servers_train_agree_and_survive_a_sigkill(swarm):
    swarm.start_bootstrap()
    trainer = swarm.start_peer("t0", "swarmreal", RUN, "--stage", "0", "--role", "trainer", "--device", "cpu",
                               "--threads", "1")
    servers = [swarm.start_peer(name, "swarmreal", RUN, "--stage", str(stage), "--role", "server", "--device", "cpu",
                                "--threads", "1")
               for name, stage in (("s0", 0), ("s1a", 1), ("s1b", 1))]
    s1a, s1b = servers[1], servers[2]

    def agreed_round():
        a = {e["outer_round"]: e["digest"] for e in s1a.of("stage_round") if e["group_size"] == 2}
        b = {e["outer_round"]: e["digest"] for e in s1b.of("stage_round") if e["group_size"] == 2}
        return sorted(set(a) & set(b)), a, b

    swarm.wait_for(lambda: agreed_round()[0] and trainer.of("swarm_progress"), 75,
                   "a stage-1 round with both replicas, and the trainer's first counts")
    rounds, a, b = agreed_round()
    assert all(a[r] == b[r] for r in rounds), (a, b)
    before = trainer.of("swarm_progress")[-1]
    assert before["completed"] > 0, before

    os.kill(s1b.proc.pid, signal.SIGKILL)
    swarm.wait_for(lambda: trainer.of("swarm_progress")[-1]["completed"] >= before["completed"] + 30, 45,
                   "30 more micro-batches after the SIGKILL")
    after = trainer.of("swarm_progress")
    last = after[-1]
    # the killed server's calls were re-sent to its replica (or counted as dropped), not lost
    assert last["retried"] + last["dropped"] > before["retried"] + before["dropped"], (before, last)
    # published between micro-batches: every one sent has ended, completed or counted as dropped
    assert all(e["sent"] == e["completed"] + e["dropped"] for e in after), after[-1]
    losses = [e["loss"] for e in after if e["loss"] is not None]
    assert _mean(losses[-3:]) < _mean(losses[:3]) - 0.3, losses
