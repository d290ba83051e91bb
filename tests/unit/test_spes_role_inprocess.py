"""The SPES role on the in-process transport: peers claim experts from each other's records, train, sync
sparsely; after the last sync every peer holds the same model and every expert has a holder."""

import asyncio
import dataclasses

import pytest
import torch

from peerd.config import NodeConfig
from peerd.roles.base import RunContext, role_class
from peerd.roles.spes import SpesRole
from peerd.run_config import AveragingConfig, RunConfig
from peerd.transport.inprocess import Hub
from protocols.diloco import DiLoCoHyperparams
from protocols.spes import SpesConfig, holders_of

pytestmark = pytest.mark.timeout(240)


def _run(rounds: int) -> RunConfig:
    return RunConfig(
        model="tiny-moe", parallelism="spes", seq_len=32, batch_size=4, eval_batches=2, max_outer_rounds=rounds,
        diloco=DiLoCoHyperparams(inner_steps=3, warmup_steps=2, inner_lr=1e-3),
        spes=SpesConfig(sync_steps=3, merge_interval=2, merge_decay_steps=100),
        averaging=AveragingConfig.from_flat(compression="none", matchmaking_timeout_s=4.0, request_timeout_s=1.0,
                                            sender_timeout_s=3.0, reducer_timeout_s=6.0),
    )


def _peer(hub, name, run, tmp_path) -> SpesRole:
    node = NodeConfig(checkpoint_dir=str(tmp_path / name), threads=1, device="cpu", status_interval_s=0.2,
                      status_ttl_s=5.0)
    return SpesRole(RunContext.build("spes-unit", run, node, hub.transport(name)))


def _miss_claims_of(peer: SpesRole, hidden: str, from_round: int) -> None:
    """From ``from_round`` on, ``peer``'s reads of the expert claims miss ``hidden``'s record (a DHT read that did
    not reach the node storing it)."""
    discovery = peer.ctx.transport.discovery
    get = discovery.get

    async def get_missing(key):
        found = await get(key)
        if key == peer.claims_key and peer.outer_round >= from_round:
            found = {p: record for p, record in found.items() if p != hidden}
        return found

    discovery.get = get_missing


def test_three_peers_train_sync_and_end_with_one_model_and_covered_experts(tmp_path):
    assert role_class("spes") is SpesRole

    async def main():
        hub = Hub()
        run = _run(rounds=3)
        peers = [_peer(hub, f"peer{i}", run, tmp_path) for i in range(3)]
        # the matchmaking leader's view of the claims misses a peer: the round's groups must not depend on it
        _miss_claims_of(peers[0], "peer2", from_round=1)
        done = []
        claimed, left, failed, allreduce_sent, reports = [], [], [], {}, {}
        for p in peers:
            p.ctx.events.subscribe(lambda e, p=p: done.append((p.peer_id, e)) if e.name == "outer_round" else None)
            p.ctx.events.subscribe(lambda e, p=p: allreduce_sent.__setitem__((p.peer_id, e.outer_round),
                                                                             p.last_report.allreduce_bytes_sent)
                                   if e.name == "outer_round" else None)
            p.ctx.events.subscribe(lambda e, p=p: reports.__setitem__((p.peer_id, e.outer_round), p.last_report)
                                   if e.name == "outer_round" else None)
            p.ctx.events.subscribe(lambda e: failed.append(e) if e.name == "round_failed" else None)
            p.ctx.events.subscribe(lambda e, p=p: claimed.append((p.peer_id, e)) if e.name == "experts_claimed"
                                   else None)
            p.ctx.events.subscribe(lambda e: left.append(e) if e.name == "leave" else None)
        await asyncio.gather(*[p.run() for p in peers])
        return peers, done, claimed, left, failed, allreduce_sent, reports

    peers, done, claimed, left, failed, allreduce_sent, reports = asyncio.run(main())
    assert not failed, failed
    # every round: one shared group of all three, every fragment synced, the same claims read by every member
    for (peer, r), report in reports.items():
        assert report.group_sizes["shared"] == 3 and not report.failed, (peer, r, report)
        assert report.claims == reports["peer0", r].claims
    # claim changes are typed events; the latest one of each peer names what it trains now
    latest = {peer: e for peer, e in claimed}
    assert set(latest) == {p.peer_id for p in peers}
    assert all(set(latest[p.peer_id].experts) == p.own for p in peers)
    assert all(e.previous == () for peer, e in claimed if e.outer_round == 0)
    # bytes sent count the refresh answers served: everything one peer received as a refresh, another served
    served = sum(p.sync.refresh_bytes_served for p in peers)
    assert served > 0 and served == sum(p.refresh_bytes_received for p in peers)
    assert sum(e.bytes_sent for e in left) >= sum(e.bytes_sent for _, e in done)
    assert sum(e.bytes_sent for e in left) > served
    assert all(p.outer_round == 3 and p.stats.rounds_ok == 3 for p in peers)
    first = dict(peers[0].model.named_parameters())
    for p in peers[1:]:
        for name, param in p.model.named_parameters():
            assert torch.equal(param, first[name]), (p.peer_id, name)
    claims = {p.peer_id: p.own for p in peers}
    assert all(holders_of(claims, 8))  # every expert has a holder
    assert sorted(len(c) for c in claims.values()) == [2, 3, 3]  # spread out after the first sync
    # after the claims spread, a peer all-reduces less than it would with all experts
    last = {peer: allreduce_sent[peer, 3] for peer in claims}
    full = {peer: allreduce_sent[peer, 1] for peer in claims}
    assert all(last[p] < 0.7 * full[p] for p in last)
    # RoundDone.bytes_sent = the all-reduce's bytes + the refresh answers served to that round's members
    assert all(e.bytes_sent >= allreduce_sent[peer, e.outer_round] for peer, e in done)
    for r in (1, 2, 3):
        served = sum(e.bytes_sent - allreduce_sent[peer, r] for peer, e in done if e.outer_round == r)
        assert served == sum(reports[p.peer_id, r].refresh_bytes_received for p in peers) > 0, r
    assert sum(e.bytes_sent for _, e in done) > sum(allreduce_sent.values())
    assert all(e.eval_nats_per_byte is not None for _, e in done)


def test_a_leavers_experts_are_reclaimed_and_training_continues(tmp_path):
    async def main():
        hub = Hub()
        peers = [_peer(hub, f"peer{i}", _run(rounds=4), tmp_path) for i in range(3)]
        leaver = peers[2]
        left_with = []

        def on_event(e):
            if e.name == "outer_round" and e.outer_round == 2:
                left_with.append(leaver.own)
                leaver.ctx.stop.set()

        leaver.ctx.events.subscribe(on_event)
        await asyncio.gather(*[p.run() for p in peers])
        return peers, left_with[0]

    peers, left_with = asyncio.run(main())
    stayers = peers[:2]
    assert peers[2].outer_round == 2 and all(p.outer_round == 4 for p in stayers)
    assert left_with and all(e in stayers[0].own | stayers[1].own for e in left_with)
    assert sorted(len(p.own) for p in stayers) == [4, 4]
    first = dict(stayers[0].model.named_parameters())
    assert all(torch.equal(param, first[name]) for name, param in stayers[1].model.named_parameters())


def test_merging_moves_only_this_peers_experts_toward_their_neighbours(tmp_path):
    from protocols.spes import merge_experts

    peer = _peer(Hub(), "solo", _run(rounds=1), tmp_path)
    peer.set_own(frozenset({0, 1}))
    block = peer.model.blocks[0].moe
    before = [torch.cat([p.detach().reshape(-1) for p in e.parameters()]) for e in block.experts]
    w1 = torch.stack([e.gate.weight.detach().reshape(-1) for e in block.experts])
    expected = merge_experts(torch.stack(before), 0.5, peer.cfg.merge_top_k, similarity_on=w1)
    peer.merge_own_experts(0.5)
    after = [torch.cat([p.detach().reshape(-1) for p in e.parameters()]) for e in block.experts]
    for e in range(8):
        if e in (0, 1):
            torch.testing.assert_close(after[e], expected[e])
            assert not torch.equal(after[e], before[e])
        else:
            assert torch.equal(after[e], before[e])
    # only the peer's own experts (and the shared parameters) are trainable
    trainable = {n for n, p in peer.model.named_parameters() if p.requires_grad}
    assert any(".experts.0." in n for n in trainable) and not any(".experts.5." in n for n in trainable)


def test_a_pause_stops_training_inside_the_round_and_frees_the_claim_until_resumed(tmp_path):
    async def main():
        run = dataclasses.replace(_run(rounds=1), spes=SpesConfig(sync_steps=5, merge_interval=0))
        peer = _peer(Hub(), "solo", run, tmp_path)
        events, records = [], []
        peer.ctx.events.subscribe(lambda e: events.append((e.name, peer.steps_since_sync)))
        step = peer._inner_step

        def inner_step():
            loss = step()
            if peer.global_step == 2:
                peer.ctx.gate.pause("user", "paused by the user")
            return loss

        peer._inner_step = inner_step
        task = asyncio.ensure_future(peer.run())
        while not any(name == "paused" for name, _ in events):
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # paused: no step, no sync
        records.append((await peer.ctx.transport.discovery.get(peer.claims_key))["solo"].value)
        steps_while_paused = peer.global_step
        peer.ctx.gate.resume("user")
        await asyncio.wait_for(task, 60)
        return peer, events, records, steps_while_paused

    peer, events, records, steps_while_paused = asyncio.run(main())
    names = [name for name, _ in events]
    assert ("paused", 2) in events and steps_while_paused == 2  # stopped after the step it was in
    assert records[0].get("left") is True  # the others neither wait for it nor count it as a holder
    assert names.index("paused") < names.index("resumed") < names.index("outer_round")
    # the round resumed where it stopped: 5 steps in all, one sync
    assert peer.global_step == 5 and peer.outer_round == 1


def test_a_peer_whose_round_went_on_without_it_adopts_the_others_model_instead_of_syncing_alone(tmp_path):
    async def main():
        hub = Hub()
        run = _run(rounds=5)
        ahead, behind = _peer(hub, "ahead", run, tmp_path), _peer(hub, "behind", run, tmp_path)
        for peer in (ahead, behind):
            for component in peer.components:
                await component.start()
            peer.set_own(frozenset(range(8)))
        with torch.no_grad():
            for p in ahead.model.parameters():
                p.add_(0.5)
        ahead.outer_round = 2  # it synced round 1 without `behind`, whose matchmaking for it failed
        ahead.snapshot_model()
        await ahead.publish_claim()
        behind.outer_round, behind.steps_since_sync = 1, 3
        events = []
        behind.ctx.events.subscribe(events.append)
        await behind.sync_round()
        for peer in (ahead, behind):
            for component in peer.components:
                await component.stop()
        return ahead, behind, events

    ahead, behind, events = asyncio.run(main())
    # adopted the model, re-claimed next to the peer ahead (which trains every expert); no sync of its own
    assert [e.name for e in events] == ["state_download", "experts_claimed"]
    assert behind.own != frozenset(range(8))
    assert behind.outer_round == 2 and behind.steps_since_sync == 0
    first = dict(ahead.model.named_parameters())
    assert all(torch.equal(param, first[name]) for name, param in behind.model.named_parameters())
