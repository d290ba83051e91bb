import math

import pytest
import torch

from protocols.diloco import (
    DiLoCoHyperparams,
    OuterState,
    flatten_parameters,
    inner_lr_at,
    load_flat_parameters_,
    make_inner_optimizer,
    set_lr,
    weighted_average,
)

pytestmark = pytest.mark.timeout(60)

HP = DiLoCoHyperparams(outer_lr=0.7, outer_momentum=0.9, outer_nesterov=True)
THETA0 = [1.0, -2.0]
G1 = [0.5, -1.0]
G2 = [0.25, 0.5]


def vec(values):
    return torch.tensor(values, dtype=torch.float32)


# ---- outer step


def test_two_outer_rounds_match_hand_computed_nesterov():
    # Round 1: buf = g1 = [0.5, -1.0]; step = g1 + 0.9 * buf = [0.95, -1.9];
    #          theta = [1.0, -2.0] - 0.7 * step = [0.335, -0.67]
    # Round 2: buf = 0.9 * [0.5, -1.0] + [0.25, 0.5] = [0.7, -0.4]; step = g2 + 0.9 * buf = [0.88, 0.14];
    #          theta = [0.335, -0.67] - 0.7 * step = [-0.281, -0.768]
    s0 = OuterState.initial(vec(THETA0))
    s1 = s0.apply(vec(G1), HP)
    torch.testing.assert_close(s1.momentum, vec([0.5, -1.0]), rtol=0, atol=1e-6)
    torch.testing.assert_close(s1.theta, vec([0.335, -0.67]), rtol=0, atol=1e-6)
    s2 = s1.apply(vec(G2), HP)
    torch.testing.assert_close(s2.momentum, vec([0.7, -0.4]), rtol=0, atol=1e-6)
    torch.testing.assert_close(s2.theta, vec([-0.281, -0.768]), rtol=0, atol=1e-6)
    assert (s0.outer_round, s1.outer_round, s2.outer_round) == (0, 1, 2)


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_rounds_match_torch_sgd(nesterov):
    hp = DiLoCoHyperparams(outer_nesterov=nesterov)
    gen = torch.Generator().manual_seed(0)
    theta0 = torch.randn(1000, generator=gen)
    grads = [torch.randn(1000, generator=gen) for _ in range(3)]

    param = torch.nn.Parameter(theta0.clone())
    sgd = torch.optim.SGD([param], lr=hp.outer_lr, momentum=hp.outer_momentum, nesterov=nesterov, dampening=0)
    state = OuterState.initial(theta0)
    for g in grads:
        param.grad = g.clone()
        sgd.step()
        state = state.apply(g, hp)
        # torch may fuse multiply-adds, so agreement is to rounding, not bitwise.
        torch.testing.assert_close(state.theta, param.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(state.momentum, sgd.state[param]["momentum_buffer"], rtol=1e-6, atol=1e-6)


def test_apply_does_not_mutate_and_rollback_is_bit_identical():
    s0 = OuterState.initial(vec(THETA0)).apply(vec(G1), HP)
    before = s0.digest()
    theta_before, momentum_before = s0.theta.clone(), s0.momentum.clone()
    s1 = s0.apply(vec(G2), HP)
    assert s1.digest() != before
    assert s0.digest() == before
    assert torch.equal(s0.theta, theta_before) and torch.equal(s0.momentum, momentum_before)
    assert s0.outer_round == 1


def test_apply_is_deterministic():
    gen = torch.Generator().manual_seed(1)
    theta, g = torch.randn(4097, generator=gen), torch.randn(4097, generator=gen)
    a = OuterState.initial(theta).apply(g, HP).apply(g, HP)
    b = OuterState.initial(theta.clone()).apply(g.clone(), HP).apply(g.clone(), HP)
    assert a.digest() == b.digest()


@pytest.mark.parametrize(
    "bad",
    [
        vec([float("nan"), 0.0]),
        vec([float("inf"), 0.0]),
        vec([1.0, 2.0, 3.0]),
        torch.tensor([1.0, 2.0], dtype=torch.float64),
        vec([[1.0, 2.0]]),
    ],
)
def test_apply_rejects_bad_input_without_touching_state(bad):
    s0 = OuterState.initial(vec(THETA0)).apply(vec(G1), HP)
    before = s0.digest()
    with pytest.raises(ValueError):
        s0.apply(bad, HP)
    assert s0.digest() == before


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("into", ["gradient", "other"])
def test_an_outer_step_into_a_handed_over_buffer_is_bit_identical_and_leaves_the_old_state(nesterov, into,
                                                                                           monkeypatch):
    # the round hands its pseudo-gradient's buffer over: the new theta is written there (4P bytes less); with the
    # averaged gradient itself as that buffer, the step runs chunk by chunk (3 chunks and a partial one here)
    import protocols.diloco.outer as outer

    monkeypatch.setattr(outer, "_STEP_CHUNK", 1000)
    hp = DiLoCoHyperparams(outer_lr=0.7, outer_momentum=0.9, outer_nesterov=nesterov)
    gen = torch.Generator().manual_seed(3)
    s0 = OuterState.initial(torch.randn(3500, generator=gen)).apply(torch.randn(3500, generator=gen), hp)
    g = torch.randn(3500, generator=gen)
    before = (s0.digest(), s0.theta.clone(), s0.momentum.clone())
    fresh = s0.apply(g.clone(), hp)
    handed = g.clone()
    out = handed if into == "gradient" else torch.empty(3500)
    reused = s0.apply(handed, hp, out=out)
    assert reused.theta.data_ptr() == out.data_ptr()  # no fresh buffer
    assert reused.digest() == fresh.digest()
    assert torch.equal(reused.theta, fresh.theta) and torch.equal(reused.momentum, fresh.momentum)
    assert s0.digest() == before[0] and torch.equal(s0.theta, before[1]) and torch.equal(s0.momentum, before[2])


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("into", [None, "gradient", "other"])
def test_the_chunked_outer_step_has_the_bits_of_one_pass_per_operation(nesterov, into, monkeypatch):
    # peers of other versions computed each operation over the whole vector; a chunk's operations are the same per
    # value, so the states (and their digests) agree bit for bit: 4 chunks and a partial one here
    import protocols.diloco.outer as outer

    monkeypatch.setattr(outer, "_STEP_CHUNK", 1000)
    hp = DiLoCoHyperparams(outer_lr=0.7, outer_momentum=0.9, outer_nesterov=nesterov)
    gen = torch.Generator().manual_seed(5)
    theta, momentum, g = (torch.randn(4500, generator=gen) for _ in range(3))
    buf = momentum * 0.9
    buf.add_(g)
    step = torch.mul(buf, 0.9).add_(g) if nesterov else buf.clone()
    expected = torch.sub(theta, step.mul_(0.7))
    handed = g.clone()
    out = {None: None, "gradient": handed, "other": torch.empty(4500)}[into]
    stepped = OuterState(theta, momentum, 1).apply(handed, hp, out=out)
    assert torch.equal(stepped.momentum, buf) and torch.equal(stepped.theta, expected)


def test_an_outer_step_that_overflows_is_refused_and_huge_finite_values_are_not():
    s0 = OuterState(vec([3e38, 3e38, -3e38]), vec([0.0, 0.0, 0.0]), 1)
    with pytest.raises(ValueError, match="theta contains non-finite"):
        s0.apply(vec([-1e38, 0.0, 0.0]), DiLoCoHyperparams(outer_lr=1.0))  # 3e38 + 1.9e38 overflows
    stepped = s0.apply(vec([0.0, 0.0, 0.0]), HP)  # the sum of theta overflows, every value is finite
    assert stepped.outer_round == 2 and torch.equal(stepped.theta, s0.theta)


def test_an_unfit_buffer_is_not_reused():
    s0 = OuterState.initial(vec(THETA0))
    g = vec(G1)
    for out in (torch.empty(3), torch.empty(2, dtype=torch.float64), torch.empty(4)[::2]):
        stepped = s0.apply(g, HP, out=out)
        assert stepped.theta.data_ptr() != out.data_ptr()
        assert torch.equal(stepped.theta, s0.apply(g, HP).theta)
    shared = torch.zeros(4)  # the gradient and the buffer overlap without being one vector
    shared[:2] = g
    stepped = s0.apply(shared[:2], HP, out=shared[1:3])
    assert torch.equal(stepped.theta, s0.apply(g, HP).theta) and torch.equal(shared[:2], g)


def test_an_in_place_pseudo_gradient_overwrites_the_handed_over_theta_local():
    s = OuterState.initial(vec(THETA0))
    local = vec([0.5, -1.0])
    delta = s.pseudo_gradient(local, in_place=True)
    assert delta.data_ptr() == local.data_ptr() and torch.equal(delta, vec([0.5, -1.0]))
    with pytest.raises(ValueError, match="contiguous fp32 CPU"):
        s.pseudo_gradient(torch.tensor([0.5, -1.0], dtype=torch.float64), in_place=True)


def test_pseudo_gradient_sign():
    s = OuterState.initial(vec(THETA0))
    local = vec([0.5, -1.0])  # the inner steps moved theta down by [0.5, -1.0]
    delta = s.pseudo_gradient(local)
    assert torch.equal(delta, vec([0.5, -1.0]))  # theta_outer - theta_local
    # Applying a plain SGD step with lr 1 and no momentum lands on the local parameters.
    hp = DiLoCoHyperparams(outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False)
    assert torch.equal(s.apply(delta, hp).theta, local)
    with pytest.raises(ValueError):
        s.pseudo_gradient(vec([1.0, 2.0, 3.0]))


def test_weighted_average_by_sample_counts():
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(100, generator=gen), torch.randn(100, generator=gen)
    assert torch.equal(weighted_average([a, b], [3, 1]), (3 * a + b) / 4)
    torch.testing.assert_close(weighted_average([a, b], [1.0, 1.0]), (a + b) / 2)
    torch.testing.assert_close(weighted_average([a, b], [0, 5]), b)  # (5 * b) / 5 rounds


@pytest.mark.parametrize(
    "weights", [[1.0], [-1.0, 2.0], [0.0, 0.0], [float("nan"), 1.0], [float("inf"), 1.0]]
)
def test_weighted_average_rejects_bad_weights(weights):
    with pytest.raises(ValueError):
        weighted_average([vec(THETA0), vec(G1)], weights)


# ---- inner schedule


def test_inner_lr_warmup_and_constant():
    hp = DiLoCoHyperparams(inner_lr=4e-4, warmup_steps=1000, lr_decay_steps=0)
    assert inner_lr_at(0, hp) == pytest.approx(4e-7)
    assert inner_lr_at(499, hp) == pytest.approx(2e-4)
    assert inner_lr_at(999, hp) == pytest.approx(4e-4)
    assert inner_lr_at(1000, hp) == 4e-4
    assert inner_lr_at(10**7, hp) == 4e-4
    assert inner_lr_at(0, DiLoCoHyperparams(warmup_steps=0)) == 4e-4
    with pytest.raises(ValueError):
        inner_lr_at(-1, hp)


def test_inner_lr_cosine_decay():
    hp = DiLoCoHyperparams(inner_lr=1e-3, warmup_steps=10, lr_decay_steps=100, min_lr_ratio=0.1)
    assert inner_lr_at(10, hp) == pytest.approx(1e-3)
    assert inner_lr_at(60, hp) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # halfway: cos = 0
    assert inner_lr_at(35, hp) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert inner_lr_at(110, hp) == pytest.approx(1e-4)
    assert inner_lr_at(5000, hp) == pytest.approx(1e-4)


def test_inner_optimizer_and_set_lr():
    model = torch.nn.Linear(3, 2)
    opt = make_inner_optimizer(model.parameters(), HP)
    group = opt.param_groups[0]
    assert isinstance(opt, torch.optim.AdamW)
    assert (group["lr"], group["betas"], group["weight_decay"]) == (4e-4, (0.9, 0.95), 0.1)
    set_lr(opt, inner_lr_at(5, HP))
    assert group["lr"] == pytest.approx(4e-4 * 6 / 1000)
    with pytest.raises(ValueError):
        set_lr(opt, float("nan"))


# ---- flat parameters


def test_flatten_and_load_round_trip():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    flat = flatten_parameters(model)
    numel = sum(p.numel() for p in model.parameters())
    assert flat.shape == (numel,) and flat.dtype == torch.float32 and not flat.requires_grad
    assert torch.equal(flat[:12], model[0].weight.detach().reshape(-1))  # parameters() order

    flat[0] = 123.0  # a copy: the model is untouched
    assert model[0].weight[0, 0].item() != 123.0

    new = torch.arange(numel, dtype=torch.float32)
    load_flat_parameters_(model, new)
    assert torch.equal(flatten_parameters(model), new)
    assert model[2].bias.tolist() == [numel - 2.0, numel - 1.0]

    half = torch.nn.Linear(2, 2).to(torch.float16)
    load_flat_parameters_(half, torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]))
    assert half.weight.dtype == torch.float16 and half.bias.tolist() == [5.0, 6.0]

    with pytest.raises(ValueError):
        load_flat_parameters_(model, torch.zeros(numel + 1))


# ---- hyperparameters


@pytest.mark.parametrize(
    "field, value",
    [
        ("inner_steps", 0),
        ("inner_steps", 1.5),
        ("inner_lr", 0.0),
        ("inner_lr", float("nan")),
        ("inner_weight_decay", -0.1),
        ("inner_betas", (0.9, 1.0)),
        ("inner_betas", (0.9,)),
        ("warmup_steps", -1),
        ("lr_decay_steps", -1),
        ("min_lr_ratio", 1.5),
        ("outer_lr", -0.7),
        ("outer_momentum", 1.0),
        ("outer_momentum", -0.1),
        ("outer_nesterov", 1),
        ("grad_clip_norm", -1.0),
    ],
)
def test_hyperparams_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        DiLoCoHyperparams(**{field: value})


def test_hyperparams_dict_round_trip_and_unknown_key():
    hp = DiLoCoHyperparams(inner_steps=50, inner_betas=(0.8, 0.9), outer_lr=1)
    assert hp.outer_lr == 1.0 and isinstance(hp.outer_lr, float)
    d = hp.to_dict()
    assert d["inner_betas"] == [0.8, 0.9]
    assert DiLoCoHyperparams.from_dict(d) == hp
    assert DiLoCoHyperparams.from_dict({}) == DiLoCoHyperparams()
    with pytest.raises(ValueError, match="outer_lrr"):
        DiLoCoHyperparams.from_dict({"outer_lrr": 0.7})


# ---- state dict and digest


def test_state_dict_round_trip():
    s = OuterState.initial(vec(THETA0)).apply(vec(G1), HP)
    r = OuterState.from_state_dict(s.state_dict(), numel=2)
    assert r.digest() == s.digest() and r.outer_round == 1
    assert r.theta.data_ptr() != s.theta.data_ptr()  # copied


@pytest.mark.parametrize(
    "change",
    [
        {"theta": vec([1.0, 2.0, 3.0])},
        {"momentum": vec([0.0])},
        {"theta": vec([float("nan"), 0.0])},
        {"momentum": vec([0.0, float("inf")])},
        {"theta": torch.tensor([1.0, 2.0], dtype=torch.float64)},
        {"theta": [1.0, 2.0]},
        {"outer_round": -1},
        {"outer_round": 1.0},
        {"extra": 1},
    ],
)
def test_from_state_dict_rejects_malformed(change):
    d = dict(OuterState.initial(vec(THETA0)).state_dict())
    d.update(change)
    with pytest.raises(ValueError):
        OuterState.from_state_dict(d, numel=2)


def test_from_state_dict_rejects_missing_key_and_wrong_numel():
    d = dict(OuterState.initial(vec(THETA0)).state_dict())
    with pytest.raises(ValueError, match="numel|elements"):
        OuterState.from_state_dict(d, numel=3)
    del d["momentum"]
    with pytest.raises(ValueError, match="momentum"):
        OuterState.from_state_dict(d)


def test_digest_changes_with_round_and_one_flipped_bit():
    s = OuterState.initial(vec(THETA0)).apply(vec(G1), HP)
    base = s.digest()
    assert len(base) == 64 and base == OuterState(s.theta.clone(), s.momentum.clone(), 1).digest()
    assert OuterState(s.theta, s.momentum, 2).digest() != base

    for name in ("theta", "momentum"):
        t = getattr(s, name).clone()
        t.view(torch.int32)[1] ^= 1  # flip the lowest mantissa bit
        flipped = OuterState(t, s.momentum, 1) if name == "theta" else OuterState(s.theta, t, 1)
        assert flipped.digest() != base


def test_constructor_validates():
    with pytest.raises(ValueError):
        OuterState(vec([1.0, float("nan")]), vec([0.0, 0.0]), 0)
    with pytest.raises(ValueError):
        OuterState(vec([1.0, 2.0]), vec([0.0]), 0)
    with pytest.raises(ValueError):
        OuterState(vec([1.0, 2.0]), torch.zeros(2, dtype=torch.float64), 0)
