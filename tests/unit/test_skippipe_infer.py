"""Inference through a swarm with stages missing: the loss through the reachable stages (a missing stage is the
identity), the skipped stages named, nothing changed on the servers; generation the same way."""

import asyncio
import math

import pytest
import torch

from peerd.data.corpus import ByteTokenizer, load_corpus
from peerd.models import build_model, split_model
from peerd.commands.swarm_infer import evaluate_swarm, generate_swarm
from peerd.transport.inprocess import Hub
from protocols.skippipe import NoPath
from protocols.stage_service import PipelineTrainer, StageService, flat_parameters
from protocols.swarm import SwarmConfig, Wiring

pytestmark = pytest.mark.timeout(150)

SEQ_LEN = 32


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one torch thread (several spin against each other on a loaded machine, 30x slower here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def service_name(k: int) -> str:
    return f"run.swarm.stage{k}"


def reference_loss(stages, keep, x, y):
    """The split model run locally through the stages in ``keep`` only."""
    with torch.no_grad():
        h = x
        for k in keep[:-1]:
            h = stages[k](h)
        return stages[keep[-1]](h, y).item()


def test_eval_with_half_the_middle_stages_missing_names_them_and_matches_the_model_without_them():
    async def main():
        torch.manual_seed(0)
        stages = split_model(build_model("tiny", seq_len=SEQ_LEN, seed=0), 4)
        before = [flat_parameters(s) for s in stages]
        config = SwarmConfig(stages=4, codec="none")
        hub = Hub()
        for k in range(4):
            await StageService(service_name(k), stages[k], config).start(hub.transport(f"s{k}"))
        wiring = Wiring(4)
        wiring.set_servers({k: [f"s{k}"] for k in range(4)})
        trainer = PipelineTrainer(hub.transport("reader").streams, service_name, wiring, config, d_model=128)
        tokens = load_corpus("shakespeare").eval
        full = await evaluate_swarm(trainer, tokens, SEQ_LEN, 4, 2)
        hub.disconnect("s2")  # stage 2's only server is gone: found out on the first call, then skipped
        half = await evaluate_swarm(trainer, tokens, SEQ_LEN, 4, 2)
        text, skipped = await generate_swarm(trainer, "ROMEO:", 5, temperature=0.0, seq_len=SEQ_LEN)
        hub.disconnect("s3")
        with pytest.raises(NoPath):
            await evaluate_swarm(trainer, tokens, SEQ_LEN, 4, 1)
        return stages, before, tokens, full, half, text, skipped

    stages, before, tokens, full, half, text, skipped = asyncio.run(main())
    starts = torch.arange(8) * SEQ_LEN
    idx = starts[:, None] + torch.arange(SEQ_LEN + 1)
    x, y = tokens[idx[:, :-1]].long(), tokens[idx[:, 1:]].long()
    assert full.skipped == () and full.path == (0, 1, 2, 3) and full.tokens == 8 * SEQ_LEN
    ref = (reference_loss(stages, [0, 1, 2, 3], x[:4], y[:4]) + reference_loss(stages, [0, 1, 2, 3], x[4:], y[4:])) / 2
    assert full.nats_per_byte == pytest.approx(ref, abs=1e-5)
    assert half.skipped == (2,) and half.path == (0, 1, 3)
    ref_half = (reference_loss(stages, [0, 1, 3], x[:4], y[:4]) + reference_loss(stages, [0, 1, 3], x[4:], y[4:])) / 2
    assert half.nats_per_byte == pytest.approx(ref_half, abs=1e-5)
    assert math.isfinite(half.perplexity) and half.nats_per_byte != full.nats_per_byte
    assert skipped == (2,) and text.startswith("ROMEO:") and len(text.encode()) >= len("ROMEO:") + 1
    # forward only: no server kept an input or changed a parameter
    for stage, flat in zip(stages, before):
        assert torch.equal(flat_parameters(stage), flat)
        assert all(p.grad is None for p in stage.parameters())


def test_peerd_eval_and_generate_print_the_loss_and_the_skipped_stages(monkeypatch, capsys):
    """The commands over an in-process swarm (the DHT client replaced): one line naming the skipped stage; exit 1
    in one line when the last stage is unreachable."""
    import contextlib

    import peerd.commands.swarm_infer as swarm_infer
    from peerd.commands.main import main
    from peerd.run_config import RunConfig

    run = RunConfig(model="tiny", seq_len=SEQ_LEN, batch_size=2, eval_batches=1, parallelism="swarm",
                    swarm=SwarmConfig(stages=3, codec="none"))
    stages = split_model(build_model("tiny", seq_len=SEQ_LEN, seed=0), 3)
    live = {0: "s0", 2: "s2"}  # stage 1 has no server

    @contextlib.asynccontextmanager
    async def fake_client(node, run_id):
        assert list(node.initial_peers) == ["/ip4/127.0.0.1/tcp/1/p2p/12D3KooWDptq23arqsipaxkBVToiQZPCgYnmBUo2eYGMRa9FzXeq"] and str(run_id) == "skiprun"
        hub = Hub()
        for k, name in live.items():
            await StageService(service_name(k), stages[k], run.swarm).start(hub.transport(name))
        wiring = Wiring(3)
        wiring.set_servers({k: [name] for k, name in live.items()})
        yield (PipelineTrainer(hub.transport("cli").streams, service_name, wiring, run.swarm, d_model=128), run,
               ByteTokenizer)

    monkeypatch.setattr(swarm_infer, "open_swarm_client", fake_client)
    peers = ["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWDptq23arqsipaxkBVToiQZPCgYnmBUo2eYGMRa9FzXeq"]
    assert main(["eval", "--run-id", "skiprun", *peers]) == 0
    out = capsys.readouterr().out
    assert "through stages 0, 2; skipped: 1" in out and "nats/byte" in out, out
    assert main(["generate", "--run-id", "skiprun", "--prompt", "To be", "--max-tokens", "2", *peers]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("To be") and "skipped stages: 1" in captured.err
    live.pop(2)
    assert main(["eval", "--run-id", "skiprun", "--json", *peers]) == 1
    assert "stage 2 has no reachable server" in capsys.readouterr().err


def test_a_skipped_stage_is_the_identity_in_training_too():
    """codec "none": a micro-batch on path (0, 1, 3) has the loss and every gradient of the model without stage 2,
    and stage 2 gets no gradient; a bad path is refused before anything is sent."""
    import copy

    async def main():
        stages = split_model(build_model("tiny", seq_len=SEQ_LEN, seed=0), 4)
        local = copy.deepcopy(stages)
        config = SwarmConfig(stages=4, codec="none")
        hub = Hub()
        for k in range(4):
            await StageService(service_name(k), stages[k], config).start(hub.transport(f"s{k}"))
        wiring = Wiring(4)
        wiring.set_servers({k: [f"s{k}"] for k in range(4)})
        trainer = PipelineTrainer(hub.transport("t").streams, service_name, wiring, config, d_model=128)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randint(0, 256, (2, SEQ_LEN), generator=g), torch.randint(0, 256, (2, SEQ_LEN), generator=g)
        for bad in ((0, 2, 1, 3), (1, 3), (0, 1, 2)):
            with pytest.raises(ValueError):
                await trainer.step(x, y, path=bad)
        loss = await trainer.step(x, y, path=(0, 1, 3), prefer={1: "s1", 3: "nobody"})
        return stages, local, x, y, loss, wiring

    stages, local, x, y, loss, wiring = asyncio.run(main())
    ref = local[3](local[1](local[0](x)), y)
    ref.backward()
    assert loss == pytest.approx(ref.item(), abs=1e-6)
    assert all(p.grad is None for p in stages[2].parameters())
    for k in (0, 1, 3):
        for (name, p), q in zip(stages[k].named_parameters(), local[k].parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=f"stage {k} {name}")
    assert wiring.stats.sent == wiring.stats.completed == 1
