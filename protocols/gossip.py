"""Randomized gossip averaging (Boyd et al. 2006) with push-sum weights (Kempe et al. 2003): no groups, no barrier.

Each peer holds a vector x (P,) and a weight w (e.g. samples it trained on). A gossip round: the peer picks k random
live peers and, one after the other, does a pairwise push-pull exchange: both sides send (w, x) and both replace
their state by the weighted pair average

    x' = (w_i x_i + w_j x_j) / (w_i + w_j),    w' = (w_i + w_j) / 2.

Each exchange preserves sum_i w_i x_i and sum_i w_i, so repeated exchanges converge to the weighted average
sum w_i x_i / sum w_i at a rate set by the spectral gap of the random communication graph. Both sides decode the
same wire bytes (each encodes its own x once and uses the decoded copy), so a pair ends bit-identical.

A peer takes part in one exchange at a time. An exchange that arrives while it is busy waits if the initiator's
PeerID is smaller and is answered "busy" otherwise (the initiator then tries another partner): waiting only from
smaller to larger PeerIDs rules out deadlock cycles. A slow or dead peer delays only the exchanges that involve it (bounded by
``exchange_timeout_s``); nobody waits for the whole swarm.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from protocols.allreduce import validate_weight
from protocols.bans import BanList
from protocols.codecs import get_codec
from protocols.interfaces import Transport
from protocols.rpc import Refused, Request, RpcError, RpcTimeout, Service, Unreachable, call
from protocols.wire import ProtocolViolation, require

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------- pure core


def pair_average(x_i: torch.Tensor, w_i: float, x_j: torch.Tensor, w_j: float) -> tuple[torch.Tensor, float]:
    """Weighted pair average and the halved total weight; symmetric, so both sides compute identical bytes.

    If both weights are zero the plain mean is used (so that weightless peers still mix).
    """
    total = w_i + w_j
    if total <= 0:
        return (x_i + x_j) / 2, 0.0
    return (x_i * w_i + x_j * w_j) / total, total / 2


def choose_partners(live: Sequence[str], me: str, k: int, rng: random.Random) -> list[str]:
    """Up to ``k`` distinct random live peers other than ``me``, in a random order."""
    others = sorted(set(live) - {me})
    rng.shuffle(others)
    return others[:k]


def consensus_distance(vectors: Sequence[torch.Tensor]) -> float:
    """Mean over peers of ||x_i - mean|| / ||mean|| (0 when all agree)."""
    mean = torch.stack(list(vectors)).mean(0)
    norm = float(mean.norm())
    return sum(float((v - mean).norm()) for v in vectors) / len(vectors) / max(norm, 1e-30)


# ------------------------------------------------------------------------------------------------------------ runner


@dataclass(frozen=True)
class GossipConfig:
    """Gossip parameters (timeouts in seconds)."""

    partners_per_round: int = 2
    """k: exchanges a peer initiates per gossip round."""
    compression: str = "fp16"
    """Codec of vectors on the wire: none | fp16 | bf16 | int8 | fp4."""
    exchange_timeout_s: float = 30.0
    """Longest one pairwise exchange may take before it is abandoned (neither side changes on a timeout before the
    answer; an answer lost in transit leaves only the responder updated)."""

    def __post_init__(self) -> None:
        get_codec(self.compression)
        if self.partners_per_round < 1:
            raise ValueError(f"partners_per_round must be >= 1, got {self.partners_per_round}")
        if self.exchange_timeout_s <= 0:
            raise ValueError(f"exchange_timeout_s must be positive, got {self.exchange_timeout_s}")


@dataclass
class GossipResult:
    """Outcome of one gossip round for the initiator."""

    exchanges: int
    busy: int
    failed: int
    bytes_sent: int
    bytes_received: int
    partners: list[str] = field(default_factory=list)


class GossipAverager(Service):
    """Serves and initiates pairwise exchanges on a shared state held by the caller.

    An RPC service (:mod:`protocols.rpc`) named ``prefix`` with one method, ``gossip`` (stream handler
    ``<prefix>.gossip``): the request carries the initiator's ``(numel, weight, codec)`` and encoded x, the reply
    the responder's weight and encoded x; a responder in another exchange refuses with code ``busy``. A malformed
    request or answer (or a non-finite or wrongly sized vector) bans its sender; a refusal, a timeout or a stream
    that breaks fails the exchange and bans nobody (a slow or dropped link is no lie).

    ``get_state() -> (x (P,) fp32, w)`` and ``set_state(x, w)`` give access to the averaged state; they are called
    only from the event loop, inside this averager's lock, so the state never changes mid-exchange.
    """

    def __init__(
        self,
        transport: Transport,
        prefix: str,
        config: GossipConfig,
        get_state: Callable[[], tuple[torch.Tensor, float]],
        set_state: Callable[[torch.Tensor, float], None],
        seed: Optional[int] = None,
        bans: Optional[BanList] = None,
    ):
        self.transport = transport
        self.prefix = self.name = prefix
        self.config = config
        self.request_timeout_s = config.exchange_timeout_s
        self.codec = get_codec(config.compression)
        self.get_state = get_state
        self.set_state = set_state
        self.rng = random.Random(seed)
        self.bans = bans if bans is not None else BanList()
        self.lock = asyncio.Lock()
        self.served = 0
        self.bytes_sent = 0
        self.bytes_received = 0

    @property
    def handler_name(self) -> str:
        return self.handler_name_of("gossip")

    async def gossip_round(self, live_peers: Sequence[str]) -> GossipResult:
        """Exchange with up to ``partners_per_round`` random live peers (busy ones are replaced by others)."""
        me = self.transport.streams.peer_id
        candidates = [p for p in choose_partners(live_peers, me, len(live_peers), self.rng) if not self.bans.is_banned(p)]
        result = GossipResult(0, 0, 0, 0, 0)
        for peer in candidates:
            if result.exchanges >= self.config.partners_per_round:
                break
            outcome = await self._exchange(peer, result)
            if outcome == "ok":
                result.exchanges += 1
                result.partners.append(peer)
            elif outcome == "busy":
                result.busy += 1
            else:
                result.failed += 1
        return result

    async def _exchange(self, peer: str, result: GossipResult) -> str:
        async with self.lock:
            x, w = self.get_state()
            w = validate_weight(w)
            mine = self.codec.encode(x)
            try:
                answer = await asyncio.wait_for(self._call(peer, x.numel(), w, mine, result), self.config.exchange_timeout_s)
            except (asyncio.TimeoutError, RpcTimeout):
                logger.info("gossip exchange with %s timed out", peer)
                return "failed"
            except Refused as e:  # the partner said no (our request broke or came late at its end): no lie
                logger.info("gossip exchange with %s refused: %s", peer, e.reason)
                return "failed"
            except (ProtocolViolation, ValueError) as e:
                self.bans.ban(peer, f"invalid gossip answer: {e}")
                return "failed"
            except Unreachable as e:
                logger.info("gossip exchange with %s failed: %s", peer, e)
                return "failed"
            if answer is None:
                return "busy"
            x_j, w_j = answer
            new_x, new_w = pair_average(self.codec.decode(mine, x.numel()), w, x_j, w_j)
            self.set_state(new_x, new_w)
            return "ok"

    async def _call(
        self, peer: str, numel: int, weight: float, payload: bytes, result: GossipResult
    ) -> Optional[tuple[torch.Tensor, float]]:
        header = {"numel": numel, "weight": weight, "codec": self.codec.name}
        try:
            reply = await call(self.transport.streams, peer, self.prefix, "gossip", header, payload,
                               timeout_s=None,  # bounded by _exchange's wait_for
                               max_reply_bytes=self.codec.encoded_size(numel))
        except Refused as e:
            if e.code == "busy":
                return None
            raise
        result.bytes_sent += reply.bytes_sent
        result.bytes_received += reply.nbytes
        self.bytes_sent += reply.bytes_sent
        self.bytes_received += reply.nbytes
        w_j = validate_weight(require(reply.header, "weight", (int, float)))
        return self.codec.decode(reply.payload, numel), w_j

    def on_bad_request(self, peer: str, method: str, error: RpcError) -> None:
        if isinstance(error, ProtocolViolation):  # a late request is no evidence of malice
            self.bans.ban(peer, f"invalid gossip exchange: {error}")

    async def rpc_gossip(self, request: Request) -> None:
        # While we are busy, an exchange from a smaller PeerID waits for us and one from a larger PeerID is answered
        # "busy": waits then only ever point from smaller to larger PeerIDs, so concurrent exchanges cannot deadlock.
        peer = request.peer
        if self.bans.is_banned(peer):
            raise Refused("banned")
        if self.lock.locked() and peer > self.transport.streams.peer_id:
            return await self._answer_busy(request)
        try:
            await asyncio.wait_for(self.lock.acquire(), self.config.exchange_timeout_s)
        except asyncio.TimeoutError:
            return await self._answer_busy(request)
        try:
            await self._serve_locked(request)
        finally:
            self.lock.release()

    async def _answer_busy(self, request: Request) -> None:
        """Read (and drop) the request before answering busy: closing on an unread request resets the stream, and the
        initiator would count a failure instead of trying another partner."""
        x, _ = self.get_state()
        try:
            await request.payload(self.codec.encoded_size(x.numel()), self.config.exchange_timeout_s)
        except RpcError:
            return
        raise Refused("in another exchange", "busy")

    async def _serve_locked(self, request: Request) -> None:
        peer = request.peer
        x, w = self.get_state()
        try:
            header = request.header
            numel = require(header, "numel", int)
            w_i = validate_weight(require(header, "weight", (int, float)))
            if numel != x.numel() or header.get("codec") != self.codec.name:
                raise ProtocolViolation(f"exchange of {numel} {header.get('codec')} values, expected {x.numel()}")
            if request.size != self.codec.encoded_size(numel):
                raise ProtocolViolation(f"payload of {request.size} bytes for {numel} values")
            payload = await request.payload(request.size, self.config.exchange_timeout_s)
            x_i = self.codec.decode(payload, numel)
        except (ProtocolViolation, ValueError, RpcTimeout, Unreachable) as e:
            if not isinstance(e, (RpcTimeout, Unreachable)):  # a broken stream is not a lie: no ban
                self.bans.ban(peer, f"invalid gossip exchange: {e}")
            raise Refused(str(e)) from None
        mine = self.codec.encode(x)
        try:
            sent = await request.reply({"weight": validate_weight(w)}, mine, self.config.exchange_timeout_s)
        except RpcError:
            return  # the initiator will not update either: skip ours to keep the pair's sum
        self.bytes_sent += sent
        self.bytes_received += request.size
        new_x, new_w = pair_average(x_i, w_i, self.codec.decode(mine, numel), w)
        self.set_state(new_x, new_w)
        self.served += 1
