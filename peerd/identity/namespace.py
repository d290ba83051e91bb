"""Run references and the run namespace: every DHT key, handler-name prefix and group key of a run, from one object.

**Run ids.** A run id is ``name`` or ``name@creator``:

- ``name``: 1-64 characters from ``[A-Za-z0-9_-]``, starting with a letter or digit. ``.`` is refused because it
  separates the parts of a DHT key (``peerd.<name>.status``): with dots, run ``a.b`` and run ``a`` could share
  keys. Every key of a run derives from its name alone, so ``demo``, ``demo@12D3KooW...`` (full PeerID) and
  ``demo@<24-character prefix>`` are one run.
- ``creator``: the creator's full PeerID or a prefix of it of at least :data:`CREATOR_MIN_PREFIX` characters
  (``12D3KooW``, the same for every Ed25519 PeerID, plus 16 characters; finding another key with the same prefix
  takes ~58^16 key generations). It only restricts which signed run config a peer accepts
  (:mod:`peerd.identity.membership`); the creator itself may start with ``name@<own PeerID>``.

**Keys.** ``peerd.<name>[.<scope>=<value>...].<what>``. Names, scope keys and values and key names are drawn from
the same alphabet without ``.`` and ``=``, and a scope segment is the only one with an ``=``, so two different
(run, scope, key) triples never give the same string (tests/unit/test_namespace.py).

This module imports nothing heavy (``peerd --help`` parses run ids with it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union

#: Every key peerd stores in the DHT starts with this.
KEY_ROOT = "peerd"
#: Separates the parts of a key; never part of a name.
SEPARATOR = "."
#: Shortest creator PeerID prefix a run id may carry: "12D3KooW" + 16 characters.
CREATOR_MIN_PREFIX = 24
#: Ed25519 PeerIDs are 52 characters long (base58btc of the identity multihash).
PEER_ID_LENGTH = 52

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}"
_NAME = re.compile(NAME_PATTERN)
_CREATOR = re.compile(r"12D3KooW[1-9A-HJ-NP-Za-km-z]+")  # base58btc alphabet


class RunIdError(ValueError):
    """A run id (or a scope) that cannot name a run; the message is one line. The CLI exits with code 2."""


def check_name(text: str, what: str = "run name") -> str:
    """``text`` if it is a valid name (:data:`NAME_PATTERN`), else RunIdError naming ``what``."""
    if not isinstance(text, str) or not _NAME.fullmatch(text):
        raise RunIdError(f"invalid {what} {text!r}: use 1-64 letters, digits, '_' or '-', starting with a letter "
                         f"or digit ('.' separates the parts of DHT keys)")
    return text


@dataclass(frozen=True)
class RunRef:
    """What a user names a run with: its name and, optionally, whose signed config to accept."""

    name: str
    """The run name; all keys derive from it alone."""
    creator: Optional[str] = None
    """Full PeerID or a >= 24-character prefix of it; restricts accepted configs. None = any (rules in
    :mod:`peerd.identity.membership`)."""

    def __post_init__(self) -> None:
        check_name(self.name, "run id")
        if self.creator is not None:
            c = self.creator
            if (not isinstance(c, str) or not CREATOR_MIN_PREFIX <= len(c) <= PEER_ID_LENGTH
                    or not _CREATOR.fullmatch(c)):
                raise RunIdError(
                    f"invalid run id {self.name}@{c}: after '@' give the creator's PeerID (12D3KooW...) or at least "
                    f"its first {CREATOR_MIN_PREFIX} characters"
                )

    @classmethod
    def parse(cls, text: str) -> "RunRef":
        """``"name"`` or ``"name@creator"`` -> RunRef. Raises RunIdError (one line) on anything else."""
        if not isinstance(text, str):
            raise RunIdError(f"a run id is a string, got {type(text).__name__}")
        name, sep, creator = text.partition("@")
        if sep and not creator:
            raise RunIdError(f"invalid run id {text!r}: nothing after '@' (give the creator's PeerID)")
        try:
            return cls(name, creator if sep else None)
        except RunIdError as e:
            if sep and "@" in creator:
                raise RunIdError(f"invalid run id {text!r}: more than one '@'") from None
            raise e from None

    def accepts(self, peer_id: str) -> bool:
        """True if a config signed by ``peer_id`` may be this run's: no creator named, or ``peer_id`` starts with
        it."""
        return self.creator is None or peer_id.startswith(self.creator)

    def __str__(self) -> str:
        return self.name if self.creator is None else f"{self.name}@{self.creator}"


def as_run_ref(run: Union[RunRef, str]) -> RunRef:
    """``run`` as a RunRef (parsed if it is a string). Raises RunIdError."""
    return run if isinstance(run, RunRef) else RunRef.parse(run)


@dataclass(frozen=True)
class RunNamespace:
    """The DHT keys and handler prefixes of one run, optionally narrowed to a scope (a pipeline stage, an expert,
    a fragment...). Scopes never collide with each other or with the unscoped namespace."""

    run: RunRef
    scope: tuple[tuple[str, str], ...] = ()
    """(key, value) pairs in the order they were added."""

    def __post_init__(self) -> None:
        if not isinstance(self.run, RunRef):
            object.__setattr__(self, "run", as_run_ref(self.run))
        seen = set()
        for key, value in self.scope:
            check_name(key, "scope key")
            check_name(value, f"value of scope {key!r}")
            if key in seen:
                raise RunIdError(f"scope {key!r} given twice")
            seen.add(key)

    @classmethod
    def of(cls, run: Union[RunRef, str, "RunNamespace"]) -> "RunNamespace":
        """The unscoped namespace of ``run`` (a RunRef, a run id string, or a namespace, returned as is)."""
        return run if isinstance(run, RunNamespace) else cls(as_run_ref(run))

    def scoped(self, **scope: object) -> "RunNamespace":
        """This namespace narrowed further, e.g. ``ns.scoped(stage=1)``, ``ns.scoped(fragment="f0")``. Values are
        converted with ``str`` (ints allowed) and validated like names. Raises RunIdError."""
        added = tuple((key, str(value)) for key, value in scope.items())
        return RunNamespace(self.run, self.scope + added)

    def _base(self) -> str:
        return SEPARATOR.join([KEY_ROOT, self.run.name] + [f"{k}={v}" for k, v in self.scope])

    def dht_key(self, name: str) -> str:
        """The DHT key ``name`` of this run and scope (``name`` validated like a run name)."""
        return f"{self._base()}{SEPARATOR}{check_name(name, 'key name')}"

    @property
    def status_key(self) -> str:
        """Run-wide key of the peers' status records (subkey = PeerID); the same for every scope, so `peerd
        status` sees every peer of the run."""
        return RunNamespace(self.run).dht_key("status")

    @property
    def config_key(self) -> str:
        """Run-wide key of the creator-signed run config (subkey = owner:<creator PeerID>)."""
        return RunNamespace(self.run).dht_key("config")

    def prefix(self, service: str) -> str:
        """Prefix of the handler names and group keys of ``service`` in this scope, e.g. ``ns.prefix("diloco")``
        for the DiLoCo matchmaker, all-reduce, gossip and state server."""
        return self.dht_key(check_name(service, "service name"))

    def __str__(self) -> str:
        return self._base()


def network_key(name: str) -> str:
    """A DHT key not tied to any run, e.g. ``network_key("dataplane")``. It cannot collide with run keys: run keys
    have at least three parts."""
    return f"{KEY_ROOT}{SEPARATOR}{check_name(name, 'key name')}"
