"""The commands that use a trained model: ``export``, ``generate``, ``eval`` (a SWARM run's held-out loss) and
``tokenizer train``."""

from __future__ import annotations

import argparse
import json
import sys

from peerd.commands.common import UsageError, node_config, require_run_id, run_async
from peerd.config import load_node_config
from peerd.runtime.processes import interruptible


def _checkpoint_model(args: argparse.Namespace):
    """(checkpoint file, its model, the tokenizer its run trained with)."""
    from peerd.commands.export import checkpoint_tokenizer, find_checkpoint, load_checkpoint_model

    # checkpoints live under the run's name (``name@creator`` names the same run)
    path = find_checkpoint(args.checkpoint_dir, args.run_id.name if args.run_id else None)
    return path, load_checkpoint_model(path, args.weights, args.model, args.seq_len), checkpoint_tokenizer(path)


def cmd_export(args: argparse.Namespace) -> int:
    from peerd.commands.export import export_llama

    path, model, tokenizer = _checkpoint_model(args)
    out = args.out or path.parent / ("export" if args.weights == "outer" else f"export-{args.weights}")
    files = export_llama(model, out, tokenizer)
    print(f"exported {args.weights} weights of {path} ({model.config.n_layers} layers, d_model "
          f"{model.config.d_model}) to {', '.join(str(f) for f in files)}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from peerd.commands.generate import generate_text

    for name in ("max_tokens", "top_k"):
        if getattr(args, name) < 0:
            raise UsageError(f"peerd generate: --{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not args.temperature >= 0:
        raise UsageError(f"peerd generate: --temperature must be >= 0, got {args.temperature}")
    if args.initial_peers:
        return _generate_through_swarm(args)
    from peerd.hardware.devices import device_problem, resolve_device

    problem = f"takes one device, got {args.device!r}" if "," in args.device else device_problem(args.device)
    if problem:
        raise UsageError(f"peerd generate: --device {problem}")
    _, model, tokenizer = _checkpoint_model(args)
    if args.device != "cpu":
        model = model.to(resolve_device(args.device))  # DeviceUnavailable: one line, exit 1
    print(generate_text(model, args.prompt, args.max_tokens, args.temperature, args.top_k, args.seed, tokenizer))
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from pathlib import Path

    from peerd.data.corpus import DOC_SEPARATOR, DataError, load_corpus
    from peerd.data.tokenizer import MAX_VOCAB, MIN_VOCAB, TokenizerCache, train_bpe

    if not MIN_VOCAB <= args.vocab_size <= MAX_VOCAB:
        raise UsageError(f"peerd tokenizer train: --vocab-size must be in {MIN_VOCAB}..{MAX_VOCAB}, got "
                         f"{args.vocab_size}")
    try:
        corpus = load_corpus(args.data)
    except DataError as e:
        print(f"peerd tokenizer train: {e}", file=sys.stderr)
        return 1
    text = corpus.train.numpy().tobytes().decode("utf-8", errors="replace")
    tokenizer = train_bpe(text.split(DOC_SEPARATOR), args.vocab_size)
    path = TokenizerCache(Path(args.checkpoint_dir).expanduser() / "tokenizers").put(tokenizer)
    if args.out:
        tokenizer.save(args.out)
    print(f"trained a byte-level BPE of {tokenizer.vocab_size} tokens on {corpus.name} ({corpus.train.numel():,} "
          f"bytes); stored in {path}{f' and {args.out}' if args.out else ''}", file=sys.stderr)
    print(f'tokenizer = "{tokenizer.spec}"')
    return 0


def _generate_through_swarm(args: argparse.Namespace) -> int:
    from peerd.commands.swarm_infer import generate_swarm, open_swarm_client
    from protocols.skippipe import NoPath

    run_id = require_run_id(args)
    node = load_node_config(None, overrides={"initial_peers": args.initial_peers})

    async def go() -> tuple[str, tuple[int, ...]]:
        async with open_swarm_client(node, run_id) as (trainer, run, tokenizer):
            try:
                return await generate_swarm(trainer, args.prompt, args.max_tokens, args.temperature, args.top_k,
                                            args.seed, seq_len=run.seq_len, tokenizer=tokenizer)
            except NoPath as e:
                raise ConnectionError(f"run {run_id}: {e}") from None

    text, skipped = run_async(interruptible(go()))
    print(text)
    print(f"skipped stages: {', '.join(map(str, skipped)) or 'none'}", file=sys.stderr)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import dataclasses
    import math

    from peerd.data.corpus import load_corpus, tokenize_corpus
    from peerd.roles.base import eval_units
    from peerd.commands.swarm_infer import evaluate_swarm, open_swarm_client
    from protocols.skippipe import NoPath

    run_id = require_run_id(args)
    if args.batches is not None and args.batches < 1:
        raise UsageError(f"peerd eval: --batches must be >= 1, got {args.batches}")
    node = node_config(args)
    if not node.initial_peers:
        raise UsageError("peerd eval: --initial-peers is required (any peer of the run)")

    async def go():
        async with open_swarm_client(node, run_id) as (trainer, run, tokenizer):
            if run.dataset != "shakespeare" and not args.data:  # local, shards:, hf: text is not here
                raise UsageError(f"peerd eval: run {run_id!r} trains on {run.dataset[:30]}: pass --data PATH|GLOB "
                                 "(its held-out text)")
            tokens = tokenize_corpus(load_corpus(args.data or "shakespeare"), tokenizer).eval
            batches = args.batches or run.eval_batches or 4
            units = eval_units(tokenizer, tokens, dataclasses.replace(run, eval_batches=batches))
            try:
                return await evaluate_swarm(trainer, tokens, run.seq_len, run.batch_size, batches), units
            except NoPath as e:  # the first or the last stage is unreachable: a runtime failure, one line
                raise ConnectionError(f"run {run_id}: {e}") from None

    result, units = run_async(interruptible(go()))
    where = (f"through stages {', '.join(map(str, result.path))}; skipped: "
             f"{', '.join(map(str, result.skipped)) or 'none'}")
    if units["eval_unit"] == "byte":
        if args.json:
            print(json.dumps({"run_id": str(run_id), "nats_per_byte": result.nats_per_byte,
                              "perplexity": result.perplexity, "tokens": result.tokens, "path": list(result.path),
                              "skipped": list(result.skipped)}))
        else:
            print(f"run {run_id}: eval {result.nats_per_byte:.4f} nats/byte (perplexity {result.perplexity:.2f}) "
                  f"over {result.tokens} bytes {where}")
        return 0
    # a BPE run: the loss is per token; per byte (the text its tokens stand for) it compares across tokenizers
    per_token, bytes_per_token = result.nats_per_byte, units.get("eval_bytes_per_token")
    per_byte = per_token / bytes_per_token if bytes_per_token else None
    if args.json:
        print(json.dumps({"run_id": str(run_id), "nats_per_token": per_token, "nats_per_byte": per_byte,
                          "bits_per_byte": per_byte / math.log(2) if per_byte is not None else None,
                          "perplexity": result.perplexity, "tokens": result.tokens, "path": list(result.path),
                          "skipped": list(result.skipped)}))
    else:
        bits = f", {per_byte / math.log(2):.4f} bits/byte" if per_byte is not None else ""
        print(f"run {run_id}: eval {per_token:.4f} nats/token (perplexity {result.perplexity:.2f}{bits}) over "
              f"{result.tokens} tokens {where}")
    return 0
