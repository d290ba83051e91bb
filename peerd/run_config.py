"""The run's configuration: what every peer of one run must agree on (model, data, DiLoCo, averaging).

It comes from ``--run-config FILE`` for the peer that creates a run and from the DHT for everyone else; a local file
that disagrees with the published one is refused. Frozen dataclasses validated in ``__post_init__``; unknown keys and
wrong types raise :class:`peerd.config.ConfigError` naming the key and the file. Importing this module imports the
protocols (and torch).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from peerd.config import ConfigError, build_config, read_toml
from protocols.allreduce import AllReduceConfig
from protocols.compression import CODECS
from protocols.diloco import DiLoCoHyperparams
from protocols.gossip import GossipConfig
from protocols.matchmaking import MatchmakingConfig

MODEL_NAMES = ("tiny", "small")
AVERAGING_METHODS = ("allreduce", "moshpit", "gossip")


@dataclass(frozen=True)
class AveragingConfig:
    """How peers average pseudo-gradients (timeouts in seconds)."""

    method: str = "allreduce"
    """Topology: allreduce (one butterfly all-reduce of pseudo-gradients among all peers present; theta_outer stays
    bit-identical), moshpit (all-reduce in grid groups of ``group_size``, Ryabinin et al. 2021) or gossip (pairwise
    push-pull with ``gossip_partners`` random peers, no barrier; Boyd et al. 2006). With moshpit and gossip every
    peer applies its own outer step and then averages its outer state (theta_outer and momentum) with its group or
    partners, so peers stay close rather than identical."""
    compression: str = "fp16"
    """Wire codec of what is averaged: none | fp16 | int8."""
    group_size: int = 4
    """moshpit: target group size M (the grid has side M and ceil(log_M N) dimensions)."""
    gossip_partners: int = 2
    """gossip: partners a peer exchanges with after each of its outer steps (k)."""
    aggregation: str = "mean"
    """How each reducer combines its part: mean, or centered_clip (CenteredClip, Karimireddy et al. 2021: a minority
    of peers sending scaled or flipped pseudo-gradients cannot drag the result away)."""
    clip_tau: float = 1.0
    """CenteredClip radius in the units of the averaged values (each reducer clips its own part)."""
    ban_s: float = 120.0
    """How long a peer that sent invalid data or stalled mid-transfer is excluded from our rounds."""
    min_group_size: int = 1
    """A round with fewer peers fails (1 lets a lone peer keep applying outer steps)."""
    matchmaking_timeout_s: float = 30.0
    """Longest a peer waits for the round's group to form."""
    request_timeout_s: float = 5.0
    """Longest one request to another peer (join, state download header) may take."""
    sender_timeout_s: float = 30.0
    """A reducer waits this long for the members' parts."""
    reducer_timeout_s: float = 60.0
    """A member waits this long for every reducer's answer."""

    def __post_init__(self) -> None:
        for name in ("matchmaking_timeout_s", "request_timeout_s", "sender_timeout_s", "reducer_timeout_s", "clip_tau", "ban_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"averaging.{name} must be a number of seconds, got {value!r}")
            object.__setattr__(self, name, float(value))  # equal configs must print (and hash) alike
        if self.method not in AVERAGING_METHODS:
            raise ConfigError(f"averaging.method must be one of {AVERAGING_METHODS}, got {self.method!r}")
        if self.ban_s <= 0:
            raise ConfigError(f"averaging.ban_s must be positive, got {self.ban_s}")
        if self.group_size < 2 or self.gossip_partners < 1:
            raise ConfigError(
                f"averaging.group_size must be >= 2 and gossip_partners >= 1, got {self.group_size}, "
                f"{self.gossip_partners}"
            )
        if self.compression not in CODECS:
            raise ConfigError(f"averaging.compression must be one of {CODECS}, got {self.compression!r}")
        try:
            self.matchmaking()
            self.allreduce()
        except ValueError as e:
            raise ConfigError(f"averaging: {e}") from None

    def matchmaking(self) -> MatchmakingConfig:
        return MatchmakingConfig(
            matchmaking_timeout_s=self.matchmaking_timeout_s,
            request_timeout_s=self.request_timeout_s,
            poll_interval_s=min(0.5, self.matchmaking_timeout_s / 4),
            min_group_size=self.min_group_size,
        )

    def allreduce(self) -> AllReduceConfig:
        return AllReduceConfig(self.compression, self.sender_timeout_s, self.reducer_timeout_s,
                               aggregation=self.aggregation, clip_tau=self.clip_tau)

    def gossip(self) -> GossipConfig:
        return GossipConfig(self.gossip_partners, self.compression, self.sender_timeout_s)


@dataclass(frozen=True)
class RunConfig:
    """Everything peers of one run must agree on. Published in the DHT under the run id."""

    model: str = "small"
    """Model size: tiny (~0.9M parameters) or small (~10.7M)."""
    seq_len: int = 256
    """Training window length in bytes (tokens of the byte-level tokenizer)."""
    batch_size: int = 16
    """Sequences per inner step on each peer."""
    dataset: str = "shakespeare"
    """Training text: shakespeare (the default corpus) or local (each peer passes --data)."""
    seed: int = 0
    """Seed of the initial model (every peer that starts a run from scratch builds the same weights)."""
    max_outer_rounds: int = 0
    """Peers leave after this many outer rounds; 0 = train until stopped."""
    eval_batches: int = 8
    """Batches of held-out text evaluated after each outer round (0 disables evaluation)."""
    diloco: DiLoCoHyperparams = field(default_factory=DiLoCoHyperparams)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    allowlist: tuple[str, ...] = ()
    """PeerIDs (``12D3KooW...``) allowed in this run; empty = anyone. Peers not on it cannot join rounds, serve or
    fetch state, or publish this run's config; the peer that creates the run must be on it
    (:mod:`peerd.membership`)."""

    def __post_init__(self) -> None:
        from peerd.signing import is_peer_id

        bad = [p for p in self.allowlist if not is_peer_id(p)]
        if bad:
            raise ConfigError(f"allowlist: not Ed25519 PeerIDs (12D3KooW...): {', '.join(map(repr, bad))}")
        object.__setattr__(self, "allowlist", tuple(sorted(set(self.allowlist))))  # equal sets hash alike
        if self.model not in MODEL_NAMES:
            raise ConfigError(f"model must be one of {MODEL_NAMES}, got {self.model!r}")
        if self.dataset not in ("shakespeare", "local"):
            raise ConfigError(f"dataset must be 'shakespeare' or 'local', got {self.dataset!r}")
        for name in ("seq_len", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_outer_rounds", "eval_batches"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("diloco", "averaging")}
        out["diloco"] = self.diloco.to_dict()
        out["averaging"] = dataclasses.asdict(self.averaging)
        if not self.allowlist:  # runs without one keep the fingerprints they had before allowlists existed
            del out["allowlist"]
        else:
            out["allowlist"] = list(self.allowlist)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "run config") -> "RunConfig":
        data = dict(data)
        try:
            diloco = DiLoCoHyperparams.from_dict(data.pop("diloco", {}))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{source}: [diloco]: {e}") from None
        averaging = build_config(AveragingConfig, data.pop("averaging", {}), f"{source}: [averaging]")
        return build_config(cls, data, source, diloco=diloco, averaging=averaging)

    def fingerprint(self) -> str:
        """Short hash of the canonical JSON form: equal configs have equal fingerprints."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def load_run_config(path: str | os.PathLike) -> RunConfig:
    """Read a run config TOML file. Raises ConfigError naming the file and key."""
    return RunConfig.from_dict(read_toml(path), source=str(path))
