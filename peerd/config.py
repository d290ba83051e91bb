"""Configuration: the run's (shared by all peers, published in the DHT) and the node's (this machine only).

Precedence for the node config: built-in defaults < ``--config FILE`` (TOML) < ``PEERD_*`` environment variables <
command-line flags. The run config comes from ``--run-config FILE`` for the peer that creates a run and from the DHT
for everyone else; a local file that disagrees with the published one is refused.

Both are frozen dataclasses validated in ``__post_init__``; unknown keys and wrong types raise :class:`ConfigError`
naming the key and the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from protocols.allreduce import AllReduceConfig
from protocols.compression import CODECS
from protocols.diloco import DiLoCoHyperparams
from protocols.gossip import GossipConfig
from peerd.schedule import ActiveHours
from protocols.matchmaking import MatchmakingConfig

MODEL_NAMES = ("tiny", "small")
AVERAGING_METHODS = ("allreduce", "moshpit", "gossip")
#: Longest path a Unix socket address holds on Linux (sun_path is 108 bytes with the terminating NUL).
MAX_UNIX_SOCKET_PATH = 107


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range."""


# ---------------------------------------------------------------------------------------------------------- run config


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
        averaging = _build(AveragingConfig, data.pop("averaging", {}), f"{source}: [averaging]")
        return _build(cls, data, source, diloco=diloco, averaging=averaging)

    def fingerprint(self) -> str:
        """Short hash of the canonical JSON form: equal configs have equal fingerprints."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def load_run_config(path: str | os.PathLike) -> RunConfig:
    """Read a run config TOML file. Raises ConfigError naming the file and key."""
    return RunConfig.from_dict(_read_toml(path), source=str(path))


# --------------------------------------------------------------------------------------------------------- node config


@dataclass(frozen=True)
class NodeConfig:
    """This machine's settings: where it listens, who it knows, what it may use."""

    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of any peers of the run (bootstrap nodes or workers), e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo..."""
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    """Multiaddrs to listen on (port 0 = any free port)."""
    announce_maddrs: tuple[str, ...] = ()
    """Multiaddrs other peers should dial (public address behind port forwarding); default: what we listen on."""
    identity: str = "~/.peerd/identity.key"
    """Ed25519 private key file (created with mode 0600 on first run); keeps the PeerID stable across restarts."""
    checkpoint_dir: str = "~/.peerd/checkpoints"
    """Where outer-round checkpoints are written (one subfolder per run id)."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""
    threads: int = 0
    """CPU threads for torch (0 = torch's default)."""
    data: Optional[str] = None
    """Local UTF-8 text file or glob to train on instead of the run's default corpus."""
    data_plane: str = "p2p"
    """How bulk peer streams (all-reduce parts, state downloads) travel: ``p2p`` = libp2p streams through p2pd
    (encrypted, the default), or ``direct`` = plain TCP between the peers' processes, endpoints authenticated with
    their identity keys, not encrypted, several times cheaper in CPU (falls back to p2p per peer when unreachable;
    :mod:`peerd.transport.direct`)."""
    data_port: int = 0
    """TCP port of the direct data plane (0 = any free port); forward it too behind a router."""
    nat_port_map: bool = False
    """Ask the home router for a port mapping (UPnP/NAT-PMP). Off by default: it probes the local gateway."""
    log_every_steps: int = 10
    """Log a progress line every this many inner steps."""
    status_interval_s: float = 5.0
    """How often this peer refreshes its status record in the DHT."""
    status_ttl_s: float = 30.0
    """Lifetime of a status record; a peer silent for longer disappears from `peerd status`."""
    gpu_memory_fraction: float = 0.0
    """Largest share of the GPU's memory this process may allocate, 0 < f <= 1
    (``torch.cuda.set_per_process_memory_fraction``); 0 = no limit. Ignored when training on CPU."""
    upload_limit_mb_s: float = 0.0
    """Cap on what this peer sends to other peers (all-reduce, state transfer, matchmaking) in MB/s (10^6 bytes per
    second); 0 = unlimited. The DHT's own small messages are not paced."""
    download_limit_mb_s: float = 0.0
    """Cap on what this peer reads from other peers' streams in MB/s; 0 = unlimited."""
    active_hours: Optional[str] = None
    """Local-time windows in which this peer trains, e.g. "22:00-07:00" or "09:00-12:00,18:00-23:30". Outside them
    it leaves rounds cleanly and pauses, then rejoins. None = always."""
    metrics_port: Optional[int] = None
    """Serve Prometheus metrics over HTTP on this TCP port (0 = any free port, logged); None = off."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint binds (0.0.0.0 inside a container whose port is published)."""
    control_socket: Optional[str] = None
    """Unix socket of the local control channel (`peerd pause`, `resume`, `health`), mode 0600; default
    ``<checkpoint_dir>/peerd.sock``."""
    health_max_age_s: float = 1800.0
    """`peerd health` fails when this peer has neither completed nor joined a round for this many seconds."""

    def __post_init__(self) -> None:
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.data_plane not in ("p2p", "direct"):
            raise ConfigError(f"data_plane must be p2p or direct, got {self.data_plane!r}")
        if not 0 <= self.data_port <= 65535:
            raise ConfigError(f"data_port must be a TCP port 0-65535 (0 = any free port), got {self.data_port}")
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0, got {self.threads}")
        if self.log_every_steps < 1:
            raise ConfigError(f"log_every_steps must be >= 1, got {self.log_every_steps}")
        if self.status_interval_s <= 0 or self.status_ttl_s <= self.status_interval_s:
            raise ConfigError(
                f"status_ttl_s ({self.status_ttl_s}) must exceed status_interval_s ({self.status_interval_s}) > 0:"
                " otherwise a live peer's record expires between refreshes"
            )
        if not 0.0 <= self.gpu_memory_fraction <= 1.0:
            raise ConfigError(f"gpu_memory_fraction must be in [0, 1] (0 = no limit), got {self.gpu_memory_fraction}")
        for name in ("upload_limit_mb_s", "download_limit_mb_s"):
            value = getattr(self, name)
            if not (0.0 <= value < float("inf")):
                raise ConfigError(f"{name} must be a number of MB/s >= 0 (0 = unlimited), got {value}")
        if self.active_hours is not None:
            try:
                ActiveHours.parse(self.active_hours)
            except ValueError as e:
                raise ConfigError(f"active_hours: {e}") from None
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be a TCP port 0-65535 (0 = any free port), got {self.metrics_port}")
        if not self.health_max_age_s > 0:
            raise ConfigError(f"health_max_age_s must be > 0, got {self.health_max_age_s}")
        if len(os.fsencode(self.control_socket_path)) > MAX_UNIX_SOCKET_PATH:
            raise ConfigError(
                f"control socket path {str(self.control_socket_path)!r} is longer than the {MAX_UNIX_SOCKET_PATH}"
                " bytes a Unix socket allows: set control_socket (or a shorter checkpoint_dir)"
            )

    @property
    def identity_path(self) -> Path:
        return Path(os.path.expanduser(self.identity))

    @property
    def checkpoint_path(self) -> Path:
        return Path(os.path.expanduser(self.checkpoint_dir))

    @property
    def control_socket_path(self) -> Path:
        if self.control_socket:
            return Path(os.path.expanduser(self.control_socket))
        return self.checkpoint_path / "peerd.sock"


ENV_PREFIX = "PEERD_"


def load_node_config(
    config_file: Optional[str] = None, environ: Mapping[str, str] = os.environ, overrides: Mapping[str, Any] = {}
) -> NodeConfig:
    """Merge defaults < TOML file (its ``[node]`` table, or the top level) < PEERD_<KEY> variables < overrides."""
    return load_node_config_with_sources(config_file, environ, overrides)[0]


def load_node_config_with_sources(
    config_file: Optional[str] = None, environ: Mapping[str, str] = os.environ, overrides: Mapping[str, Any] = {},
    flag_names: Mapping[str, str] = {},
) -> tuple[NodeConfig, dict[str, str]]:
    """:func:`load_node_config` plus where each value came from: key -> ``"default"``, ``"file PATH"``,
    ``"env PEERD_KEY"`` or ``"flag --key"`` (overrides are the command line's flags; ``flag_names`` maps a key to
    its flag where the two are spelled differently)."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {f.name: "default" for f in fields(NodeConfig)}
    if config_file:
        data = _read_toml(config_file)
        if "node" in data:
            stray = sorted(set(data) - {"node"})
            if stray:
                raise ConfigError(f"{config_file}: keys outside the [node] table: {', '.join(stray)}")
            data = data["node"]
        values.update(_check_keys(NodeConfig, data, config_file))
        sources.update({key: f"file {config_file}" for key in data})
    known = {f.name: f for f in fields(NodeConfig)}
    for name, f in known.items():
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is not None:
            values[name] = _parse_env(raw, f, ENV_PREFIX + name.upper())
            sources[name] = f"env {ENV_PREFIX + name.upper()}"
    given = {k: v for k, v in overrides.items() if v is not None}
    values.update(given)
    sources.update({k: f"flag {flag_names.get(k, '--' + k.replace('_', '-'))}" for k in given})
    return _build(NodeConfig, values, config_file or "node config"), sources


def _parse_env(raw: str, f: dataclasses.Field, var: str) -> Any:
    kind = str(f.type)
    if kind.startswith("Optional["):
        if raw.strip().lower() in ("", "none"):
            return None
        kind = kind[len("Optional["):-1]
    try:
        if kind.startswith("tuple"):
            return tuple(x for x in raw.replace(",", " ").split() if x)
        if kind == "bool":
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        raise ConfigError(f"{var}={raw!r} is not a valid {kind}") from None
    return raw


# ------------------------------------------------------------------------------------------------------------ helpers


def _read_toml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def _check_keys(cls: type, data: Any, source: str) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a table of keys, got {type(data).__name__} {data!r}")
    names = {f.name for f in fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"{source}: unknown key {key!r} (known: {', '.join(sorted(names))})")
    return dict(data)


_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "Optional[str]": (str, type(None)),
          "Optional[int]": (int, type(None))}


def _build(cls: type, data: Mapping[str, Any], source: str, **extra: Any) -> Any:
    data = _check_keys(cls, data, source)
    for f in fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        kind = str(f.type)
        if kind.startswith("tuple"):
            if isinstance(value, str):
                value = (value,)
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{source}: {f.name} must be a list of strings, got {value!r}")
            data[f.name] = tuple(value)
        elif kind in _TYPES:
            ok = isinstance(value, _TYPES[kind]) and not (isinstance(value, bool) and kind != "bool")
            if not ok:
                raise ConfigError(f"{source}: {f.name} must be {kind}, got {type(value).__name__} {value!r}")
            if kind == "float":
                data[f.name] = float(value)
    try:
        return cls(**data, **extra)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
