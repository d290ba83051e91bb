"""Sampling text from a trained model: temperature and top-k sampling (Fan et al. 2018, "Hierarchical Neural
Story Generation", section 5.4), in the run's tokens (bytes, or its BPE)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from peerd.data.corpus import DOC_SEPARATOR, ByteTokenizer


@torch.no_grad()
def sample(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
           top_k: int = 50, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Extend ``prompt`` by ``max_new_tokens`` tokens drawn from ``model``.

    Args:
        model: ``model(idx) -> (logits (B, T, V), _)`` with a ``config.seq_len`` context; the context is cropped to
            its last ``seq_len`` tokens (no KV cache: each token re-reads the context, fine for small models).
        prompt: int64 token ids, (T0,) with T0 >= 1.
        max_new_tokens: >= 0 tokens to add.
        temperature: > 0 divides the logits; 0 = greedy (the most likely token every time).
        top_k: sample among the k most likely tokens only; 0 = all of them.
        generator: CPU generator for reproducible draws.

    Returns:
        int64 ids (T0 + max_new_tokens,) on CPU, the prompt first.

    Raises:
        ValueError: empty prompt, or negative ``max_new_tokens`` / ``temperature`` / ``top_k``.
    """
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise ValueError("the prompt must be a non-empty 1-D sequence of token ids")
    if max_new_tokens < 0 or temperature < 0 or top_k < 0:
        raise ValueError(f"max_new_tokens ({max_new_tokens}), temperature ({temperature}) and top_k ({top_k}) "
                         "must be >= 0")
    device = next(model.parameters()).device
    seq_len = model.config.seq_len
    was_training = model.training
    model.eval()
    ids = prompt.to(torch.long).cpu()
    try:
        for _ in range(max_new_tokens):
            context = ids[-seq_len:].to(device)[None]  # (1, T)
            logits, _ = model(context)
            token = next_token(logits[0, -1], temperature, top_k, generator)
            ids = torch.cat((ids, token.view(1)))
    finally:
        model.train(was_training)
    return ids


def next_token(logits: torch.Tensor, temperature: float, top_k: int,
               generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Draw one token id (0-dim int64, CPU) from next-token ``logits`` (V,): greedy at temperature 0, else from
    the softmax of ``logits / temperature`` over the ``top_k`` most likely (0: all)."""
    logits = logits.float().cpu()
    if temperature == 0:
        return logits.argmax()
    logits = logits / temperature
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)[0]


def generate_text(model: nn.Module, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                  top_k: int = 50, seed: int = 0, tokenizer=ByteTokenizer) -> str:
    """``prompt`` followed by ``max_new_tokens`` sampled tokens of ``tokenizer`` (default bytes), decoded as UTF-8
    (invalid bytes become U+FFFD). An empty prompt samples the start of a document: the model is given the
    separator its training documents were joined with, which is left out of the text. Same arguments and model ->
    same text. Raises ``ValueError`` as :func:`sample`."""
    generator = torch.Generator().manual_seed(seed)
    context = tokenizer.encode(prompt or DOC_SEPARATOR).long()
    ids = sample(model, context, max_new_tokens, temperature, top_k, generator)
    return tokenizer.decode(ids if prompt else ids[context.numel():])
