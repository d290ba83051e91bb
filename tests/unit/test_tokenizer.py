"""The run's subword tokenizer: deterministic training, identical ids on every peer, digest checks, the cache of
tokenized corpora, and a joiner fetching the file from a live peer (a lying peer is skipped)."""

import asyncio
import json

import numpy as np
import pytest
import torch

import peerd.data.corpus_store
import peerd.data.corpus
from peerd.config import ConfigError, NodeConfig
from peerd.data.corpus import DataError, load_corpus, tokenize_corpus
from peerd.commands.export import checkpoint_tokenizer, export_llama, find_checkpoint, load_checkpoint_model
from peerd.commands.generate import generate_text
from peerd.identity.namespace import RunNamespace, RunRef
from peerd.roles.base import RunContext
from peerd.roles.diloco import DiLoCoRole
from peerd.roles.tokenizer_sync import resolve_tokenizer, serve_tokenizers
from peerd.run_config import RunConfig
from peerd.status.records import make_status
from peerd.data.tokenizer import BpeTokenizer, TokenizerCache, TokenizerError, parse_spec, train_bpe
from peerd.transport.inprocess import Hub
from protocols.blobs import BlobServer, BlobUnavailable, fetch_blob, sha256_hex
from protocols.diloco import DiLoCoHyperparams

pytestmark = pytest.mark.timeout(120)

DOCS = [f"To be, or not to be: that is the question {i}.\nWhether 'tis nobler in the mind to suffer" for i in range(300)]


@pytest.fixture(scope="module")
def bpe() -> BpeTokenizer:
    return train_bpe(DOCS, vocab_size=300)


def test_training_is_deterministic_and_peers_encode_alike(bpe):
    again = train_bpe(DOCS, vocab_size=300)
    assert again.data == bpe.data and again.digest == bpe.digest == sha256_hex(bpe.data)
    other_peer = BpeTokenizer(bpe.data)  # what a joiner builds from the fetched file
    text = "To be, or not to be, that is Hamlet's question\n\nÉ 漢字 ✓"
    ids = bpe.encode(text)
    assert ids.dtype == torch.int32 and torch.equal(ids, other_peer.encode(text))
    assert ids.numel() < len(text.encode())  # merges learned
    assert bpe.decode(ids) == text  # byte-level: any text round-trips, no unknown tokens
    assert bpe.vocab_size == 300
    with pytest.raises(ValueError):
        bpe.decode([300])
    with pytest.raises(TokenizerError):
        BpeTokenizer(b"{not json")


def test_spec_in_the_run_config(bpe):
    assert parse_spec("bytes") is None and parse_spec(bpe.spec) == bpe.digest
    for bad in ("bpe", "bpe:" + "0" * 63, "bpe:" + "G" * 64, "wordpiece"):
        with pytest.raises(ValueError):
            parse_spec(bad)
        with pytest.raises(ConfigError, match="tokenizer"):
            RunConfig(tokenizer=bad)
    # the default is fingerprint-neutral (older peers computed the same fingerprint); a BPE run is another run
    assert RunConfig().fingerprint() == RunConfig(tokenizer="bytes").fingerprint()
    assert RunConfig(tokenizer=bpe.spec).fingerprint() != RunConfig().fingerprint()


def test_cache_hands_out_only_files_with_the_right_digest(tmp_path, bpe):
    cache = TokenizerCache(tmp_path)
    assert cache.get(bpe.digest) is None
    path = cache.put(bpe)
    assert cache.get(bpe.digest).digest == bpe.digest and cache.blob(bpe.digest) == bpe.data
    path.write_bytes(bpe.data + b" ")  # damaged on disk
    assert cache.get(bpe.digest) is None and not path.exists()


def test_local_corpus_streamed_into_memory_mapped_caches(tmp_path, bpe, monkeypatch, caplog):
    """A local corpus (text with CRLF and multi-byte characters, and jsonl) is streamed in pieces smaller than a
    document into a byte cache and an id cache; both equal the in-memory path exactly, and a second start reads them
    memory-mapped without reading or tokenizing again."""
    (tmp_path / "a.txt").write_bytes("\r\n\r\n".join(DOCS[:120]).encode() + "\n\n\n É 漢字 ✓\r\n".encode())
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": d + " ✓"}) for d in DOCS[120:]) + "\n")
    spec = str(tmp_path / "*.*")
    monkeypatch.setattr(peerd.data.corpus_store, "PIECE_BYTES", 61)
    monkeypatch.setattr(peerd.data.corpus, "PIECE_BYTES", 61)
    in_memory = load_corpus(spec)
    cache = tmp_path / "cache"
    streamed = load_corpus(spec, cache)
    assert torch.equal(streamed.train, in_memory.train) and torch.equal(streamed.eval, in_memory.eval)
    assert streamed.eval_files == in_memory.eval_files and streamed.key
    with caplog.at_level("INFO", logger="peerd.data"):
        ids = tokenize_corpus(streamed, bpe, cache)
    said = [r.getMessage() for r in caplog.records if r.name == "peerd.data"]
    assert len(said) == 2 and all("tokenizing the" in m and "once, cached in" in m for m in said)  # train, eval
    whole = tokenize_corpus(in_memory, bpe)  # one pass over the whole text, no cache
    assert ids.train.dtype == torch.int32 and torch.equal(ids.train, whole.train) and torch.equal(ids.eval, whole.eval)
    assert int(ids.train.max()) >= 256 and int(ids.train.max()) < bpe.vocab_size
    assert sorted(p.suffix for p in cache.iterdir()) == [".i32", ".i32", ".json", ".u8"]

    monkeypatch.setattr(peerd.data.corpus, "_file_pieces", lambda *a: pytest.fail("read the files again"))
    monkeypatch.setattr(peerd.data.corpus_store, "encode_bytes", lambda *a: pytest.fail("tokenized again"))
    maps = []
    real_memmap = np.memmap
    monkeypatch.setattr(np, "memmap", lambda *a, **k: maps.append(k["mode"]) or real_memmap(*a, **k))
    caplog.clear()
    with caplog.at_level("INFO", logger="peerd.data"):
        again = tokenize_corpus(load_corpus(spec, cache), bpe, cache)
    assert not [r for r in caplog.records if "tokenizing" in r.getMessage()]  # cached: nothing to say
    assert torch.equal(again.train, ids.train) and torch.equal(again.eval, ids.eval)
    assert maps == ["c"] * 3  # bytes, train ids, eval ids: memory-mapped copy-on-write
    assert tokenize_corpus(in_memory, peerd.data.corpus.ByteTokenizer) is in_memory  # bytes: the corpus is its own ids


def test_jsonl_corpus_reads_the_text_field(tmp_path):
    good = tmp_path / "docs.jsonl"
    good.write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS[:50])) + "\n")
    corpus = load_corpus(str(good))
    assert (corpus.train.numpy().tobytes() + corpus.eval.numpy().tobytes()).decode() == "\n\n".join(DOCS[:50])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match="bad.jsonl:2"):
        load_corpus(str(bad))


class LyingServer(BlobServer):
    async def rpc_blob(self, request):
        await request.reply({}, b"not the tokenizer you asked for")


def test_a_joiner_fetches_the_file_from_a_live_peer_and_skips_a_liar(tmp_path, bpe, wait_for_order):
    async def main():
        hub = Hub()
        ns = RunNamespace(RunRef("unit"))
        creator, liar, joiner = (hub.transport(name) for name in ("creator", "liar", "joiner"))
        creator_cache = TokenizerCache(tmp_path / "creator")
        creator_cache.put(bpe)
        honest = serve_tokenizers(creator, ns, creator_cache)
        lying = LyingServer(liar, honest.name, lambda digest: None)
        for server in (honest, lying):
            await server.start()
        for t in (liar, creator):  # both look like live peers of the run
            await t.discovery.store(ns.status_key, t.streams.peer_id, make_status(role="training", outer_round=1),
                                    t.discovery.time() + 60)
        cache = TokenizerCache(tmp_path / "joiner")
        got = await resolve_tokenizer(bpe.spec, cache, joiner, ns, asyncio.Event())
        assert got.digest == bpe.digest and cache.get(bpe.digest) is not None
        assert honest.served == 1
        with pytest.raises(BlobUnavailable):  # the liar alone: its bytes never count
            await fetch_blob(joiner, honest.name, [liar.streams.peer_id], bpe.digest, 1 << 20, 5.0)
        with pytest.raises(ValueError):
            await fetch_blob(joiner, honest.name, [creator.streams.peer_id], "../etc/passwd", 1 << 20, 5.0)
        # nobody has it: the wait ends when the daemon stops
        stop = asyncio.Event()
        other = train_bpe(DOCS[:100], vocab_size=280)
        waiting = asyncio.ensure_future(resolve_tokenizer(other.spec, TokenizerCache(tmp_path / "w"), joiner, ns,
                                                          stop, retry_s=0.05))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        stop.set()
        assert await asyncio.wait_for(waiting, 5) is None

    asyncio.run(main())


def test_a_diloco_peer_trains_on_bpe_tokens(tmp_path, bpe):
    """The role sizes the model by the tokenizer's vocabulary and trains on its ids."""
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(DOCS))
    run = RunConfig(model="tiny", seq_len=16, batch_size=2, eval_batches=1, dataset="local", tokenizer=bpe.spec,
                    diloco=DiLoCoHyperparams(inner_steps=2, warmup_steps=1))
    node = NodeConfig(checkpoint_dir=str(tmp_path / "node"), data=str(text), threads=1, device="cpu")
    ctx = RunContext.build("unit", run, node, Hub().transport("solo"))
    ctx.tokenizer = bpe
    role = DiLoCoRole(ctx)
    assert role.model.config.vocab_size == bpe.vocab_size
    x, _ = role.sampler.next_batch()
    assert int(x.max()) >= 256  # merged tokens, not bytes
    assert len(list((tmp_path / "node" / "corpus-cache").glob("*.i32"))) == 2  # ids cached for the next start

    async def main():
        await role.train_until_quota()

    asyncio.run(main())
    assert role.steps_since_sync == 2

    # what the run produced is usable with its tokenizer: generate, and export with tokenizer.json
    TokenizerCache(tmp_path / "node" / "tokenizers").put(bpe)  # the daemon's cache, as resolve_tokenizer leaves it
    role.save_checkpoint()
    path = find_checkpoint(tmp_path / "node")
    assert checkpoint_tokenizer(path).digest == bpe.digest
    model = load_checkpoint_model(path, weights="local")
    assert torch.equal(model.tok_emb.weight, role.model.tok_emb.weight.detach())
    text = generate_text(model, "To be", max_new_tokens=5, tokenizer=bpe)
    assert text.startswith("To be") and len(bpe.encode(text)) >= len(bpe.encode("To be"))
    files = export_llama(model, tmp_path / "hf", checkpoint_tokenizer(path))
    assert [f.name for f in files] == ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"]
    import transformers  # the test extra installs it
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")  # as a byte-level run's export loads
    assert hf.encode("To be, or not to be") == bpe.encode("To be, or not to be").tolist()
    assert json.loads(files[1].read_text())["vocab_size"] == bpe.vocab_size


def test_a_presets_placeholder_tokenizer_is_refused_with_the_command_that_replaces_it(tmp_path):
    # node_configs/runs/{125m,350m,1.1b}.toml ship tokenizer = "bpe:000...0" until the creator trains the run's BPE:
    # a daemon started with it stops at once (exit 2 through the CLI) instead of waiting for a file no peer has
    from peerd.data.tokenizer import PLACEHOLDER_DIGEST
    from peerd.run_config import load_run_config

    assert load_run_config("node_configs/runs/1.1b.toml").tokenizer == f"bpe:{PLACEHOLDER_DIGEST}"

    async def main():
        hub = Hub()
        return await resolve_tokenizer(f"bpe:{PLACEHOLDER_DIGEST}", TokenizerCache(tmp_path / "c"),
                                       hub.transport("creator"), RunNamespace(RunRef("unit")), asyncio.Event())

    with pytest.raises(ConfigError, match="peerd tokenizer train") as refused:
        asyncio.run(main())
    assert refused.value.key == "tokenizer"
