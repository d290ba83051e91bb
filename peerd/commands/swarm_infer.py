"""Run a SWARM run's model through its live stage servers, skipping the stages that have none (SkipPipe inference).

SkipPipe (Blagoev et al. 2025, arXiv 2502.19913, section on inference with missing stages): a model trained with
stage skips degrades gracefully when stages are absent, since a skipped stage is the identity on the activations.
Here the first and the last stage must be reachable; any middle stage with no server that answers is skipped, and
the result names it. Everything goes through the stage servers' ``infer`` method (forward only: no server keeps
an input or changes a parameter).

:func:`evaluate_swarm` and :func:`generate_swarm` take a :class:`PipelineTrainer` (any transport: in-process in the
tests); :func:`open_swarm_client` builds one for ``peerd eval`` / ``peerd generate --swarm`` from a short-lived DHT
client.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from protocols.skippipe import NoPath
from protocols.stage_service import PipelineTrainer
from protocols.swarm import NoServer

__all__ = ["SwarmEval", "evaluate_swarm", "generate_swarm", "open_swarm_client", "reachable_path"]

logger = logging.getLogger(__name__)

TOKENIZER_TIMEOUT_S = 60.0
"""How long ``peerd eval``/``generate`` wait for a live peer to serve a BPE run's tokenizer file (seconds)."""


@dataclass(frozen=True)
class SwarmEval:
    """Held-out loss of a swarm's model through the stages that answered."""

    nats_per_byte: float
    """Mean cross-entropy per predicted byte, in nats."""
    perplexity: float
    """exp(nats_per_byte)."""
    tokens: int
    """Predicted bytes the mean is over."""
    path: tuple[int, ...]
    """The stages the batches went through."""
    skipped: tuple[int, ...]
    """Middle stages with no reachable server, passed over as the identity."""


def reachable_path(trainer: PipelineTrainer) -> tuple[int, ...]:
    """Stages with a usable server in ``trainer.wiring`` (announced, not banned). Raises :class:`NoPath` if the
    first or the last stage has none."""
    stages = trainer.wiring.stages
    usable = [k for k, b in enumerate(stages) if any(not b.bans.is_banned(s) for s in b.servers)]
    if not usable or usable[0] != 0 or usable[-1] != len(stages) - 1:
        end = 0 if not usable or usable[0] != 0 else len(stages) - 1
        raise NoPath(f"stage {end} has no reachable server")
    return tuple(usable)


async def _through_reachable(trainer: PipelineTrainer, tokens: torch.Tensor,
                             targets: Optional[torch.Tensor]) -> tuple[Any, tuple[int, ...]]:
    """``trainer.infer`` along the reachable stages; a stage whose servers all fail is dropped from the path and
    the batch is redone. Raises NoPath once the first or the last stage is gone."""
    while True:
        path = reachable_path(trainer)
        try:
            return await trainer.infer(tokens, targets, path=path), path
        except NoServer as e:  # its servers are banned in the wiring now: the next path leaves that stage out
            logger.info("a stage stopped answering (%s): redoing the batch without it", e)


async def evaluate_swarm(trainer: PipelineTrainer, eval_tokens: torch.Tensor, seq_len: int, batch_size: int,
                         max_batches: int) -> SwarmEval:
    """Loss of the swarm's model on the start of ``eval_tokens`` (uint8 or int64 bytes, (N,)): the same windows
    as :func:`peerd.data.corpus.evaluate` (consecutive, non-overlapping, ``max_batches`` batches of ``batch_size``).

    Raises:
        NoPath: the first or the last stage has no reachable server.
        ValueError: ``eval_tokens`` shorter than one window, or sizes not positive.
    """
    if seq_len <= 0 or batch_size <= 0 or max_batches <= 0:
        raise ValueError(f"seq_len ({seq_len}), batch_size ({batch_size}) and max_batches ({max_batches}) must be "
                         "positive")
    n_windows = min((eval_tokens.numel() - 1) // seq_len, max_batches * batch_size)
    if n_windows <= 0:
        raise ValueError(f"{eval_tokens.numel()} eval tokens are too few for one window of {seq_len + 1}")
    starts = torch.arange(n_windows) * seq_len
    window = torch.arange(seq_len + 1)
    total, count = 0.0, 0
    last_path: tuple[int, ...] = ()
    for first in range(0, n_windows, batch_size):
        idx = starts[first:first + batch_size, None] + window  # (b, T+1)
        x, y = eval_tokens[idx[:, :-1]].long(), eval_tokens[idx[:, 1:]].long()  # (b, T)
        loss, last_path = await _through_reachable(trainer, x, y)
        total += loss * y.numel()
        count += y.numel()
    nats = total / count
    # a stage that failed midway is reported skipped: some batches went without it
    skipped = tuple(k for k in range(trainer.num_stages) if k not in last_path)
    return SwarmEval(nats, math.exp(nats), count, last_path, skipped)


async def generate_swarm(trainer: PipelineTrainer, prompt: str, max_new_tokens: int, temperature: float = 0.8,
                         top_k: int = 50, seed: int = 0, seq_len: Optional[int] = None,
                         tokenizer: Any = None) -> tuple[str, tuple[int, ...]]:
    """``prompt`` followed by ``max_new_tokens`` tokens of ``tokenizer`` (default bytes; a BPE run's
    :class:`peerd.data.tokenizer.BpeTokenizer`) sampled through the reachable stages (as
    :func:`peerd.commands.generate.generate_text`, one ``infer`` per token, context cropped to ``seq_len``), and the stages
    skipped. An empty prompt samples the start of a document (as :func:`peerd.commands.generate.generate_text`). Raises
    NoPath as :func:`evaluate_swarm`."""
    from peerd.data.corpus import DOC_SEPARATOR, ByteTokenizer
    from peerd.commands.generate import next_token

    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer
    ids = tokenizer.encode(prompt or DOC_SEPARATOR).long()
    start = 0 if prompt else ids.numel()
    generator = torch.Generator().manual_seed(seed)
    path: tuple[int, ...] = reachable_path(trainer)
    for _ in range(max_new_tokens):
        context = ids[-seq_len:] if seq_len else ids
        logits, path = await _through_reachable(trainer, context[None], None)  # (1, V)
        ids = torch.cat((ids, next_token(logits[0], temperature, top_k, generator).view(1)))
    return tokenizer.decode(ids[start:]), tuple(k for k in range(trainer.num_stages) if k not in path)


@contextlib.asynccontextmanager
async def open_swarm_client(node: Any, run_id: str):
    """``(trainer, run, tokenizer)`` for the SWARM run ``run_id``: a short-lived DHT client
    (``node.initial_peers``), the run's published config, a :class:`PipelineTrainer` whose wiring holds the
    announced stage servers, and the run's tokenizer (bytes, or its BPE from ``node``'s tokenizer cache or fetched
    from the run's live peers into it: :func:`peerd.roles.tokenizer_sync.fetch_run_tokenizer`).

    Raises ConnectionError if the run has no (unambiguous) published config, is not a SWARM run, or no peer served
    its tokenizer file in time.
    """
    from peerd.daemon import read_status
    from peerd.identity.namespace import RunNamespace, as_run_ref
    from peerd.run_config import RunConfig
    from peerd.transport.factory import open_reader
    from protocols.swarm import StageAnnouncement, Wiring

    _, published = await read_status(node, run_id)
    if published is None:
        raise ConnectionError(f"run {run_id}: no published run config found through {node.initial_peers}")
    run = RunConfig.from_dict(published["config"])
    if run.parallelism != "swarm":
        raise ConnectionError(f"run {run_id} is a {run.parallelism!r} run, not a SWARM run")
    ns = RunNamespace(as_run_ref(run_id))
    transport = await open_reader(node)
    try:
        by_stage: dict[int, list[str]] = {k: [] for k in range(run.swarm.stages)}
        for k in range(run.swarm.stages):
            with contextlib.suppress(ConnectionError):  # a stage the DHT did not answer for is reported empty
                for peer, record in (await transport.discovery.get(ns.scoped(stage=k).dht_key("servers"))).items():
                    announcement = StageAnnouncement.parse(record.value, run.swarm.stages)
                    if announcement is not None and announcement.stage == k:
                        by_stage[k].append(peer)
        wiring = Wiring(run.swarm.stages, ban_s=run.swarm.ban_s)
        wiring.set_servers(by_stage)
        from peerd.models.transformer import MODEL_SIZES

        trainer = PipelineTrainer(transport.streams, lambda k: ns.scoped(stage=k).prefix("swarm"), wiring,
                                  run.swarm, d_model=MODEL_SIZES[run.model]["d_model"])
        from peerd.roles.tokenizer_sync import fetch_run_tokenizer
        from peerd.data.tokenizer import TokenizerCache, tokenizer_dir

        tokenizer = await fetch_run_tokenizer(run.tokenizer, TokenizerCache(tokenizer_dir(node)), transport, ns,
                                              TOKENIZER_TIMEOUT_S)
        yield trainer, run, tokenizer
    finally:
        await transport.shutdown()
