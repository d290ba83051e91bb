"""`peerd export` and `peerd generate` on a checkpoint (real processes, CPU)."""

import json
import subprocess

import pytest
import torch

from peerd.worker.checkpoint_file import Checkpoint, checkpoint_path, save_checkpoint
from peerd.commands.generate import generate_text, sample
from peerd.models import build_model
from peerd.testing.localswarm import peerd_cmd
from protocols.diloco import flatten_parameters

pytestmark = pytest.mark.timeout(180)


def _peerd(*args, timeout=120):
    return subprocess.run(peerd_cmd(*args), capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def checkpoint_dir(tmp_path):
    model = build_model("tiny", 32, seed=5)
    flat = flatten_parameters(model)
    save_checkpoint(checkpoint_path(tmp_path, "demo"),
                    Checkpoint({"theta_outer": flat, "momentum": torch.zeros_like(flat), "theta_local": flat.clone()},
                               {"model": "tiny", "seq_len": 32}))
    return tmp_path, model


def test_generate_prints_the_prompt_and_sampled_text(checkpoint_dir):
    root, model = checkpoint_dir
    result = _peerd("generate", "--checkpoint-dir", str(root), "--prompt", "ROMEO:", "--max-tokens", "40",
                    "--temperature", "0.9", "--top-k", "20", "--seed", "7")
    assert result.returncode == 0, result.stderr
    text = result.stdout[:-1]  # print's newline
    assert text.startswith("ROMEO:") and len(text.encode()) > len("ROMEO:")
    assert text == generate_text(model, "ROMEO:", 40, 0.9, 20, seed=7)  # same model, same draws


def test_export_writes_a_llama_folder(checkpoint_dir, tmp_path):
    root, model = checkpoint_dir
    out = tmp_path / "hf"
    result = _peerd("export", "--checkpoint-dir", str(root), "--run-id", "demo", "--out", str(out))
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 4
    assert (out / "model.safetensors").stat().st_size > 4 * sum(p.numel() for p in model.parameters())
    # the run id as a joiner gives it (name@creator) names the same run: its checkpoint is under the name
    creator = "12D3KooW" + "A" * 44
    result = _peerd("export", "--checkpoint-dir", str(root), "--run-id", f"demo@{creator}", "--out", str(out / "b"))
    assert result.returncode == 0, result.stderr
    assert (out / "b" / "config.json").exists()


def test_bad_flags_exit_2_and_a_missing_checkpoint_exits_1(tmp_path):
    result = _peerd("generate", "--checkpoint-dir", str(tmp_path), "--prompt", "x", "--max-tokens", "-1")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    result = _peerd("export", "--checkpoint-dir", str(tmp_path / "none"), "--out", str(tmp_path / "o"))
    assert result.returncode == 1 and "no checkpoint" in result.stderr


def test_greedy_sampling_is_deterministic_and_top_k_one_is_greedy():
    model = build_model("tiny", 16, seed=1)
    prompt = torch.tensor([72, 105], dtype=torch.long)
    greedy = sample(model, prompt, 30, temperature=0)  # longer than seq_len: the context is cropped
    assert greedy.shape == (32,) and torch.equal(greedy[:2], prompt)
    top1 = sample(model, prompt, 30, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(3))
    assert torch.equal(top1, greedy)
    with pytest.raises(ValueError):
        sample(model, torch.tensor([], dtype=torch.long), 3)


@pytest.mark.parametrize("command", ["export", "generate"])
def test_help_describes_the_command(command):
    result = _peerd(command, "--help")
    assert result.returncode == 0, result.stderr
    assert "--checkpoint-dir" in result.stdout and "--weights" in result.stdout


def test_an_empty_prompt_samples_the_start_of_a_document(checkpoint_dir):
    root, model = checkpoint_dir
    result = _peerd("generate", "--checkpoint-dir", str(root), "--prompt", "", "--max-tokens", "20", "--seed", "3")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout[:-1] == generate_text(model, "", 20, seed=3)
    assert len(result.stdout[:-1].encode()) <= 20 * 4


def test_export_writes_into_the_checkpoint_folder_by_default(checkpoint_dir):
    root, _ = checkpoint_dir
    result = _peerd("export", "--checkpoint-dir", str(root))
    assert result.returncode == 0, result.stderr
    out = root / "demo" / "export"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert str(out) in result.stdout
