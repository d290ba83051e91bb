"""The memory model (peerd/hardware/memory.py) against what torch really holds, measured on a CPU: the model state exactly
(weights, gradients, AdamW moments after a step), the activations through the tensors autograd saves for backward
(``saved_tensors_hooks``, counted by storage so views count once), and the choices the planner makes."""

import contextlib
import dataclasses

import pytest
import torch

from peerd.commands.main import main
from peerd.config import ConfigError, NodeConfig
from peerd.commands.doctor import check_memory
from peerd.hardware.memory import GIB, Shape, activation_bytes, estimate, fit_node, plan
from peerd.models.registry import MODEL_PRESETS, get_preset
from peerd.models.transformer import Transformer, TransformerConfig
from peerd.run_config import RunConfig
from protocols.diloco import DiLoCoHyperparams, make_inner_optimizer

pytestmark = pytest.mark.timeout(120)

#: Relative difference allowed between predicted and counted activation bytes: the model's coefficients are
#: counted from the same architecture, so only per-micro-batch constants (a scalar loss, RNG state) differ.
ACTIVATION_TOLERANCE = 0.01


def _saved_bytes(model: torch.nn.Module, batch: int, seq_len: int, precision: str) -> int:
    """Bytes of the storages autograd saves for backward in one forward pass, parameters and buffers excluded."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    gen = torch.Generator().manual_seed(batch)
    x = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        _, loss = model(x, x)
    assert loss is not None and saved
    return sum(saved.values())


def _model(vocab: int = 300, layers: int = 2, checkpointing: bool = False) -> Transformer:
    config = TransformerConfig(seq_len=64, vocab_size=vocab, d_model=192, n_layers=layers, n_heads=6, mlp_hidden=512)
    model = Transformer(config, seed=0)
    model.activation_checkpointing = checkpointing
    return model.train()


def _shape(model: Transformer) -> Shape:
    c = model.config
    return Shape(c.d_model, c.n_layers, c.n_heads, c.mlp_hidden, c.vocab_size)


def test_parameter_counts_match_the_registry_for_every_dense_preset():
    for name, preset in MODEL_PRESETS.items():
        if preset.family != "dense":
            with pytest.raises(ValueError, match="dense presets only"):
                Shape.of(name, 256)
            continue
        for vocab in (256, 32768):
            assert Shape.of(name, vocab).parameters == preset.parameter_count(vocab)


def test_model_state_bytes_are_exact_after_an_adamw_step():
    model = _model()
    optimizer = make_inner_optimizer(model.parameters(), DiLoCoHyperparams())
    x = torch.randint(0, 300, (2, 64))
    model(x, x)[1].backward()
    optimizer.step()
    est = estimate(_shape(model), seq_len=64, micro_batch_size=2, precision="fp32", device_type="cpu")
    assert est.weights == sum(p.numel() * p.element_size() for p in model.parameters())
    assert est.gradients == sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    moments = sum(v.numel() * v.element_size() for state in optimizer.state.values()
                  for k, v in state.items() if k in ("exp_avg", "exp_avg_sq"))
    assert est.optimizer == moments
    assert est.step_temporaries == est.weights  # foreach AdamW's one fp32 copy on a CPU
    assert est.reserve == 0
    cuda = estimate(_shape(model), seq_len=64, micro_batch_size=2, precision="fp32", device_type="cuda")
    assert cuda.reserve > 0 and cuda.step_temporaries == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("model_name", ["d192-vocab256", "d192-vocab1000", "small"])
def test_predicted_activations_match_what_autograd_saves(precision, model_name):
    if model_name == "small":  # the preset itself: 6 blocks of width 384
        model = get_preset("small").build(seq_len=64, seed=0).train()
    else:
        model = _model(vocab=int(model_name.split("vocab")[1]), layers=3)
    e = 4 if precision == "fp32" else 2
    one, two = (_saved_bytes(model, b, 64, precision) for b in (1, 2))
    per_sequence = two - one  # what scales with the batch: the activations
    predicted = activation_bytes(_shape(model), 64, e, checkpointing=False)
    assert abs(per_sequence - predicted) <= ACTIVATION_TOLERANCE * predicted, (per_sequence, predicted)
    # what does not scale with the batch under autocast: the copies of the matmul weights, exactly
    est = estimate(_shape(model), seq_len=64, micro_batch_size=1, precision=precision, device_type="cpu")
    assert abs((one - per_sequence) - est.weight_copies) <= ACTIVATION_TOLERANCE * predicted


def test_checkpointed_blocks_keep_only_their_inputs():
    model = _model(layers=3, checkpointing=True)
    shape = _shape(model)
    one, two = (_saved_bytes(model, b, 64, "fp32") for b in (1, 2))
    # the forward pass keeps the block inputs and what the head saves; one block's activations come back in the
    # backward pass (the block term is checked by the test above)
    block = activation_bytes(shape, 64, 4, False) - activation_bytes(dataclasses.replace(shape, n_layers=2), 64, 4,
                                                                     False)
    predicted = activation_bytes(shape, 64, 4, checkpointing=True) - block
    assert abs((two - one) - predicted) <= ACTIVATION_TOLERANCE * predicted, (two - one, predicted)
    assert predicted + block < activation_bytes(shape, 64, 4, checkpointing=False) / 2


GPU_TARGETS = [("1.1b", 24), ("350m", 12), ("125m", 8)]


@pytest.mark.parametrize("preset,card_gib", GPU_TARGETS)
def test_each_preset_fits_its_target_card_with_nothing_set(preset, card_gib):
    # a card of card_gib GiB with 0.5 GiB taken by the CUDA context and the desktop; the run's default batch
    run = RunConfig(model=preset, seq_len=1024, batch_size=16)
    chosen = plan(Shape.of(preset, 256), seq_len=1024, batch_size=16, budget=int((card_gib - 0.5) * GIB))
    assert chosen.fits and run.batch_size % chosen.micro_batch_size == 0
    assert chosen.estimate.peak <= (card_gib - 0.5) * GIB
    # half the card does not hold it (or holds it only with a smaller plan): the planner really chose
    half = plan(Shape.of(preset, 256), seq_len=1024, batch_size=16, budget=int(card_gib / 2 * GIB))
    assert not half.fits or (half.micro_batch_size, half.activation_checkpointing) != (16, False)


def test_the_planner_prefers_the_whole_batch_then_big_micro_batches_then_checkpointing():
    shape = Shape.of("125m", 256)
    kw = dict(seq_len=1024, batch_size=16)
    roomy = plan(shape, budget=80 * GIB, **kw)
    assert (roomy.micro_batch_size, roomy.activation_checkpointing) == (16, False)
    whole = estimate(shape, seq_len=1024, micro_batch_size=16).peak
    smaller = plan(shape, budget=whole - 1, **kw)
    assert smaller.fits and smaller.micro_batch_size < 16 and not smaller.activation_checkpointing
    assert smaller.micro_batch_size * 1024 >= 4096
    tight = plan(shape, budget=int(3.5 * GIB), **kw)
    assert tight.fits and tight.activation_checkpointing
    hopeless = plan(shape, budget=GIB, **kw)
    assert not hopeless.fits and hopeless.activation_checkpointing  # the plan of the lowest peak, reported
    assert all(hopeless.estimate.peak <= plan(shape, budget=None, micro_batch_size=m, checkpointing=c, **kw)
               .estimate.peak for m in (1, 2, 4, 8, 16) for c in (False, True))
    mine = plan(shape, budget=80 * GIB, micro_batch_size=4, checkpointing=True, **kw)
    assert (mine.micro_batch_size, mine.activation_checkpointing) == (4, True)
    unknown = plan(shape, budget=None, **kw)
    assert unknown.fits and (unknown.micro_batch_size, unknown.activation_checkpointing) == (16, False)
    with pytest.raises(ValueError, match="must divide"):
        plan(shape, budget=None, micro_batch_size=5, **kw)


def test_eight_bit_adamw_shrinks_the_optimizer_state_to_about_a_quarter():
    shape = Shape.of("1.1b", 256)
    full = estimate(shape, seq_len=1024, micro_batch_size=1).optimizer
    small = estimate(shape, seq_len=1024, micro_batch_size=1, optimizer_8bit=True).optimizer
    assert full == 8 * shape.parameters and 0.25 <= small / full <= 0.26


def test_join_chooses_micro_batch_and_checkpointing_and_refuses_what_cannot_fit(tmp_path):
    node = NodeConfig(checkpoint_dir=str(tmp_path))
    run = RunConfig(model="125m", seq_len=1024, batch_size=16)
    cuda = torch.device("cuda")
    fitted, line = fit_node(node, run, cuda, 256, budget=(int(3.5 * GIB), "cuda:0 (a test card)"))
    assert fitted.activation_checkpointing and 16 % fitted.micro_batch_size == 0
    assert line.startswith("125m: predicted peak ") and "GiB of 3.5 GiB free on cuda:0 (a test card)" in line
    with pytest.raises(ConfigError) as refused:
        fit_node(node, run, cuda, 256, budget=(GIB, "cuda:0 (a test card)"))
    message = str(refused.value)
    assert "\n" not in message and message.startswith("125m does not fit cuda:0 (a test card): predicted peak")
    assert "optimizer_8bit" in message
    pinned = dataclasses.replace(node, micro_batch_size=16, activation_checkpointing=False)
    with pytest.raises(ConfigError, match="unset micro_batch_size and activation_checkpointing"):
        fit_node(pinned, run, cuda, 256, budget=(int(3.5 * GIB), "cuda:0"))
    # on a CPU nothing is chosen and nothing refused: the user's values (whole batch, no checkpointing)
    cpu, line = fit_node(node, run, torch.device("cpu"), 256)
    assert (cpu.micro_batch_size, cpu.activation_checkpointing) == (0, False) and "on cpu" in line
    # other parallelisms and mixture-of-experts models get no prediction
    assert fit_node(node, RunConfig(model="tiny-moe"), cuda, 256, budget=(GIB, "x")) == (node, None)


def test_doctor_prints_the_prediction_and_fails_when_it_cannot_fit(tmp_path):
    node = NodeConfig(checkpoint_dir=str(tmp_path), device="cpu")
    ok = check_memory(node, RunConfig(model="small", seq_len=128, batch_size=8))[0]
    assert ok.ok and ok.name == "memory" and "predicted peak" in ok.line()
    checks = check_memory(node, RunConfig(model="1.1b", seq_len=1024, batch_size=16), budget=(4 * GIB, "cuda:0 (x)"))
    assert ok.line().startswith("OK    memory")
    assert len(checks) == 1  # the host memory is not predicted for a run the device cannot hold
    bad = checks[0]
    assert not bad.ok and bad.line().startswith("FAIL  memory       1.1b does not fit")
    assert "; fix: " in bad.line() and "\n" not in bad.line()


def test_optimizer_8bit_is_refused_with_one_line_without_bitsandbytes(monkeypatch, tmp_path, capsys):
    import peerd.config as config

    monkeypatch.setattr(config, "bitsandbytes_installed", lambda: False)
    with pytest.raises(ConfigError, match="needs the bitsandbytes package"):
        NodeConfig(optimizer_8bit=True)
    code = main(["join", "--run-id", "x", "--checkpoint-dir", str(tmp_path), "--optimizer-8bit"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--optimizer-8bit" in err[0] and "pip install bitsandbytes" in err[0]
    monkeypatch.setattr(config, "bitsandbytes_installed", lambda: True)
    with pytest.raises(ConfigError, match="CUDA GPU"):
        NodeConfig(optimizer_8bit=True, device="cpu")
    with pytest.raises(ConfigError, match="8-bit AdamW needs a CUDA GPU"):
        fit_node(NodeConfig(optimizer_8bit=True, checkpoint_dir=str(tmp_path)), RunConfig(), torch.device("cpu"), 256)


def test_eight_bit_optimizer_comes_from_bitsandbytes(monkeypatch):
    import sys
    import types

    from peerd.worker.inner_step import make_optimizer

    made = []

    class AdamW8bit(torch.optim.AdamW):
        def __init__(self, params, **kw):
            made.append(kw)
            super().__init__(params, **kw)

    fake = types.ModuleType("bitsandbytes")
    fake.optim = types.SimpleNamespace(AdamW8bit=AdamW8bit)
    monkeypatch.setitem(sys.modules, "bitsandbytes", fake)
    hp = DiLoCoHyperparams()
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert isinstance(make_optimizer(params, "cuda", hp=hp, eight_bit=True), AdamW8bit)
    assert made == [dict(lr=hp.inner_lr, betas=tuple(hp.inner_betas), weight_decay=hp.inner_weight_decay)]
    assert type(make_optimizer(params, "cpu", hp=hp)) is torch.optim.AdamW
    with pytest.raises(ValueError, match="CUDA"):
        make_optimizer(params, "cpu", hp=hp, eight_bit=True)


def test_get_preset_shape_round_trip():
    assert Shape.of(get_preset("small"), 256) == Shape.of("small", 256)


def test_a_gpu_evaluates_in_the_background_where_the_copy_leaves_the_plan_as_it_is(tmp_path):
    node = NodeConfig(checkpoint_dir=str(tmp_path))
    cuda = torch.device("cuda")
    roomy, line = fit_node(node, RunConfig(model="125m", seq_len=1024, batch_size=16), cuda, 256,
                           budget=(80 * GIB, "cuda:0 (a big card)"))
    assert roomy.background_eval is True and line.endswith("evaluations on a copy of the weights")
    # 1.1b on a 24 GB card: the copy (4 bytes a parameter) does not fit beside the inner steps
    big = RunConfig(model="1.1b", seq_len=1024, batch_size=16)
    card = (int(23.5 * GIB), "cuda:0 (a 24 GB card)")
    tight, line = fit_node(node, big, cuda, 256, budget=card)
    assert tight.background_eval is False and "evaluations on a copy" not in line
    assert plan(Shape.of("1.1b", 256), seq_len=1024, batch_size=16, budget=card[0], eval_copy=True).fits is False
    with pytest.raises(ConfigError, match="1.1b does not fit"):  # asked for, it is counted and refused
        fit_node(dataclasses.replace(node, background_eval=True), big, cuda, 256, budget=card)
    # asked off, no copy is counted; a run without evaluations needs none; a CPU is left as it was
    off, line = fit_node(dataclasses.replace(node, background_eval=False), big, cuda, 256, budget=card)
    assert off.background_eval is False and "copy" not in line
    no_eval, _ = fit_node(node, RunConfig(model="125m", seq_len=1024, batch_size=16, eval_batches=0), cuda, 256,
                          budget=(80 * GIB, "x"))
    assert no_eval.background_eval is None
    cpu, _ = fit_node(node, RunConfig(model="125m", seq_len=1024, batch_size=16), torch.device("cpu"), 256)
    assert cpu.background_eval is None
