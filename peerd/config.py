"""The node's configuration (this machine only): where it listens, who it knows, what it may use.

Importing this module does not import torch, so light commands (``peerd --help``, ``health``, ``pause``) start fast.

Precedence for the node config: built-in defaults < ``--config FILE`` (TOML) < ``PEERD_*`` environment variables <
command-line flags. NodeConfig is a frozen dataclass validated in ``__post_init__``; unknown keys and wrong types
raise :class:`ConfigError` naming the key and the file (TOML reading and type checks: :mod:`peerd.config_loading`,
shared with :mod:`peerd.run_config`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from peerd.config_loading import ConfigError, build_config, check_keys, read_toml
from peerd.node_values import ActiveHours, bind_problem

#: Longest path a Unix socket address holds on Linux (sun_path is 108 bytes with the terminating NUL).
MAX_UNIX_SOCKET_PATH = 107


#: Values of ``NodeConfig.precision``.
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
#: Values of ``NodeConfig.host_memory_check``.
HOST_MEMORY_CHECKS = ("refuse", "warn")


#: Identity file, inside ``checkpoint_dir``, of each kind of daemon when ``identity`` is not set: a bootstrap node
#: and a worker on one machine (or two workers with their own checkpoint dirs) get PeerIDs of their own.
DEFAULT_IDENTITY_FILES = {"worker": "identity.key", "bootstrap": "bootstrap.key"}
#: Control socket file in ``checkpoint_dir`` per kind of daemon, so a bootstrap node and a worker sharing the default
#: checkpoint dir each serve their own (``control_socket`` overrides both).
DEFAULT_CONTROL_SOCKETS = {"worker": "peerd.sock", "bootstrap": "bootstrap.sock"}


# --------------------------------------------------------------------------------------------------------- node config


def local_devices_problem(devices: Any) -> Optional[str]:
    """Why ``devices`` is no valid ``local_devices`` value, or None: each entry ``cpu`` or ``cuda:N``, all of one
    kind (NCCL and gloo do not mix in one group), no GPU twice (two replicas on one GPU only share its compute);
    ``cpu`` may repeat (several processes on one machine's cores). Checks no device (no torch import)."""
    devices = tuple(devices)
    for d in devices:
        if not isinstance(d, str) or not (d == "cpu" or (d.startswith("cuda:") and d[5:].isdigit())):
            return f"entries must be cpu or cuda:N, got {d!r}"
    if len({d.split(":")[0] for d in devices}) > 1:
        return f"mixes CPUs and GPUs ({', '.join(devices)}): use one kind"
    gpus = [d for d in devices if d != "cpu"]
    if len(set(gpus)) != len(gpus):
        return f"names a GPU twice ({', '.join(devices)})"
    return None


def bitsandbytes_installed() -> bool:
    """Whether the ``bitsandbytes`` package can be imported (found on the path; not imported here: it loads CUDA
    libraries)."""
    import importlib.util

    return importlib.util.find_spec("bitsandbytes") is not None


#: Values of the node config key ``transport``.
TRANSPORTS = ("p2pd", "libp2p", "auto")

#: Values of the node config key ``dht``.
DHT_MODES = ("process", "inline")

#: Values of the node config key ``relay``.
RELAY_MODES = ("off", "auto", "always")

#: Values of the node config key ``swarm_role``.
SWARM_ROLES = ("auto", "server", "trainer")

@dataclass(frozen=True)
class NodeConfig:
    """This machine's settings: where it listens, who it knows, what it may use."""

    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of any peers of the run (bootstrap nodes or workers), e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo..."""
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    """Multiaddrs to listen on (port 0 = any free port)."""
    announce_maddrs: tuple[str, ...] = ()
    """Multiaddrs other peers should dial (public address behind port forwarding); default: what we listen on."""
    identity: Optional[str] = None
    """Ed25519 private key file (created with mode 0600 on first run); keeps the PeerID stable across restarts. A
    running daemon locks it: two daemons never share one. Default ``<checkpoint_dir>/identity.key`` for workers,
    ``<checkpoint_dir>/bootstrap.key`` for bootstrap nodes."""
    checkpoint_dir: str = "~/.peerd/checkpoints"
    """Where outer-round checkpoints are written (one subfolder per run id)."""
    device: Union[str, tuple[str, ...]] = "auto"
    """auto (a CUDA or ROCm GPU, else Apple's MPS, else the CPU) | cpu | cuda | cuda:N | mps (:mod:`peerd.hardware.devices`).
    A list of GPUs (``["cuda:0", "cuda:1"]``; ``cuda:0,cuda:1`` as a flag or variable) trains on them as one peer:
    it is ``local_devices``, and ``device`` becomes the first of them."""
    local_devices: tuple[str, ...] = ()
    """Several devices of this machine as one peer, e.g. ``["cuda:0", "cuda:1"]``: one PeerID and one
    pseudo-gradient per outer round, each inner step data-parallel across them (the first is the daemon's own;
    :mod:`peerd.worker.local_dp`). All GPUs (``cuda:N``, each once) or all ``cpu``; the run's ``batch_size`` must be a
    multiple of their number. DiLoCo runs only. () = one device (``device``)."""
    threads: int = 0
    """CPU threads for torch (0 = torch's default)."""
    data: Optional[str] = None
    """Local UTF-8 text file or glob to train on instead of the run's default corpus."""
    data_plane: str = "direct"
    """How bulk peer streams (all-reduce parts, state downloads) travel: ``direct`` (the default) = TLS 1.3 over
    TCP between the peers' processes, certificates bound to their PeerIDs: encrypted, integrity-protected and
    cheaper in CPU than p2pd. A peer publishes its direct address only once the dial-back check says others can
    dial it; streams to peers that did not (behind a NAT, relayed) or that fail the connection go through p2pd
    (:mod:`peerd.transport.direct`). ``p2p`` = every stream through p2pd (libp2p's encrypted streams)."""
    data_port: int = 0
    """TCP port of the direct data plane (0 = any free port); forward it too behind a router (the dial-back check
    tests the libp2p port only)."""
    transport: str = "auto"
    """libp2p implementation: ``p2pd`` = hivemind's Go daemon; ``libp2p`` = py-libp2p in a Python process (no Go
    binary: any machine that runs Python); ``auto`` = p2pd where its binary runs, else py-libp2p (one log line says
    which and why). Both speak the same protocols: one swarm may hold peers of both kinds."""
    dht: str = "process"
    """Where this peer's DHT node runs (p2pd transport): ``process`` = a child Python process, so DHT maintenance
    never waits for training (the default); ``inline`` = in the daemon's own event loop, ~250 MB less memory per
    peer (no second interpreter, no torch shared-memory manager), for many peers on one machine. Same DHT either
    way: peers of both kinds form one swarm. The py-libp2p transport always runs it in a child process."""
    nat_port_map: bool = False
    """Ask the home router for a port mapping (UPnP/NAT-PMP). Off by default: it probes the local gateway."""
    relay: str = "auto"
    """libp2p circuit relays (p2pd transport): ``auto`` = this peer relays for others and, when libp2p's AutoNAT
    finds it behind a NAT, reserves a slot on a relay (the initial peers by default) so others reach it through
    there; ``always`` = reserve a relay slot even where AutoNAT finds nothing wrong; ``off`` = no relays, as before.
    The dial-back check at join (:mod:`protocols.reachability`) says whether others can dial this peer directly.
    On the py-libp2p transport (no AutoNAT there) ``auto`` reserves slots on the initial peers when no listen
    address is a public IP (:mod:`peerd.transport.libp2p_relay`); it relays for nobody."""
    config_wait_s: float = 300.0
    """How long ``join`` without ``--run-config`` waits for the run's creator to publish its config (0: not at all)."""
    log_every_steps: int = 10
    """Log a progress line every this many inner steps; the loss is read back from the device only then."""
    swarm_progress_interval_s: float = 30.0
    """SWARM trainers: least seconds between two progress lines at info level (micro-batches take a second or two:
    the lines between are logged at debug level); 0 = a line every ``log_every_steps`` micro-batches."""
    micro_batch_size: int = 0
    """Sequences per forward/backward pass; must divide the run's ``batch_size``: each inner step accumulates
    ``batch_size / micro_batch_size`` micro-batches, so the run's tokens per inner step (and the science) are
    unchanged and only this machine's memory use is. 0 = chosen: on a GPU the largest that fits its free memory
    (:mod:`peerd.hardware.memory`), elsewhere the run's ``batch_size``."""
    precision: str = "auto"
    """Inner-step arithmetic: ``fp32``; ``bf16`` (autocast, fp32 master weights); ``fp16`` (autocast + loss
    scaling); ``auto`` = bf16 on a CUDA GPU that supports it, fp16 on an older one, fp32 on CPU. The outer state
    and pseudo-gradients stay fp32 in every mode."""
    compile: bool = False
    """Compile the model with ``torch.compile`` (warm-up steps are left out of tokens/s)."""
    activation_checkpointing: Optional[bool] = None
    """Recompute each block's activations in the backward pass: less memory for a bigger micro-batch (about a third
    more compute). None = chosen with ``micro_batch_size`` from the GPU's free memory (:mod:`peerd.hardware.memory`); off
    on a CPU."""
    optimizer_8bit: bool = False
    """Keep the inner AdamW's moments in 8 bits (bitsandbytes' ``AdamW8bit``: ~2 bytes per parameter instead of 8)
    on a CUDA GPU. Needs the ``bitsandbytes`` package (``pip install bitsandbytes``)."""
    host_memory_check: str = "refuse"
    """What ``peerd join`` does when the run's predicted host-memory peak (:mod:`peerd.hardware.host_memory`: the
    outer state, the round boundary's buffers, the checkpoint copy) exceeds this machine's memory and swap:
    ``refuse`` (exit with one line) or ``warn`` (log it and train anyway: for a prediction you know to be pessimistic
    here, e.g. compressed swap the machine does not report; the kernel's out-of-memory killer ends the peer if it was
    right)."""
    background_eval: Optional[bool] = None
    """Evaluate after outer rounds on a copy of the model in a background thread while the next inner steps run;
    the loss comes as an ``eval`` event instead of in the round's event. False: each round waits for its eval. None
    = on where a GPU trains (a 125m evaluation held an H200's round boundary for 0.4 s; the copy's fp32 parameters,
    4 bytes each, are counted in the memory plan), off on a CPU (the evaluation would take the inner steps' cores)."""
    background_checkpoint: Optional[bool] = None
    """Write checkpoints from a background thread (a copy of the state in host memory, written in order) while
    training goes on; the last checkpoint, on stop, is always waited for. False: each round waits for its checkpoint
    write. None = on where a GPU trains (a 125m checkpoint held an H200's round boundary for 6.2 s), off on a CPU
    (the copy would cost the inner steps' memory bandwidth for a write that takes ~0.1 s there)."""
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
    uplink_mb_s: float = 0.0
    """This peer's upload link rate in MB/s (10^6 bytes per second: 12.5 for 100 Mbit/s), as a speed test gives it;
    0 = unknown: measured from the bytes that reached peers during earlier all-reduces
    (:class:`peerd.transport.uplink.UplinkMeter`). Each all-reduce paces its connections at their shares of it
    (``SO_MAX_PACING_RATE``, Linux, direct data plane; an upload cap counts where it is lower): unpaced they
    overfill the link's queue in turns, 0.75-0.78 of a 100 Mbit/s link against 0.92 paced (docs/benchmarks.md). A
    rate 30% above the link keeps less than half of that gain; too low a rate caps the upload at it."""
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
    stage: Optional[int] = None
    """SWARM runs: the pipeline stage this peer serves (0-based, below the run's ``[swarm] stages``); None = the
    swarm's bottleneck stage when it joins."""
    swarm_role: str = "auto"
    """SWARM runs: ``trainer`` (serve a stage and push micro-batches through the swarm), ``server`` (serve only) or
    ``auto`` (a stage-0 server trains)."""
    pause_when_cpu_busy_percent: float = 0.0
    """Pause while other programs keep the CPU busier than this, in percent of all cores (this daemon's own
    processes not counted), averaged over ``cpu_busy_window_s``; train again once they drop 5 points below it.
    0 = off (:mod:`peerd.service.rules`)."""
    cpu_busy_window_s: float = 30.0
    """Seconds over which ``pause_when_cpu_busy_percent`` averages the other programs' CPU use."""
    pause_on_battery: bool = False
    pause_while_programs: tuple[str, ...] = ()
    """Pause while any of these programs runs (process names, e.g. ``["steam", "vlc"]``; BOINC's "exclusive
    applications", empty by default)."""
    pause_while_user_active_s: float = 0.0
    """Pause while the user has touched keyboard or mouse within this many seconds (BOINC's "suspend when computer is
    in use" with its 3-minute idle time: set 180; 0 = off, the default). Read where the desktop exposes it
    (``xprintidle`` on X11); elsewhere the rule is inactive and the log says so once."""
    """Pause while the machine runs on battery (``psutil.sensors_battery``); machines without one never pause."""
    gpu: bool = True
    """Use a GPU if there is one. False: ``device = "auto"`` trains on the CPU, and ``device = "cuda"`` is an
    error."""
    dashboard_port: Optional[int] = None
    """`peerd join`: serve the web dashboard (run view, this machine, pause/resume) on this TCP port (0 = any free
    port, logged); None = off (:mod:`peerd.dashboard`)."""
    dashboard_host: str = "127.0.0.1"
    """Address the dashboard binds. Anything but a loopback address needs ``dashboard_token``."""
    dashboard_token: Optional[str] = None
    """Secret the dashboard asks for (``?token=`` once, then a cookie) when bound beyond loopback; at least 16
    characters."""

    def _normalize_device(self) -> None:
        """``device`` as one name; a list of several devices moves to ``local_devices`` (the first stays the peer's
        device). Raises ConfigError for a name that is no device, or a list that contradicts ``local_devices``."""
        from peerd.hardware.devices import device_problem, split_devices

        devices = split_devices(self.device)
        if not devices:
            raise ConfigError("device: names no device", key="device", reason="names no device")
        for name in devices:
            problem = device_problem(name)
            if problem:
                raise ConfigError(f"device {problem}", key="device", reason=problem)
        if len(devices) > 1:
            problem = local_devices_problem(devices)
            if problem:
                raise ConfigError(f"device: {problem}", key="device", reason=problem)
            if self.local_devices and tuple(self.local_devices) != devices:
                reason = (f"the list {', '.join(devices)} contradicts local_devices = {', '.join(self.local_devices)}:"
                          " give the devices once")
                raise ConfigError(f"device: {reason}", key="device", reason=reason)
            object.__setattr__(self, "local_devices", devices)  # frozen: set once, while constructing
        object.__setattr__(self, "device", devices[0])

    def __post_init__(self) -> None:
        from peerd.multiaddrs import check_multiaddr

        for name in ("initial_peers", "host_maddrs", "announce_maddrs"):
            for maddr in getattr(self, name):
                try:
                    check_multiaddr(maddr, require_peer_id=name == "initial_peers")
                except ValueError as e:
                    raise ConfigError(f"{name}: {e}", key=name, reason=str(e)) from None
        for name, path, want_dir in (("checkpoint_dir", self.checkpoint_path, True),
                                     ("identity", self.identity_path, False)):
            if want_dir and path.exists() and not path.is_dir():
                raise ConfigError(f"{name}: {str(path)!r} exists and is not a folder", key=name,
                                  reason=f"{str(path)!r} exists and is not a folder")
            if not want_dir and path.is_dir():
                raise ConfigError(f"{name}: {str(path)!r} is a folder, not a key file", key=name,
                                  reason=f"{str(path)!r} is a folder, not a key file")
        self._normalize_device()
        problem = local_devices_problem(self.local_devices)
        if problem:
            raise ConfigError(f"local_devices: {problem}", key="local_devices", reason=problem)
        if self.local_devices and self.device not in ("auto", self.local_devices[0],
                                                      self.local_devices[0].split(":")[0]):
            reason = (f"device {self.device!r} contradicts local_devices (the first of them, "
                      f"{self.local_devices[0]!r}, is the peer's device): leave device at auto or "
                      f"{self.local_devices[0].split(':')[0]}")
            raise ConfigError(f"local_devices: {reason}", key="local_devices", reason=reason)
        if not self.gpu and any(d.startswith("cuda") for d in self.local_devices):
            raise ConfigError("local_devices names GPUs but gpu = false", key="gpu",
                              reason="gpu = false contradicts GPUs in local_devices")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if self.dht not in DHT_MODES:
            raise ConfigError(f"dht must be one of {', '.join(DHT_MODES)}, got {self.dht!r}", key="dht",
                              reason=f"must be one of {', '.join(DHT_MODES)}, got {self.dht!r}")
        if self.relay not in RELAY_MODES:
            raise ConfigError(f"relay must be one of {', '.join(RELAY_MODES)}, got {self.relay!r}", key="relay",
                              reason=f"must be one of {', '.join(RELAY_MODES)}, got {self.relay!r}")
        if self.data_plane not in ("p2p", "direct"):
            raise ConfigError(f"data_plane must be p2p or direct, got {self.data_plane!r}")
        if not 0 <= self.data_port <= 65535:
            raise ConfigError(f"data_port must be a TCP port 0-65535 (0 = any free port), got {self.data_port}")
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0, got {self.threads}")
        if not 0 <= self.config_wait_s <= 86400:
            raise ConfigError(f"config_wait_s must be in [0, 86400], got {self.config_wait_s}", key="config_wait_s")
        if not self.swarm_progress_interval_s >= 0:
            raise ConfigError(f"swarm_progress_interval_s must be >= 0, got {self.swarm_progress_interval_s}",
                              key="swarm_progress_interval_s")
        if self.log_every_steps < 1:
            raise ConfigError(f"log_every_steps must be >= 1, got {self.log_every_steps}")
        if self.micro_batch_size < 0:
            raise ConfigError(f"micro_batch_size must be >= 0 (0 = the run's batch_size), got {self.micro_batch_size}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.host_memory_check not in HOST_MEMORY_CHECKS:
            raise ConfigError(f"host_memory_check must be one of {', '.join(HOST_MEMORY_CHECKS)}, got "
                              f"{self.host_memory_check!r}", key="host_memory_check")
        if self.optimizer_8bit and not bitsandbytes_installed():
            reason = "needs the bitsandbytes package (pip install bitsandbytes), or set optimizer_8bit = false"
            raise ConfigError(f"optimizer_8bit: {reason}", key="optimizer_8bit", reason=reason)
        if self.optimizer_8bit and self.device == "cpu":
            reason = "bitsandbytes' 8-bit AdamW trains on a CUDA GPU: use device auto or cuda, or drop optimizer_8bit"
            raise ConfigError(f"optimizer_8bit: {reason}", key="optimizer_8bit", reason=reason)
        if self.status_interval_s <= 0 or self.status_ttl_s <= self.status_interval_s:
            raise ConfigError(
                f"status_ttl_s ({self.status_ttl_s}) must exceed status_interval_s ({self.status_interval_s}) > 0:"
                " otherwise a live peer's record expires between refreshes"
            )
        if not 0.0 <= self.gpu_memory_fraction <= 1.0:
            raise ConfigError(f"gpu_memory_fraction must be in [0, 1] (0 = no limit), got {self.gpu_memory_fraction}")
        for name in ("upload_limit_mb_s", "download_limit_mb_s", "uplink_mb_s"):
            value = getattr(self, name)
            if not (0.0 <= value < float("inf")):
                meaning = "unknown" if name == "uplink_mb_s" else "unlimited"
                raise ConfigError(f"{name} must be a number of MB/s >= 0 (0 = {meaning}), got {value}")
        if self.active_hours is not None:
            try:
                ActiveHours.parse(self.active_hours)
            except ValueError as e:
                raise ConfigError(f"active_hours: {e}") from None
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be a TCP port 0-65535 (0 = any free port), got {self.metrics_port}")
        if self.stage is not None and (isinstance(self.stage, bool) or not isinstance(self.stage, int)
                                       or self.stage < 0):
            raise ConfigError(f"stage must be an int >= 0 (a pipeline stage of a SWARM run), got {self.stage!r}")
        if self.swarm_role not in SWARM_ROLES:
            raise ConfigError(f"swarm_role must be one of {', '.join(SWARM_ROLES)}, got {self.swarm_role!r}")
        if not 0.0 <= self.pause_when_cpu_busy_percent <= 100.0:
            raise ConfigError("pause_when_cpu_busy_percent must be in [0, 100] (0 = off), got "
                              f"{self.pause_when_cpu_busy_percent}", key="pause_when_cpu_busy_percent",
                              reason=f"must be in [0, 100] (0 = off), got {self.pause_when_cpu_busy_percent}")
        if not 0 <= self.pause_while_user_active_s <= 86400:
            raise ConfigError(f"pause_while_user_active_s must be in [0, 86400] (0 = off), got "
                              f"{self.pause_while_user_active_s}", key="pause_while_user_active_s")
        if not self.cpu_busy_window_s > 0:
            raise ConfigError(f"cpu_busy_window_s must be > 0, got {self.cpu_busy_window_s}")
        if not self.gpu and self.device not in ("auto", "cpu"):
            raise ConfigError(f"device {self.device!r} contradicts gpu = false: use device auto or cpu", key="gpu",
                              reason=f"gpu = false contradicts device {self.device!r}: use device auto or cpu")
        if self.dashboard_port is not None and not 0 <= self.dashboard_port <= 65535:
            raise ConfigError(f"dashboard_port must be a TCP port 0-65535 (0 = any free port), got "
                              f"{self.dashboard_port}", key="dashboard_port",
                              reason=f"must be a TCP port 0-65535 (0 = any free port), got {self.dashboard_port}")
        problem = bind_problem(self.dashboard_host, self.dashboard_token)
        if problem:
            raise ConfigError(f"dashboard_host: {problem}", key="dashboard_host", reason=problem)
        if not self.health_max_age_s > 0:
            raise ConfigError(f"health_max_age_s must be > 0, got {self.health_max_age_s}")
        if len(os.fsencode(self.control_socket_path)) > MAX_UNIX_SOCKET_PATH:
            raise ConfigError(
                f"control socket path {str(self.control_socket_path)!r} is longer than the {MAX_UNIX_SOCKET_PATH}"
                " bytes a Unix socket allows: set control_socket (or a shorter checkpoint_dir)"
            )

    @property
    def identity_path(self) -> Path:
        """A worker's identity file: ``identity``, else ``<checkpoint_dir>/identity.key``."""
        return self.identity_path_for("worker")

    def identity_path_for(self, role: str) -> Path:
        """The identity file of a daemon of kind ``role`` (a key of :data:`DEFAULT_IDENTITY_FILES`)."""
        if self.identity:
            return Path(os.path.expanduser(self.identity))
        return self.checkpoint_path / DEFAULT_IDENTITY_FILES[role]

    @property
    def checkpoint_path(self) -> Path:
        return Path(os.path.expanduser(self.checkpoint_dir))

    @property
    def control_socket_path(self) -> Path:
        """The worker's control socket (see :meth:`control_socket_path_for`)."""
        return self.control_socket_path_for("worker")

    def control_socket_path_for(self, role: str) -> Path:
        """The control socket of a daemon of kind ``role`` (a key of :data:`DEFAULT_CONTROL_SOCKETS`)."""
        if self.control_socket:
            return Path(os.path.expanduser(self.control_socket))
        return self.checkpoint_path / DEFAULT_CONTROL_SOCKETS[role]


ENV_PREFIX = "PEERD_"

#: Keys only a run config has at its top level: a node config file holding any of them is a run config passed to the
#: wrong flag (run configs import torch to load, so the few tell-tale keys are listed here; a test keeps them true).
RUN_CONFIG_KEYS = frozenset({"model", "seq_len", "batch_size", "dataset", "parallelism", "max_outer_rounds",
                             "diloco", "averaging", "swarm", "spes"})


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
        data = read_toml(config_file)
        if "node" not in data and RUN_CONFIG_KEYS & set(data):
            raise ConfigError(f"{config_file} is a run config (it sets {', '.join(sorted(RUN_CONFIG_KEYS & set(data)))}"
                              f"): pass it as --run-config {config_file}; --config takes a node config (a [node] "
                              "table, e.g. node_configs/machines/cpu.toml)")
        if "node" in data:
            stray = sorted(set(data) - {"node"})
            if stray:
                raise ConfigError(f"{config_file}: keys outside the [node] table: {', '.join(stray)}")
            data = data["node"]
        values.update(check_keys(NodeConfig, data, config_file))
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
    try:
        return build_config(NodeConfig, values, config_file or "node config"), sources
    except ConfigError as e:
        where = sources.get(e.key or "", "default")
        if where.startswith(("flag ", "env ")):  # name what the user typed, not the file it overrode
            raise ConfigError(f"{where[where.index(' ') + 1:]}: {e.reason}", key=e.key, reason=e.reason) from None
        raise


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
