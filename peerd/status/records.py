"""The status records every peer of a run keeps in the DHT (key ``RunNamespace.status_key``, subkey = its PeerID),
and how readers check them.

**Schema and evolution.** A record is a dict: the fields of :data:`STATUS_FIELDS` (always present, None where
unknown), the optional fields of :data:`OPTIONAL_STATUS_FIELDS`, ``time`` (when it was made, Unix seconds) and
``v`` (:data:`STATUS_VERSION`, the schema version of its writer). Readers (:func:`status_problem`,
:class:`StatusFilter`):

- check the type and bounds of every field they know, and drop a record whose known field is wrong;
- ignore fields they do not know, so a peer of a later version that adds a field (e.g. ``stage``) stays visible to
  peers of this version, and vice versa; :class:`StatusFilter` hands on only the known fields;
- read records without ``v`` (written before the version field existed: version 0, the fields of
  :data:`STATUS_FIELDS` and ``time``) like any other.

A later version may add optional fields (give them a checker in ``_CHECKS``) but never drops or retypes a field of
:data:`STATUS_FIELDS`: older readers require them.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Optional

from peerd.status.history import history_problem, known_series

#: Schema version written by this code. 0 = records without ``v``.
STATUS_VERSION = 1
#: Fields every status record carries (None where unknown).
STATUS_FIELDS = ("role", "outer_round", "inner_step", "loss", "tokens_per_s", "eval_nats_per_byte", "digest")
#: Known fields a record may lack (added after version 0): ``instance`` = a random id per daemon process (<= 64
#: characters), which tells a restarted peer from its previous process; ``stage`` = the pipeline stage a SWARM server
#: serves (a non-negative integer); ``history`` = the peer's compact recent history of losses and tokens/s
#: (:mod:`peerd.status.history`, read by dashboards); ``fragment_rounds`` = the outer round of each Streaming DiLoCo fragment
#: of a DiLoCo worker with ``[diloco] fragments`` > 1 (a list of at most 256 non-negative integers), and
#: ``fragment_digests`` the first 16 hex characters of each fragment's theta_outer digest (fork healing per fragment);
#: ``reachable`` =
#: whether other peers could dial this peer back directly (:mod:`protocols.reachability`; a boolean, None = not
#: checked yet or nobody answered); ``relayed`` = whether the peer holds a circuit relay reservation (others reach it
#: through a relay; a boolean, None = not checked); ``round_retries`` = a DiLoCo all-reduce worker's failed tries of
#: its current round per fragment (``{fragment name: [outer round, tries]}``, at most 256 entries; the next try's
#: group key counts them, :func:`peerd.roles.outer_sync.group_key`); ``experts`` = the experts a SPES peer holds and
#: trains (a list of at most 4096 non-negative integers, possibly empty); ``tokens_trained`` and ``rounds_contributed``
#: = this peer's contribution to the run so far (tokens it trained, outer rounds its update went into; non-negative
#: integers, kept across restarts in its checkpoint; :func:`contribution` ranks them).
OPTIONAL_STATUS_FIELDS = ("instance", "stage", "history", "fragment_rounds", "fragment_digests", "reachable", "relayed",
                          "round_retries", "experts", "tokens_trained", "rounds_contributed")
KNOWN_STATUS_FIELDS = STATUS_FIELDS + OPTIONAL_STATUS_FIELDS

_MAX_ROUND = 2**40
_MAX_VERSION = 2**31


def make_status(**fields: Any) -> dict[str, Any]:
    """A status record of this version: the known fields given by keyword (the others None), ``time`` = now and
    ``v`` = STATUS_VERSION. Raises ValueError naming any unknown field."""
    unknown = set(fields) - set(KNOWN_STATUS_FIELDS)
    if unknown:
        raise ValueError(f"unknown status fields {sorted(unknown)} (known: {', '.join(KNOWN_STATUS_FIELDS)})")
    record = {name: fields.get(name) for name in KNOWN_STATUS_FIELDS}
    record["time"] = time.time()
    record["v"] = STATUS_VERSION
    return record


def _short_str(limit: int, nullable: bool = True) -> Callable[[Any], bool]:
    return lambda v: (nullable and v is None) or (isinstance(v, str) and 0 < len(v) <= limit)


def _count(v: Any) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _MAX_ROUND)


def _finite(nullable: bool = True) -> Callable[[Any], bool]:
    return lambda v: (nullable and v is None) or (
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))


#: field -> (check, what it must be). Bounds: the DHT carries records to every peer of the run; a reader trusts none
#: of them blindly.
_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "role": (_short_str(32, nullable=False), "a string of 1-32 characters"),
    "outer_round": (_count, "a non-negative integer"),
    "inner_step": (_count, "a non-negative integer"),
    "loss": (_finite(), "a finite number"),
    "tokens_per_s": (_finite(), "a finite number"),
    "eval_nats_per_byte": (_finite(), "a finite number"),
    "digest": (lambda v: v is None or (isinstance(v, str) and len(v) <= 64), "a string of at most 64 characters"),
    "instance": (_short_str(64), "a string of 1-64 characters"),
    "stage": (_count, "a non-negative integer"),
    "history": (lambda v: v is None or history_problem(v) is None, "a history table (peerd.status.history)"),
    "fragment_rounds": (lambda v: v is None or (isinstance(v, (list, tuple)) and 0 < len(v) <= 256
                                                and all(_count(x) and x is not None for x in v)),
                        "a list of 1-256 non-negative integers"),
    "fragment_digests": (lambda v: v is None or (isinstance(v, (list, tuple)) and 0 < len(v) <= 256
                                                 and all(isinstance(x, str) and 0 < len(x) <= 64 for x in v)),
                         "a list of 1-256 strings of 1-64 characters"),
    "reachable": (lambda v: v is None or isinstance(v, bool), "a boolean"),
    "relayed": (lambda v: v is None or isinstance(v, bool), "a boolean"),
    "round_retries": (lambda v: v is None or (isinstance(v, dict) and 0 < len(v) <= 256 and all(
        _short_str(64, nullable=False)(k) and isinstance(x, (list, tuple)) and len(x) == 2
        and all(_count(c) and c is not None for c in x) for k, x in v.items())),
        "a map of 1-256 fragment names to [outer round, tries]"),
    "experts": (lambda v: v is None or (isinstance(v, (list, tuple)) and len(v) <= 4096
                                        and all(_count(x) and x is not None for x in v)),
                "a list of at most 4096 non-negative integers"),
    "tokens_trained": (_count, "a non-negative integer"),
    "rounds_contributed": (_count, "a non-negative integer"),
    "time": (_finite(nullable=False), "a finite number"),
    "v": (lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _MAX_VERSION,
          "a non-negative integer"),
}
_REQUIRED = STATUS_FIELDS + ("time",)


def status_problem(record: Any) -> Optional[str]:
    """None if ``record`` is a readable status record (rules in the module docstring), else what is wrong (a
    reader drops such records): not a dict, a field of STATUS_FIELDS or ``time`` missing, or a known field of the
    wrong type or out of bounds. Unknown fields are no problem."""
    if not isinstance(record, dict):
        return f"not a record but {type(record).__name__}"
    missing = [name for name in _REQUIRED if name not in record]
    if missing:
        return f"fields {', '.join(missing)} are missing"
    for name, (check, what) in _CHECKS.items():
        if name in record and not check(record[name]):
            value = repr(record[name])
            return f"{name} is not {what}: {value[:80]}"
    return None


def known_fields(record: dict) -> dict[str, Any]:
    """The fields of a readable ``record`` this version knows (optional ones None if absent, ``v`` 0 if absent)."""
    out = {name: record.get(name) for name in KNOWN_STATUS_FIELDS}
    out["time"] = record["time"]
    out["v"] = record.get("v", 0)
    if out["history"] is not None:
        out["history"] = known_series(out["history"])
    return out


class StatusFilter:
    """Keeps the status records that are readable (:func:`status_problem`), reduced to the fields this version
    knows (:func:`known_fields`); logs each bad one once per (peer, problem)."""

    def __init__(self, log: Optional[logging.Logger] = None):
        self.log = log or logging.getLogger(__name__)
        self.dropped = 0
        self._logged: set[tuple[str, str]] = set()

    def __call__(self, records: dict[str, Any]) -> dict[str, dict]:
        """PeerID -> status value (``records`` maps PeerIDs to :class:`protocols.interfaces.Record` or values)."""
        out = {}
        for peer, record in records.items():
            value = getattr(record, "value", record)
            problem = status_problem(value)
            if problem is None:
                out[peer] = known_fields(value)
                continue
            self.dropped += 1
            if (peer, problem) not in self._logged and len(self._logged) < 4096:
                self._logged.add((peer, problem))
                self.log.warning("dropped the status record of %s: %s", peer, problem,
                                 extra={"event": "status_refused", "peer": peer, "reason": problem})
        return out



def dialable_peers(discovery: Any, status_key: str) -> Callable[[], Any]:
    """A reader for the reachability check's helpers (:func:`peerd.transport.dialback.helpers_for`): each call reads
    the run's status records under ``status_key`` and returns, shuffled, the PeerIDs of live peers that did not
    leave and whose own check did not find them unreachable. Raises ConnectionError if the DHT cannot be read."""
    import random

    read = StatusFilter()

    async def peers() -> list[str]:
        live = [p for p, s in read(await discovery.get(status_key)).items()
                if s.get("role") != "left" and s.get("reachable") is not False]
        random.shuffle(live)
        return live

    return peers

def contribution(records: dict[str, dict]) -> list[dict[str, Any]]:
    """What each peer contributed to the run, ranked: ``[{rank, peer, tokens, rounds, share}, ...]`` by tokens
    trained, then rounds (then PeerID), from the ``tokens_trained`` / ``rounds_contributed`` of their signed status
    records (a peer that left counts while its last record lives); ``share`` = its fraction of all tokens listed.
    Records without the fields (other roles, older versions) are left out."""
    rows = [{"peer": peer, "tokens": r["tokens_trained"], "rounds": r.get("rounds_contributed") or 0}
            for peer, r in records.items() if isinstance(r.get("tokens_trained"), int)]
    rows.sort(key=lambda row: (-row["tokens"], -row["rounds"], row["peer"]))
    total = sum(row["tokens"] for row in rows)
    for rank, row in enumerate(rows, 1):
        row["rank"], row["share"] = rank, row["tokens"] / total if total else 0.0
    return rows
