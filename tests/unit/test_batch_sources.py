"""Batch sources of ``shards:`` and ``hf:`` runs: a joiner trains only on shards it fetched, shard after shard in
its own order, waits for a shard no peer has yet, resumes bit-identically; DiLoCo, SPES and SWARM roles train on
them (``hf:`` offline, on a local Parquet folder)."""

import asyncio
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from peerd.config import NodeConfig
from peerd.data.corpus import ByteTokenizer, DataError, load_corpus
from peerd.data.hf_stream import HfBatches
from peerd.data.shards import ShardStore, shard_order, split_corpus
from peerd.data.sources import HfSource, batches_in
from peerd.events import RoundDone
from peerd.identity.namespace import RunNamespace, RunRef
from peerd.roles.base import RunContext
from peerd.roles.batch_sources import ShardBatches, shard_store
from peerd.roles.diloco import DiLoCoRole
from peerd.roles.shard_sync import shards_service
from peerd.run_config import AveragingConfig, RunConfig
from peerd.status.records import make_status
from peerd.transport.inprocess import Hub
from protocols.blobs import BlobServer
from protocols.diloco import DiLoCoHyperparams

pytestmark = pytest.mark.timeout(120)

SHARD = 4096
T, B = 32, 8


@pytest.fixture
def parquet_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # nothing from this machine's cache
    folder = tmp_path / "parquet"
    folder.mkdir()
    for f in range(4):
        pq.write_table(pa.table({"text": [f"file {f} document {i}: " + "word " * (i % 7) for i in range(40)]}),
                       folder / f"part-{f}.parquet")
    return folder


async def _announce(transport, ns):
    """``transport`` looks like a live peer of the run (its status record)."""
    await transport.discovery.store(ns.status_key, transport.streams.peer_id, make_status(role="training"),
                                    transport.discovery.time() + 60)


def _source(spec, transport, ns, store, stop):
    return ShardBatches(spec, store, transport, ns, ByteTokenizer, T, B, "joiner", 0, eval_batches=2, stop=stop,
                        retry_s=0.05, log_every_s=0.2)


def test_a_shard_source_trains_only_on_fetched_shards_moves_on_and_resumes(tmp_path, corpus_file, caplog):
    creator_store = ShardStore(tmp_path / "creator")
    manifest = split_corpus(corpus_file, creator_store, SHARD)
    corpus = load_corpus(corpus_file)
    per_shard = batches_in(SHARD, T, B)
    assert per_shard == SHARD // (B * (T + 1)) > 1

    async def main():
        hub = Hub()
        ns = RunNamespace(RunRef("unit"))
        creator, joiner = hub.transport("creator"), hub.transport("joiner")
        blocked = set()  # shards no peer holds yet
        server = BlobServer(creator, shards_service(ns), lambda d: None if d in blocked else creator_store.blob(d))
        await server.start()
        await _announce(creator, ns)
        stop = asyncio.Event()
        store = ShardStore(tmp_path / "joiner")
        order = shard_order(len(manifest.train), "joiner", 0)
        blocked.add(manifest.train[order[2]][0])
        source = _source(manifest.spec, joiner, ns, store, stop)
        assert await source.start()
        # held out: the first eval shard (one is enough for 2 batches of 8 windows of 33 bytes), as every peer has it
        assert source.eval_tokens.numpy().tobytes() == corpus.eval.numpy()[:manifest.eval[0][1]].tobytes()
        batches, states = [], []
        for _ in range(2 * per_shard):
            assert await source.ready()
            states.append(source.state_dict())
            batches.append(source.next_batch())
        # the first shard's count of batches from shard order[0], the next ones from order[1]
        for k, (x, y) in enumerate(batches):
            assert x.shape == y.shape == (B, T) and x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
            shard = bytes(store.blob(manifest.train[order[0 if k < per_shard else 1]][0]))
            assert all(bytes(row.to(torch.uint8).tolist()) in shard for row in x)
        assert states[per_shard - 1]["position"] == 0 and states[per_shard]["position"] == 1
        assert states[per_shard]["drawn"] == 0
        held = {p.name for p in store.root.iterdir()} - {manifest.digest}
        assert held == {manifest.train[order[i]][0] for i in (0, 1)} | {manifest.eval[0][0]}

        # shard order[2] is on no peer yet: the source waits for it (logged), it does not fail
        waiting = asyncio.ensure_future(source.ready())
        await asyncio.sleep(0.5)
        assert not waiting.done()
        blocked.clear()
        assert await asyncio.wait_for(waiting, 10)
        assert all(bytes(row.to(torch.uint8).tolist()) in bytes(store.blob(manifest.train[order[2]][0]))
                   for row in source.next_batch()[0])
        # stopped while waiting for a missing shard: ready() answers False
        blocked.update(d for d, _ in manifest.train)
        for _ in range(per_shard - 1):
            assert await source.ready()
            source.next_batch()
        waiting = asyncio.ensure_future(source.ready())
        await asyncio.sleep(0.2)
        stop.set()
        assert await asyncio.wait_for(waiting, 10) is False
        with pytest.raises(RuntimeError):
            source.next_batch()
        await source.close()

        # resume from each state: the same batches, bit for bit
        for k in (0, per_shard - 1, per_shard + 1):
            again = _source(manifest.spec, joiner, ns, store, asyncio.Event())
            again.load_state_dict(states[k])
            assert await again.start()
            for x, y in batches[k:]:
                assert await again.ready()
                x2, y2 = again.next_batch()
                assert torch.equal(x, x2) and torch.equal(y, y2)
            await again.close()
        with pytest.raises(ValueError):
            again.load_state_dict({**states[0], "manifest": "0" * 64})

    with caplog.at_level(logging.INFO, logger="peerd.roles.batch_sources"):
        asyncio.run(main())
    assert any("training waits for shard" in r.message for r in caplog.records)


def test_a_stopped_wait_for_the_manifest_or_a_shard_ends_without_a_batch(tmp_path, corpus_file):
    manifest = split_corpus(corpus_file, ShardStore(tmp_path / "creator"), SHARD)

    async def main():
        hub = Hub()
        ns = RunNamespace(RunRef("unit"))
        stop = asyncio.Event()
        source = _source(manifest.spec, hub.transport("alone"), ns, ShardStore(tmp_path / "alone"), stop)
        starting = asyncio.ensure_future(source.start())  # no peer holds the manifest
        await asyncio.sleep(0.2)
        assert not starting.done()
        stop.set()
        assert await asyncio.wait_for(starting, 10) is False
        await source.close()

    asyncio.run(main())


def _diloco_run(dataset: str, **kw) -> RunConfig:
    return RunConfig(model="tiny", seq_len=T, batch_size=4, eval_batches=1, dataset=dataset, **kw,
                     diloco=DiLoCoHyperparams(inner_steps=3, warmup_steps=1, inner_lr=1e-3),
                     averaging=AveragingConfig.from_flat(compression="none", min_group_size=2,
                                                         matchmaking_timeout_s=4.0, request_timeout_s=1.0,
                                                         sender_timeout_s=3.0, reducer_timeout_s=6.0))


def test_a_joiner_fetches_the_creators_shards_and_both_finish_a_diloco_round(tmp_path, corpus_file, monkeypatch):
    monkeypatch.setattr("peerd.roles.batch_sources.RETRY_S", 0.1)  # a joiner asks again soon for the manifest
    creator_node = NodeConfig(checkpoint_dir=str(tmp_path / "creator"), threads=1, device="cpu",
                              status_interval_s=0.2, status_ttl_s=5.0)
    manifest = split_corpus(corpus_file, shard_store(creator_node), SHARD)
    run = _diloco_run(manifest.spec, max_outer_rounds=1)

    async def main():
        hub = Hub()
        roles = []
        for name, node in (("creator", creator_node),
                           ("joiner", NodeConfig(checkpoint_dir=str(tmp_path / "joiner"), threads=1, device="cpu",
                                                 status_interval_s=0.2, status_ttl_s=5.0))):
            roles.append(DiLoCoRole(RunContext.build("unit", run, node, hub.transport(name))))
        done = []
        for role in roles:
            role.ctx.events.subscribe(lambda e, r=role: done.append((r.peer_id, e)) if isinstance(e, RoundDone)
                                      else None)
        await asyncio.wait_for(asyncio.gather(*(r.run() for r in roles)), 90)
        return roles, done

    (creator, joiner), done = asyncio.run(main())
    assert creator.sampler.fetcher.fetched == 0 and joiner.sampler.fetcher.fetched >= 2  # training, held out
    assert sorted(p for p, _ in done) == sorted([creator.peer_id, joiner.peer_id])
    assert all(e.outer_round == 1 and e.group_size == 2 for _, e in done)
    assert torch.equal(creator.eval_tokens, joiner.eval_tokens)
    # what the joiner holds: the manifest, the shards it trained on or fetched ahead, the held-out one
    held = {p.name for p in shard_store(joiner.ctx.node).root.iterdir()}
    assert manifest.digest in held and len(held) < len(manifest.train)
    # the checkpoint keeps the position in the shard order: a restarted joiner continues there
    state = joiner.sampler.state_dict()
    assert state["drawn"] == 3 and state["position"] == 0
    again = DiLoCoRole(RunContext.build("unit", run, joiner.ctx.node, Hub().transport("joiner")))
    again.resume()
    assert again.sampler.state_dict() == state


def test_hf_batches_resume_exactly_from_any_batch(parquet_folder):
    name = str(parquet_folder)
    reference = HfBatches(name, ByteTokenizer, seq_len=8, batch_size=3, peer_id="peer-a", seed=0)
    states, batches = [], []
    for _ in range(80):  # past the end of the first file: documents span batches and files
        states.append(reference.state_dict())
        batches.append(reference.next_batch())
    assert reference.documents_read > 40
    for k in (0, 1, 7, 45, 79):
        again = HfBatches(name, ByteTokenizer, seq_len=8, batch_size=3, peer_id="peer-a", seed=0)
        again.load_state_dict(states[k])
        for x, y in batches[k:]:
            x2, y2 = again.next_batch()
            assert torch.equal(x, x2) and torch.equal(y, y2)
    with pytest.raises(ValueError):
        again.load_state_dict({**states[3], "seq_len": 9})


def test_a_diloco_peer_trains_on_an_hf_folder_and_resumes_its_stream(tmp_path, parquet_folder):
    run = _diloco_run(f"hf:{parquet_folder}")
    node = NodeConfig(checkpoint_dir=str(tmp_path / "node"), threads=1, device="cpu")

    async def main():
        role = DiLoCoRole(RunContext.build("unit", run, node, Hub().transport("solo")))
        assert await role.sampler.start()
        await role.train_until_quota()
        # the last data file is held out: its first documents are the eval tokens, never trained on
        assert ByteTokenizer.decode(role.eval_tokens).startswith("file 3 document 0:")
        state = role.sampler.state_dict()
        following = [role.sampler.next_batch() for _ in range(2)]
        assert not any("file 3" in ByteTokenizer.decode(row) for x, _ in following for row in x)
        again = DiLoCoRole(RunContext.build("unit", run, node, Hub().transport("solo")))
        again.sampler.load_state_dict(state)  # before start, as a resume from a checkpoint does
        assert await again.sampler.start()
        for x, _ in following:
            assert await again.sampler.ready()
            assert torch.equal(again.sampler.next_batch()[0], x)
        return role, state

    role, state = asyncio.run(main())
    assert role.steps_since_sync == 3 and state["batches_drawn"] == 3
    assert role.stats.last_loss is not None


def test_an_hf_dataset_of_one_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    folder = tmp_path / "one"
    folder.mkdir()
    pq.write_table(pa.table({"text": ["a document"] * 5}), folder / "only.parquet")
    source = HfSource(str(folder), ByteTokenizer, 8, 2, "peer", 0, 1)
    with pytest.raises(DataError, match="held out"):
        asyncio.run(source.start())


@pytest.mark.parametrize("kind", ["shards", "hf"])
def test_a_spes_peer_trains_on_shards_and_hf(tmp_path, corpus_file, parquet_folder, kind):
    from peerd.roles.spes import SpesRole
    from protocols.spes import SpesConfig

    node = NodeConfig(checkpoint_dir=str(tmp_path / "node"), threads=1, device="cpu")
    dataset = (split_corpus(corpus_file, shard_store(node), SHARD).spec if kind == "shards"
               else f"hf:{parquet_folder}")
    run = RunConfig(model="tiny-moe", parallelism="spes", seq_len=T, batch_size=4, eval_batches=1, dataset=dataset,
                    diloco=DiLoCoHyperparams(inner_steps=3, warmup_steps=1, inner_lr=1e-3),
                    spes=SpesConfig(sync_steps=3, merge_interval=2, merge_decay_steps=100))

    async def main():
        role = SpesRole(RunContext.build("unit", run, node, Hub().transport("solo")))
        assert await role.sampler.start()
        role.set_own(frozenset(range(role.n_experts)))
        await role.train_steps(3)
        loss = await role.evaluate()
        await role.sampler.close()
        return role, loss

    role, loss = asyncio.run(main())
    assert role.steps_since_sync == 3 and role.stats.last_loss is not None and loss is not None


def test_a_swarm_trainer_trains_on_shards(tmp_path, corpus_file):
    from peerd.roles.swarm import SwarmRole
    from protocols.swarm import SwarmConfig

    steps = 4
    nodes = [NodeConfig(checkpoint_dir=str(tmp_path / f"p{i}"), threads=1, device="cpu", status_interval_s=0.5,
                        status_ttl_s=5.0) for i in range(2)]
    spec = split_corpus(corpus_file, shard_store(nodes[0]), SHARD).spec
    run = RunConfig(model="tiny", seq_len=T, batch_size=4, eval_batches=0, parallelism="swarm", dataset=spec,
                    swarm=SwarmConfig(stages=2, call_timeout_s=10.0, pending_timeout_s=30.0))

    async def main():
        hub, stop = Hub(), asyncio.Event()
        ctxs = [RunContext.build("swarmunit", run, node, hub.transport(f"p{i}"), stop=stop)
                for i, node in enumerate(nodes)]
        server = SwarmRole(ctxs[1], stage=1, trainer=False)
        serving = asyncio.ensure_future(server.run(ctxs[1]))
        while server.service is None:
            await asyncio.sleep(0.01)
        await server.announce()
        trainer = SwarmRole(ctxs[0], stage=0, trainer=True, max_steps=steps)
        await asyncio.wait_for(trainer.run(ctxs[0]), 90)
        stop.set()
        await asyncio.wait_for(serving, 10)
        return trainer

    trainer = asyncio.run(main())
    assert trainer.wiring.stats.completed == steps and len(trainer.losses) == steps
