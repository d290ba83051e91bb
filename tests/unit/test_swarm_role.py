"""The SWARM role in-process: joining servers fill the bottleneck stage, announce, and a trainer trains."""

import asyncio

import pytest

from peerd.config import NodeConfig
from peerd.roles.base import RunContext, role_class
from peerd.roles.swarm import SwarmRole, read_stage_servers
from peerd.run_config import RunConfig
from peerd.transport.inprocess import Hub
from protocols.diloco import DiLoCoHyperparams
from protocols.swarm import StageAnnouncement, SwarmConfig

pytestmark = pytest.mark.timeout(120)

STEPS = 25


def _run() -> RunConfig:
    return RunConfig(model="tiny", seq_len=64, batch_size=8, eval_batches=0, parallelism="swarm",
                     swarm=SwarmConfig(stages=2, call_timeout_s=10.0, pending_timeout_s=30.0),
                     diloco=DiLoCoHyperparams(inner_lr=3e-3, inner_weight_decay=0.0))


def test_swarm_role_is_registered():
    assert role_class("swarm") is SwarmRole


def test_announcements_from_peers_are_validated():
    assert StageAnnouncement.parse({"stage": 1, "throughput": 2.5, "load": 3}, 2) == StageAnnouncement(1, 2.5, 3)
    for bad in ({"stage": 2}, {"stage": True}, {"stage": 0, "throughput": float("nan")}, {"stage": 0, "load": -1},
                {"stage": 0, "throughput": -1.0}, [0], None):
        assert StageAnnouncement.parse(bad, 2) is None, bad


def test_servers_join_the_bottleneck_and_the_trainers_train(tmp_path, monkeypatch):
    """Joining servers fill the bottleneck stage and the trainers train through them; each peer moves its long-lived
    heap out of the garbage collector's walk once, when its stage serves."""
    import peerd.roles.swarm as swarm_role

    frozen = []
    monkeypatch.setattr(swarm_role, "freeze_heap", lambda: frozen.append(1) or 1)

    async def main():
        hub = Hub()
        run = _run()
        stop = asyncio.Event()
        roles, tasks = [], []
        for i in range(4):
            node = NodeConfig(checkpoint_dir=str(tmp_path / f"p{i}"), threads=1, device="cpu",
                              status_interval_s=0.5, status_ttl_s=5.0)
            ctx = RunContext.build("swarmunit", run, node, hub.transport(f"p{i}"), stop=stop)
            role = SwarmRole(ctx, max_steps=STEPS)
            roles.append(role)
            tasks.append(asyncio.ensure_future(role.run(ctx)))
            while role.service is None:  # joined and announced before the next peer looks
                await asyncio.sleep(0.01)
            await role.announce()
        assert [r.stage for r in roles] == [0, 1, 0, 1]
        view = await read_stage_servers(roles[0].ctx)
        assert {p: a.stage for p, a in view.items()} == {"p0": 0, "p1": 1, "p2": 0, "p3": 1}
        trainers = [tasks[0], tasks[2]]
        await asyncio.wait_for(asyncio.gather(*trainers), 90)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return roles

    roles = asyncio.run(main())
    for trainer in (roles[0], roles[2]):
        stats = trainer.wiring.stats
        assert stats.completed == STEPS and stats.dropped == 0, stats
        losses = trainer.losses
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses
    # both servers of the last stage took micro-batches from the trainers
    assert all(r.service.backwards >= 5 for r in roles[1::2])
    assert len(frozen) == 4


async def _start_servers(hub, tmp_path, run, stages, stop, prefix="p", status_interval_s=0.5):
    roles, tasks = [], []
    for i, stage in enumerate(stages):
        node = NodeConfig(checkpoint_dir=str(tmp_path / f"{prefix}{i}"), threads=1, device="cpu",
                          status_interval_s=status_interval_s, status_ttl_s=max(5.0, 2 * status_interval_s))
        ctx = RunContext.build("swarmunit", run, node, hub.transport(f"{prefix}{i}"), stop=stop)
        role = SwarmRole(ctx, stage=stage, trainer=False)
        roles.append(role)
        tasks.append(asyncio.ensure_future(role.run(ctx)))
        while role.service is None:
            await asyncio.sleep(0.01)
        await role.announce()
    return roles, tasks


def test_three_plus_one_servers_rebalance_to_two_plus_two(tmp_path):
    """A mover starts from the current parameters of a live server of its new stage."""
    import dataclasses

    import torch

    from protocols.stage_service import flat_parameters

    async def main():
        hub, stop = Hub(), asyncio.Event()
        # no stage rounds (they start at wall-clock multiples of sync_interval_s and would move the parameters)
        run = dataclasses.replace(_run(), swarm=SwarmConfig(stages=2, rebalance_period_s=0.3, sync_interval_s=0))
        # stage 1's server first, its parameters changed before any stage-0 server looks (else, on a slow machine,
        # the first stage-0 server can find stage 1 still empty and fill it from the initial weights)
        last, last_tasks = await _start_servers(hub, tmp_path, run, [1], stop, prefix="q")
        with torch.no_grad():  # stage 1 has trained: its parameters are no longer the initial ones
            for p in last[0].service.stage.parameters():
                p.add_(0.01)
        expected = flat_parameters(last[0].service.stage)
        roles, tasks = await _start_servers(hub, tmp_path, run, [0, 0, 0], stop)
        roles, tasks = roles + last, tasks + last_tasks
        for _ in range(60):
            await asyncio.sleep(0.1)
            if sorted(r.stage for r in roles) == [0, 0, 1, 1] and sum(len(r.moves) for r in roles) >= 1:
                await asyncio.sleep(1.0)  # and it stays there
                break
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return roles, expected

    roles, expected = asyncio.run(main())
    assert sorted(r.stage for r in roles) == [0, 0, 1, 1]
    movers = [r for r in roles if r.moves]
    assert len(movers) == 1 and movers[0].moves == [(0, 1)], [r.moves for r in roles]
    assert torch.equal(flat_parameters(movers[0].service.stage), expected)


def test_two_servers_that_each_see_themselves_as_the_mover_never_both_move(tmp_path, monkeypatch):
    """Petals' rule picks one mover per view, but views differ: here each of p0 and p1 measured itself faster than
    it announced, so each sees itself as the best mover. Their move claims let at most one of them move."""
    import dataclasses

    from peerd.roles.swarm_moves import MoveClaims
    from protocols.stage_service import StageService
    from protocols.swarm import should_move

    claims, granted, starting = [], [], []
    claims_done, all_starting = asyncio.Event(), asyncio.Event()
    real_claim, real_start = MoveClaims.claim, StageService.start

    async def recorded_claim(self, source, target, servers):
        claims.append((self.ctx.peer_id, source, target))
        granted.append(await real_claim(self, source, target, servers))
        if len(granted) == 2:
            claims_done.set()
        return granted[-1]

    async def start_together(service, transport):
        """Movers start serving their new stage at the same time (as on a loaded machine, where downloading the
        stage takes seconds): none announces its move before the others have made their last check."""
        if claims_done.is_set():
            starting.append(service)
            if len(starting) == sum(g is not None for g in granted):
                all_starting.set()
            await all_starting.wait()
        return await real_start(service, transport)

    monkeypatch.setattr(MoveClaims, "claim", recorded_claim)
    monkeypatch.setattr(StageService, "start", start_together)

    async def main():
        hub, stop = Hub(), asyncio.Event()
        run = dataclasses.replace(_run(), swarm=SwarmConfig(stages=2, rebalance_period_s=3600.0, sync_interval_s=0))
        # announcements only when the test makes them: the announced and the live throughputs stay apart
        roles, tasks = await _start_servers(hub, tmp_path, run, [0, 0, 0, 1], stop, status_interval_s=3600.0)
        for role, samples in zip(roles, [10, 10, 10, 5]):  # 1 sample/s each, stage 1's server 0.5
            role.service.samples, role.service.compute_s = samples, 10.0
            await role.announce()
        for role in roles[:2]:
            role.service.samples = 12  # measured since: 1.2 samples/s, not announced yet
        view = {p: a.stage for p, a in (await read_stage_servers(roles[0].ctx)).items()}
        own_views = [should_move(r.ctx.peer_id, view, {**{p: 1.0 for p in view}, "p3": 0.5,
                                                       r.ctx.peer_id: 1.2}, 2) for r in roles[:2]]
        concurrent = await asyncio.gather(roles[0].rebalance_once(), roles[1].rebalance_once())
        after_race = sorted(r.stage for r in roles)
        later = [await r.rebalance_once() for r in roles[:3]]  # one at a time: the claims were withdrawn
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return roles, own_views, concurrent, after_race, later

    roles, own_views, concurrent, after_race, later = asyncio.run(main())
    assert own_views == [1, 1]  # each one's own view makes it the mover: the race is real
    assert sorted(peer for peer, _, _ in claims[:2]) == ["p0", "p1"], claims  # both claimed at once
    assert concurrent.count(1) <= 1, concurrent
    assert after_race in ([0, 0, 0, 1], [0, 0, 1, 1]), after_race
    assert sorted(r.stage for r in roles) == [0, 0, 1, 1]
    assert sum(len(r.moves) for r in roles) == 1, [r.moves for r in roles]
    assert concurrent.count(1) + later.count(1) == 1, (concurrent, later)


def test_an_empty_stage_is_filled(tmp_path):
    import dataclasses

    async def main():
        hub, stop = Hub(), asyncio.Event()
        run = dataclasses.replace(_run(), swarm=SwarmConfig(stages=3, rebalance_period_s=0.3))
        roles, tasks = await _start_servers(hub, tmp_path, run, [0, 0, 1], stop)
        for _ in range(50):
            await asyncio.sleep(0.1)
            if sorted(r.stage for r in roles) == [0, 1, 2]:
                break
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return roles

    roles = asyncio.run(main())
    assert sorted(r.stage for r in roles) == [0, 1, 2]
    assert [r.moves for r in roles if r.moves] == [[(0, 2)]]


def test_a_trainer_says_what_it_waits_for_logs_progress_sparingly_and_sums_up_when_it_leaves(tmp_path, caplog):
    """A stage-0 trainer alone says once which stage it waits for; its progress lines come at info level at most
    every swarm_progress_interval_s (the others at debug); leaving, it sums up its micro-batches."""
    from peerd.events import LogEvents, SwarmProgress

    async def main():
        hub = Hub()
        run, stop = _run(), asyncio.Event()
        node = NodeConfig(checkpoint_dir=str(tmp_path / "t"), threads=1, device="cpu", status_interval_s=0.5,
                          status_ttl_s=5.0, log_every_steps=1, swarm_progress_interval_s=3600.0)
        ctx = RunContext.build("swarmunit", run, node, hub.transport("t"), stop=stop)
        progress = []
        ctx.events.subscribe(lambda e: progress.append(e) if isinstance(e, SwarmProgress) else None)
        ctx.events.subscribe(LogEvents())  # as the daemon logs them
        trainer = SwarmRole(ctx, stage=0, trainer=True, max_steps=6)
        task = asyncio.ensure_future(trainer.run(ctx))
        while not any("waiting for a server of stage 1" in r.getMessage() for r in caplog.records):
            await asyncio.sleep(0.05)
        roles, tasks = await _start_servers(hub, tmp_path, run, [1], stop, prefix="s")
        await asyncio.wait_for(task, 90)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return progress

    with caplog.at_level("INFO"):
        progress = asyncio.run(main())
    messages = [r.getMessage() for r in caplog.records]
    assert sum("waiting for a server of stage 1" in m for m in messages) == 1, messages
    assert len(progress) >= 6 and [e.quiet for e in progress] == [False] + [True] * (len(progress) - 1)
    assert sum(m.startswith("swarm trainer:") for m in messages) == 1  # the quiet ones are below info
    leave = [m for m in messages if m.startswith("leaving run swarmunit: served stage 0; trained 6 micro-batches")]
    assert len(leave) == 1, messages
