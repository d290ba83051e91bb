"""Names of a run's keys in the DHT and of its stream handlers (minimal: the strings peers use today).

``RunNamespace(run=RunRef.parse(run_id))`` gives every key a run's peers share: ``prefix(role)`` for the stream
handlers and group keys of a role, ``status_key``, ``config_key``; ``scoped(fragment=...)`` narrows group keys to one
parameter fragment (a stage, an expert).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RunRef:
    """A run id ``name`` or ``name@creator`` (creator: a PeerID prefix of the run's creator)."""

    name: str
    creator: str | None = None

    @classmethod
    def parse(cls, run_id: str) -> "RunRef":
        name, _, creator = run_id.partition("@")
        return cls(name, creator or None)

    def __str__(self) -> str:
        return f"{self.name}@{self.creator}" if self.creator else self.name


@dataclass(frozen=True)
class RunNamespace:
    """Keys of one run; ``scope`` narrows the role prefix (e.g. ``(("fragment", "stage0"),)``)."""

    run: RunRef
    scope: tuple[tuple[str, str], ...] = field(default=())

    def scoped(self, **parts: str) -> "RunNamespace":
        return RunNamespace(self.run, self.scope + tuple(sorted(parts.items())))

    def dht_key(self, suffix: str) -> str:
        return f"peerd.{self.run}.{suffix}"

    @property
    def status_key(self) -> str:
        """Every peer of the run keeps its status record here (subkey = PeerID)."""
        return self.dht_key("status")

    @property
    def config_key(self) -> str:
        return self.dht_key("config")

    def prefix(self, role: str) -> str:
        """Prefix of ``role``'s stream handlers and group keys. The DiLoCo role's unscoped prefix is the run's own
        (``peerd.<run>``), as before roles were named."""
        base = f"peerd.{self.run}" if role == "diloco" else f"peerd.{self.run}.{role}"
        return base + "".join(f".{k}-{v}" for k, v in self.scope)
