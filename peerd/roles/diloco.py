"""The data-parallel DiLoCo role (Douillard et al. 2023, Alg. 1): inner steps on local data, outer rounds with the
swarm through the run's outer-sync strategy (:mod:`peerd.roles.outer_sync`).

Life of a worker (:class:`peerd.worker.outer_worker.OuterWorker`):

1. Resume from its local checkpoint if there is one, then *catch up*: if a live peer (seen through the status
   records in the DHT) is at a later outer round, download theta_outer and the outer momentum from it
   (:mod:`peerd.worker.catch_up`).
2. Loop: run inner AdamW steps until the round's quota (H, or what remains of the current round for a joiner);
   then run a round with the round strategy the run config chose (:mod:`peerd.worker.rounds`: whole-model rounds,
   Streaming DiLoCo's fragments, or the delayed overlap); evaluate; checkpoint.
3. On stop: abandon matchmaking (or let a running all-reduce finish, bounded), checkpoint, leave.

Recovery after a failed round (any strategy): the peers are back in step at the next boundary. theta_outer and the
momentum did not move, so every peer tries the same outer round again, under a fresh group key
(:func:`protocols.group_keys.group_key`: ``round<r>.retry<n>``, n = the failed tries of round r, the largest count
among ours and the live peers' status records): the old key's discovery records and the seal its leader remembers
outlive the failure, and a peer reaching the old key before its former leader came back was answered "already
sealed" (or handed the failed group) and failed once more. A group is never sealed early below ``min_group_size``
(:class:`protocols.matchmaking.Matchmaker`). The members' views of the live peers are pooled in matchmaking (each
sends the PeerIDs it expects), so a group seals early only once it has every peer any member knows of.
"""

from __future__ import annotations

from peerd.worker.outer_worker import OuterWorker


class DiLoCoRole(OuterWorker):
    """One peer's DiLoCo training. ``run()`` returns when stopped or after ``max_outer_rounds``."""
