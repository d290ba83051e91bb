"""The MoE transformer: shapes, top-k routing, the load-balancing loss, gradients only where tokens were routed, and
local experts (gradient + AdamW state only for shared + own experts)."""

import pytest
import torch

from peerd.models import count_parameters
from peerd.models.local_experts import gradient_bytes, optimizer_state_bytes, train_only_experts
from peerd.models.moe import (MOE_SIZES, MoEConfig, MoETransformer, build_moe_model, expert_parameter_names,
                              load_balancing_loss, shared_parameter_names)

pytestmark = pytest.mark.timeout(120)


def small(n_experts=8, top_k=2, **kw):
    return MoETransformer(MoEConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2, mlp_hidden=48,
                                    n_experts=n_experts, top_k=top_k, **kw), seed=0)


def test_forward_shapes_loss_and_deterministic_init():
    model = build_moe_model("tiny-moe", 32, seed=3)
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 32, 256) and loss.dim() == 0 and torch.isfinite(loss)
    torch.testing.assert_close(loss.detach(), model.last_ce_loss + model.config.aux_loss_coef * model.last_aux_loss)
    assert model(idx)[1] is None
    model.eval()  # evaluation reports the cross-entropy alone
    assert torch.equal(model(idx, idx)[1], model.last_ce_loss)
    model.train()
    again = build_moe_model("tiny-moe", 32, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    assert MOE_SIZES["small-moe"]["n_experts"] == 16 and MOE_SIZES["small-moe"]["top_k"] == 2
    with pytest.raises(ValueError):
        model(torch.zeros(2, 33, dtype=torch.long))
    with pytest.raises(ValueError):
        small(n_experts=2, top_k=3)
    with pytest.raises(ValueError):
        build_moe_model("huge-moe", 32, 0)


def test_expert_and_shared_names_partition_the_parameters():
    model = small()
    named = dict(model.named_parameters())
    experts = [expert_parameter_names(model, e) for e in range(8)]
    shared = shared_parameter_names(model)
    every = [n for names in experts for n in names] + list(shared)
    assert sorted(every) == sorted(named) and len(set(every)) == len(every)
    assert all(len(names) == 2 * 3 for names in experts)  # 2 blocks x (gate, up, proj)
    assert any(n.endswith("q_norm.weight") for n in shared) and any("router" in n for n in shared)
    assert count_parameters(model) == sum(named[n].numel() for n in every)


def test_routing_picks_k_distinct_experts_per_token():
    model = small(n_experts=8, top_k=2)
    idx = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))
    model(idx)
    for chosen in model.routing():
        assert chosen.shape == (3 * 16, 2)
        assert bool(((chosen >= 0) & (chosen < 8)).all())
        assert bool((chosen[:, 0] != chosen[:, 1]).all())
    model1 = small(n_experts=4, top_k=1)
    model1(idx)
    assert model1.routing()[0].shape == (48, 1)


def test_load_balancing_loss_is_one_when_uniform_and_larger_when_skewed():
    E, N = 8, 64
    uniform = torch.full((N, E), 1.0 / E)
    chosen = torch.stack([torch.arange(N) % E, (torch.arange(N) + 1) % E], dim=1)  # (N, 2)
    assert load_balancing_loss(uniform, chosen, E).item() == pytest.approx(1.0)
    skewed = torch.full((N, E), 0.02)
    skewed[:, 0] = 1.0 - 0.02 * (E - 1)
    all_zero = torch.stack([torch.zeros(N, dtype=torch.long), torch.ones(N, dtype=torch.long)], dim=1)
    assert load_balancing_loss(skewed, all_zero, E).item() > 3.0
    # a model whose routers are zero routes uniformly: its aux loss is the minimum, 1
    model = small()
    with torch.no_grad():
        for block in model.blocks:
            block.moe.router.weight.zero_()
    model(torch.randint(0, 256, (2, 16)))
    assert model.last_aux_loss.item() == pytest.approx(1.0)


def test_gradients_reach_only_the_routed_experts():
    model = small(n_experts=8, top_k=2)
    idx = torch.randint(0, 256, (1, 2), generator=torch.Generator().manual_seed(2))  # 2 tokens: <= 4 experts/layer
    _, loss = model(idx, idx)
    loss.backward()
    for layer, chosen in enumerate(model.routing()):
        routed = set(chosen.reshape(-1).tolist())
        assert len(routed) < 8
        for e in range(8):
            grads = [model.get_parameter(n).grad for n in expert_parameter_names(model, e)
                     if n.startswith(f"blocks.{layer}.")]
            if e in routed:
                assert all(g is not None and g.abs().sum() > 0 for g in grads), (layer, e)
            else:
                assert all(g is None for g in grads), (layer, e)
    assert all(model.get_parameter(n).grad is not None for n in shared_parameter_names(model))


def _train_step_bytes(model, experts):
    trainable = train_only_experts(model, experts)
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    idx = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(3))  # 128 tokens reach every expert
    _, loss = model(idx, idx)
    loss.backward()
    optimizer.step()
    moments = sum(s[k].numel() * s[k].element_size() for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))
    return gradient_bytes(model), moments, optimizer_state_bytes(optimizer), len(trainable)


def test_four_peers_with_four_of_sixteen_experts_keep_a_quarter_of_the_expert_training_state():
    reference = small(n_experts=16)
    shared = sum(reference.get_parameter(n).numel() for n in shared_parameter_names(reference))
    per_expert = sum(reference.get_parameter(n).numel() for n in expert_parameter_names(reference, 0))
    experts_total = 16 * per_expert
    full_grad, full_moments, _, _ = _train_step_bytes(small(n_experts=16), range(16))
    assert full_grad == 4 * (shared + experts_total) and full_moments == 8 * (shared + experts_total)
    for peer in range(4):
        model = small(n_experts=16)
        own = range(4 * peer, 4 * peer + 4)
        grad, moments, state, tensors = _train_step_bytes(model, own)
        trained = shared + experts_total * 4 // 16
        assert grad == 4 * trained, peer
        assert moments == 8 * trained, peer
        assert moments <= state <= moments + 8 * tensors  # + AdamW's scalar step counters
        frozen = [n for e in range(16) if e not in own for n in expert_parameter_names(model, e)]
        assert all(model.get_parameter(n).grad is None and not model.get_parameter(n).requires_grad for n in frozen)
        assert grad + moments < 0.5 * (full_grad + full_moments)
    with pytest.raises(IndexError):
        train_only_experts(small(n_experts=16), [16])
