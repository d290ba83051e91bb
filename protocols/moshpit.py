"""Moshpit averaging (Ryabinin et al. 2021, "Moshpit SGD", NeurIPS): all-reduce in small groups on a virtual grid.

N peers sit on a virtual d-dimensional grid with side M (M^d >= N). In round r every peer all-reduces with the
peers that share all of its coordinates except coordinate ``r mod d``: a group of (at most) M peers. With N = M^d
and no failures, d consecutive rounds give every peer the exact global (weighted) average; with failures or a
partially filled grid the peers still converge to the average exponentially fast.

Grid placement is decided identically by every peer from one list of peers: each epoch of d rounds, peers are
ordered by ``sha256(epoch, PeerID)`` and peer number i gets the base-M digits of i as coordinates, so groups are
reshuffled every epoch (groupmates of one epoch are spread across groups in the next).

That list must be the same on every peer, or peers compute different grids and wait for groupmates that are
averaging elsewhere. Live-peer views read from the DHT are not (a dead peer's record outlives it by up to its TTL;
under load a live peer's record can lapse). So each round starts with a rendezvous: every peer matchmakes under the
round's key, carrying only its PeerID; the sealed member list, identical on every member, is the list the grid is
built from. Tensors then move only inside the grid groups, so a peer that dies mid-transfer fails its own group's
all-reduce and no other. A peer that dies before the seal costs the rendezvous its matchmaking timeout once; the
survivors' groups are then computed without it. A peer that reaches the rendezvous after its seal joins the
rendezvous of the round's other late peers (``on_late="next"``) and averages on their grid.

That rendezvous costs O(N) per peer (one leader admits all N peers, and each of the N answers carries the whole
member list: O(N^2) bytes per round), which is fine for tens to hundreds of peers and not for thousands. The
*sharded* rendezvous (``MoshpitAverager(..., rendezvous="group")``) matchmakes the way the paper's peers do (each
looks up its group key in the DHT and meets only the peers under it): each peer computes its grid group from its
own view of the live peers and matchmakes only with the peers sharing that group key, so a leader admits at most M
peers and an answer lists only the group's members: O(M) per peer and round. A group knows its members, so it
waits for exactly them (up to ``max_wait_s``, not the idle window: gaps between groupmates' arrivals exceed any
short window) and seals as soon as the last one is in; a groupmate whose process died is found by probing it once
the group is idle, and costs about two idle windows, not ``max_wait_s``. It needs views that agree: a peer whose view differs
computes another grid, its would-be groupmates wait ``max_wait_s`` for it and then average without it, and it
averages with whoever shares its key (late peers still join the next group of late peers instead of failing).

Defaults follow the paper's experiments: target group size M = 4 (paper: groups of 4-32); the grid dimension is
floor or ceil of log_M N with side ceil(N^(1/d)), preferring grids without lone peers (see :meth:`Grid.for_peers`).
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from protocols.allreduce import AllReduceResult, ButterflyAllReduce
from protocols import group_keys
from protocols.matchmaking import Group, Matchmaker, MatchmakingFailed


# ---------------------------------------------------------------------------------------------------------- pure core


@dataclass(frozen=True)
class Grid:
    """A virtual grid of ``side`` ** ``dims`` cells holding ``n_peers`` peers."""

    side: int
    dims: int
    n_peers: int

    @classmethod
    def for_peers(cls, n_peers: int, target_group_size: int) -> "Grid":
        """The grid for ``n_peers``: d = floor or ceil of log_M N dimensions (at least 1), side ceil(N^(1/d)).

        Of the two, the grid that leaves no peer alone in a group is preferred, then the one whose side is closest
        to M (15 peers with M = 4: a 4 x 4 grid; 3 peers with M = 2: one group of 3).
        """
        if n_peers < 1 or target_group_size < 2:
            raise ValueError(f"need n_peers >= 1 and target_group_size >= 2, got {n_peers}, {target_group_size}")
        if n_peers == 1:
            return cls(1, 1, 1)
        exact = math.log(n_peers, target_group_size)
        candidates = []
        for dims in sorted({max(1, math.floor(exact + 1e-9)), max(1, math.ceil(exact - 1e-9))}):
            grid = cls(max(1, math.ceil(n_peers ** (1 / dims) - 1e-9)), dims, n_peers)
            candidates.append((grid._has_lone_peer(), abs(grid.side - target_group_size), -dims, grid))
        return min(candidates, key=lambda c: c[:3])[3]

    def _has_lone_peer(self) -> bool:
        """Whether filling cells 0..N-1 leaves some group of one along some dimension."""
        for dim in range(self.dims):
            sizes: dict[tuple, int] = {}
            for index in range(self.n_peers):
                key = self.group_of(self.coordinates(index), dim)
                sizes[key] = sizes.get(key, 0) + 1
            if min(sizes.values()) == 1 and self.n_peers > 1:
                return True
        return False

    def coordinates(self, index: int) -> tuple[int, ...]:
        """Base-``side`` digits of ``index`` (little-endian), one per dimension."""
        if not 0 <= index < self.side**self.dims:
            raise ValueError(f"index {index} outside a grid of {self.side}^{self.dims}")
        return tuple((index // self.side**k) % self.side for k in range(self.dims))

    def dimension(self, outer_round: int) -> int:
        """The coordinate that varies inside the groups of round ``outer_round``."""
        return outer_round % self.dims

    def group_of(self, coords: Sequence[int], outer_round: int) -> tuple[int, ...]:
        """Coordinates that identify the group: all but the current dimension (that one is set to -1)."""
        dim = self.dimension(outer_round)
        return tuple(-1 if k == dim else c for k, c in enumerate(coords))


def placement(peers: Sequence[str], epoch: int) -> list[str]:
    """Order of peers on the grid for an epoch: by sha256(epoch, PeerID). Identical on every peer."""
    return sorted(set(peers), key=lambda p: hashlib.sha256(f"{epoch}:{p}".encode()).digest())


@dataclass(frozen=True)
class Assignment:
    """Where one peer averages in one round: its group key and how many peers the grid puts in that group."""

    key: str
    expected_size: int
    coordinates: tuple[int, ...]

#: Prefix of the round-wide rendezvous keys.
MOSHPIT_PREFIX = "moshpit.r"


def round_key(outer_round: int) -> str:
    """The round-wide rendezvous key of ``outer_round`` (0-based); every group key of the round starts with it plus
    ``.``. The key numbers rounds from 1, as peers' logs do (``moshpit.r1`` is the first round):
    :func:`protocols.group_keys.group_key` under the prefix ``moshpit.r``."""
    return group_keys.group_key(outer_round, prefix=MOSHPIT_PREFIX)


def group_key(outer_round: int, grid: Grid, cell: Sequence[int]) -> str:
    """The key of the group at ``cell`` (coordinates, -1 on the round's free dimension) in ``outer_round``."""
    return f"{round_key(outer_round)}.g{grid.side}x{grid.dims}." + ".".join("x" if c < 0 else str(c) for c in cell)


def assign(peer: str, live_peers: Sequence[str], outer_round: int, target_group_size: int) -> Assignment:
    """The group of ``peer`` in round ``outer_round`` given the live peers (``peer`` is added if missing)."""
    everyone = sorted(set(live_peers) | {peer})
    grid = Grid.for_peers(len(everyone), target_group_size)
    epoch = outer_round // grid.dims
    order = placement(everyone, epoch)
    coords = grid.coordinates(order.index(peer))
    group = grid.group_of(coords, outer_round)
    size = sum(1 for i in range(len(order)) if grid.group_of(grid.coordinates(i), outer_round) == group)
    return Assignment(group_key(outer_round, grid, group), size, coords)


def group_mates(peer: str, live_peers: Sequence[str], outer_round: int, target_group_size: int) -> list[str]:
    """The other peers the grid puts in ``peer``'s group for ``outer_round``."""
    everyone = sorted(set(live_peers) | {peer})
    key = assign(peer, everyone, outer_round, target_group_size).key
    return [p for p in everyone if p != peer and assign(p, everyone, outer_round, target_group_size).key == key]


def round_to_join(peer: str, rounds: dict[str, int], outer_round: int, target_group_size: int) -> int:
    """The round ``peer`` should average in next, given every live peer's next round (``rounds``).

    Normally ``outer_round``. But if every groupmate of that round has already moved past it (we fell behind, e.g.
    after waiting out a dead partner), waiting for them is pointless: skip ahead to the earliest round our
    groupmates are at, and repeat. Groups are thereby re-aligned after a failure instead of timing out round after
    round.
    """
    live = sorted(set(rounds) | {peer})
    for _ in range(64):  # bounded: each step moves at least one round forward
        mates = group_mates(peer, live, outer_round, target_group_size)
        if not mates or not all(rounds.get(m, outer_round) > outer_round for m in mates):
            return outer_round
        outer_round = min(rounds[m] for m in mates)
    return outer_round


def grid_group(peer: str, rendezvous: Group, outer_round: int, target_group_size: int) -> Group:
    """``peer``'s grid group of ``outer_round``, cut out of the sealed rendezvous (the same on every member)."""
    key, mates = partition(tuple(sorted(set(rendezvous.members))), outer_round, target_group_size)[peer]
    return Group(f"{rendezvous.group_id}.{key}", key, mates[0], mates, {p: rendezvous.infos.get(p, {}) for p in mates})


@functools.lru_cache(maxsize=16)
def partition(everyone: tuple[str, ...], outer_round: int, target_group_size: int) -> dict[str, tuple[str, tuple]]:
    """Every peer's (group key, sorted groupmates) in ``outer_round``, for the sorted peer list ``everyone``: the
    groups :func:`assign` gives, computed in one pass (O(N log N), not O(N^2) calls), so that thousands of peers
    (or thousands of simulated peers in one process, which share the cache) can cut their group out of a
    rendezvous."""
    grid = Grid.for_peers(len(everyone), target_group_size)
    order = placement(everyone, outer_round // grid.dims)
    cells: dict[tuple[int, ...], list[str]] = {}
    for index, peer in enumerate(order):
        cells.setdefault(grid.group_of(grid.coordinates(index), outer_round), []).append(peer)
    out = {}
    for cell, peers in cells.items():
        key = group_key(outer_round, grid, cell)
        mates = tuple(sorted(peers))
        for peer in peers:
            out[peer] = (key, mates)
    return out


# ------------------------------------------------------------------------------------------------------------ runner


RENDEZVOUS = ("round", "group")


class MoshpitAverager:
    """One moshpit round = a rendezvous, then a butterfly all-reduce inside this peer's grid group.

    ``rendezvous="round"`` (default): all of the round's peers matchmake under ``moshpit.r<round>`` and the grid is
    built from the sealed member list (identical on every member, whatever their views; O(N) per peer).
    ``rendezvous="group"``: the sharded rendezvous: the grid comes from this peer's view ``live_peers`` and the peer
    matchmakes only under its own group key with the groupmates that grid gives it, waiting for exactly them up to
    ``max_wait_s`` (O(M) per peer: thousands of peers; views should agree: a groupmate whose view gave it another
    group is left out one idle window after the last arrival, a dead one after two).
    """

    def __init__(self, matchmaker: Matchmaker, allreduce: ButterflyAllReduce, target_group_size: int = 4,
                 rendezvous: str = "round"):
        if target_group_size < 2:
            raise ValueError(f"target_group_size must be >= 2, got {target_group_size}")
        if rendezvous not in RENDEZVOUS:
            raise ValueError(f"rendezvous must be one of {RENDEZVOUS}, got {rendezvous!r}")
        self.matchmaker = matchmaker
        self.allreduce = allreduce
        self.target_group_size = target_group_size
        self.rendezvous = rendezvous

    async def average(
        self, outer_round: int, tensor: torch.Tensor, weight: float, live_peers: Sequence[str],
        coming: Optional[Sequence[str]] = None,
    ) -> AllReduceResult:
        """Average ``tensor`` (P,) fp32 with this round's grid group.

        With ``rendezvous="round"``, ``live_peers`` (this peer's view of who is training) only tells the rendezvous
        how many peers to wait for before sealing early; the grid itself comes from the sealed rendezvous. With
        ``rendezvous="group"`` the grid is built from ``live_peers``.

        ``coming`` (``rendezvous="round"`` only): the PeerIDs known to be heading for this round's rendezvous. The
        rendezvous then waits for exactly them (up to ``max_wait_s``) instead of sealing after an idle window: when
        the previous round ended at times spread wider than the window (a loaded DHT, rounds of different lengths)
        an idle-window seal splits the round into a main grid and groups of late peers. A listed peer that died is
        left out after two unanswered probes (:meth:`protocols.matchmaking.Matchmaker.form_group`,
        ``expected_members``). None: seal once ``len(live_peers)`` peers joined or after the idle window.

        Raises MatchmakingFailed (no rendezvous within the matchmaking timeout, or a grid group below
        ``min_group_size``) or AllReduceFailed (the group's all-reduce failed).
        """
        me = self.matchmaker.peer_id
        if self.rendezvous == "group":
            return await self._average_sharded(outer_round, tensor, weight, live_peers)
        expected = len(set(live_peers) | {me})
        # a peer that comes after the seal averages with the other late peers rather than failing its round
        # the all-reduce's announcement (measured rates, dial-only) reaches every member through the group infos
        rendezvous = await self.matchmaker.form_group(round_key(outer_round), self.allreduce.announce(),
                                                      expected_size=expected, on_late="next",
                                                      expected_members=None if coming is None else tuple(coming))
        group = grid_group(me, rendezvous, outer_round, self.target_group_size)
        if len(group.members) < self.matchmaker.config.min_group_size:
            raise MatchmakingFailed(f"grid group {group.key} of {len(group.members)} peer(s) is smaller than "
                                    f"min_group_size={self.matchmaker.config.min_group_size}")
        return await self.allreduce.run(group, tensor, weight)

    async def _average_sharded(self, outer_round: int, tensor: torch.Tensor, weight: float,
                               live_peers: Sequence[str]) -> AllReduceResult:
        me = self.matchmaker.peer_id
        groups = partition(_sorted_peers(live_peers), outer_round, self.target_group_size)
        if me not in groups:
            groups = partition(_sorted_peers([*live_peers, me]), outer_round, self.target_group_size)
        key, mates = groups[me]
        # a groupmate whose view gave it another group of this round is not waited for (see form_group)
        group = await self.matchmaker.form_group(key, self.allreduce.announce(), expected_members=mates,
                                                 on_late="next", round_prefix=round_key(outer_round) + ".")
        if len(group.members) < self.matchmaker.config.min_group_size:
            raise MatchmakingFailed(f"group {group.key} of {len(group.members)} peer(s) is smaller than "
                                    f"min_group_size={self.matchmaker.config.min_group_size}")
        return await self.allreduce.run(group, tensor, weight)


_last_sorted: list = [None, ()]  # (the last tuple given, its sorted form): peers of one process share one view


def _sorted_peers(peers: Sequence[str]) -> tuple[str, ...]:
    """``peers`` sorted, without duplicates. The same tuple passed again (every simulated peer of a swarm passes
    the swarm's view) is sorted once, not once per peer: O(N) per peer would be O(N^2) per simulated round."""
    if isinstance(peers, tuple) and peers is _last_sorted[0]:
        return _last_sorted[1]
    result = tuple(sorted(set(peers)))
    if isinstance(peers, tuple):
        _last_sorted[:] = [peers, result]
    return result
