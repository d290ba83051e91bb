"""Matchmaking keys of outer rounds, and the rule that gives a failed round a fresh key.

Every role keys a round's groups the same way: ``<prefix><N>[.retry<n>][.attempt<a>]``, where N = the outer
round's version + 1 (the number peers' logs give that round), n = the round's failed tries that the peers agree on
and a = the all-reduce attempt within one try. A failed round is tried again under a fresh key: the peers'
discovery records and the sealed groups their matchmakers remember for the old key outlive the failure, and a peer
that tried the old key again while the former leader had not come back was answered "already sealed" (or handed
the failed group) and failed again. Peers agree on n through their status records (:data:`RETRIES_FIELD`).
"""

from __future__ import annotations

from typing import Mapping, Optional

#: The prefix of DiLoCo's and SPES's round keys (Moshpit's round-wide rendezvous uses ``moshpit.r``).
ROUND_PREFIX = "round"

#: Status-record field with each fragment's failed tries of its current round: ``{fragment name: [round, tries]}``.
RETRIES_FIELD = "round_retries"

#: Larger try counts in a peer's status record are ignored (bad input, not a real count).
MAX_RETRIES = 10_000


def group_key(outer_round: int, retry: int = 0, attempt: int = 1, prefix: str = ROUND_PREFIX) -> str:
    """The matchmaking key of try ``retry`` (0: the first) of the round after version ``outer_round`` (>= 0),
    ``attempt`` (>= 1) of its all-reduce: ``round<N>`` with N = ``outer_round`` + 1, then ``.retry<retry>`` and
    ``.attempt<attempt>`` where they are not the first."""
    key = f"{prefix}{outer_round + 1}"
    if retry:
        key += f".retry{retry}"
    return key if attempt == 1 else f"{key}.attempt{attempt}"


def agreed_retry(outer_round: int, own: int, fragment: str, records: Mapping[str, Mapping]) -> int:
    """The try of ``outer_round`` to join: the most failed tries of it that we (``own``) or any peer (status
    ``records``, PeerID -> record, :data:`RETRIES_FIELD`) counted for ``fragment``. Members of a failed group all
    count it, so they agree; a peer that missed a try (it was downloading the state, or restarted) catches up on the
    others' count. Malformed entries are ignored."""
    counts = [own]
    for record in records.values():
        retries = record.get(RETRIES_FIELD) if isinstance(record, Mapping) else None
        entry = retries.get(fragment) if isinstance(retries, dict) else None
        if (isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[0] == outer_round
                and isinstance(entry[1], int) and not isinstance(entry[1], bool) and 0 <= entry[1] <= MAX_RETRIES):
            counts.append(entry[1])
    return max(counts)


class RoundTries:
    """The failed tries of one fragment's current round, and the key of its next try.

    :meth:`try_key` picks the agreed try (:func:`agreed_retry`); :meth:`failed` counts that try as failed, so the next
    :meth:`try_key` of the same round moves on to a fresh key; :meth:`record` is what the status record publishes."""

    def __init__(self, fragment: str, prefix: str = ROUND_PREFIX):
        self.fragment = fragment
        self.prefix = prefix
        self._failed = (-1, 0)  # (outer round, its failed tries)
        self._trying = (-1, 0)  # (outer round, the try under way)

    def retry(self, outer_round: int, records: Mapping[str, Mapping]) -> int:
        """The try of ``outer_round`` to join now, given the other peers' status ``records``; remembered for
        :meth:`failed`."""
        own = self._failed[1] if self._failed[0] == outer_round else 0
        self._trying = (outer_round, agreed_retry(outer_round, own, self.fragment, records))
        return self._trying[1]

    def try_key(self, outer_round: int, records: Mapping[str, Mapping], attempt: int = 1) -> str:
        """:func:`group_key` of the try :meth:`retry` picks."""
        return group_key(outer_round, self.retry(outer_round, records), attempt, self.prefix)

    def failed(self) -> None:
        """The try picked last failed: the round's next try uses the next key."""
        r, retry = self._trying
        self._failed = (r, retry + 1)

    def record(self, outer_round: int) -> Optional[list[int]]:
        """``[outer_round, failed tries]`` for the status record; None when ``outer_round`` has not failed."""
        r, tries = self._failed
        return [r, tries] if tries and r == outer_round else None
