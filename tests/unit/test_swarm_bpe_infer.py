"""`peerd eval` / `peerd generate` through a swarm of a BPE run: the client fetches the run's tokenizer from a live
peer into its cache, evaluates in tokens (nats/token, with bits/byte beside) and samples in tokens."""

import contextlib
import json
import math

import pytest
import torch

from peerd.data.corpus import evaluate, load_corpus, tokenize_corpus
from peerd.events import Evaluated, RoundDone
from peerd.models import build_model, split_model
from peerd.identity.namespace import RunNamespace
from peerd.roles.base import eval_units
from peerd.roles.tokenizer_sync import fetch_run_tokenizer, serve_tokenizers
from peerd.run_config import RunConfig
from peerd.status.records import make_status
from peerd.data.tokenizer import TokenizerCache, train_bpe
from peerd.transport.inprocess import Hub
from protocols.stage_service import PipelineTrainer, StageService
from protocols.swarm import SwarmConfig, Wiring

pytestmark = pytest.mark.timeout(120)

SEQ_LEN = 16
DOCS = [f"To be, or not to be: that is the question {i}.\nWhether 'tis nobler in the mind to suffer" for i in range(60)]
PEERS = ["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWDptq23arqsipaxkBVToiQZPCgYnmBUo2eYGMRa9FzXeq"]


def service_name(k: int) -> str:
    return f"bpe.swarm.stage{k}"


def test_swarm_eval_and_generate_of_a_bpe_run_fetch_its_tokenizer(tmp_path, monkeypatch, capsys, wait_for_order):
    import peerd.commands.swarm_infer as swarm_infer
    from peerd.commands.main import main

    torch.set_num_threads(1)
    bpe = train_bpe(DOCS, vocab_size=300)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(DOCS))
    run = RunConfig(model="tiny", seq_len=SEQ_LEN, batch_size=2, eval_batches=1, parallelism="swarm",
                    dataset="local", tokenizer=bpe.spec, swarm=SwarmConfig(stages=2, codec="none"))
    model = build_model("tiny", SEQ_LEN, seed=0, vocab_size=bpe.vocab_size)
    stages = split_model(model, 2)
    client_cache = TokenizerCache(tmp_path / "client")
    fetched = []

    @contextlib.asynccontextmanager
    async def client(node, run_id):
        hub = Hub()
        ns = RunNamespace(run_id)  # the CLI hands over the parsed RunRef
        servers = [hub.transport(f"s{k}") for k in range(2)]
        creator_cache = TokenizerCache(tmp_path / "creator")
        creator_cache.put(bpe)
        files = serve_tokenizers(servers[0], ns, creator_cache)  # what every daemon serves
        await files.start()
        await servers[0].discovery.store(ns.status_key, servers[0].streams.peer_id,
                                         make_status(role="training", outer_round=0), servers[0].discovery.time() + 60)
        for k, t in enumerate(servers):
            await StageService(service_name(k), stages[k], run.swarm).start(t)
        wiring = Wiring(2)
        wiring.set_servers({k: [t.streams.peer_id] for k, t in enumerate(servers)})
        reader = hub.transport("cli")
        tokenizer = await fetch_run_tokenizer(run.tokenizer, client_cache, reader, ns, timeout_s=10)
        fetched.append(files.served)
        yield PipelineTrainer(reader.streams, service_name, wiring, run.swarm, d_model=128), run, tokenizer

    monkeypatch.setattr(swarm_infer, "open_swarm_client", client)
    assert main(["eval", "--run-id", "bpe", "--data", str(corpus), "--json", *PEERS]) == 0
    result = json.loads(capsys.readouterr().out)
    assert fetched == [1] and client_cache.get(bpe.digest) is not None  # fetched once, then cached
    eval_tokens = tokenize_corpus(load_corpus(str(corpus)), bpe).eval
    reference = evaluate(model, eval_tokens, SEQ_LEN, 2, 1)
    assert result["nats_per_token"] == pytest.approx(reference.nats_per_byte, abs=1e-4)  # per token of the BPE
    assert result["tokens"] == 2 * SEQ_LEN and result["skipped"] == []
    units = eval_units(bpe, eval_tokens, run)
    assert units["eval_unit"] == "token" and units["eval_bytes_per_token"] > 1.0  # merges cover several bytes
    targets = eval_tokens[1:2 * SEQ_LEN + 1]
    assert units["eval_bytes_per_token"] == pytest.approx(len(bpe.decode(targets).encode()) / targets.numel())
    assert result["bits_per_byte"] == pytest.approx(
        result["nats_per_token"] / units["eval_bytes_per_token"] / math.log(2))

    assert main(["eval", "--run-id", "bpe", "--data", str(corpus), *PEERS]) == 0
    line = capsys.readouterr().out
    assert "nats/token" in line and "bits/byte" in line and f"over {2 * SEQ_LEN} tokens" in line, line
    assert fetched == [1, 0]  # the second client found the file in its cache

    assert main(["generate", "--run-id", "bpe", "--prompt", "To be", "--max-tokens", "3", *PEERS]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("To be") and "skipped stages: none" in captured.err


def test_eval_events_say_their_unit():
    byte_event = Evaluated(2, 1.3862943611198906, 100)
    assert "1.3863 nats/byte (2.0000 bits/byte)" in byte_event.message()
    bpe_event = Evaluated(2, 2.772588722239781, 100, eval_unit="token", eval_bytes_per_token=2.0)
    assert "2.7726 nats/token (2.0000 bits/byte)" in bpe_event.message()
    assert bpe_event.fields()["eval_unit"] == "token"
    done = RoundDone(1, 2, 0, 0, 0.0, {}, 1, 0.0, 1.0, 1, 0, "d", "allreduce", 3.0, 10, eval_unit="token")
    assert "eval 3.0000 nats/token" in done.message() and "bits/byte" not in done.message()
    assert eval_units(type("Bytes", (), {})(), torch.zeros(10), RunConfig()) == {"eval_unit": "byte"}
