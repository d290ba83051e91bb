"""Streaming DiLoCo fragments (``[diloco] fragments = F``): the partition, the staggered schedule, and in-process
workers that sync one fragment every H/F steps."""

import asyncio

import pytest
import torch

from peerd.config import ConfigError, NodeConfig
from peerd.events import RoundDone
from peerd.models import build_model
from peerd.roles.base import RunContext
from peerd.roles.diloco import DiLoCoRole
from peerd.run_config import AveragingConfig, RunConfig
from peerd.status.records import status_problem
from peerd.transport.inprocess import Hub
from protocols.diloco import DiLoCoHyperparams
from protocols.streaming import FragmentSchedule, strided_fragments

pytestmark = pytest.mark.timeout(120)


def _names_numels(model):
    named = list(model.named_parameters())
    return [n for n, _ in named], [p.numel() for _, p in named]


def test_strided_fragments_hold_every_parameter_once_with_blocks_strided_across_fragments():
    names, numels = _names_numels(build_model("tiny", 32, 0))  # 4 blocks, an embedding and a final norm
    for f in (1, 2, 4):
        parts = strided_fragments(names, numels, f)
        assert len(parts) == f
        flat = [n for part in parts for n in part]
        assert sorted(flat) == sorted(names) and len(flat) == len(names)
        for part in parts:
            assert list(part) == [n for n in names if n in part]  # model order inside a fragment
    parts = strided_fragments(names, numels, 2)
    assert {n.split(".")[1] for n in parts[0] if n.startswith("blocks.")} == {"0", "2"}
    assert {n.split(".")[1] for n in parts[1] if n.startswith("blocks.")} == {"1", "3"}
    assert "tok_emb.weight" in parts[0] and "norm.weight" in parts[1]  # each to the lighter fragment at its turn
    assert strided_fragments(names, numels, 1) == [tuple(names)]
    with pytest.raises(ValueError, match="empty"):
        strided_fragments(names, numels, 7)  # 4 blocks + 2 other parameters
    with pytest.raises(ValueError):
        strided_fragments(names, numels, 0)


@pytest.mark.parametrize("h,f", [(12, 1), (12, 3), (12, 4), (8, 8)])
def test_schedule_syncs_every_parameter_exactly_once_per_h_steps(h, f):
    names, numels = _names_numels(build_model("tiny", 32, 0)) if f <= 6 else (None, None)
    schedule = FragmentSchedule(h, f)
    due = [schedule.due(step) for step in range(1, h + 1)]
    assert sorted(d for d in due if d is not None) == list(range(f))
    assert [step for step, d in enumerate(due, 1) if d is not None] == [schedule.stride * (p + 1) for p in range(f)]
    assert due[-1] == f - 1  # the last fragment syncs at the end of the cycle, as the whole model with F = 1
    if names is not None:
        parts = strided_fragments(names, numels, f)
        synced = [n for d in due if d is not None for n in parts[d]]
        assert sorted(synced) == sorted(names)
    assert [schedule.next_boundary(s) for s in (0, schedule.stride - 1, schedule.stride)] == \
        [schedule.stride, schedule.stride, 2 * schedule.stride]
    with pytest.raises(ValueError, match="divide"):
        FragmentSchedule(10, 4)


def test_fragments_are_fingerprint_neutral_at_one_and_validated():
    base = RunConfig(model="tiny")
    assert RunConfig(model="tiny", diloco=DiLoCoHyperparams(fragments=1)).fingerprint() == base.fingerprint()
    assert "fragments" not in base.fingerprint_dict()["diloco"]
    assert RunConfig(model="tiny", diloco=DiLoCoHyperparams(fragments=4)).fingerprint() != base.fingerprint()
    assert RunConfig.from_dict({"diloco": {"fragments": 4, "inner_steps": 8}}).diloco.fragments == 4
    with pytest.raises(ValueError, match="fragments"):
        DiLoCoHyperparams(inner_steps=10, fragments=4)
    with pytest.raises(ConfigError, match="fragments"):
        RunConfig(diloco=DiLoCoHyperparams(fragments=2), averaging=AveragingConfig(method="gossip"))
    # fragments + the delayed overlap compose (each fragment's all-reduce overlaps the next inner steps)
    assert RunConfig(diloco=DiLoCoHyperparams(fragments=2, overlap="delayed")).diloco.overlap == "delayed"


def _run(fragments=4, max_outer_rounds=2) -> RunConfig:
    return RunConfig(
        model="tiny", seq_len=32, batch_size=4, eval_batches=0, max_outer_rounds=max_outer_rounds,
        diloco=DiLoCoHyperparams(inner_steps=4, warmup_steps=2, inner_lr=1e-3, fragments=fragments),
        averaging=AveragingConfig.from_flat(min_group_size=2, matchmaking_timeout_s=4.0, request_timeout_s=1.0,
                                            sender_timeout_s=3.0, reducer_timeout_s=6.0),
    )


def _worker(hub, name, run, tmp_path) -> DiLoCoRole:
    node = NodeConfig(checkpoint_dir=str(tmp_path / name), threads=1, device="cpu")
    return DiLoCoRole(RunContext.build("unit", run, node, hub.transport(name)))


def test_workers_sync_one_fragment_per_stride_and_hold_identical_fragments(tmp_path):
    async def main():
        hub = Hub()
        run = _run()
        workers = [_worker(hub, f"peer-{c}", run, tmp_path) for c in "abc"]
        done = []
        workers[0].ctx.events.subscribe(lambda e: done.append(e) if isinstance(e, RoundDone) else None)
        theta0 = [p.outer.theta.clone() for p in workers[0].parts]
        await asyncio.gather(*[w.run() for w in workers])
        for w in workers:
            assert [p.outer.outer_round for p in w.parts] == [2, 2, 2, 2]
            assert w.stats.rounds_ok == 2 and w.stats.rounds_failed == 0
        for j in range(4):
            digests = {w.parts[j].outer.digest() for w in workers}
            assert len(digests) == 1  # every peer holds identical fragments
            assert not torch.equal(workers[0].parts[j].outer.theta, theta0[j])  # and every fragment moved
        assert len({w.digest() for w in workers}) == 1
        # one RoundDone per cycle of H steps, its bytes summed over the cycle's four fragment rounds
        assert [e.outer_round for e in done] == [1, 2] and all(e.bytes_sent > 0 for e in done)
        fields = workers[0].status_fields()
        assert fields["fragment_rounds"] == [2, 2, 2, 2] and fields["digest"] == workers[0].digest()[:16]
        return workers

    workers = asyncio.run(main())
    a = workers[0]

    async def resume_and_download():
        hub = Hub()
        again = _worker(hub, "peer-a", _run(), tmp_path)  # same checkpoint dir: resumes peer-a's checkpoint
        again.resume()
        assert again.digest() == a.digest() and [p.outer.outer_round for p in again.parts] == [2, 2, 2, 2]
        torch.testing.assert_close(torch.cat([p.fragment.flatten(again.model) for p in again.parts]),
                                   torch.cat([p.fragment.flatten(a.model) for p in a.parts]), rtol=0, atol=0)
        # a fresh peer downloads all fragments with their rounds from it
        fresh = _worker(hub, "peer-z", _run(), tmp_path)
        for w in (again, fresh):
            for component in w.components:
                await component.start()
        assert await fresh.download_first(["peer-a"])
        assert fresh.digest() == a.digest() and fresh.fragment_rounds() == [2, 2, 2, 2]
        assert (fresh.steps_since_sync, fresh.round_quota) == (0, 1)  # cycle start: fragment 0 is due after 1 step
        for w in (again, fresh):
            for component in w.components:
                await component.stop()

    asyncio.run(resume_and_download())


def test_a_download_mid_cycle_joins_at_the_next_fragment_boundary(tmp_path):
    async def main():
        hub = Hub()
        a, b = (_worker(hub, name, _run(max_outer_rounds=0), tmp_path) for name in ("peer-a", "peer-b"))
        for w in (a, b):
            for component in w.components:
                await component.start()
            await w.publish_status()
        for _ in range(2):  # fragments 0 and 1 sync
            for w in (a, b):
                await w.train_until_quota()
            await asyncio.gather(a.run_round(), b.run_round())
        assert a.fragment_rounds() == b.fragment_rounds() == [1, 1, 0, 0]
        assert a.parts[0].outer.digest() == b.parts[0].outer.digest()
        assert (a.steps_since_sync, a.round_quota) == (2, 3)
        late = _worker(hub, "peer-c", _run(max_outer_rounds=0), tmp_path)
        for component in late.components:
            await component.start()
        assert await late.download_first(["peer-a"])
        assert late.fragment_rounds() == [1, 1, 0, 0] and late.digest() == a.digest()
        assert (late.steps_since_sync, late.round_quota) == (2, 3)  # fragment 2 is due next, as for the others
        assert status_problem({**late.status_fields(), "time": 1.0, "v": 1}) is None
        for w in (a, b, late):
            for component in w.components:
                await component.stop()

    asyncio.run(main())


def test_topk_error_feedback_of_every_fragment_survives_a_restart(tmp_path):
    async def main():
        hub = Hub()
        run = RunConfig(
            model="tiny", seq_len=32, batch_size=4, eval_batches=0, max_outer_rounds=1,
            diloco=DiLoCoHyperparams(inner_steps=2, warmup_steps=2, inner_lr=1e-3, fragments=2),
            averaging=AveragingConfig.from_flat(compression="topk", min_group_size=2, matchmaking_timeout_s=4.0,
                                                request_timeout_s=1.0, sender_timeout_s=3.0, reducer_timeout_s=6.0))
        workers = [_worker(hub, f"peer-{c}", run, tmp_path) for c in "ab"]
        await asyncio.gather(*[w.run() for w in workers])
        a = workers[0]
        assert a.digest() == workers[1].digest()
        errors = [f.error for f in a.feedbacks()]
        assert len(errors) == 2 and all(float(e.abs().sum()) > 0 for e in errors)  # top-k left something unsent
        again = _worker(Hub(), "peer-a", run, tmp_path)
        again.resume()
        for mine, theirs in zip(again.feedbacks(), errors):
            assert torch.equal(mine.error, theirs)

    asyncio.run(main())
