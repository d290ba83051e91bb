"""The names a run config chooses among, each mapped to the code behind it as ``"module:Class"`` (imported on use).

One table per choice: :mod:`peerd.run_config` validates against these keys, the CLI and the docs list them, and the
roles resolve them. This module imports nothing of peerd, so the run config (below the roles) can import it without
loading torch models or a role.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Role name (the run config's ``parallelism``) -> the role class (:class:`peerd.roles.base.Role`).
ROLES: dict[str, str] = {
    "diloco": "peerd.roles.diloco:DiLoCoRole",
    "swarm": "peerd.roles.swarm:SwarmRole",
    "spes": "peerd.roles.spes:SpesRole",
}

#: Averaging method (the run config's ``averaging.method``) -> its outer-sync strategy
#: (:class:`peerd.roles.outer_sync.OuterSync`, whose ``method`` is this key).
OUTER_SYNCS: dict[str, str] = {
    "allreduce": "peerd.roles.outer_sync:AllReduceSync",
    "moshpit": "peerd.roles.outer_sync:MoshpitSync",
    "gossip": "peerd.roles.outer_sync:GossipSync",
}


def resolve(table: dict[str, str], name: str, what: str) -> Any:
    """The object ``table[name]`` names, imported now. Raises KeyError naming ``what`` and the known names."""
    try:
        target = table[name]
    except KeyError:
        raise KeyError(f"unknown {what} {name!r}; known: {sorted(table)}") from None
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)
