"""Export to Hugging Face transformers' Llama: same logits as peerd's model; checkpoints found and checked."""

import pytest
import torch
import transformers  # in the test extra (setup.cfg)

from peerd.worker.checkpoint_file import Checkpoint, CheckpointError, checkpoint_path, save_checkpoint
from peerd.commands.export import export_llama, find_checkpoint, load_checkpoint_model
from peerd.models import build_model
from protocols.diloco import flatten_parameters

pytestmark = pytest.mark.timeout(120)



def _trained_like(seed: int = 3):
    """A tiny model whose norms are not all ones (so RMSNorm weights are checked too)."""
    model = build_model("tiny", 32, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def _save(tmp_path, run_id, net, **meta):
    flat = flatten_parameters(net)
    metadata = {"model": "tiny", "seq_len": 32} | meta
    save_checkpoint(checkpoint_path(tmp_path, run_id),
                    Checkpoint({"theta_outer": flat, "momentum": torch.zeros_like(flat),
                                "theta_local": flat + 1.0}, metadata))


def test_exported_llama_gives_the_same_logits(tmp_path):
    model = _trained_like()
    export_llama(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in model.parameters())
    x = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, _ = model(x)
        theirs = hf(input_ids=x).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_checkpoint_round_trip_picks_outer_or_local_weights(tmp_path):
    model = _trained_like()
    _save(tmp_path, "run-a", model)
    path = find_checkpoint(tmp_path)
    assert path == checkpoint_path(tmp_path, "run-a")
    outer = load_checkpoint_model(path)
    assert torch.equal(flatten_parameters(outer), flatten_parameters(model))
    local = load_checkpoint_model(path, weights="local")
    assert torch.equal(flatten_parameters(local), flatten_parameters(model) + 1.0)


def test_checkpoint_errors_are_clear(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        find_checkpoint(tmp_path)
    model = _trained_like()
    _save(tmp_path, "run-a", model)
    _save(tmp_path, "run-b", model, model="small")
    with pytest.raises(CheckpointError, match="--run-id"):
        find_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="parameters"):
        load_checkpoint_model(find_checkpoint(tmp_path, "run-b"))
    _save(tmp_path, "run-c", model, model=None, seq_len=None)
    with pytest.raises(CheckpointError, match="--model"):
        load_checkpoint_model(find_checkpoint(tmp_path, "run-c"))
    assert load_checkpoint_model(find_checkpoint(tmp_path, "run-c"), model="tiny", seq_len=32) is not None


def test_a_byte_level_export_loads_its_tokenizer_with_auto_tokenizer(tmp_path):
    """The ids of a byte-level run are the UTF-8 bytes: AutoTokenizer maps text to them and back, as it loads a BPE
    run's export (before, a byte-level export had no tokenizer file and AutoTokenizer asked for sentencepiece)."""
    files = export_llama(build_model("tiny", 16, seed=1), tmp_path / "hf")
    assert {f.name for f in files} >= {"tokenizer.json", "tokenizer_config.json"}
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in ("ROMEO:", "naïve café\n\n", " spaces  and\ttabs", "\u2603 ok"):
        ids = tok(text)["input_ids"]
        assert ids == list(text.encode("utf-8")), text
        assert tok.decode(ids) == text
    assert len(tok) == 256
