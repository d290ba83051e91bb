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
from typing import Any, Mapping, Optional

from peerd.config_loading import ConfigError, build_config, read_toml
from peerd.models.registry import MODEL_PRESETS
from peerd.roles.registry import OUTER_SYNCS, ROLES
from protocols.allreduce import AllReduceConfig
from protocols.codecs import PSEUDO_GRADIENT_CODECS, SPARSE_CODECS
from protocols.diloco import DiLoCoHyperparams
from protocols.gossip import GossipConfig
from protocols.matchmaking import MatchmakingConfig
from protocols.spes import SpesConfig
from protocols.state_transfer import StateTransferConfig
from protocols.swarm import STAGE_ROUND_OUTER_STEP, SwarmConfig

#: Names in the model registry (:data:`peerd.models.registry.MODEL_PRESETS`).
MODEL_NAMES = tuple(MODEL_PRESETS)
#: Mixture-of-experts models (peerd/models/moe.py): the ones SPES trains; DiLoCo trains them whole.
MOE_MODEL_NAMES = tuple(name for name, preset in MODEL_PRESETS.items() if preset.family == "moe")
#: Averaging methods (:data:`peerd.roles.registry.OUTER_SYNCS`).
AVERAGING_METHODS = tuple(OUTER_SYNCS)
#: How peers of a run split the work (:data:`peerd.roles.registry.ROLES`).
PARALLELISMS = tuple(ROLES)

#: ``[averaging.<table>]`` -> (attribute of AveragingConfig, the protocol's own config class). Each protocol
#: documents its fields (protocols/matchmaking/, allreduce/, gossip.py, state_transfer.py).
PROTOCOL_TABLES: dict[str, tuple[str, type]] = {
    "matchmaking": ("matchmaking_config", MatchmakingConfig),
    "allreduce": ("allreduce_config", AllReduceConfig),
    "gossip": ("gossip_config", GossipConfig),
    "state_transfer": ("state_transfer_config", StateTransferConfig),
}

#: The flat ``[averaging]`` keys of configs written before the protocol sub-tables (files, published records,
#: pins): key -> the (table, field)s it sets, the first being the one it always named. They keep their meaning:
#: the all-reduce's compression and sender timeout were also the gossip's, and state downloads waited
#: ``reducer_timeout_s``. The fingerprint is computed in this flat form (see :meth:`RunConfig.fingerprint`).
LEGACY_AVERAGING_KEYS: dict[str, tuple[tuple[str, str], ...]] = {
    "compression": (("allreduce", "compression"), ("gossip", "compression")),
    "matchmaking_timeout_s": (("matchmaking", "matchmaking_timeout_s"),),
    "request_timeout_s": (("matchmaking", "request_timeout_s"),),
    "min_group_size": (("matchmaking", "min_group_size"),),
    "sender_timeout_s": (("allreduce", "sender_timeout_s"), ("gossip", "exchange_timeout_s")),
    "reducer_timeout_s": (("allreduce", "reducer_timeout_s"), ("state_transfer", "download_timeout_s")),
    "aggregation": (("allreduce", "aggregation"),),
    "clip_tau": (("allreduce", "clip_tau"),),
    "gossip_partners": (("gossip", "partners_per_round"),),
}


def _legacy_poll_interval_s(matchmaking_timeout_s: float) -> float:
    """The matchmaking poll interval flat configs implied."""
    return min(0.5, matchmaking_timeout_s / 4)


@dataclass(frozen=True)
class AveragingConfig:
    """How peers average pseudo-gradients: the topology, plus the config of each protocol it uses (in TOML, the
    sub-tables ``[averaging.matchmaking]``, ``[averaging.allreduce]``, ``[averaging.gossip]`` and
    ``[averaging.state_transfer]``; their fields are documented by the protocols). Flat keys of older configs
    (:data:`LEGACY_AVERAGING_KEYS`) are read too, each into the one protocol field it always meant."""

    method: str = "allreduce"
    """Topology: allreduce (one butterfly all-reduce of pseudo-gradients among all peers present; theta_outer stays
    bit-identical), moshpit (all-reduce in grid groups of ``group_size``, Ryabinin et al. 2021) or gossip (pairwise
    push-pull with ``[averaging.gossip] partners_per_round`` random peers, no barrier; Boyd et al. 2006). With
    moshpit and gossip every peer applies its own outer step and then averages its outer state (theta_outer and
    momentum) with its group or partners, so peers stay close rather than identical."""
    group_size: int = 4
    """moshpit: target group size M (the grid has side M and ceil(log_M N) dimensions)."""
    ban_s: float = 120.0
    """How long (seconds) a peer that sent invalid data or stalled mid-transfer is excluded from our rounds."""
    matchmaking_config: MatchmakingConfig = field(default_factory=MatchmakingConfig)
    """``[averaging.matchmaking]``: group formation (:class:`protocols.matchmaking.MatchmakingConfig`)."""
    allreduce_config: AllReduceConfig = field(default_factory=AllReduceConfig)
    """``[averaging.allreduce]``: the butterfly all-reduce (:class:`protocols.allreduce.AllReduceConfig`)."""
    gossip_config: GossipConfig = field(default_factory=GossipConfig)
    """``[averaging.gossip]``: pairwise gossip (:class:`protocols.gossip.GossipConfig`)."""
    state_transfer_config: StateTransferConfig = field(default_factory=StateTransferConfig)
    """``[averaging.state_transfer]``: state downloads (:class:`protocols.state_transfer.StateTransferConfig`)."""

    def __post_init__(self) -> None:
        if isinstance(self.ban_s, bool) or not isinstance(self.ban_s, (int, float)):
            raise ConfigError(f"averaging.ban_s must be a number of seconds, got {self.ban_s!r}")
        object.__setattr__(self, "ban_s", float(self.ban_s))  # equal configs must print (and hash) alike
        if self.method not in AVERAGING_METHODS:
            raise ConfigError(f"averaging.method must be one of {AVERAGING_METHODS}, got {self.method!r}")
        if self.ban_s <= 0:
            raise ConfigError(f"averaging.ban_s must be positive, got {self.ban_s}")
        if self.group_size < 2:
            raise ConfigError(f"averaging.group_size must be >= 2, got {self.group_size}")

    @classmethod
    def from_flat(cls, **values: Any) -> "AveragingConfig":
        """From the flat keys of older configs (:data:`LEGACY_AVERAGING_KEYS`) plus ``method``, ``group_size``,
        ``ban_s``, with their old meaning. Raises ConfigError (unknown key, or a value a protocol refuses)."""
        return cls.from_dict(values, "averaging")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "averaging") -> "AveragingConfig":
        """From an ``[averaging]`` table: sub-tables per protocol, or the flat keys of older configs (not both).
        Raises ConfigError naming the key and ``source``."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: expected a table of keys, got {type(data).__name__} {data!r}")
        data = dict(data)
        tables = {t: data.pop(t) for t in PROTOCOL_TABLES if t in data}
        legacy = {k: data.pop(k) for k in LEGACY_AVERAGING_KEYS if k in data}
        if tables and legacy:
            raise ConfigError(f"{source}: flat keys {', '.join(sorted(legacy))} mixed with the sub-tables "
                              f"{', '.join(sorted(tables))}: move them into their sub-tables")
        if legacy:
            tables = {t: {} for t in PROTOCOL_TABLES}
            for key, value in legacy.items():
                for table, name in LEGACY_AVERAGING_KEYS[key]:
                    tables[table][name] = value
            mm = tables["matchmaking"].get("matchmaking_timeout_s", MatchmakingConfig.matchmaking_timeout_s)
            if isinstance(mm, (int, float)) and not isinstance(mm, bool) and mm > 0:
                tables["matchmaking"]["poll_interval_s"] = _legacy_poll_interval_s(mm)
        built = {}
        for table, (attr, protocol_cls) in PROTOCOL_TABLES.items():
            built[attr] = build_config(protocol_cls, tables.get(table, {}), f"{source}.{table}")
        known = {f.name for f in fields(cls)} - {attr for attr, _ in PROTOCOL_TABLES.values()}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown key {unknown[0]!r} (known: "
                              f"{', '.join(sorted(known | set(PROTOCOL_TABLES)))}, or the older flat keys "
                              f"{', '.join(LEGACY_AVERAGING_KEYS)})")
        return build_config(cls, data, source, **built)

    def to_dict(self) -> dict[str, Any]:
        """Every field, protocol configs as sub-tables (what is published: complete, no reader fills a default)."""
        out: dict[str, Any] = {"method": self.method, "group_size": self.group_size, "ban_s": self.ban_s}
        for table, (attr, _) in PROTOCOL_TABLES.items():
            out[table] = _plain(dataclasses.asdict(getattr(self, attr)))
        return out

    def protocol(self, table: str) -> Any:
        """The config of the protocol of ``[averaging.<table>]``."""
        return getattr(self, PROTOCOL_TABLES[table][0])

    def matchmaking(self) -> MatchmakingConfig:
        return self.matchmaking_config

    def allreduce(self) -> AllReduceConfig:
        return self.allreduce_config

    def gossip(self) -> GossipConfig:
        return self.gossip_config

    def state_transfer(self) -> StateTransferConfig:
        return self.state_transfer_config

    def fingerprint_dict(self) -> dict[str, Any]:
        """The flat form the fingerprint hashes (fixed before the sub-tables existed): ``method``, ``group_size``,
        ``ban_s`` and every key of :data:`LEGACY_AVERAGING_KEYS` (from the field it always named); any other
        protocol field only where it differs from what the flat form implies (the value of the flat key that also
        sets it, the implied poll interval, else its default), as ``"<table>.<field>"``."""
        out: dict[str, Any] = {"method": self.method, "group_size": self.group_size, "ban_s": self.ban_s}
        implied: dict[tuple[str, str], Any] = {}
        for key, targets in LEGACY_AVERAGING_KEYS.items():
            (table, name), *also = targets
            out[key] = getattr(self.protocol(table), name)
            implied[(table, name)] = out[key]
            for other in also:
                implied[other] = out[key]
        implied[("matchmaking", "poll_interval_s")] = _legacy_poll_interval_s(self.matchmaking_config.matchmaking_timeout_s)
        for table, (attr, cls) in PROTOCOL_TABLES.items():
            values = _plain(dataclasses.asdict(getattr(self, attr)))
            defaults = _plain(dataclasses.asdict(cls()))
            for name, value in values.items():
                expected = implied.get((table, name), defaults.get(name))
                if value != expected:
                    out[f"{table}.{name}"] = value
        return out


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """JSON-shaped (tuples as lists), as TOML and msgpack give them back."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


@dataclass(frozen=True)
class RunConfig:
    """Everything peers of one run must agree on. Published in the DHT under the run id."""

    model: str = "small"
    """A name of the model registry (:data:`MODEL_NAMES`, ``peerd/models/registry.py``): dense tiny (~0.9M
    parameters), small (~10.7M), 125m, 350m, 1.1b; mixture-of-experts tiny-moe (~2.7M) and small-moe (~46M)."""
    seq_len: int = 256
    """Training window length in bytes (tokens of the byte-level tokenizer)."""
    batch_size: int = 16
    """Sequences per inner step on each peer."""
    dataset: str = "shakespeare"
    """Training text: shakespeare (the default corpus), local (each peer passes --data), ``shards:<sha256>`` (the
    creator's local corpus split into content-addressed shards that peers fetch from each other,
    :mod:`peerd.data.shards`) or ``hf:NAME`` (a Hugging Face dataset with a ``text`` column, streamed; each peer
    reads its shards in its own order, :mod:`peerd.data.hf_stream`)."""
    tokenizer: str = "bytes"
    """``bytes`` (UTF-8 bytes, vocab 256) or ``bpe:<sha256 of the tokenizer file>``: a byte-level BPE trained by
    the run's creator (``peerd tokenizer train``); peers without the file fetch it from live peers of the run and
    check its digest (:mod:`peerd.data.tokenizer`)."""
    seed: int = 0
    """Seed of the initial model (every peer that starts a run from scratch builds the same weights)."""
    max_outer_rounds: int = 0
    """Peers leave after this many outer rounds; 0 = train until stopped."""
    eval_batches: int = 8
    """Batches of held-out text evaluated after each outer round (0 disables evaluation)."""
    eval_every: int = 1
    """Evaluate after every ``eval_every``-th outer round (and after the last one, ``max_outer_rounds``); >= 1."""
    diloco: DiLoCoHyperparams = field(default_factory=DiLoCoHyperparams)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    allowlist: tuple[str, ...] = ()
    """PeerIDs (``12D3KooW...``) allowed in this run; empty = anyone. Peers not on it cannot join rounds, serve or
    fetch state, or publish this run's config; the peer that creates the run must be on it
    (:mod:`peerd.identity.membership`)."""
    parallelism: str = "diloco"
    """How peers split the work (:data:`PARALLELISMS`): diloco (every peer trains the whole model, DiLoCo outer
    steps), swarm (the model cut into ``[swarm] stages`` pipeline stages, SWARM parallelism) or spes (a
    mixture-of-experts model, each peer training the shared parameters and its own experts, :mod:`protocols.spes`)."""
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    """``[swarm]``: stages, activation codec, wiring and rebalancing (:class:`protocols.swarm.SwarmConfig`)."""
    spes: SpesConfig = field(default_factory=SpesConfig)
    """``[spes]``: sync interval, expert holders and merging warm-up (:class:`protocols.spes.SpesConfig`)."""

    def __post_init__(self) -> None:
        from peerd.identity.signing import is_peer_id

        bad = [p for p in self.allowlist if not is_peer_id(p)]
        if bad:
            raise ConfigError(f"allowlist: not Ed25519 PeerIDs (12D3KooW...): {', '.join(map(repr, bad))}")
        object.__setattr__(self, "allowlist", tuple(sorted(set(self.allowlist))))  # equal sets hash alike
        if self.parallelism not in PARALLELISMS:
            raise ConfigError(f"parallelism must be one of {PARALLELISMS}, got {self.parallelism!r}")
        if self.diloco.overlap != "none" and self.averaging.method != "allreduce":
            raise ConfigError(f"[diloco] overlap = {self.diloco.overlap!r} needs averaging.method = 'allreduce' "
                              f"(the mixing methods have no shared outer step to delay), got {self.averaging.method!r}")
        if self.diloco.straggler != "drop" and (self.averaging.method != "allreduce" or self.diloco.overlap != "none"
                                                or self.diloco.fragments > 1):
            raise ConfigError(f"[diloco] straggler = {self.diloco.straggler!r} needs averaging.method = 'allreduce', "
                              "overlap = 'none' and fragments = 1")
        if self.diloco.fragments > 1 and self.averaging.method != "allreduce":
            raise ConfigError(f"[diloco] fragments = {self.diloco.fragments} needs averaging.method = 'allreduce' "
                              f"(got {self.averaging.method!r}): each fragment's round is a shared outer step")
        sparse = {"allreduce": "moshpit", "gossip": "gossip"}  # these average outer *states*: no error feedback there
        for table, method in sparse.items():
            codec = self.averaging.protocol(table).compression
            if self.averaging.method == method and codec in PSEUDO_GRADIENT_CODECS + SPARSE_CODECS:
                raise ConfigError(f"[averaging.{table}] compression = {codec!r} is for pseudo-gradients (method "
                                  f"'allreduce'); averaging.method = {method!r} averages outer states")
        if self.model not in MODEL_NAMES:
            raise ConfigError(f"model must be one of {MODEL_NAMES}, got {self.model!r}")
        if self.parallelism == "swarm":
            from peerd.models import MODEL_SIZES

            if self.model not in MODEL_SIZES:
                raise ConfigError(f"parallelism 'swarm' needs a dense model {tuple(MODEL_SIZES)}, got {self.model!r}")
            n_layers = MODEL_SIZES[self.model]["n_layers"]
            if self.swarm.stages > n_layers:
                raise ConfigError(f"[swarm] stages ({self.swarm.stages}) cannot exceed the {n_layers} blocks of "
                                  f"model {self.model!r}: every stage holds at least one block")
        if self.parallelism == "spes" and self.model not in MOE_MODEL_NAMES:
            raise ConfigError(f"parallelism 'spes' needs a mixture-of-experts model {MOE_MODEL_NAMES}, "
                              f"got {self.model!r}")
        if self.parallelism == "spes" and self.averaging.method != "allreduce":
            # SPES averages its shared and expert fragments by all-reduce (peerd/roles/spes_sync.py): another
            # method would be accepted and silently replaced
            raise ConfigError(f"parallelism 'spes' needs averaging.method = 'allreduce', got "
                              f"{self.averaging.method!r}")
        if self.parallelism == "spes" and (exchange := self.averaging.allreduce().exchange) != "reduce":
            # the sparse sync (peerd/roles/spes_sync.py) averages each fragment among its holders with the butterfly:
            # the ring or the gather would be accepted and silently replaced
            raise ConfigError(f"parallelism 'spes' averages by the butterfly: [averaging.allreduce] exchange must be "
                              f"'reduce', got {exchange!r}")
        try:
            from peerd.data.tokenizer import parse_spec

            parse_spec(self.tokenizer)
        except ValueError as e:
            raise ConfigError(str(e), key="tokenizer", reason=str(e)) from None
        self._check_dataset()
        for name in ("seq_len", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if isinstance(self.eval_every, bool) or not isinstance(self.eval_every, int) or self.eval_every < 1:
            raise ConfigError(f"eval_every must be an int >= 1 (outer rounds), got {self.eval_every!r}")
        for name in ("max_outer_rounds", "eval_batches"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        """Every field (what the creator publishes: a reader never fills a field from its own default), except an
        empty allowlist (runs without one kept the fingerprints they had before allowlists existed), and
        ``[swarm]`` / ``[spes]`` in a run of another parallelism that leaves them at their defaults."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("diloco", "averaging", "swarm", "spes")}
        out["diloco"] = self.diloco.to_dict()
        if self.parallelism == "swarm" or self.swarm != SwarmConfig():
            # left out otherwise, so peers that predate [swarm] still read the configs of DiLoCo runs
            out["swarm"] = dataclasses.asdict(self.swarm)
        out["averaging"] = self.averaging.to_dict()
        if self.parallelism == "spes" or self.spes != SpesConfig():  # other runs publish what they always did
            out["spes"] = dataclasses.asdict(self.spes)
        if not self.allowlist:
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
        averaging = AveragingConfig.from_dict(data.pop("averaging", {}), f"{source}: [averaging]")
        swarm = build_config(SwarmConfig, _table(data.pop("swarm", {}), f"{source}: [swarm]"), f"{source}: [swarm]")
        spes = build_config(SpesConfig, _table(data.pop("spes", {}), f"{source}: [spes]"), f"{source}: [spes]")
        return build_config(cls, data, source, diloco=diloco, averaging=averaging, swarm=swarm, spes=spes)

    def stage_error(self, stage: int) -> Optional[str]:
        """Why a peer cannot serve pipeline stage ``stage`` of this run (``--stage``), or None if it can."""
        if self.parallelism != "swarm":
            return f"--stage {stage}: run has no stages (parallelism {self.parallelism!r})"
        if not 0 <= stage < self.swarm.stages:
            return f"--stage {stage}: the run has stages 0-{self.swarm.stages - 1}"
        return None

    def fingerprint(self) -> str:
        """Short hash (16 hex digits of SHA-256) of the canonical JSON of :meth:`fingerprint_dict`: equal configs
        have equal fingerprints, and adding a defaulted field to the config keeps the fingerprints of configs that
        leave it at its default (checkpoints resume, pins hold)."""
        return hashlib.sha256(json.dumps(self.fingerprint_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def _check_dataset(self) -> None:
        from peerd.data.hf_stream import parse_hf_spec
        from peerd.data.shards import parse_shards_spec

        if self.dataset in ("shakespeare", "local"):
            return
        try:
            if parse_shards_spec(self.dataset) is not None or parse_hf_spec(self.dataset) is not None:
                return
        except ValueError as e:
            raise ConfigError(str(e), key="dataset", reason=str(e)) from None
        raise ConfigError(f"dataset must be 'shakespeare', 'local', 'shards:<sha256>' or 'hf:NAME', got "
                          f"{self.dataset!r}")

    def fingerprint_dict(self) -> dict[str, Any]:
        """What the fingerprint hashes: :meth:`to_dict` with ``averaging`` in the flat form the scheme was fixed
        with (:meth:`AveragingConfig.fingerprint_dict`), and any field not in :data:`FINGERPRINT_FIELDS` /
        :data:`FINGERPRINT_DILOCO_FIELDS` (added later) left out where it is at its default."""
        full = self.to_dict()
        defaults = RunConfig().to_dict()
        out = {k: v for k, v in full.items() if k in FINGERPRINT_FIELDS or v != defaults.get(k, _MISSING)}
        default_diloco = DiLoCoHyperparams().to_dict()
        out["diloco"] = {k: v for k, v in full["diloco"].items()
                         if k in FINGERPRINT_DILOCO_FIELDS or v != default_diloco.get(k, _MISSING)}
        out["averaging"] = self.averaging.fingerprint_dict()
        if "swarm" in out:
            default_swarm = dataclasses.asdict(SwarmConfig())
            out["swarm"] = {k: v for k, v in out["swarm"].items()
                            if k in FINGERPRINT_SWARM_FIELDS or v != default_swarm.get(k, _MISSING)}
        return out


#: Top-level keys the fingerprint scheme was fixed with: always hashed (``allowlist`` only when not empty, as
#: :meth:`RunConfig.to_dict` gives it). Any field added since (e.g. ``parallelism``) is hashed only when it is not
#: at its default. Never add to these lists: that would change every fingerprint.
FINGERPRINT_FIELDS = ("model", "seq_len", "batch_size", "dataset", "seed", "max_outer_rounds", "eval_batches",
                      "diloco", "averaging", "allowlist")
#: The same for ``[diloco]``.
FINGERPRINT_DILOCO_FIELDS = ("inner_steps", "inner_lr", "inner_betas", "inner_weight_decay", "warmup_steps",
                             "lr_decay_steps", "min_lr_ratio", "grad_clip_norm", "outer_lr", "outer_momentum",
                             "outer_nesterov")
#: The same for ``[swarm]``.
FINGERPRINT_SWARM_FIELDS = ("stages", "codec", "ema_alpha", "ban_s", "max_retries", "call_timeout_s",
                            "max_tensor_bytes", "max_pending", "pending_timeout_s", "rebalance_period_s",
                            "balance_quality")
_MISSING = object()


def _table(value: Any, source: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{source}: expected a table of keys, got {type(value).__name__} {value!r}")
    return value


def load_run_config(path: str | os.PathLike) -> RunConfig:
    """Read a run config TOML file. Raises ConfigError naming the file and key (also for a SWARM run that sets a
    ``[diloco]`` outer step other than its stage rounds' plain averaging, which it would not get)."""
    data = read_toml(path)
    run = RunConfig.from_dict(data, source=str(path))
    diloco = data.get("diloco", {})
    if run.parallelism == "swarm":
        for key, value in STAGE_ROUND_OUTER_STEP.items():
            if key in diloco and diloco[key] != value:
                raise ConfigError(
                    f"{path}: [diloco] {key} = {diloco[key]!r}: a swarm's stage rounds average the replicas' "
                    f"parameters (SWARM; {', '.join(f'{k} = {v:g}' for k, v in STAGE_ROUND_OUTER_STEP.items())}): "
                    f"a DiLoCo outer step on stage rounds makes the loss climb back; remove {key}")
    return run
