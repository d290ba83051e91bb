"""SWARM parallelism's decisions, pure (no I/O): stochastic wiring and stage rebalancing.

Source: SWARM parallelism (Ryabinin et al. 2023, arXiv 2301.11913, section 3.2 "stochastic wiring", 3.3 "adaptive
swarm rebalancing"). The wiring follows the reference balancer's rule (a min-heap keyed by a server's accumulated
expected time, ``work / EMA(throughput)``; servers never measured go first so they get measured; a failed server is
banned for a while). The rebalancing rule, which the reference code does not ship, follows Petals'
``block_selection.py``: a server moves to the bottleneck stage only if ``old / new`` bottleneck throughput is below
``balance_quality`` (0.75), and never leaves its stage empty.

Stage rounds (:func:`stage_round_hyperparams`): the servers of one stage average their parameters, as SWARM does
(section 3.2 and appendix: the peers of a stage synchronize with all-reduce, plain averaging), never with a DiLoCo
outer step.

Units: work in samples (or any consistent unit), times in seconds, throughput in work per second.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional

from protocols.bans import BanList
from protocols.codecs import CODECS
from protocols.diloco import DiLoCoHyperparams

__all__ = [
    "NoServer", "StageAnnouncement", "StageBalancer", "SwarmConfig", "Wiring", "WiringStats", "bottleneck_stage", "choose_stage",
    "MoveClaim", "STAGE_ROUND_OUTER_STEP", "move_claim_stands", "rebalance_delay_s", "should_move",
    "stage_round_hyperparams", "stage_throughputs",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SwarmConfig:
    """Settings of a SWARM run (the ``[swarm]`` table of a run config). Validated on construction (ValueError)."""

    stages: int = 2
    """Number of pipeline stages S the model is cut into."""
    codec: str = "fp16"
    """Codec of activations and activation gradients on the wire (a name of ``protocols.codecs.CODECS``)."""
    ema_alpha: float = 0.1
    """Weight of the newest measurement in a server's EMA throughput, in (0, 1]."""
    ban_s: float = 30.0
    """How long a failed or timed-out server is skipped by the wiring, in seconds."""
    max_retries: int = 3
    """Further servers of the same stage a micro-batch is tried on after a failure before it is dropped."""
    call_timeout_s: float = 30.0
    """Limit of one forward/backward call to a stage server, in seconds."""
    max_tensor_bytes: int = 256 << 20
    """Largest encoded activation or gradient a peer accepts, in bytes."""
    max_pending: int = 64
    """Micro-batches a stage server keeps inputs of (for their backward) at once; more are refused (busy)."""
    pending_timeout_s: float = 120.0
    """A kept input with no backward after this many seconds is dropped, in seconds."""
    rebalance_period_s: float = 90.0
    """Mean time between two rebalancing checks, in seconds; each wait is drawn in [2/3, 4/3] of it."""
    balance_quality: float = 0.75
    """A server moves only if old / new bottleneck throughput falls below this, in (0, 1]."""
    sync_interval_s: float = 60.0
    """Time between two outer rounds of a stage's replicas on the stage's parameters, in seconds (rounds start at
    wall-clock multiples of it, so replicas meet); 0: replicas never average."""
    skip_ratio: float = 0.0
    """SkipPipe (Blagoev et al. 2025): each micro-batch skips up to this fraction of the S stages (middle stages
    only; a skipped stage is the identity), in [0, 1); 0: every micro-batch visits every stage
    (:mod:`protocols.skippipe`)."""

    spot_check_prob: float = 0.0
    """Probability that a trainer spot-checks a stage call: it recomputes the same input on another replica of the
    stage (or on its own copy of the stage, when it serves it) and bans the server whose output disagrees
    (reliability row B9; :meth:`protocols.stage_service.PipelineTrainer.step`); 0: never, in [0, 1]."""
    spot_check_tolerance: float = 0.1
    """Two outputs of a spot-check agree if ``||a - b|| <= tolerance * max(||a||, ||b||)`` (L2 over the whole
    tensor): honest replicas differ by the steps they took since their last stage round and by the codec, in (0, 1]."""

    def __post_init__(self) -> None:
        if not isinstance(self.stages, int) or self.stages < 1:
            raise ValueError(f"swarm.stages must be a positive int, got {self.stages!r}")
        if self.codec not in CODECS:
            raise ValueError(f"swarm.codec must be one of {', '.join(CODECS)}, got {self.codec!r}")
        if not 0 < self.ema_alpha <= 1:
            raise ValueError(f"swarm.ema_alpha must be in (0, 1], got {self.ema_alpha}")
        if not 0 < self.balance_quality <= 1:
            raise ValueError(f"swarm.balance_quality must be in (0, 1], got {self.balance_quality}")
        if isinstance(self.skip_ratio, bool) or not isinstance(self.skip_ratio, (int, float)) \
                or not 0 <= self.skip_ratio < 1:
            raise ValueError(f"swarm.skip_ratio must be in [0, 1), got {self.skip_ratio!r}")

        if not 0 <= self.spot_check_prob <= 1:
            raise ValueError(f"swarm.spot_check_prob must be in [0, 1], got {self.spot_check_prob}")
        if not 0 < self.spot_check_tolerance <= 1:
            raise ValueError(f"swarm.spot_check_tolerance must be in (0, 1], got {self.spot_check_tolerance}")
        if not self.sync_interval_s >= 0:
            raise ValueError(f"swarm.sync_interval_s must be >= 0, got {self.sync_interval_s}")
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"swarm.max_retries must be a non-negative int, got {self.max_retries!r}")
        if not isinstance(self.max_pending, int) or self.max_pending < 1:
            raise ValueError(f"swarm.max_pending must be a positive int, got {self.max_pending!r}")
        for name in ("ban_s", "call_timeout_s", "pending_timeout_s", "rebalance_period_s", "max_tensor_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"swarm.{name} must be positive, got {getattr(self, name)}")
        if self.pending_timeout_s <= self.call_timeout_s:
            raise ValueError(f"swarm.pending_timeout_s ({self.pending_timeout_s}) must exceed call_timeout_s "
                             f"({self.call_timeout_s}): a kept input must outlive the forward call that made it")


class NoServer(LookupError):
    """No server of a stage is available (none announced, or all banned / already tried)."""


# ---------------------------------------------------------------------------------------------------- stage rounds

#: ``[diloco]`` keys a SWARM run does not take from its config: a stage round's outer step is plain averaging
#: (:func:`stage_round_hyperparams`), and these are its values.
STAGE_ROUND_OUTER_STEP = {"outer_lr": 1.0, "outer_momentum": 0.0}


def stage_round_hyperparams(hp: DiLoCoHyperparams) -> DiLoCoHyperparams:
    """``hp`` with the outer step of a stage round: SGD with lr 1 and no momentum on the samples-weighted mean
    pseudo-gradient, i.e. ``theta := sum_i w_i theta_i / sum_i w_i``, the replicas' parameters averaged (SWARM,
    arXiv 2301.11913: the peers of a stage average with all-reduce).

    Why not DiLoCo's outer step (lr 0.7, Nesterov momentum 0.9): a stage round is a wall-clock event among replicas
    that step every micro-batch, not a synchronous step of a global optimizer. Once the momentum has built up along
    the direction the replicas keep moving in, each round moves theta ``lr / (1 - mu)`` = 7 times as far as the
    replicas went since the last one: the inner AdamW runs at an effective learning rate several times its own, and
    the loss stalls far above one process's or climbs back (as much with one server per stage, where averaging does
    nothing; neither resetting the AdamW moments at each round nor equal step counts per replica helps). Plain
    averaging moves no replica further than the replicas went themselves; the replicas keep their AdamW moments
    (resetting them costs accuracy)."""
    return dataclasses.replace(hp, **STAGE_ROUND_OUTER_STEP, outer_nesterov=False)


# ----------------------------------------------------------------------------------------------- stochastic wiring


class StageBalancer:
    """Stochastic wiring among the servers of one stage.

    Every server has an accumulated expected time (its "queue"); :meth:`choose` picks the smallest and adds
    ``work / throughput`` to it, so over many micro-batches each server receives work in proportion to its
    measured throughput (a server at half speed gets a third of a two-server stage). A server never measured is
    chosen before any measured one; its first measurement lifts its queue to the smallest other queue so it does
    not take a burst of catch-up work.

    Args:
        ema_alpha: weight of the newest throughput measurement.
        ban_s: how long :meth:`fail` excludes a server, in seconds.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, *, ema_alpha: float = 0.1, ban_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ema_alpha = ema_alpha
        self.bans = BanList(ban_s, clock=clock)
        self._queue: dict[str, float] = {}
        self._throughput: dict[str, float] = {}
        self._heap: list[tuple[float, int, str]] = []  # (queue, tie-break, server); stale entries skipped
        self._tie = itertools.count()
        self.chosen: dict[str, int] = {}

    @property
    def servers(self) -> list[str]:
        return list(self._queue)

    def throughput(self, server: str) -> Optional[float]:
        """EMA throughput of ``server`` (work per second), or None while unmeasured."""
        return self._throughput.get(server)

    def set_servers(self, servers: Iterable[str]) -> None:
        """Replace the set of servers (from the stage's announcements); known servers keep their state."""
        servers = set(servers)
        for gone in set(self._queue) - servers:
            del self._queue[gone]
            self._throughput.pop(gone, None)
        start = min(self._queue.values(), default=0.0)
        for new in sorted(servers - set(self._queue)):
            self._push(new, start)

    def _push(self, server: str, queue: float) -> None:
        self._queue[server] = queue
        heapq.heappush(self._heap, (queue, next(self._tie), server))

    def choose(self, work: float = 1.0, exclude: Iterable[str] = ()) -> str:
        """The server for the next ``work`` (samples) of this stage; books ``work`` on it.

        ``exclude``: servers not to use (e.g. those a micro-batch already failed on). Raises :class:`NoServer`.
        """
        exclude = set(exclude)
        usable = [s for s in self._queue if s not in exclude and not self.bans.is_banned(s)]
        if not usable:
            raise NoServer(f"no usable server among {len(self._queue)}")
        unmeasured = [s for s in usable if s not in self._throughput]
        if unmeasured:
            server = min(unmeasured, key=lambda s: (self.chosen.get(s, 0), s))
        else:
            skipped, server = [], None
            while self._heap:
                queue, tie, candidate = heapq.heappop(self._heap)
                if self._queue.get(candidate) != queue:
                    continue  # stale entry: the server left or its queue moved on
                if candidate in usable:
                    server = candidate
                    break
                skipped.append((queue, tie, candidate))
            for entry in skipped:
                heapq.heappush(self._heap, entry)
            assert server is not None, "every usable server has a live heap entry"
            self._push(server, self._queue[server] + work / self._throughput[server])
        self.chosen[server] = self.chosen.get(server, 0) + 1
        return server

    def report(self, server: str, work: float, seconds: float) -> None:
        """``server`` did ``work`` in ``seconds``: update its EMA throughput (unknown servers are ignored)."""
        if server not in self._queue or seconds <= 0 or work <= 0:
            return
        measured = work / seconds
        old = self._throughput.get(server)
        if old is None:
            others = [q for s, q in self._queue.items() if s != server and s in self._throughput]
            self._push(server, max(self._queue[server], min(others, default=0.0)))
            self._throughput[server] = measured
        else:
            self._throughput[server] = (1 - self.ema_alpha) * old + self.ema_alpha * measured

    def fail(self, server: str, reason: str) -> None:
        """``server`` failed or timed out: skip it for ``ban_s`` seconds."""
        self.bans.ban(server, reason)


@dataclass
class WiringStats:
    """Counts of a trainer's micro-batches: every one sent ends as completed or dropped, never silently lost."""

    sent: int = 0
    completed: int = 0
    retried: int = 0
    """Calls re-sent to another server of the same stage after a failure (one micro-batch may retry several)."""
    dropped: int = 0
    failures_by_server: dict[str, int] = field(default_factory=dict)
    spot_checks: int = 0
    """Stage calls recomputed elsewhere to check them (``SwarmConfig.spot_check_prob``)."""
    spot_check_bans: int = 0
    """Servers banned because their output disagreed with the other opinions of a spot-check."""
    spot_check_unresolved: int = 0
    """Spot-checks where two outputs disagreed and no third opinion could decide (nobody banned)."""


class Wiring:
    """One :class:`StageBalancer` per stage plus the counts; what a trainer consults for each micro-batch."""

    def __init__(self, num_stages: int, *, ema_alpha: float = 0.1, ban_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stages = [StageBalancer(ema_alpha=ema_alpha, ban_s=ban_s, clock=clock) for _ in range(num_stages)]
        self.stats = WiringStats()

    def set_servers(self, by_stage: Mapping[int, Iterable[str]]) -> None:
        """Servers of each stage (stages missing from the map are left as they are)."""
        for k, servers in by_stage.items():
            self.stages[k].set_servers(servers)

    def fail(self, stage: int, server: str, reason: str) -> None:
        self.stages[stage].fail(server, reason)
        self.stats.failures_by_server[server] = self.stats.failures_by_server.get(server, 0) + 1


# --------------------------------------------------------------------------------------------------- announcements


@dataclass(frozen=True)
class StageAnnouncement:
    """What a stage server publishes about itself (in the DHT, under its stage's key, subkey = its PeerID).

    ``stage``: the stage it serves; ``throughput``: samples per second of compute it measured (None before its
    first micro-batch); ``load``: micro-batches it holds inputs of; ``seq``: increases with every announcement of
    this server, so after a move (its old stage's record lives until it expires) readers keep the newest.
    ``outer_round``: outer rounds its stage's parameters completed (replicas at the same round average together).
    """

    stage: int
    throughput: Optional[float] = None
    load: int = 0
    seq: int = 0
    outer_round: int = 0

    def to_dict(self) -> dict:
        return {"stage": self.stage, "throughput": self.throughput, "load": self.load, "seq": self.seq,
                "outer_round": self.outer_round}

    @classmethod
    def parse(cls, value: object, num_stages: int) -> Optional["StageAnnouncement"]:
        """A peer's announcement, or None if it is malformed or names a stage outside [0, num_stages) (peers'
        records are untrusted: a bad one is ignored, never raised)."""
        if not isinstance(value, dict):
            return None
        stage, throughput, load = value.get("stage"), value.get("throughput"), value.get("load", 0)
        seq, outer_round = value.get("seq", 0), value.get("outer_round", 0)
        if not (isinstance(outer_round, int) and not isinstance(outer_round, bool) and 0 <= outer_round < 2**63):
            return None
        if not (isinstance(seq, int) and not isinstance(seq, bool) and 0 <= seq < 2**63):
            return None
        if not (isinstance(stage, int) and not isinstance(stage, bool) and 0 <= stage < num_stages):
            return None
        if throughput is not None and not (isinstance(throughput, (int, float)) and not isinstance(throughput, bool)
                                           and 0 < throughput < float("inf")):
            return None
        if not (isinstance(load, int) and not isinstance(load, bool) and 0 <= load < 2**31):
            return None
        return cls(stage, None if throughput is None else float(throughput), load, seq, outer_round)


# ----------------------------------------------------------------------------------------------------- rebalancing


def stage_throughputs(assignment: Mapping[str, int], throughput: Mapping[str, float], num_stages: int) -> list[float]:
    """Throughput of each stage = sum of its servers' throughputs (0 for an empty stage)."""
    totals = [0.0] * num_stages
    for server, stage in assignment.items():
        totals[stage] += throughput.get(server, 0.0)
    return totals


def bottleneck_stage(assignment: Mapping[str, int], throughput: Mapping[str, float], num_stages: int) -> int:
    """The stage with the lowest throughput (an empty stage first; ties go to the lowest index)."""
    totals = stage_throughputs(assignment, throughput, num_stages)
    counts = [0] * num_stages
    for stage in assignment.values():
        counts[stage] += 1
    return min(range(num_stages), key=lambda k: (counts[k] > 0, totals[k], k))


def choose_stage(assignment: Mapping[str, int], throughput: Mapping[str, float], num_stages: int) -> int:
    """The stage a joining server should serve: the swarm's bottleneck."""
    return bottleneck_stage(assignment, throughput, num_stages)


def _rule_target(server: str, assignment: Mapping[str, int], throughput: Mapping[str, float], num_stages: int,
                 balance_quality: float) -> tuple[Optional[int], float]:
    """Petals' rule for one server: (the stage it should move to or None, the bottleneck throughput after that move)."""
    mine = assignment[server]
    if sum(1 for s in assignment.values() if s == mine) <= 1:
        return None, 0.0  # never leave a stage empty
    target = bottleneck_stage(assignment, throughput, num_stages)
    if target == mine:
        return None, 0.0
    new = stage_throughputs({**assignment, server: target}, throughput, num_stages)
    if not any(s == target for s in assignment.values()):
        return target, min(new)
    old = stage_throughputs(assignment, throughput, num_stages)
    if min(new) <= 0:
        return None, 0.0
    return (target, min(new)) if min(old) / min(new) < balance_quality else (None, 0.0)


def should_move(server: str, assignment: Mapping[str, int], throughput: Mapping[str, float], num_stages: int,
                balance_quality: float = 0.75) -> Optional[int]:
    """The stage ``server`` should move to, or None to stay.

    Petals' rule (``server/block_selection.py``): move to the bottleneck stage only if it leaves no stage empty and
    ``old_bottleneck / new_bottleneck < balance_quality``; an empty stage is always filled by a server whose stage
    keeps another server. ``throughput`` is work per second per server (a missing server counts as 0).

    One mover per view: of the servers on ``server``'s stage that the rule would move to the same target, only the
    one whose move leaves the highest bottleneck (ties: the lowest PeerID) moves. Servers that read the same
    announcements therefore never move together and overshoot (3 + 1 -> 1 + 3); the others see the move in their next
    check and stay.
    """
    target, gain = _rule_target(server, assignment, throughput, num_stages, balance_quality)
    if target is None:
        return None
    mine = assignment[server]
    for other in assignment:
        if other == server or assignment[other] != mine:
            continue
        other_target, other_gain = _rule_target(other, assignment, throughput, num_stages, balance_quality)
        if other_target == target and (other_gain > gain or (other_gain == gain and other < server)):
            return None
    return target


@dataclass(frozen=True)
class MoveClaim:
    """A server's notice that it is about to move from stage ``source`` to ``target`` (in the DHT under the run's
    moves key, subkey = its PeerID), stored before it moves and ``withdrawn`` once it has moved or backed off.

    ``claimed_at``: DHT time (seconds) when it was made. Claims make moves mutually exclusive where the one-mover-
    per-view rule of :func:`should_move` cannot: two servers that read the announcements a moment apart (a new
    throughput announced in between, or each using its own fresh throughput) can each see itself as the best mover.
    """

    source: int
    target: int
    claimed_at: float
    withdrawn: bool = False

    def to_dict(self) -> dict:
        return {"source": self.source, "target": self.target, "claimed_at": self.claimed_at,
                "withdrawn": self.withdrawn}

    @classmethod
    def parse(cls, value: object, num_stages: int) -> Optional["MoveClaim"]:
        """A peer's claim, or None if it is malformed (peers' records are untrusted: a bad one is ignored)."""
        if not isinstance(value, dict):
            return None
        source, target = value.get("source"), value.get("target")
        claimed_at, withdrawn = value.get("claimed_at"), value.get("withdrawn", False)
        for stage in (source, target):
            if not (isinstance(stage, int) and not isinstance(stage, bool) and 0 <= stage < num_stages):
                return None
        if not (isinstance(claimed_at, (int, float)) and not isinstance(claimed_at, bool)
                and 0 <= claimed_at < float("inf")) or not isinstance(withdrawn, bool):
            return None
        return cls(source, target, float(claimed_at), withdrawn)


def move_claim_stands(me: str, claims: Mapping[str, MoveClaim]) -> bool:
    """Whether ``me`` may move: no other server's claim stands (is present and not withdrawn).

    Read the claims after one's own claim is stored (the store completed). Safety: of two servers whose claims
    overlap in time, the one whose store completed last reads after both stores completed and sees the other's, so
    two servers never both move (given that a completed DHT store is visible to later reads; the first to store may
    miss the second's claim and move alone). Both may see each other and back off; their jittered next checks
    (:func:`rebalance_delay_s`) then rarely collide again. Deliberately not "the earliest claim wins": the earlier
    claimant may not have seen the later one, which then would move too. Waiting between the store and the read
    would only make both back off more often.
    """
    return not any(peer != me and not claim.withdrawn for peer, claim in claims.items())


def rebalance_delay_s(period_s: float, rng: random.Random) -> float:
    """Wait before the next rebalancing check: uniform in [2/3, 4/3] of ``period_s`` (jitter keeps servers from
    deciding at the same instant on the same view and all moving at once)."""
    return period_s * rng.uniform(2 / 3, 4 / 3)
