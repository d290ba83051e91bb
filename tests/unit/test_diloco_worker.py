"""The DiLoCo role's round logic on the in-process transport: failed rounds roll back, then recover."""

import asyncio
import threading

import pytest
import torch

from peerd.config import NodeConfig
from peerd.run_config import AveragingConfig, RunConfig
from peerd.roles.base import RunContext
from peerd.roles.diloco import DiLoCoRole
from peerd.worker.rounds import RoundEnd
from peerd.transport.inprocess import Hub
from protocols.allreduce import AllReduceFailed
from protocols.diloco import DiLoCoHyperparams, OuterState, flatten_parameters

pytestmark = pytest.mark.timeout(120)


def _run(min_group_size: int, matchmaking_timeout_s: float = 4.0) -> RunConfig:
    return RunConfig(
        model="tiny", seq_len=32, batch_size=4, eval_batches=0,
        diloco=DiLoCoHyperparams(inner_steps=3, warmup_steps=2, inner_lr=1e-3),
        averaging=AveragingConfig.from_flat(compression="none", min_group_size=min_group_size,
                                            matchmaking_timeout_s=matchmaking_timeout_s, request_timeout_s=1.0,
                                            sender_timeout_s=3.0, reducer_timeout_s=6.0),
    )


def _worker(hub, name, run, tmp_path) -> DiLoCoRole:
    node = NodeConfig(checkpoint_dir=str(tmp_path / name), threads=1, device="cpu")
    return DiLoCoRole(RunContext.build("unit", run, node, hub.transport(name)))


async def _start(worker):
    for component in worker.components:
        await component.start()
    await worker.publish_status()


def test_round_without_enough_peers_keeps_theta_outer_and_local_progress(tmp_path):
    async def main():
        worker = _worker(Hub(), "alone", _run(min_group_size=2), tmp_path)
        await _start(worker)
        before = worker.outer.digest()
        await worker.train_until_quota()
        local = flatten_parameters(worker.model)
        assert await worker.run_round() == RoundEnd.FAILED
        assert worker.stats.rounds_failed == 1
        assert worker.outer.digest() == before  # bit-identical rollback
        assert torch.equal(flatten_parameters(worker.model), local)  # local steps kept
        assert worker.steps_since_sync == 3 and worker.round_quota == 6  # next pseudo-gradient covers both
        await worker.train_until_quota()
        assert worker.steps_since_sync == 6 and worker.samples_since_sync == 24

    asyncio.run(main())


def test_the_training_loop_goes_on_while_the_new_theta_outer_is_hashed(tmp_path, monkeypatch):
    """The round's new state is hashed (SHA-256 of 8P bytes: seconds for a billion parameters) in a worker thread
    after the boundary: the training loop's round returns and the inner steps go on; the status record says no
    digest until it is known, and RoundDone, with it, follows."""
    hashing, release = threading.Event(), threading.Event()
    real_digest = OuterState.digest

    def slow_digest(self):
        if self.outer_round >= 1 and self.known_digest is None:
            hashing.set()
            assert release.wait(60)  # held until the test has seen the inner steps go on
        return real_digest(self)

    monkeypatch.setattr(OuterState, "digest", slow_digest)

    async def main():
        worker = _worker(Hub(), "alone", _run(min_group_size=1), tmp_path)
        done = []
        worker.ctx.events.subscribe(lambda e: done.append(e) if e.name == "outer_round" else None)
        await _start(worker)
        await worker.train_until_quota()
        assert await worker.boundary_round() == RoundEnd.DONE
        assert worker.outer.outer_round == 1 and done == []
        assert worker.status_fields()["digest"] is None  # not known yet: never computed on the event loop
        await worker.train_until_quota()  # the next round's inner steps, while the digest is held
        assert worker.steps_since_sync == 3
        assert hashing.is_set() and done == []
        release.set()
        await worker.rounds.settled()
        assert [e.outer_round for e in done] == [1]
        assert done[0].digest == worker.outer.digest()
        assert worker.status_fields()["digest"] == worker.outer.digest()[:16]

    asyncio.run(main())


def test_injected_allreduce_failure_rolls_back_everyone_then_the_next_round_succeeds(tmp_path):
    async def main():
        hub = Hub()
        # b's retry waits in matchmaking for a, which notices the failure only at its sender timeout (3 s): on a loaded
        # machine that can take longer than the default 4 s window, and then the retry never forms
        run = _run(min_group_size=2, matchmaking_timeout_s=30.0)
        a, b = (_worker(hub, name, run, tmp_path) for name in ("peer-a", "peer-b"))
        for w in (a, b):
            await _start(w)
        fired = []
        real_run = b.sync.allreduce.run

        async def failing_run(group, tensor, weight, out=None):
            if len(fired) < 2:  # both attempts of round 1: the retry among the survivors would succeed
                fired.append(group.group_id)
                raise AllReduceFailed("injected")
            return await real_run(group, tensor, weight, out)

        b.sync.allreduce.run = failing_run
        start = a.outer.digest()
        assert start == b.outer.digest()
        for w in (a, b):
            await w.train_until_quota()
        await asyncio.gather(a.run_round(), b.run_round())
        print(f"FIGURE A9: all-reduce failed (injected {len(fired)}x) in round 1 of 2 peers; theta_outer digest "
              f"before {start[:16]}, after a {a.outer.digest()[:16]} b {b.outer.digest()[:16]} (rounds failed "
              f"{a.stats.rounds_failed}, {b.stats.rounds_failed}; local steps kept {a.steps_since_sync}, "
              f"{b.steps_since_sync})")
        assert len(fired) == 2
        assert a.stats.rounds_failed == b.stats.rounds_failed == 1
        assert a.outer.digest() == b.outer.digest() == start
        for w in (a, b):
            await w.train_until_quota()
        assert await asyncio.gather(a.run_round(), b.run_round()) == [RoundEnd.DONE] * 2
        assert a.outer.outer_round == b.outer.outer_round == 1
        assert a.outer.digest() == b.outer.digest() != start
        # the successful round averaged all six local steps of each peer
        assert a.steps_since_sync == b.steps_since_sync == 0

    asyncio.run(main())


def test_refused_peer_downloads_the_leaders_state(tmp_path):
    async def main():
        hub = Hub()
        a, b = (_worker(hub, name, _run(min_group_size=1), tmp_path) for name in ("peer-a", "peer-b"))
        for w in (a, b):
            await _start(w)
        # b diverged (e.g. it averaged in another group): same round, different theta_outer
        b.outer = OuterState(b.outer.theta + 1.0, b.outer.momentum.clone(), 0)
        for _ in range(4):
            for w in (a, b):
                await w.train_until_quota()
            await asyncio.gather(a.run_round(), b.run_round())
            if a.outer.outer_round == b.outer.outer_round and a.outer.digest() == b.outer.digest():
                break
        # the refused peer adopted the leader's state, then they average together again
        assert a.outer.outer_round == b.outer.outer_round >= 1
        assert a.outer.digest() == b.outer.digest()
        assert not torch.equal(a.outer.theta, OuterState.initial(a.outer.theta).theta + 1.0)

    asyncio.run(main())


def test_peer_ahead_waits_for_a_syncing_peer_instead_of_outrunning_it(tmp_path):
    """b downloads a's state more slowly than a runs a round (a capped uploader). While b's status says "syncing", a
    counts it in its round's expected group and waits in matchmaking, so b joins that very round; before, a sealed
    the round alone and b found it a round further on every download."""

    async def main():
        hub = Hub()
        run = _run(min_group_size=1)
        a = _worker(hub, "peer-a", run, tmp_path)
        await _start(a)
        for _ in range(2):  # a trains alone for two rounds
            await a.train_until_quota()
            await a.run_round()
        assert a.outer.outer_round == 2
        b = _worker(hub, "peer-b", run, tmp_path)
        await _start(b)
        sizes, roles, waited_for = [], [], []
        real_run, real_round, real_download = a.sync.allreduce.run, a.sync.round, b.download_first
        a_matchmaking = asyncio.Event()

        async def recording_run(group, tensor, weight, out=None):
            sizes.append(len(group.members))
            return await real_run(group, tensor, weight, out)

        async def recording_round(local, weight, live, syncing, owned=False, digest=True, retake_local=None):
            waited_for.append(set(syncing))
            a_matchmaking.set()
            return await real_round(local, weight, live, syncing, owned, digest, retake_local)

        syncing_published = asyncio.Event()

        async def slow_download(peers):
            roles.append((await a.peer_records())[b.peer_id]["role"])
            syncing_published.set()
            await asyncio.wait_for(a_matchmaking.wait(), 60)  # the download outlasts the start of a's round
            return await real_download(peers)

        a.sync.allreduce.run, a.sync.round, b.download_first = recording_run, recording_round, slow_download
        await a.train_until_quota()

        async def b_joins():
            assert await b.catch_up(await b.live_peers())
            await b.train_until_quota()
            await b.run_round()

        async def a_round():
            await asyncio.wait_for(syncing_published.wait(), 60)
            await a.run_round()

        await asyncio.gather(a_round(), b_joins())
        assert waited_for == [{b.peer_id}]  # a's round counted the syncing b in its expected group
        assert roles == ["syncing"]
        assert sizes == [2]  # a waited for b
        assert a.outer.outer_round == b.outer.outer_round == 3 and a.outer.digest() == b.outer.digest()
        assert (await a.peer_records())[b.peer_id]["role"] == "diloco"

    asyncio.run(main())


@pytest.mark.parametrize("method", ["allreduce", "gossip"])
def test_diverged_local_training_sits_the_round_out_and_restarts_from_theta_outer(tmp_path, method):
    async def main():
        run = _run(min_group_size=1)
        run = RunConfig(**{**run.__dict__, "averaging": AveragingConfig(**{**run.averaging.__dict__, "method": method})})
        worker = _worker(Hub(), "diverged", run, tmp_path)
        await _start(worker)
        before = worker.outer.digest()
        await worker.train_until_quota()
        with torch.no_grad():
            next(worker.model.parameters()).view(-1)[0] = float("nan")  # local training blew up
        await worker.run_round()  # must not raise
        assert worker.stats.rounds_failed == 1 and worker.stats.rounds_ok == 0
        assert worker.outer.digest() == before  # theta_outer untouched
        assert torch.equal(flatten_parameters(worker.model), worker.outer.theta)  # restarted from theta_outer
        assert worker.steps_since_sync == 0
        await worker.train_until_quota()
        await worker.run_round()
        assert worker.stats.rounds_ok == 1 and bool(torch.isfinite(worker.outer.theta).all())

    asyncio.run(main())


def test_the_allreduce_round_announces_the_measured_rates_in_its_group_info(tmp_path):
    from protocols.matchmaking import MatchmakingFailed

    async def main():
        worker = _worker(Hub(), "alone", _run(min_group_size=2), tmp_path)
        infos = []

        async def capture(key, info, **kwargs):
            infos.append(info)
            raise MatchmakingFailed("captured")  # the round ends here: only its group info is under test

        worker.sync.matchmaker.form_group = capture
        worker.sync.allreduce.rates = {"up": 1.25e7, "down": 2.5e7}  # as measured after a few long runs
        outcome = await worker.sync.exchange(torch.zeros(worker.sync.state.outer.numel), 1.0, {}, frozenset())
        assert not isinstance(outcome, tuple)  # the round failed (no group), as arranged
        assert infos == [{"digest": worker.sync.state.outer.digest(), "rates": {"up": 1.25e7, "down": 2.5e7}}]

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_stop_while_joining_leaves_without_evaluating(tmp_path):
    """Ctrl-C before the first inner step: the peer checkpoints and leaves at once, without the start-up eval."""
    async def main():
        run = RunConfig(**{**_run(min_group_size=1).__dict__, "eval_batches": 2})
        worker = _worker(Hub(), "stopped", run, tmp_path)
        names = []
        worker.ctx.events.subscribe(lambda e: names.append(e.name))
        worker.ctx.stop.set()
        await worker.run()
        assert "eval" not in names and names[-1] == "leave"
        assert list((tmp_path / "stopped").rglob("*.safetensors"))  # checkpointed on the way out

    asyncio.run(main())


def test_the_first_inner_step_is_reported_before_a_full_logging_window(tmp_path):
    """A volunteer sees training start: step 1 is reported, then every ``log_every_steps`` and at the round's end."""
    async def main():
        node = NodeConfig(checkpoint_dir=str(tmp_path / "p"), threads=1, device="cpu", log_every_steps=50)
        worker = DiLoCoRole(RunContext.build("unit", _run(min_group_size=2), node, Hub().transport("p")))
        steps = []
        worker.ctx.events.subscribe(lambda e: steps.append(e.inner_step) if e.name == "inner" else None)
        await _start(worker)
        await worker.train_until_quota()
        assert steps == [1, 3]  # the first step, then the end of the 3-step round (the 50-step window never fills)

    asyncio.run(main())


def test_a_gossip_round_counts_the_exchanges_a_peer_answered_in_its_group_size(tmp_path):
    """A gossip peer whose own calls met a busy partner still mixed the partner's state in by answering its call."""
    async def main():
        hub = Hub()
        run = _run(min_group_size=1)
        run = RunConfig(**{**run.__dict__, "averaging": AveragingConfig(**{**run.averaging.__dict__,
                                                                           "method": "gossip"})})
        a, b = (_worker(hub, name, run, tmp_path) for name in ("peer-a", "peer-b"))
        sizes = {"peer-a": [], "peer-b": []}
        for name, worker in (("peer-a", a), ("peer-b", b)):
            worker.ctx.events.subscribe(
                lambda e, name=name: sizes[name].append(e.group_size) if e.name == "outer_round" else None)
            await _start(worker)
        for worker in (a, b):
            await worker.train_until_quota()
        await a.run_round()
        assert sizes["peer-a"] == [2] and b.sync.gossip.served == 1  # a called b, b answered
        hub.disconnect("peer-a")  # b's own calls now fail: its round mixed a's state in only by answering
        await b.run_round()
        assert sizes["peer-b"] == [2], sizes

    asyncio.run(main())


@pytest.mark.timeout(90)
@pytest.mark.parametrize("ahead_during_evaluation", [0, 2])
def test_a_joiner_starting_during_round_0_trains_what_is_left_of_it_and_joins_the_creators_group(
        tmp_path, ahead_during_evaluation):
    """b starts while a (the run's creator) is k of H inner steps into round 0: b trains the H - k steps left and
    both average in round 0's group. Before, b trained all H steps; a, at the rendezvous with b still k steps behind
    (longer than a's matchmaking window here: b's steps past H - k wait for a's round to end), sealed round 0 alone
    and b dropped its steps to adopt a's state. With ``ahead_during_evaluation`` = d: a trains d more steps while b
    runs its join's evaluation, and b trains H - k - d (before, b counted a's steps before its evaluation only, and
    came to the rendezvous d steps late: a loaded CPU's evaluation takes seconds)."""
    import threading

    from peerd.events import RoundDone

    H, k, d = 10, 5, ahead_during_evaluation
    run = RunConfig(
        model="tiny", seq_len=32, batch_size=4, eval_batches=0, max_outer_rounds=1,
        diloco=DiLoCoHyperparams(inner_steps=H, warmup_steps=2, inner_lr=1e-3),
        averaging=AveragingConfig.from_flat(compression="none", min_group_size=1, matchmaking_timeout_s=2.0,
                                            request_timeout_s=1.0, sender_timeout_s=3.0, reducer_timeout_s=6.0))

    async def main():
        hub = Hub()
        a, b = (_worker(hub, name, run, tmp_path) for name in ("peer-a", "peer-b"))
        done = {a.peer_id: [], b.peer_id: []}
        a_round_over, b_stepping = threading.Event(), threading.Event()
        holds = {step: (threading.Event(), threading.Event()) for step in {k, k + d}}  # step -> (reached, released)
        for w in (a, b):
            w.ctx.events.subscribe(lambda e, w=w: done[w.peer_id].append(e) if isinstance(e, RoundDone) else None)
        a.ctx.events.subscribe(lambda e: a_round_over.set() if isinstance(e, RoundDone) else None)
        a_step, b_step = a._inner_step, b._inner_step

        def a_steps():  # runs in the executor: a holds at steps k and k + d until released
            hold = holds.get(a.steps_since_sync)
            if hold is not None:
                hold[0].set()
                assert hold[1].wait(30)
            return a_step()

        def b_steps():  # b's steps beyond what is left of a's round come after a's round: b is that far behind
            b_stepping.set()
            if b.steps_since_sync >= H - k - d:
                a_round_over.wait(30)
            return b_step()

        async def b_evaluates():  # b's join evaluation: meanwhile a trains d more steps and its record says so
            holds[k][1].set()
            assert await loop.run_in_executor(None, holds[k + d][0].wait, 30)
            await a.ctx.status.publish()

        a._inner_step, b._inner_step = a_steps, b_steps
        if d:
            b.evaluate_and_publish = b_evaluates
        loop = asyncio.get_running_loop()
        a_run = asyncio.ensure_future(a.run())
        assert await loop.run_in_executor(None, holds[k][0].wait, 30)
        await a.ctx.status.publish()  # a's record now says k steps into round 0
        b_run = asyncio.ensure_future(b.run())
        assert await loop.run_in_executor(None, b_stepping.wait, 30)
        while b.peer_id not in await a.live_peers():  # a counts on b at its rendezvous
            await asyncio.sleep(0.05)
        holds[k + d][1].set()
        await asyncio.wait_for(asyncio.gather(a_run, b_run), 60)
        return a, b, done

    a, b, done = asyncio.run(main())
    (ra,), (rb,) = done[a.peer_id], done[b.peer_id]
    assert (ra.outer_round, ra.group_size, ra.inner_steps) == (1, 2, H)
    assert (rb.outer_round, rb.group_size, rb.inner_steps) == (1, 2, H - k - d)
    assert rb.weight == (H - k - d) * run.batch_size and ra.digest == rb.digest
    assert a.stats.rounds_failed == b.stats.rounds_failed == 0


def test_a_worker_reports_its_contribution_and_keeps_counting_after_a_restart(tmp_path):
    """tokens_trained and rounds_contributed in the status record (what `peerd status` and the dashboard rank),
    carried across a restart by the checkpoint."""
    from peerd.status.records import contribution

    run = _run(min_group_size=1)
    per_round = run.diloco.inner_steps * run.batch_size * run.seq_len

    async def main():
        worker = _worker(Hub(), "solo", run, tmp_path)
        await _start(worker)
        for _ in range(2):
            await worker.train_until_quota()
            await worker.run_round()
        worker.save_checkpoint(final=True)
        fields = worker.status_fields()
        again = _worker(Hub(), "solo", run, tmp_path)
        again.resume()
        return fields, again.status_fields()

    fields, resumed = asyncio.run(main())
    assert (fields["tokens_trained"], fields["rounds_contributed"]) == (2 * per_round, 2)
    assert (resumed["tokens_trained"], resumed["rounds_contributed"]) == (2 * per_round, 2)
    ranked = contribution({"solo": fields, "other": {**fields, "tokens_trained": 6 * per_round,
                                                     "rounds_contributed": 5}, "swarm": {"role": "swarm"}})
    assert [(r["rank"], r["peer"], r["rounds"]) for r in ranked] == [(1, "other", 5), (2, "solo", 2)]
    assert [r["share"] for r in ranked] == [0.75, 0.25]


def test_a_round_writes_its_pseudo_gradient_and_new_theta_outer_into_theta_locals_copy(tmp_path, monkeypatch):
    # the handover that saves 8 bytes a parameter at the boundary: the fresh copy of theta_local the round takes
    # becomes the pseudo-gradient the all-reduce sends, then the new theta_outer; both peers stay bit-identical
    from peerd.roles.fragments import Fragment

    copies = []
    real_flatten = Fragment.flatten

    def recording_flatten(self, model):
        flat = real_flatten(self, model)
        copies.append(flat.data_ptr())
        return flat

    monkeypatch.setattr(Fragment, "flatten", recording_flatten)

    async def main():
        hub = Hub()
        a, b = (_worker(hub, name, _run(min_group_size=2, matchmaking_timeout_s=30.0), tmp_path) for name in "ab")
        sent, averaged = [], []
        for w in (a, b):
            await _start(w)
            real_run = w.sync.allreduce.run

            async def recording_run(group, tensor, weight, out=None, real_run=real_run):
                sent.append(tensor.data_ptr())
                averaged.append(out.data_ptr())
                return await real_run(group, tensor, weight, out)

            w.sync.allreduce.run = recording_run
            await w.train_until_quota()
        copies.clear()
        assert await asyncio.gather(a.run_round(), b.run_round()) == [RoundEnd.DONE] * 2
        assert sorted(sent) == sorted(copies[:2])  # the pseudo-gradients went out of the copies, no fresh vector
        assert averaged == sent  # and the averages came back into them
        assert {a.outer.theta.data_ptr(), b.outer.theta.data_ptr()} == set(copies[:2])
        assert a.outer.outer_round == b.outer.outer_round == 1 and a.outer.digest() == b.outer.digest()

    asyncio.run(main())


def test_an_attempt_that_failed_after_writing_averages_over_the_pseudo_gradient_retries_with_it_taken_anew(tmp_path):
    """The average is written over the pseudo-gradient as its parts come back; an attempt that fails mid-way leaves
    that buffer part average, part input. The retry among the survivors must send the true pseudo-gradient (taken
    again from theta_local, which the model still holds), or theta_outer would step along garbage."""

    async def main():
        hub = Hub()
        run = _run(min_group_size=2, matchmaking_timeout_s=30.0)
        a, b = (_worker(hub, name, run, tmp_path) for name in ("peer-a", "peer-b"))
        calls = {}
        for w in (a, b):
            await _start(w)
            real_run = w.sync.allreduce.run

            async def failing_once(group, tensor, weight, out=None, real_run=real_run, mine=calls.setdefault(w, [])):
                mine.append((tensor.clone(), tensor.data_ptr(), out is not None and out.data_ptr()))
                if len(mine) == 1:  # attempt 1: half the parts' "averages" arrived, then a reducer died
                    out[: out.numel() // 2] = 1e3
                    raise AllReduceFailed("injected after writing half the averages")
                return await real_run(group, tensor, weight, out)

            w.sync.allreduce.run = failing_once
            await w.train_until_quota()
        start = a.outer
        assert await asyncio.gather(a.run_round(), b.run_round()) == [RoundEnd.DONE] * 2
        for w in (a, b):
            (first, first_ptr, first_out), (second, second_ptr, second_out) = calls[w]
            assert first_out == first_ptr and second_out == second_ptr  # written over the input, both attempts
            assert second_ptr != first_ptr and torch.equal(second, first)  # taken anew: the true pseudo-gradient
        assert a.outer.outer_round == b.outer.outer_round == 1 and a.outer.digest() == b.outer.digest()
        mean = (calls[a][0][0] + calls[b][0][0]) / 2  # both trained the same number of samples
        torch.testing.assert_close(a.outer.theta, start.apply(mean, a.hp).theta, rtol=1e-6, atol=1e-7)

    asyncio.run(main())


def test_theta_outer_goes_back_into_the_model_off_the_event_loop(tmp_path, monkeypatch):
    """Right after a round the event loop still moves the round's last answers to the other members (they can sit
    in a transport's buffers); the copy of the new theta_outer into the model (~1 s for a billion parameters on a
    CPU host) runs in a worker thread meanwhile: here each copy is held until a task on the loop has run."""
    from peerd.roles.fragments import FragmentState

    real = FragmentState.reset_to_outer
    loop_ran, off_loop = threading.Event(), []

    def held(self, model, outer=None):
        if threading.current_thread() is not threading.main_thread():
            off_loop.append(self)
            assert loop_ran.wait(60)  # set only by a task on the event loop: a copy on the loop never returns
        return real(self, model, outer)

    monkeypatch.setattr(FragmentState, "reset_to_outer", held)

    async def main():
        hub = Hub()
        a, b = (_worker(hub, name, _run(min_group_size=2, matchmaking_timeout_s=30.0), tmp_path) for name in "ab")
        for w in (a, b):
            await _start(w)
            await w.train_until_quota()

        async def on_the_loop():
            while len(off_loop) < 2:
                await asyncio.sleep(0.01)
            loop_ran.set()

        ticker = asyncio.ensure_future(on_the_loop())
        assert await asyncio.gather(a.run_round(), b.run_round()) == [RoundEnd.DONE] * 2
        await ticker
        assert len(off_loop) == 2 and a.steps_since_sync == b.steps_since_sync == 0
        assert torch.equal(flatten_parameters(a.model), a.outer.theta)

    asyncio.run(main())
