"""A creator's corpus as content-addressed shards: the split keeps the corpus's bytes, the manifest names them, each
peer walks its own shard order, and a joiner fetches only the shards it needs from live peers (digest checked, a
lying peer skipped and counted, an interrupted download resumed where it stopped)."""

import asyncio
import os

import pytest

from peerd.config import ConfigError
from peerd.data.corpus import DataError, load_corpus
from peerd.data.shards import ShardManifest, ShardStore, parse_shards_spec, shard_order, shards_needed, split_corpus
from peerd.identity.namespace import RunNamespace, RunRef
from peerd.roles.shard_sync import ShardFetcher, serve_shards, shards_service
from peerd.run_config import RunConfig
from peerd.status.records import make_status
from peerd.transport.inprocess import Hub
from protocols.blobs import BlobServer, BlobUnavailable, fetch_blob_file, sha256_hex
from protocols.rpc import Refused

pytestmark = pytest.mark.timeout(60)

SHARD = 4096
PIECE = 1000


@pytest.fixture
def creator_store(tmp_path, corpus_file):
    store = ShardStore(tmp_path / "creator")
    return store, split_corpus(corpus_file, store, SHARD)


def test_split_keeps_the_corpus_bytes_and_names_every_shard_by_digest(corpus_file, creator_store):
    store, manifest = creator_store
    corpus = load_corpus(corpus_file)
    assert len(manifest.train) == -(-corpus.train.numel() // SHARD) and len(manifest.train) > 10
    assert b"".join(bytes(store.blob(d)) for d, _ in manifest.train) == corpus.train.numpy().tobytes()
    assert b"".join(bytes(store.blob(d)) for d, _ in manifest.eval) == corpus.eval.numpy().tobytes()
    assert all(sha256_hex(bytes(store.blob(d))) == d and size == len(store.blob(d)) for d, size in manifest.train)
    assert store.tokens(manifest.train[0][0]).numel() == SHARD
    # the manifest is a blob too, and names the corpus in the run config
    assert parse_shards_spec(manifest.spec) == manifest.digest and store.manifest(manifest.digest) == manifest
    assert split_corpus(corpus_file, ShardStore(store.root.parent / "again"), SHARD).spec == manifest.spec
    assert RunConfig(dataset=manifest.spec).dataset == manifest.spec
    for bad in ("shards:abc", "shards:" + "A" * 64, "s3://bucket", "hf:"):
        with pytest.raises(ConfigError):
            RunConfig(dataset=bad)
    for bad in (b"{}", b"not json", manifest.to_bytes().replace(b'"train":[[', b'"train":[[1,')):
        with pytest.raises(DataError):
            ShardManifest.from_bytes(bad)


def test_each_peer_walks_its_own_shard_order(creator_store):
    _, manifest = creator_store
    n = len(manifest.train)
    a, b = shard_order(n, "peer-a", 0), shard_order(n, "peer-b", 0)
    assert sorted(a) == list(range(n)) and sorted(b) == list(range(n))
    assert a == shard_order(n, "peer-a", 0) and a != b and a != shard_order(n, "peer-a", 1)
    need = shards_needed(manifest, a, n - 1)  # the last shard of the order, then the first again
    assert need[:2] == [manifest.train[a[-1]][0], manifest.train[a[0]][0]]
    assert need[2:] == [d for d, _ in manifest.eval]


class LyingServer(BlobServer):
    async def rpc_blob(self, request):
        await request.reply({}, b"x" * request.header.get("length", 10))


class FailingServer(BlobServer):
    """Serves its first ``pieces`` ranges, then refuses: a peer that went away mid-download."""

    def __init__(self, *args, pieces: int):
        super().__init__(*args)
        self.pieces = pieces
        self.offsets: list[int] = []

    async def rpc_blob(self, request):
        if len(self.offsets) >= self.pieces:
            raise Refused("gone", "unavailable")
        self.offsets.append(request.header["offset"])
        await super().rpc_blob(request)


class RecordingServer(BlobServer):
    def __init__(self, *args):
        super().__init__(*args)
        self.offsets: list[int] = []

    async def rpc_blob(self, request):
        self.offsets.append(request.header.get("offset", 0))
        await super().rpc_blob(request)


def test_a_joiner_fetches_only_its_shards_skips_a_liar_and_counts_it(tmp_path, creator_store, wait_for_order):
    store, manifest = creator_store

    async def main():
        hub = Hub()
        ns = RunNamespace(RunRef("unit"))
        creator, liar, joiner = (hub.transport(name) for name in ("creator", "liar", "joiner"))
        honest = serve_shards(creator, ns, store)
        lying = LyingServer(liar, shards_service(ns), lambda digest: None)
        for server in (honest, lying):
            await server.start()
        for t in (liar, creator):  # both look like live peers of the run
            await t.discovery.store(ns.status_key, t.streams.peer_id, make_status(role="training", outer_round=1),
                                    t.discovery.time() + 60)
        fetcher = ShardFetcher(joiner, ns, ShardStore(tmp_path / "joiner"), piece_bytes=PIECE, timeout_s=5.0)
        got = await fetcher.manifest(manifest.spec, asyncio.Event())
        assert got == manifest
        order = shard_order(len(manifest.train), joiner.streams.peer_id, 0)
        need = shards_needed(manifest, order, 0)
        # the liar is asked first: its bytes never reach the store, it is counted and never asked again
        await fetcher.fetch(manifest, need[:1], peers=[liar.streams.peer_id, creator.streams.peer_id])
        assert fetcher.liars == {liar.streams.peer_id}
        await fetcher.fetch(manifest, need, peers=[liar.streams.peer_id, creator.streams.peer_id])
        assert fetcher.liars == {liar.streams.peer_id} and fetcher.fetched == len(need)
        for digest in need:
            assert sha256_hex(fetcher.store.path(digest).read_bytes()) == digest
        # only the shards it trains on (and the eval shards) are here
        held = {p.name for p in fetcher.store.root.iterdir()} - {manifest.digest}
        assert held == set(need) and len(held) < len(manifest.train)
        # the liar alone delivers nothing
        with pytest.raises(BlobUnavailable):
            await fetch_blob_file(joiner, shards_service(ns), [liar.streams.peer_id], manifest.train[order[5]][0],
                                  manifest.train[order[5]][1], str(tmp_path / "x"), PIECE, 5.0)
        assert not (tmp_path / "x").exists()
        # the joiner serves what it holds to the next joiner
        await serve_shards(joiner, ns, fetcher.store).start()
        late = ShardFetcher(hub.transport("late"), ns, ShardStore(tmp_path / "late"), piece_bytes=PIECE)
        await late.fetch(manifest, need[:1], peers=[joiner.streams.peer_id])
        assert late.store.has(need[0])

    asyncio.run(main())


def test_an_interrupted_shard_download_resumes_where_it_stopped(tmp_path, creator_store, wait_for_order):
    store, manifest = creator_store
    digest, size = manifest.train[0]
    assert size == SHARD

    async def main():
        hub = Hub()
        ns = RunNamespace(RunRef("unit"))
        first, second, joiner = (hub.transport(name) for name in ("first", "second", "joiner"))
        going = FailingServer(first, shards_service(ns), store.blob, pieces=2)
        staying = RecordingServer(second, shards_service(ns), store.blob)
        for server in (going, staying):
            await server.start()
        path = str(tmp_path / digest)
        with pytest.raises(BlobUnavailable):
            await fetch_blob_file(joiner, shards_service(ns), [first.streams.peer_id], digest, size, path, PIECE, 5.0)
        assert going.offsets == [0, PIECE] and os.path.getsize(path + ".part") == 2 * PIECE
        assert not os.path.exists(path)
        liars = set()
        peer = await fetch_blob_file(joiner, shards_service(ns), [second.streams.peer_id], digest, size, path,
                                     PIECE, 5.0, liars)
        assert peer == second.streams.peer_id and not liars
        assert staying.offsets == [2 * PIECE, 3 * PIECE, 4 * PIECE]  # only what was missing
        assert sha256_hex(open(path, "rb").read()) == digest and not os.path.exists(path + ".part")
        # a part file with wrong bytes names no one: it is dropped and the shard fetched again from one peer
        other, other_size = manifest.train[1]
        with open(str(tmp_path / other) + ".part", "wb") as f:
            f.write(b"\0" * PIECE)
        staying.offsets.clear()
        await fetch_blob_file(joiner, shards_service(ns), [second.streams.peer_id], other, other_size,
                              str(tmp_path / other), PIECE, 5.0, liars)
        assert not liars and staying.offsets == [PIECE, 2 * PIECE, 3 * PIECE, 4 * PIECE, 0, PIECE, 2 * PIECE,
                                                 3 * PIECE, 4 * PIECE]
        assert sha256_hex((tmp_path / other).read_bytes()) == other

    asyncio.run(main())


def test_a_daemon_never_trains_a_sharded_run_on_other_text(tmp_path, corpus_file, creator_store):
    from peerd.config import NodeConfig
    from peerd.roles.base import RunContext

    _, manifest = creator_store
    node = NodeConfig(checkpoint_dir=str(tmp_path / "node"), data=corpus_file, threads=1, device="cpu")
    ctx = RunContext.build("unit", RunConfig(dataset=manifest.spec), node, Hub().transport("solo"))
    with pytest.raises(DataError, match="shards:"):
        ctx.training_corpus()
