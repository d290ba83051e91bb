"""Evaluation every ``eval_every`` rounds, in the background (``background_eval``), and checkpoint writes off the
training thread (``background_checkpoint``), on in-process DiLoCo workers."""

import asyncio

import pytest
import torch

from peerd.config import ConfigError, NodeConfig
from peerd.events import Evaluated, RoundDone
from peerd.roles.base import RunContext
from peerd.roles.diloco import DiLoCoRole
from peerd.run_config import AveragingConfig, RunConfig
from peerd.transport.inprocess import Hub
from protocols.diloco import DiLoCoHyperparams

pytestmark = pytest.mark.timeout(120)


def _run(**diloco) -> RunConfig:
    return RunConfig(
        model="tiny", seq_len=32, batch_size=4, eval_batches=2, eval_every=2, max_outer_rounds=3,
        diloco=DiLoCoHyperparams(inner_steps=2, warmup_steps=2, inner_lr=1e-3, **diloco),
        averaging=AveragingConfig.from_flat(min_group_size=2, matchmaking_timeout_s=4.0, request_timeout_s=1.0,
                                            sender_timeout_s=3.0, reducer_timeout_s=6.0),
    )


def _worker(hub, name, run, tmp_path, background: bool) -> tuple[DiLoCoRole, list]:
    node = NodeConfig(checkpoint_dir=str(tmp_path / name), threads=1, device="cpu", background_eval=background,
                      background_checkpoint=background)
    role = DiLoCoRole(RunContext.build("unit", run, node, hub.transport(name)))
    events = []
    role.ctx.events.subscribe(events.append)
    return role, events


def test_eval_every_and_straggler_are_fingerprint_neutral_at_their_defaults_and_validated():
    base = RunConfig(model="tiny")
    assert RunConfig(model="tiny", diloco=DiLoCoHyperparams(straggler="drop")).fingerprint() == base.fingerprint()
    with pytest.raises(ValueError, match="straggler"):
        DiLoCoHyperparams(straggler="wait")
    with pytest.raises(ConfigError, match="straggler"):
        RunConfig(diloco=DiLoCoHyperparams(straggler="carry", overlap="delayed"))
    assert RunConfig(model="tiny", eval_every=1).fingerprint() == base.fingerprint()
    assert "eval_every" not in base.fingerprint_dict()
    assert RunConfig(model="tiny", eval_every=5).fingerprint() != base.fingerprint()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="eval_every"):
            RunConfig(eval_every=bad)


@pytest.mark.parametrize("diloco", [{}, {"overlap": "delayed"}, {"fragments": 2}], ids=["none", "delayed", "F2"])
def test_background_eval_and_checkpoint_match_the_foreground_ones(diloco, tmp_path):
    async def main():
        hub = Hub()
        run = _run(**diloco)
        (a, a_events), (b, b_events) = (_worker(hub, "peer-a", run, tmp_path, True),
                                        _worker(hub, "peer-b", run, tmp_path, False))
        await asyncio.gather(a.run(), b.run())
        assert a.outer.outer_round == b.outer.outer_round == 3 and a.digest() == b.digest()
        fg = {e.outer_round: e.eval_nats_per_byte for e in b_events if isinstance(e, RoundDone)}
        assert set(fg) == {1, 2, 3} and fg[1] is None and None not in (fg[2], fg[3])  # every 2nd round, and the last
        assert all(e.eval_nats_per_byte is None for e in a_events if isinstance(e, RoundDone))
        bg = {e.outer_round: e.eval_nats_per_byte for e in a_events if isinstance(e, Evaluated) and e.outer_round}
        assert set(bg) == {2, 3}
        for r in (2, 3):  # the copy evaluated in the background is theta_outer, as the foreground evaluation
            assert bg[r] == pytest.approx(fg[r], rel=1e-6)
        assert a.writer is None  # the writer thread finished with the final checkpoint
        again, _ = _worker(Hub(), "peer-a", run, tmp_path, True)
        again.resume()
        assert again.digest() == a.digest() and again.outer.outer_round == 3

    asyncio.run(main())


def test_a_straggler_carries_its_missed_rounds_pseudo_gradient_into_the_next_round(tmp_path):
    from protocols.diloco import flatten_parameters

    async def main():
        hub = Hub()
        run = RunConfig(
            model="tiny", seq_len=32, batch_size=4, eval_batches=0,
            diloco=DiLoCoHyperparams(inner_steps=2, warmup_steps=2, inner_lr=1e-3, straggler="carry"),
            averaging=AveragingConfig.from_flat(min_group_size=1, matchmaking_timeout_s=1.0, request_timeout_s=0.5,
                                                sender_timeout_s=3.0, reducer_timeout_s=6.0))
        (a, _), (b, b_events) = (_worker(hub, "peer-a", run, tmp_path, False),
                                 _worker(hub, "peer-b", run, tmp_path, False))
        for w in (a, b):
            for component in w.components:
                await component.start()
            await w.publish_status()
        await a.train_until_quota()
        await a.run_round()  # b is late: the deadline passes and a's round goes on without it
        assert a.outer.outer_round == 1
        await b.train_until_quota()
        missed = b.outer.theta - flatten_parameters(b.model)  # b's pseudo-gradient of the round it missed
        await b.run_round()  # b adopts a's state and keeps its pseudo-gradient
        assert b.outer.digest() == a.outer.digest()
        assert torch.equal(flatten_parameters(b.model), a.outer.theta - missed)
        assert b.samples_since_sync == 8  # its 2 steps of batch 4 weigh in the next round
        for w in (a, b):
            await w.train_until_quota()
        await asyncio.gather(a.run_round(), b.run_round())
        assert a.outer.outer_round == b.outer.outer_round == 2 and a.outer.digest() == b.outer.digest()
        done = [e for e in b_events if isinstance(e, RoundDone)]
        assert done[-1].weight == 16.0  # the missed round's 8 samples and this round's 8
        for w in (a, b):
            for component in w.components:
                await component.stop()

    asyncio.run(main())


def test_checkpoints_and_evaluations_leave_the_round_by_default_where_a_gpu_trains(tmp_path):
    from peerd.hardware.devices import off_the_round

    assert NodeConfig().background_checkpoint is None and NodeConfig().background_eval is None
    assert off_the_round(None, torch.device("cuda", 0)) and off_the_round(None, torch.device("mps"))
    assert not off_the_round(None, torch.device("cpu"))
    assert not off_the_round(False, torch.device("cuda", 0)) and off_the_round(True, torch.device("cpu"))
    run = _run()
    default = DiLoCoRole(RunContext.build("unit", run, NodeConfig(checkpoint_dir=str(tmp_path / "a"), threads=1,
                                                                   device="cpu"), Hub().transport("a")))
    assert default.writer is None  # a CPU peer writes in the foreground unless told otherwise
    chosen, _ = _worker(Hub(), "b", run, tmp_path, True)
    assert chosen.writer is not None


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_a_background_snapshot_holds_the_values_of_when_it_was_taken(device):
    from peerd.worker.checkpointing import HostSnapshot

    snapshot = HostSnapshot()
    state = {"inner.0.exp_avg": torch.arange(6.0, device=device), "inner.0.step": torch.tensor(3.0)}
    copies, ready = snapshot.take(state, reuse=True)
    state["inner.0.exp_avg"].mul_(10)  # the next inner step changes the optimizer's state in place
    state["inner.0.step"].add_(1)
    ready()
    assert copies["inner.0.exp_avg"].device.type == "cpu"
    assert torch.equal(copies["inner.0.exp_avg"], torch.arange(6.0)) and copies["inner.0.step"].item() == 3.0
    again, ready = snapshot.take(state, reuse=True)
    ready()
    assert torch.equal(again["inner.0.exp_avg"], torch.arange(6.0) * 10)
    # a write still reading the last snapshot keeps it: the next one goes to fresh buffers
    held, ready = snapshot.take(state, reuse=False)
    ready()
    assert held["inner.0.exp_avg"].data_ptr() != again["inner.0.exp_avg"].data_ptr()
    assert torch.equal(again["inner.0.exp_avg"], torch.arange(6.0) * 10)
    if device == "cuda":  # page-locked buffers kept from one snapshot to the next while their writes finished
        assert held["inner.0.exp_avg"].is_pinned()
        reused, ready = snapshot.take(state, reuse=True)
        ready()
        assert reused["inner.0.exp_avg"].data_ptr() == held["inner.0.exp_avg"].data_ptr()
