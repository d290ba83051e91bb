"""Move claims of SWARM stage servers in the DHT: at most one server of a run moves between stages at a time.

A server that Petals' rule tells to move (:func:`protocols.swarm.should_move`) first stores a
:class:`protocols.swarm.MoveClaim` under the run's moves key (subkey = its PeerID), then reads every claim: if
another live server's claim stands it withdraws its own and stays (its next rebalancing check decides again);
otherwise it moves and withdraws its claim once the move is announced. See
:func:`protocols.swarm.move_claim_stands` for why two servers never both move.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Collection, Optional

from peerd.roles.base import RunContext
from protocols.swarm import MoveClaim, move_claim_stands

__all__ = ["MoveClaims", "moves_key"]

logger = logging.getLogger(__name__)

#: A claim's lifetime in the DHT, in rebalancing periods (at least MIN_CLAIM_TTL_S): only a server that dies while
#: moving leaves one standing, and it blocks others' moves until it expires.
CLAIM_TTL_PERIODS = 2.0
MIN_CLAIM_TTL_S = 60.0


def moves_key(ctx: RunContext) -> str:
    """DHT key of the run's move claims (subkey = each claimant's PeerID)."""
    return ctx.namespace.dht_key("stage_moves")


class MoveClaims:
    """One server's move claims (a record of its own whose expiration only grows: a DHT record is replaced only by
    one that expires later, in hivemind's DHT too)."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self._expiration = 0.0

    def _next_expiration(self, claim: MoveClaim) -> float:
        ttl = max(MIN_CLAIM_TTL_S, CLAIM_TTL_PERIODS * self.ctx.run.swarm.rebalance_period_s)
        self._expiration = max(claim.claimed_at + ttl, self._expiration + 1e-3)
        return self._expiration

    async def claim(self, source: int, target: int, servers: Collection[str]) -> Optional[MoveClaim]:
        """Claim a move from ``source`` to ``target``; the claim if this server may move now, else None (nothing
        stands then: a claim that lost is withdrawn). Only claims of ``servers`` (the live stage servers this server
        sees, banned peers excluded) count, so a departed server's or a stranger's record blocks nobody. An
        unreachable DHT means no move this time."""
        ctx, discovery = self.ctx, self.ctx.transport.discovery
        claim = MoveClaim(source, target, discovery.time())
        try:
            if not await discovery.store(moves_key(ctx), ctx.peer_id, claim.to_dict(), self._next_expiration(claim)):
                return None
            records = await discovery.get(moves_key(ctx))
        except ConnectionError as e:
            logger.info("no stage move this time: the DHT did not take or return move claims (%s)", e)
            await self.withdraw(claim)
            return None
        claims = {peer: parsed for peer, record in records.items()
                  if peer in servers and not ctx.bans.is_banned(peer)
                  and (parsed := MoveClaim.parse(record.value, ctx.run.swarm.stages)) is not None}
        claims[ctx.peer_id] = claim
        if move_claim_stands(ctx.peer_id, claims):
            return claim
        others = sorted(peer for peer, c in claims.items() if peer != ctx.peer_id and not c.withdrawn)
        logger.info("not moving to stage %d now: %s moving too (claims), the next check decides again", target,
                    ", ".join(others))
        await self.withdraw(claim)
        return None

    async def withdraw(self, claim: MoveClaim) -> None:
        """Mark ``claim`` withdrawn (its record replaced). A failed store leaves the claim to expire."""
        withdrawn = dataclasses.replace(claim, withdrawn=True)
        try:
            await self.ctx.transport.discovery.store(moves_key(self.ctx), self.ctx.peer_id, withdrawn.to_dict(),
                                                     self._next_expiration(claim))
        except ConnectionError as e:
            logger.info("withdrawing the move claim failed (%s); it expires on its own", e)
