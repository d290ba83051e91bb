#!/usr/bin/env python
"""Benchmark (part 1, no training): SPES vs DiLoCo on the full MoE, per peer: training-state memory and bytes sent
per sync round.

Same MoE model (``--model``, a run config MoE name) for both; ``--peers`` peers. Expert claims come from
``protocols.spes.rebalance`` (fair shares, ``--min-holders``), exactly what the role computes after a sync.

- Memory: parameters + gradients + AdamW state, measured (bytes of the tensors that exist after one training
  step on one batch) for a SPES peer (shared + its experts trained, the rest frozen) and for a DiLoCo peer (every
  parameter trained).
- Bytes: one sync round among ``--peers`` in-process peers (``peerd.transport.inprocess.Hub``, real matchmaking and
  butterfly all-reduce, ``--compression``): SPES = shared with everyone + each expert among its holders + the refresh
  of untrained copies; DiLoCo = every parameter with everyone (the same fragments, every peer holding every expert:
  the bytes of one whole-model all-reduce plus per-fragment headers).

Not measured here yet: eval loss reached (training runs), peak RSS / CUDA memory, the merging warm-up's effect.
Results replace the section ``SECTION_HEADING`` of docs/benchmarks.md with ``--md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from peerd.models import build_moe_model  # noqa: E402
from peerd.models.local_experts import gradient_bytes, optimizer_state_bytes, train_only_experts  # noqa: E402
from peerd.namespace import RunNamespace, RunRef  # noqa: E402
from peerd.roles.spes_sync import SparseSync  # noqa: E402
from peerd.transport.inprocess import Hub  # noqa: E402
from protocols.allreduce import AllReduceConfig  # noqa: E402
from protocols.matchmaking import MatchmakingConfig  # noqa: E402
from protocols.spes import PeerClaim, holders_of, rebalance  # noqa: E402

from benchlib import replace_section  # noqa: E402

SECTION_HEADING = "## SPES vs DiLoCo on the full MoE: memory and bytes per peer (scripts/bench_spes.py)"


def training_state(model_name: str, seq_len: int, experts) -> dict:
    model = build_moe_model(model_name, seq_len, seed=0)
    optimizer = torch.optim.AdamW(train_only_experts(model, experts), lr=1e-3)
    idx = torch.randint(0, 256, (8, seq_len), generator=torch.Generator().manual_seed(0))
    _, loss = model(idx, idx)
    loss.backward()
    optimizer.step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads, state = gradient_bytes(model), optimizer_state_bytes(optimizer)
    return {"params": params, "grads": grads, "optimizer": state, "total": params + grads + state}


async def sync_bytes(model_name: str, seq_len: int, claims: dict, compression: str) -> dict:
    hub = Hub()
    ns = RunNamespace(run=RunRef.parse("bench-spes"))
    mm = MatchmakingConfig(matchmaking_timeout_s=30.0, request_timeout_s=10.0, poll_interval_s=0.05)
    ar = AllReduceConfig(compression=compression, sender_timeout_s=30.0, reducer_timeout_s=60.0)
    syncs = {}
    for name, own in claims.items():
        s = SparseSync(hub.transport(name), ns, "spes", build_moe_model(model_name, seq_len, seed=0), own, mm, ar,
                       refresh_timeout_s=60.0)
        await s.start()
        syncs[name] = s
    n_experts = next(iter(syncs.values())).n_experts
    reports = await asyncio.gather(*[s.sync(0, holders_of(claims, n_experts), len(syncs), 1.0)
                                     for s in syncs.values()])
    for s in syncs.values():
        await s.stop()
    failed = {n: r.failed for n, r in zip(syncs, reports) if r.failed}
    if failed:
        raise RuntimeError(f"sync failed: {failed}")
    n = len(reports)
    return {"allreduce_sent": sum(r.allreduce_bytes_sent for r in reports) / n,
            "refresh_received": sum(r.refresh_bytes_received for r in reports) / n}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--model", default="small-moe")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--min-holders", type=int, default=1)
    parser.add_argument("--compression", default="fp16")
    parser.add_argument("--md", default=None, help="write the section into this markdown file")
    a = parser.parse_args(argv)
    if a.peers < 1:
        parser.error("--peers must be >= 1")
    n_experts = build_moe_model(a.model, a.seq_len, 0).config.n_experts
    peers = [f"peer{i}" for i in range(a.peers)]
    claims = rebalance(n_experts, {p: PeerClaim(frozenset(), n_experts) for p in peers}, a.min_holders)
    spes_mem = training_state(a.model, a.seq_len, claims[peers[0]])
    full_mem = training_state(a.model, a.seq_len, range(n_experts))
    spes_bytes = asyncio.run(sync_bytes(a.model, a.seq_len, claims, a.compression))
    full_bytes = asyncio.run(sync_bytes(a.model, a.seq_len, {p: frozenset(range(n_experts)) for p in peers},
                                        a.compression))
    result = {"model": a.model, "peers": a.peers, "experts": n_experts, "experts_per_peer": len(claims[peers[0]]),
              "min_holders": a.min_holders, "compression": a.compression,
              "memory": {"spes": spes_mem, "diloco": full_mem},
              "bytes_per_round": {"spes": spes_bytes, "diloco": full_bytes}}
    print(json.dumps(result, indent=1))
    mb = 1e6
    sent_s, sent_d = spes_bytes["allreduce_sent"], full_bytes["allreduce_sent"]
    section = f"""{SECTION_HEADING}

`python scripts/bench_spes.py --model {a.model} --peers {a.peers} --min-holders {a.min_holders} --compression \
{a.compression} --md docs/benchmarks.md` (no training: memory measured after one step, bytes of one in-process sync
round with the real matchmaking and all-reduce). {n_experts} experts, {len(claims[peers[0]])} per SPES peer.

| per peer | SPES | DiLoCo (full MoE) | SPES / DiLoCo |
|---|---|---|---|
| parameters (MB) | {spes_mem['params'] / mb:.1f} | {full_mem['params'] / mb:.1f} | 1.00 |
| gradients (MB) | {spes_mem['grads'] / mb:.1f} | {full_mem['grads'] / mb:.1f} | {spes_mem['grads'] / full_mem['grads']:.2f} |
| AdamW state (MB) | {spes_mem['optimizer'] / mb:.1f} | {full_mem['optimizer'] / mb:.1f} | \
{spes_mem['optimizer'] / full_mem['optimizer']:.2f} |
| training state total (MB) | {spes_mem['total'] / mb:.1f} | {full_mem['total'] / mb:.1f} | \
{spes_mem['total'] / full_mem['total']:.2f} |
| all-reduce bytes sent per round (MB) | {sent_s / mb:.2f} | {sent_d / mb:.2f} | {sent_s / sent_d:.2f} |
| refresh of untrained experts received per round (MB) | {spes_bytes['refresh_received'] / mb:.2f} | 0 | |
| sent per round incl. refresh served (MB, mean over peers) | {(sent_s + spes_bytes['refresh_received']) / mb:.2f} | {sent_d / mb:.2f} | {(sent_s + spes_bytes['refresh_received']) / sent_d:.2f} |

The all-reduce carries only trained parameters; the refresh of the untrained copies (every expert a peer does not
hold, in the all-reduce codec's dtype) is most of what a peer receives. Not measured yet: eval loss reached (SPES vs DiLoCo vs single process, with and without merging), peak RSS / CUDA memory.
"""
    if a.md:
        replace_section(a.md, SECTION_HEADING, section)
    else:
        print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
