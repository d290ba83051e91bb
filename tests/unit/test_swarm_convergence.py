"""A swarm with replicated stages trains like one process: the loss of an in-process swarm (2 stages x 2 servers,
stage rounds on a virtual clock) against the same stages trained in one process on the same micro-batches."""

import asyncio

import pytest

from peerd.run_config import RunConfig
from peerd.testing.swarm_convergence import (
    all_rounds_completed, convergence, micro_batches, single_process_losses, swarm_losses,
)
from protocols.diloco import DiLoCoHyperparams
from protocols.swarm import SwarmConfig

#: swarm-tiny's model and inner optimizer at 16 tokens per sequence (4x less compute per micro-batch than 64).
RUN = RunConfig(model="tiny", seq_len=16, batch_size=8, eval_batches=0, parallelism="swarm",
                swarm=SwarmConfig(stages=2, call_timeout_s=60.0, pending_timeout_s=120.0, sync_interval_s=0,
                                  rebalance_period_s=3600.0),
                diloco=DiLoCoHyperparams(inner_lr=3e-3, inner_weight_decay=0.0))
#: Long enough that an outer step with momentum on stage rounds shows (the loss stalls about 20% above the single
#: process's from about 300 micro-batches on), short enough for a unit test.
MICRO_BATCHES = 400
ROUND_EVERY = 5


@pytest.mark.long
@pytest.mark.slow  # in-process, but minutes of CPU (400 micro-batches through 4 servers and one process)
@pytest.mark.timeout(1200)
def test_a_swarm_with_two_servers_per_stage_trains_like_one_process():
    batches = micro_batches(RUN, MICRO_BATCHES)
    rounds = []
    swarm = asyncio.run(swarm_losses(RUN, batches, replicas=2, round_every=ROUND_EVERY, on_round=rounds.append))
    single = single_process_losses(RUN, batches)
    result = convergence(swarm, single)
    assert len(rounds) == MICRO_BATCHES // ROUND_EVERY and all(map(all_rounds_completed, rounds)), rounds[:3]
    assert result.last[1] < single[0] - 1.0, result  # the reference itself learned
    assert result.ratio <= 1.05, result  # last-100 mean within 5% of the single process
    assert result.max_rise <= 0.10, result  # never more than 10% above its running minimum
