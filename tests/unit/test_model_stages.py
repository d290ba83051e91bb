import pytest
import torch

from peerd.models import build_model
from peerd.models.stages import PipelineStage, build_stage, split_model, stage_bounds

pytestmark = pytest.mark.timeout(60)

SEQ_LEN = 32


def batch(seed: int = 3, b: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, SEQ_LEN), generator=g), torch.randint(0, 256, (b, SEQ_LEN), generator=g)


def test_stage_bounds_cover_every_block_once():
    assert stage_bounds(4, 2) == [(0, 2), (2, 4)]
    assert stage_bounds(4, 3) == [(0, 2), (2, 3), (3, 4)]
    assert stage_bounds(6, 1) == [(0, 6)]
    for bad in (0, 5, 2.0):
        with pytest.raises(ValueError, match="num_stages"):
            stage_bounds(4, bad)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_pipeline_equals_single_process_forward_backward(num_stages):
    """Fixed wiring, one micro-batch, fp32: loss and every parameter's gradient match the unsplit model."""
    model = build_model("tiny", seq_len=SEQ_LEN, seed=0)
    stages = split_model(model, num_stages)
    x, y = batch()
    _, ref_loss = model(x, y)
    ref_loss.backward()

    # the pipeline as peers run it: each stage's input is a detached leaf, its gradient is sent back
    h = x
    inputs, outputs = [], []
    for stage in stages[:-1]:
        inp = h if stage.first else h.detach().requires_grad_(True)
        out = stage(inp)
        inputs.append(inp)
        outputs.append(out)
        h = out
    last_in = h.detach().requires_grad_(True)
    loss = stages[-1](last_in, y)
    loss.backward()
    grad = last_in.grad
    for stage, inp, out in zip(reversed(stages[:-1]), reversed(inputs), reversed(outputs)):
        out.backward(grad)
        grad = inp.grad if not stage.first else None

    assert torch.allclose(loss, ref_loss, rtol=0, atol=1e-6)
    ref = dict(model.named_parameters())
    blocks_done = 0
    for stage in stages:
        for name, p in stage.named_parameters():
            if name.startswith("blocks."):
                _, i, rest = name.split(".", 2)
                ref_name = f"blocks.{blocks_done + int(i)}.{rest}"
            elif name == "head":
                continue  # checked with the embedding below
            else:
                ref_name = name
            assert p.grad is not None, name
            if ref_name == "tok_emb.weight":
                got = p.grad + stages[-1].head.grad  # the tie, split across the two ends
            else:
                got = p.grad
            torch.testing.assert_close(got, ref[ref_name].grad, rtol=1e-5, atol=1e-7, msg=ref_name)
        blocks_done += len(stage.blocks)
    assert blocks_done == model.config.n_layers
    n_stage = sum(p.numel() for s in stages for p in s.parameters())
    n_model = sum(p.numel() for p in model.parameters())
    assert n_stage == n_model + model.tok_emb.weight.numel()  # only the untied head is new


def test_stages_copy_and_build_stage_is_deterministic():
    model = build_model("tiny", seq_len=SEQ_LEN, seed=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stage = split_model(model, 2)[1]
    with torch.no_grad():
        for p in stage.parameters():
            p.add_(1.0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    a, b = build_stage("tiny", SEQ_LEN, 5, 1, 2, device="cpu"), build_stage("tiny", SEQ_LEN, 5, 1, 2, device="cpu")
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert a.last and not a.first and len(a.blocks) == 2
    with pytest.raises(ValueError, match="stage index"):
        build_stage("tiny", SEQ_LEN, 5, 2, 2)


def test_one_stage_keeps_the_tie_and_equals_the_model():
    model = build_model("tiny", seq_len=SEQ_LEN, seed=0)
    (stage,) = split_model(model, 1)
    assert stage.head is None
    x, y = batch()
    assert torch.equal(stage(x, y), model(x, y)[1])


def test_stage_rejects_wrong_inputs():
    first, last = split_model(build_model("tiny", seq_len=SEQ_LEN, seed=0), 2)
    x, y = batch()
    with pytest.raises(ValueError, match="token ids"):
        first(torch.zeros(2, 4, 128))
    with pytest.raises(ValueError, match="activations"):
        last(x)
    with pytest.raises(ValueError, match="targets"):
        first(x, y)
    with pytest.raises(ValueError, match="seq_len"):
        last(torch.zeros(1, SEQ_LEN + 1, 128))
    assert isinstance(first, PipelineStage)
