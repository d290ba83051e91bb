"""``peerd corpus split``: the run creator's corpus as content-addressed shards in this node's shard store."""

from __future__ import annotations

import argparse
import sys

from peerd.commands.common import UsageError

MIB = 1 << 20


def shard_bytes_of(shard_mb: float) -> int:
    """Bytes per shard for ``--shard-mb`` (MiB, fractions allowed). Raises UsageError for a value that gives
    less than one byte or more than 1 GiB."""
    size = int(shard_mb * MIB) if shard_mb == shard_mb else 0  # NaN -> 0
    if not 1 <= size <= 1024 * MIB:
        raise UsageError(f"peerd corpus split: --shard-mb must be in (0, 1024], got {shard_mb}")
    return size


def cmd_corpus(args: argparse.Namespace) -> int:
    """Split ``args.path`` into ``<checkpoint-dir>/corpus-cache/shards`` (from where `peerd join` serves the shards
    to the run's peers) and print the run-config line ``dataset = "shards:<digest>"`` on stdout, a summary on
    stderr. Returns 0, or 1 (one line) for a corpus that cannot be read or stored; bad flags raise UsageError."""
    from pathlib import Path
    from types import SimpleNamespace

    from peerd.data.corpus import DataError
    from peerd.data.corpus_store import corpus_cache_dir
    from peerd.data.shards import ShardStore, split_corpus

    shard_bytes = shard_bytes_of(args.shard_mb)
    if args.path == "shakespeare":
        raise UsageError("peerd corpus split: give the path or glob of your corpus (shakespeare needs no shards)")

    cache = corpus_cache_dir(SimpleNamespace(checkpoint_path=str(Path(args.checkpoint_dir).expanduser())))
    store = ShardStore(cache / "shards")
    try:
        manifest = split_corpus(args.path, store, shard_bytes, cache_dir=cache)
    except (DataError, OSError) as e:
        print(f"peerd corpus split: {e}", file=sys.stderr)
        return 1
    train_bytes = sum(size for _, size in manifest.train)
    eval_bytes = sum(size for _, size in manifest.eval)
    print(f"split {args.path} into {len(manifest.train)} training shards ({train_bytes:,} bytes) and "
          f"{len(manifest.eval)} held-out shard(s) ({eval_bytes:,} bytes) of up to {shard_bytes:,} bytes; stored "
          f"in {store.root}, from where `peerd join --checkpoint-dir {args.checkpoint_dir}` serves them to the "
          "run's peers", file=sys.stderr)
    print(f'dataset = "{manifest.spec}"')
    return 0
