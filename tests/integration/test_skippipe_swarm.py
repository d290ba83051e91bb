"""Real SkipPipe peers (hivemind DHT + p2pd, one process each) of the tiny model on Shakespeare: 4 stages, one server
each (stage 0's is the trainer), ``skip_ratio = 0.25`` (``node_configs/runs/skippipe-tiny.toml``). The loss falls;
after the only server of a middle stage is SIGKILLed, training goes on (paths skip the lost stage); ``peerd eval``
through the live stages then names the skipped stage and still reports a loss."""

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from peerd.testing.localswarm import LOCAL, peerd_cmd

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

RUN = Path(__file__).resolve().parents[2] / "node_configs" / "runs" / "skippipe-tiny.toml"


def _mean(xs):
    return sum(xs) / len(xs)


def test_skippipe_trains_loses_a_middle_stage_and_evaluates_without_it(swarm):
    maddr = swarm.start_bootstrap()
    common = ("--device", "cpu", "--threads", "1")
    trainer = swarm.start_peer("t0", "skipreal", RUN, "--stage", "0", "--role", "trainer", *common)
    servers = {k: swarm.start_peer(f"s{k}", "skipreal", RUN, "--stage", str(k), "--role", "server", *common)
               for k in (1, 2, 3)}

    def progress():
        events = trainer.of("swarm_progress")
        return events[-1] if events else None

    swarm.wait_for(lambda: progress() is not None and progress()["completed"] >= 30, 120,
                   "30 micro-batches through the 4-stage swarm")
    before = progress()
    os.kill(servers[2].proc.pid, signal.SIGKILL)  # stage 2 has no server left
    # inference through whatever stages answer, started now so that it overlaps the training below: stage 2 is
    # gone (a stage whose servers do not answer is skipped, whether or not their records have expired yet)
    evaluation = swarm.children.start(peerd_cmd("eval", "--run-id", "skipreal", "--initial-peers", maddr,
                                                "--config", str(LOCAL), "--batches", "2", "--json"),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    swarm.wait_for(lambda: progress()["completed"] >= before["completed"] + 40, 90,
                   "40 more micro-batches after the only stage-2 server was SIGKILLed")
    after = trainer.of("swarm_progress")
    last = after[-1]
    # at most the micro-batches in flight at the kill are lost, and each one is counted
    assert last["dropped"] - before["dropped"] <= 4, (before, last)
    assert all(e["sent"] == e["completed"] + e["dropped"] for e in after), last
    losses = [e["loss"] for e in after if e["loss"] is not None]
    assert _mean(losses[-3:]) < _mean(losses[:3]) - 0.3, losses

    # the inference skipped stage 2 and named it
    stdout, stderr = evaluation.communicate(timeout=120)  # (the swarm's close kills it on a failure)
    assert evaluation.returncode == 0, stderr[-2000:]
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["skipped"] == [2] and report["path"] == [0, 1, 3], report
    assert 0 < report["nats_per_byte"] < 6, report
