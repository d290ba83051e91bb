import math

import pytest
import torch

from peerd.models import MODEL_SIZES, Transformer, TransformerConfig, build_model, count_parameters

pytestmark = pytest.mark.timeout(60)

SEQ_LEN = 32


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    return build_model("tiny", seq_len=SEQ_LEN, seed=0)


def random_batch(seed: int, batch: int = 4, seq_len: int = SEQ_LEN) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (batch, seq_len), generator=g)
    y = torch.randint(0, 256, (batch, seq_len), generator=g)
    return x, y


def test_shapes_and_untrained_loss_near_uniform(tiny):
    x, y = random_batch(1)
    logits, loss = tiny(x, y)
    assert logits.shape == (4, SEQ_LEN, 256)
    assert loss.dim() == 0
    assert abs(loss.item() - math.log(256)) < 0.2
    logits_short, no_loss = tiny(x[:, :5])
    assert logits_short.shape == (4, 5, 256)
    assert no_loss is None


def test_sequence_longer_than_seq_len_raises(tiny):
    with pytest.raises(ValueError, match="seq_len"):
        tiny(torch.zeros(1, SEQ_LEN + 1, dtype=torch.long))


def test_causal_masking(tiny):
    x, _ = random_batch(2)
    changed = x.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 256
    with torch.no_grad():
        before, _ = tiny(x)
        after, _ = tiny(changed)
    torch.testing.assert_close(before[:, :-1], after[:, :-1], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, -1], after[:, -1])


def test_same_seed_bit_identical_and_global_rng_untouched():
    rng_before = torch.random.get_rng_state()
    a = build_model("tiny", seq_len=SEQ_LEN, seed=7)
    b = build_model("tiny", seq_len=SEQ_LEN, seed=7)
    c = build_model("tiny", seq_len=SEQ_LEN, seed=8)
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_parameter_counts():
    assert 500_000 <= count_parameters(build_model("tiny", SEQ_LEN, 0)) <= 2_000_000
    assert 5_000_000 <= count_parameters(build_model("small", SEQ_LEN, 0)) <= 20_000_000


def test_state_dict_is_exactly_the_parameters(tiny):
    state = tiny.state_dict()
    assert not any("rope" in key for key in state)
    assert set(state) == {name for name, _ in tiny.named_parameters()}
    # Tied head: the embedding is the only vocab-sized matrix.
    assert sum(p.shape[0] == 256 for p in tiny.parameters()) == 1


def test_adamw_steps_lower_loss():
    model = build_model("tiny", seq_len=SEQ_LEN, seed=3)
    x, y = random_batch(4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_unknown_size_names_valid_sizes():
    with pytest.raises(ValueError) as info:
        build_model("huge", SEQ_LEN, 0)
    for size in MODEL_SIZES:
        assert size in str(info.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(n_heads=3), "divisible"),
        (dict(d_model=12, n_heads=4), "even"),
        (dict(n_layers=0), "n_layers"),
        (dict(seq_len=-1), "seq_len"),
    ],
)
def test_config_validation(overrides, message):
    kwargs = dict(seq_len=SEQ_LEN, d_model=16, n_layers=1, n_heads=2, mlp_hidden=32) | overrides
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**kwargs)
