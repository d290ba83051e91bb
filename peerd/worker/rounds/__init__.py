"""Round strategies: how a DiLoCo worker's model meets the swarm's at a round boundary, chosen once from the run
config (:func:`make_rounds`).

- :class:`WholeModelRounds` (DiLoCo, Douillard et al. 2023, Alg. 1): the whole model syncs every H inner steps.
- :class:`FragmentRounds` (Streaming DiLoCo, Douillard et al. 2025, sec. 2.2; ``[diloco] fragments = F`` > 1): F
  strided fragments, fragment p syncs after step (p + 1) H/F of each cycle of H steps.
- :class:`DelayedRounds` (Streaming DiLoCo's overlap; ``[diloco] overlap = "delayed"``): round r's all-reduce runs
  in the background while round r+1's inner steps go on.
- :class:`DelayedFragmentRounds` (both): each fragment's all-reduce runs in the background while the next inner
  steps go on.

Each owns its fragments' outer states (:attr:`RoundStrategy.parts`), their outer syncs (:attr:`RoundStrategy.syncs`,
one per fragment, from :data:`peerd.roles.registry.OUTER_SYNCS`), what is in flight and its schedule's position;
:meth:`RoundStrategy.round` runs one round.
"""

from __future__ import annotations

from peerd.worker.rounds.base import RoundEnd, RoundStrategy
from peerd.worker.rounds.delayed import DelayedRounds
from peerd.worker.rounds.delayed_fragments import DelayedFragmentRounds
from peerd.worker.rounds.fragments import FragmentRounds
from peerd.worker.rounds.whole import WholeModelRounds

__all__ = ["RoundEnd", "RoundStrategy", "WholeModelRounds", "FragmentRounds", "DelayedRounds", "DelayedFragmentRounds",
           "make_rounds"]


def make_rounds(worker) -> RoundStrategy:
    """The round strategy the run config asks for (``[diloco] overlap`` and ``fragments``), built for ``worker``."""
    delayed, fragmented = worker.hp.overlap == "delayed", worker.hp.fragments > 1
    if delayed and fragmented:
        return DelayedFragmentRounds(worker)
    if delayed:
        return DelayedRounds(worker)
    if fragmented:
        return FragmentRounds(worker)
    return WholeModelRounds(worker)
