"""SPES (arXiv 2602.11543, "Pretraining A Large Language Model using Distributed GPUs: A Memory-Efficient
Decentralized Paradigm"; reference code zjr2000/SPES): the pure decisions, without I/O.

- :func:`claim_experts`: which experts of a mixture-of-experts model a peer trains, from the claims of the live
  peers it sees (the reference fixes ``owner = expert // experts_per_node`` in a config; here a peer claims the
  experts with the fewest live holders, so joins and leaves rebalance without a coordinator).
- :func:`merge_alpha` / :func:`merge_experts`: the expert-merging warm-up (SPES sec. 3, the reference's run script:
  every ``merge_interval`` steps, alpha decays linearly to 0 over ``merge_decay_steps``; each expert moves toward
  its ``merge_top_k`` most cosine-similar experts of the same layer).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Collection, Mapping, Optional

import torch


@dataclass(frozen=True)
class SpesConfig:
    """The ``[spes]`` table of a run config. Steps are inner (optimizer) steps."""

    sync_steps: int = 100
    """Inner steps between two syncs (shared parameters with every peer, each expert with its holders)."""
    min_holders: int = 1
    """Peers that should train each expert when there are enough peers and memory (more: a leave loses less)."""
    experts_per_peer: int = 0
    """Most experts one peer trains; 0 = as many as its fair share (see :func:`claim_experts`) needs."""
    merge_interval: int = 500
    """Inner steps between two expert-merging updates (0 disables merging)."""
    merge_decay_steps: int = 10000
    """alpha reaches 0 at this step; no merging afterwards."""
    alpha_0: float = 0.01
    """Merging strength at step 0."""
    merge_top_k: int = 4
    """Most cosine-similar experts of the same layer an expert moves toward."""

    def __post_init__(self) -> None:
        for name in ("sync_steps", "min_holders", "merge_decay_steps", "merge_top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"spes.{name} must be an int >= 1, got {value!r}")
        for name in ("experts_per_peer", "merge_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"spes.{name} must be an int >= 0, got {value!r}")
        if not (isinstance(self.alpha_0, (int, float)) and math.isfinite(self.alpha_0) and 0 <= self.alpha_0 <= 1):
            raise ValueError(f"spes.alpha_0 must be in [0, 1], got {self.alpha_0!r}")


@dataclass(frozen=True)
class PeerClaim:
    """What a live peer publishes: the experts it trains and the most it can train (its memory)."""

    experts: frozenset[int]
    capacity: int


def expert_capacity(memory_bytes: int, shared_bytes: int, expert_bytes: int) -> int:
    """How many experts fit in ``memory_bytes`` of training state after the shared parameters' ``shared_bytes``
    (bytes per trained parameter times its count: e.g. 12 for fp32 gradient + AdamW moments). At least 0."""
    if expert_bytes <= 0:
        raise ValueError(f"expert_bytes must be positive, got {expert_bytes}")
    return max(0, (memory_bytes - shared_bytes) // expert_bytes)


def fair_shares(n_experts: int, capacities: Mapping[str, int], min_holders: int) -> dict[str, int]:
    """How many experts each peer should train: ``n_experts * min(min_holders, peers)`` slots water-filled over the
    peers' capacities (a small peer takes what it can, the others split the rest evenly; the remainder of an uneven
    split goes to the lowest PeerIDs). Every peer computes the same answer from the same view."""
    peers = sorted(capacities)
    if not peers:
        return {}
    slots = n_experts * min(min_holders, len(peers))
    caps = {p: max(0, min(int(capacities[p]), n_experts)) for p in peers}
    share = {p: 0 for p in peers}
    open_peers = [p for p in peers if caps[p] > 0]
    while slots > 0 and open_peers:
        level, extra = divmod(slots, len(open_peers))
        progress = 0
        for i, p in enumerate(open_peers):
            give = min(caps[p] - share[p], level + (1 if i < extra else 0))
            share[p] += give
            progress += give
        slots -= progress
        open_peers = [p for p in open_peers if share[p] < caps[p]]
        if progress == 0:
            break
    return share


def _tiebreak(peer: str, expert: int) -> bytes:
    # A per-peer order among equally held experts, so peers that claim at the same time spread out.
    return hashlib.sha256(f"{peer}/{expert}".encode()).digest()


def claim_experts(
    me: str,
    n_experts: int,
    others: Mapping[str, PeerClaim],
    capacity: int,
    min_holders: int = 1,
    experts_per_peer: int = 0,
    current: Collection[int] = (),
) -> frozenset[int]:
    """The experts ``me`` should train, given the live ``others``' claims (itself excluded).

    Count: the peer's fair share (:func:`fair_shares` of ``n_experts * min(min_holders, peers)`` slots over every
    live peer's capacity, ``experts_per_peer`` as a cap when > 0), never above ``capacity``. Choice: the experts
    with the fewest live holders among the others; among equals, the ones ``me`` already trains (its optimizer
    state stays), then a per-peer pseudo-random order.

    Re-claiming at every sync with a fresh view rebalances after joins and leaves: a leaver's experts are left with
    fewer holders and get claimed first. Once no claim changes, every expert has ``min(min_holders, peers)``
    holders when the capacities allow it: an expert short of holders while another has more would make a holder of
    the latter switch (it sees fewer holders on the former).
    """
    if n_experts < 1:
        raise ValueError(f"n_experts must be >= 1, got {n_experts}")
    capacity = max(0, min(int(capacity), n_experts))
    if experts_per_peer > 0:
        capacity = min(capacity, experts_per_peer)
    holders = [0] * n_experts
    for claim in others.values():
        for e in claim.experts:
            if 0 <= e < n_experts:
                holders[e] += 1
    capacities = {p: c.capacity if experts_per_peer <= 0 else min(c.capacity, experts_per_peer)
                  for p, c in others.items()}
    capacities[me] = capacity
    count = min(capacity, fair_shares(n_experts, capacities, min_holders)[me])
    current = set(current)
    order = sorted(range(n_experts), key=lambda e: (holders[e], e not in current, _tiebreak(me, e)))
    return frozenset(order[:count])


def rebalance(
    n_experts: int,
    claims: Mapping[str, PeerClaim],
    min_holders: int = 1,
    experts_per_peer: int = 0,
    max_sweeps: int = 32,
) -> dict[str, frozenset[int]]:
    """Everyone's new claims from the same view: :func:`claim_experts` for each peer in PeerID order, repeated until
    no claim changes (at most ``max_sweeps`` sweeps). Every peer of a sync round computes this from the claims
    that round used and keeps its own entry, so peers that re-claim at the same moment agree instead of chasing
    each other's stale claims. Returns PeerID -> experts."""
    current = {p: frozenset(c.experts) for p, c in claims.items()}
    capacity = {p: c.capacity for p, c in claims.items()}
    for _ in range(max_sweeps):
        changed = False
        for me in sorted(current):
            others = {p: PeerClaim(current[p], capacity[p]) for p in current if p != me}
            mine = claim_experts(me, n_experts, others, capacity[me], min_holders, experts_per_peer, current[me])
            changed |= mine != current[me]
            current[me] = mine
        if not changed:
            break
    return current


def holders_of(claims: Mapping[str, Collection[int]], n_experts: int) -> list[list[str]]:
    """For each expert, the sorted PeerIDs that claim it."""
    out: list[list[str]] = [[] for _ in range(n_experts)]
    for peer in sorted(claims):
        for e in claims[peer]:
            if 0 <= e < n_experts:
                out[e].append(peer)
    return out


def merge_alpha(step: int, alpha_0: float, decay_steps: int) -> float:
    """alpha_t = alpha_0 * (1 - t / decay_steps), clipped at 0 (SPES expert-merging warm-up)."""
    if decay_steps < 1:
        raise ValueError(f"decay_steps must be >= 1, got {decay_steps}")
    return max(0.0, alpha_0 * (1.0 - step / decay_steps))


def merge_due(step: int, config: SpesConfig) -> bool:
    """Whether the merging update runs after inner step ``step`` (every ``merge_interval`` steps while alpha > 0)."""
    return (config.merge_interval > 0 and step > 0 and step % config.merge_interval == 0
            and merge_alpha(step, config.alpha_0, config.merge_decay_steps) > 0)


def merge_experts(theta: torch.Tensor, alpha: float, top_k: int,
                  similarity_on: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One expert-merging update of one layer's experts (SPES): theta_e <- theta_e + alpha * mean_{j in N(e)}
    (theta_j - theta_e), N(e) = the ``top_k`` experts j != e with the highest cosine similarity to e, all from the
    weights before the update.

    Args:
        theta: (E, P) the layer's experts, one flat row each.
        alpha: merging strength (>= 0; 0 returns ``theta`` unchanged).
        top_k: neighbours per expert (capped at E - 1).
        similarity_on: (E, Q) what the similarity is measured on (the reference: the first MLP matrix, w1);
            default ``theta``.

    Returns:
        (E, P) new tensor, same dtype as ``theta``.
    """
    if theta.dim() != 2:
        raise ValueError(f"theta must be (E, P), got shape {tuple(theta.shape)}")
    E = theta.shape[0]
    k = min(top_k, E - 1)
    if alpha == 0 or k < 1:
        return theta.clone()
    basis = (theta if similarity_on is None else similarity_on).double()  # (E, Q)
    if basis.shape[0] != E:
        raise ValueError(f"similarity_on has {basis.shape[0]} rows, theta {E}")
    unit = basis / basis.norm(dim=1, keepdim=True).clamp_min(1e-12)
    similarity = unit @ unit.T  # (E, E)
    similarity.fill_diagonal_(-math.inf)
    neighbours = similarity.topk(k, dim=1).indices  # (E, k)
    base = theta.double()
    pull = base[neighbours].mean(dim=1) - base  # (E, P)
    return (base + alpha * pull).to(theta.dtype)


def claim_record(experts: Collection[int], capacity: int, outer_round: int, left: bool = False) -> dict:
    """What a peer publishes about its experts (msgpack-able). ``left``: the peer has left; its experts are free
    at once instead of when the record expires."""
    record = {"experts": sorted(int(e) for e in experts), "capacity": int(capacity), "outer_round": int(outer_round)}
    if left:
        record["left"] = True
    return record


def parse_claim(value: object, n_experts: int) -> Optional[tuple[PeerClaim, int]]:
    """A peer's published claim as ``(PeerClaim, outer_round)``, or None if it is malformed (expert ids out of range
    or repeated, a capacity or round that is not a non-negative int): a bad record makes that peer invisible to
    expert assignment, never a crash. A peer that left is None too."""
    if not isinstance(value, dict) or value.get("left") is True:
        return None
    experts, capacity, outer_round = value.get("experts"), value.get("capacity"), value.get("outer_round")

    def count(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not (isinstance(experts, list) and all(count(e) and e < n_experts for e in experts)
            and len(set(experts)) == len(experts) and count(capacity) and count(outer_round)):
        return None
    return PeerClaim(frozenset(experts), capacity), outer_round
