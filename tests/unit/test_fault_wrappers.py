"""Faults reach the DiLoCo role through wrappers of its context (transport, checkpoint store, outer sync), never
through hooks in the role: an injected round failure rolls everyone back, a kill at the checkpoint phase fires
before the rename."""

import asyncio
from types import SimpleNamespace

import pytest

from peerd.config import NodeConfig
from peerd.testing.faults import FaultyOuterSync, Faults, instrument
from peerd.roles.base import RunContext
from peerd.roles.diloco import DiLoCoRole
from peerd.run_config import AveragingConfig, RunConfig
from peerd.transport.inprocess import Hub
from protocols.diloco import DiLoCoHyperparams

pytestmark = pytest.mark.timeout(120)


def _run() -> RunConfig:
    return RunConfig(
        model="tiny", seq_len=32, batch_size=4, eval_batches=0,
        diloco=DiLoCoHyperparams(inner_steps=2, warmup_steps=1, inner_lr=1e-3),
        averaging=AveragingConfig.from_flat(compression="none", min_group_size=2, matchmaking_timeout_s=4.0,
                                            request_timeout_s=1.0, sender_timeout_s=3.0, reducer_timeout_s=6.0),
    )


def _role(hub, name, tmp_path, faults=None) -> DiLoCoRole:
    node = NodeConfig(checkpoint_dir=str(tmp_path / name), threads=1, device="cpu")
    return DiLoCoRole(instrument(RunContext.build("wrap", _run(), node, hub.transport(name)), faults))


def test_fail_round_through_the_sync_wrapper_rolls_both_peers_back(tmp_path):
    async def main():
        hub = Hub()
        faults = Faults().fail_round(at_round=1)
        a, b = _role(hub, "peer-a", tmp_path), _role(hub, "peer-b", tmp_path, faults)
        assert isinstance(b.sync, FaultyOuterSync) and not isinstance(a.sync, FaultyOuterSync)
        for role in (a, b):
            for component in role.components:
                await component.start()
            await role.ctx.status.publish()
        start = a.outer.digest()
        for role in (a, b):
            await role.train_until_quota()
        await asyncio.gather(a.run_round(), b.run_round())
        assert faults.fired["fail_round"] >= 1
        for role in (a, b):  # everyone rolled back, bit-identically, and kept the local steps
            assert role.stats.rounds_failed == 1 and role.outer.digest() == start and role.steps_since_sync == 2
        assert a.outer.outer_round == b.outer.outer_round == 0

    asyncio.run(main())


def test_kill_at_the_checkpoint_phase_fires_between_write_and_rename(tmp_path):
    killed = []
    faults = Faults(on_kill=lambda: killed.append(True)).kill(at_round=1, phase="checkpoint")
    role = _role(Hub(), "solo", tmp_path, faults)
    role.save_checkpoint()  # round 0: nothing due
    assert not killed
    before = role.ctx.checkpoints.path.read_bytes()
    faults.round = 1
    role.steps_since_sync = 5
    role.save_checkpoint()  # the kill returns here (in-process); a real peer is SIGKILLed at this point
    assert killed == [True] and faults.fired["kill"] == 1
    assert role.ctx.checkpoints.path.read_bytes() == before  # the new checkpoint was never renamed into place
    assert role.ctx.checkpoints.load().metadata["steps_since_sync"] == 0


def test_the_sync_wrapper_tells_the_schedule_which_round_a_delayed_exchange_is():
    class Strategy:
        state = SimpleNamespace(outer=SimpleNamespace(outer_round=4))

        async def exchange(self, pseudo_gradient, weight, live, syncing, also_expect=()):
            return ("exchanged", also_expect)

    faults = Faults()
    wrapped = FaultyOuterSync(Strategy(), faults)
    assert asyncio.run(wrapped.exchange(None, 1.0, {}, frozenset(), also_expect=(3,))) == ("exchanged", (3,))
    assert faults.round == 5
