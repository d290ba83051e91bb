"""A trained model out of a peerd checkpoint: back into a :class:`~peerd.models.Transformer`, or to a folder that
Hugging Face ``transformers`` loads as ``LlamaForCausalLM`` (``model.safetensors`` + ``config.json``).

Why the mapping is direct: peerd's dense model is Llama's architecture (pre-norm RMSNorm, SwiGLU, no biases) with
the same RoPE convention as ``transformers``' Llama (rotate the first half of each head against the second half,
``inv_freq = base^(-2i/D)``), so q/k need no permutation; only the fused qkv projection is split and names change.
The LM head is tied to the embedding (``tie_word_embeddings``), stored once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

from peerd.worker.checkpoint_file import FILENAME, CheckpointError, load_checkpoint
from peerd.models.registry import get_preset
from peerd.models.transformer import Transformer

#: Which flat vector of a DiLoCo checkpoint to export: the run's synced model (every peer holds the same) or this
#: peer's model with its local inner steps since the last outer round.
WEIGHTS = ("outer", "local")


def find_checkpoint(checkpoint_dir: str | os.PathLike, run_id: Optional[str] = None) -> Path:
    """The checkpoint file of ``run_id`` under a node's ``checkpoint_dir`` (``<dir>/<run id>/state.safetensors``);
    without ``run_id`` the only run there, or ``<dir>/state.safetensors`` itself.

    Raises:
        CheckpointError: nothing there, or several runs and no ``run_id`` (the message lists them).
    """
    root = Path(checkpoint_dir).expanduser()
    if run_id is not None:
        path = root / run_id / FILENAME
        if not path.is_file():
            raise CheckpointError(f"no checkpoint of run {run_id!r} in {root} (looked for {path})")
        return path
    if (root / FILENAME).is_file():
        return root / FILENAME
    found = sorted(p for p in root.glob(f"*/{FILENAME}") if p.is_file())
    if not found:
        raise CheckpointError(f"no checkpoint in {root}")
    if len(found) > 1:
        runs = ", ".join(p.parent.name for p in found)
        raise CheckpointError(f"{root} holds checkpoints of several runs ({runs}): pass --run-id")
    return found[0]


def checkpoint_tokenizer(path: str | os.PathLike):
    """The tokenizer a checkpoint's run trained with: :class:`~peerd.data.corpus.ByteTokenizer` (also for checkpoints that
    do not record one), or its BPE from the node's tokenizer cache (``<checkpoint_dir>/tokenizers``, found next to
    the checkpoint or its run folder). Raises CheckpointError if the BPE file is not there."""
    from peerd.data.corpus import ByteTokenizer
    from peerd.data.tokenizer import TokenizerCache, parse_spec

    checkpoint = load_checkpoint(path)
    spec = checkpoint.metadata.get("tokenizer", "bytes") if checkpoint is not None else "bytes"
    try:
        digest = parse_spec(spec)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    if digest is None:
        return ByteTokenizer
    here = Path(path).expanduser().resolve().parent
    for folder in (here, here.parent):
        found = TokenizerCache(folder / "tokenizers").get(digest)
        if found is not None:
            return found
    raise CheckpointError(f"checkpoint {path} was trained with tokenizer {spec}, whose file is not in "
                          f"{here.parent / 'tokenizers'}: copy it there from a peer of the run")


def load_checkpoint_model(path: str | os.PathLike, weights: str = "outer", model: Optional[str] = None,
                          seq_len: Optional[int] = None) -> Transformer:
    """The dense model stored in a DiLoCo checkpoint file, on CPU in eval mode.

    Args:
        path: a checkpoint file (:func:`find_checkpoint`).
        weights: ``outer`` (theta_outer) or ``local`` (theta_local), see :data:`WEIGHTS`.
        model, seq_len: the run's model name and sequence length, for checkpoints that do not record them.

    Raises:
        CheckpointError: unreadable, not a DiLoCo checkpoint, model unknown, or the vector's size does not match.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    checkpoint = load_checkpoint(path)
    if checkpoint is None:
        raise CheckpointError(f"no checkpoint at {path}")
    meta = checkpoint.metadata
    model = model or meta.get("model")
    seq_len = seq_len or meta.get("seq_len")
    if not model or not seq_len:
        raise CheckpointError(f"checkpoint {path} does not record its model and seq_len: pass --model and --seq-len")
    try:
        preset = get_preset(model)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    if preset.family != "dense":
        raise CheckpointError(f"checkpoint {path} holds {model!r}, a {preset.family} model: only dense models export")
    flat = checkpoint.tensors.get(f"theta_{weights}")
    if flat is None:
        raise CheckpointError(f"checkpoint {path} has no theta_{weights}: is it a DiLoCo checkpoint?")
    net = Transformer(preset.config(int(seq_len), checkpoint_tokenizer(path).vocab_size), seed=0)
    params = list(net.parameters())
    if flat.numel() != sum(p.numel() for p in params):
        raise CheckpointError(f"checkpoint {path}: {flat.numel()} values, model {model!r} has "
                              f"{sum(p.numel() for p in params)} parameters")
    with torch.no_grad():
        offset = 0
        for p in params:  # the order of the role's whole-model fragment: named_parameters()
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    return net.eval()


def llama_config(model: Transformer) -> dict:
    """``config.json`` of a ``LlamaForCausalLM`` with ``model``'s architecture (fp32 weights)."""
    c = model.config
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.mlp_hidden,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.seq_len,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_base},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
    }


def llama_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """``model``'s weights under ``transformers``' Llama names (contiguous CPU fp32 copies; no ``lm_head``: tied)."""
    C = model.config.d_model
    out = {"model.embed_tokens.weight": model.tok_emb.weight, "model.norm.weight": model.norm.weight}
    for i, block in enumerate(model.blocks):
        prefix = f"model.layers.{i}"
        q, k, v = block.attn.qkv.weight.split(C, dim=0)  # (C, C) each: rows are output features, heads in order
        out |= {
            f"{prefix}.input_layernorm.weight": block.attn_norm.weight,
            f"{prefix}.self_attn.q_proj.weight": q,
            f"{prefix}.self_attn.k_proj.weight": k,
            f"{prefix}.self_attn.v_proj.weight": v,
            f"{prefix}.self_attn.o_proj.weight": block.attn.proj.weight,
            f"{prefix}.post_attention_layernorm.weight": block.mlp_norm.weight,
            f"{prefix}.mlp.gate_proj.weight": block.mlp.gate.weight,
            f"{prefix}.mlp.up_proj.weight": block.mlp.up.weight,
            f"{prefix}.mlp.down_proj.weight": block.mlp.proj.weight,
        }
    return {name: t.detach().to("cpu", torch.float32).contiguous().clone() for name, t in out.items()}


def export_llama(model: Transformer, out_dir: str | os.PathLike, tokenizer=None) -> list[Path]:
    """Write ``model.safetensors``, ``config.json``, ``tokenizer.json`` and ``tokenizer_config.json`` into
    ``out_dir`` (created); returns the paths written. ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)``
    then gives the same logits as ``model``, and ``AutoTokenizer.from_pretrained(out_dir)`` the run's token ids: the
    file of a BPE ``tokenizer`` (:class:`peerd.data.tokenizer.BpeTokenizer`), or for a byte-level run (``tokenizer``
    None or :class:`peerd.data.corpus.ByteTokenizer`) a tokenizer whose ids are the UTF-8 bytes."""
    from safetensors.torch import save_file

    from peerd.data.tokenizer import byte_level_tokenizer_json

    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    weights, config = out / "model.safetensors", out / "config.json"
    save_file(llama_state_dict(model), str(weights), metadata={"format": "pt"})
    config.write_text(json.dumps(llama_config(model), indent=2, sort_keys=True) + "\n")
    tokenizer_file, tokenizer_config = out / "tokenizer.json", out / "tokenizer_config.json"
    if getattr(tokenizer, "data", None) is None:
        tokenizer_file.write_text(byte_level_tokenizer_json())
    else:
        tokenizer.save(tokenizer_file)
    # without it AutoTokenizer guesses a tokenizer class from config.json's llama and asks for sentencepiece
    tokenizer_config.write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                            "model_max_length": model.config.seq_len,
                                            "clean_up_tokenization_spaces": False}, indent=2, sort_keys=True) + "\n")
    return [weights, config, tokenizer_file, tokenizer_config]
