"""The ``peerd`` command line. Parses arguments and calls :mod:`peerd.daemon`; nothing else imports this module.

Exit codes: 0 clean stop (``join``, ``bootstrap`` and ``dashboard`` stopped by SIGINT/SIGTERM included), 1 runtime
failure, 2 usage or configuration error, 128 + the signal's number (130 SIGINT, 143 SIGTERM) for a command interrupted
before it was done, or stopped by a second signal (:mod:`peerd.processes`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from typing import Any, Optional, Sequence

from peerd import __version__
from peerd.config import (
    DHT_MODES,
    PRECISIONS,
    RELAY_MODES,
    SWARM_ROLES,
    TRANSPORTS,
    ConfigError,
    NodeConfig,
    load_node_config,
    load_node_config_with_sources,
)
from peerd.service.control import ControlUnavailable
from peerd.namespace import RunIdError
from peerd.processes import Interrupted, interruptible
from peerd.telemetry import LOG_FORMATS

logger = logging.getLogger("peerd")

EXAMPLE_PEER = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line instead of usage + message
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def _run_id(value: str) -> str:
    """A run id as :meth:`peerd.namespace.RunRef.parse` accepts it (the one place run ids are parsed)."""
    from peerd.namespace import RunIdError, RunRef

    try:
        return str(RunRef.parse(value))
    except RunIdError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _node_flags(p: argparse.ArgumentParser, listen_default: Optional[str] = None) -> None:
    g = p.add_argument_group("node")
    g.add_argument("--config", metavar="FILE", help="node config TOML (e.g. node_configs/machines/cpu.toml)")
    g.add_argument("--initial-peers", nargs="+", metavar="MADDR",
                   help=f"multiaddrs of any peers of the run, e.g. {EXAMPLE_PEER}")
    g.add_argument("--host-maddrs", nargs="+", metavar="MADDR",
                   help="multiaddrs to listen on (default /ip4/0.0.0.0/tcp/0; tests use /ip4/127.0.0.1/tcp/0)")
    g.add_argument("--announce-maddrs", nargs="+", metavar="MADDR",
                   help="public multiaddrs other peers should dial (behind port forwarding)")
    g.add_argument("--identity", metavar="PATH",
                   help="Ed25519 identity key file, created on first run and locked while the daemon runs (default "
                   "<checkpoint-dir>/identity.key; bootstrap: <checkpoint-dir>/bootstrap.key)")
    g.add_argument("--nat-port-map", action=argparse.BooleanOptionalAction, default=None,
                   help="ask the router for a port mapping via UPnP/NAT-PMP (default off)")
    g.add_argument("--transport", choices=TRANSPORTS,
                   help="libp2p implementation: p2pd (hivemind's Go daemon), libp2p (py-libp2p, pure Python) or "
                   "auto (p2pd where its binary runs, else py-libp2p; the default)")
    g.add_argument("--dht", choices=DHT_MODES,
                   help="where the DHT node runs: process (a child process; the default) or inline (in the "
                   "daemon, ~250 MB less memory: for many peers on one machine)")
    g.add_argument("--relay", choices=RELAY_MODES,
                   help="libp2p circuit relays: auto (relay for others; use a relay when behind a NAT; the default), "
                   "always (always reserve a relay slot) or off")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                   help="text for people, json (one object per line) for log shippers")
    p.add_argument("--log-level", metavar="LEVEL", help="DEBUG, INFO, WARNING... (default: $PEERD_LOGLEVEL or INFO)")


def _device_list(text: str) -> tuple[str, ...]:
    """``--local-devices cuda:0,cuda:1`` -> ("cuda:0", "cuda:1")."""
    return tuple(d.strip() for d in text.split(",") if d.strip())


def _worker_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("worker")
    g.add_argument("--device", metavar="DEV", help="where to train: auto (default: a CUDA/ROCm GPU, else Apple's "
                   "mps, else the CPU), cpu, cuda, cuda:N, mps, or GPUs as one peer: cuda:0,cuda:1")
    g.add_argument("--threads", type=int, metavar="N", help="CPU threads for torch (default: torch's choice)")
    g.add_argument("--checkpoint-dir", metavar="DIR",
                   help="checkpoint folder, also holds the control socket (default ~/.peerd/checkpoints)")
    g.add_argument("--data", metavar="PATH|GLOB", help="train on this local corpus instead of the run's: UTF-8 text files, .jsonl "
                   "(a \"text\" field per line) or .parquet (a text column)")
    g.add_argument("--stage", type=int, metavar="K", help="SWARM runs: serve pipeline stage K (default: the bottleneck)")
    g.add_argument("--role", choices=SWARM_ROLES, dest="swarm_role",
                   help="SWARM runs: trainer (also push micro-batches), server (serve only); default auto "
                        "(stage-0 servers train)")
    g = p.add_argument_group("using the GPU well (node options: the run's tokens per inner step stay the same)")
    g.add_argument("--micro-batch-size", type=int, metavar="M",
                   help="sequences per forward/backward; the run's batch_size is reached by accumulating "
                   "batch_size/M micro-batches (must divide it; default 0 = chosen from the GPU's free memory, the "
                   "whole batch on a CPU)")
    g.add_argument("--precision", choices=PRECISIONS,
                   help="auto (default): bf16 autocast on GPUs that support it, fp16 + loss scaling on older "
                   "ones, fp32 on CPU; master weights and the outer state stay fp32")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the model with torch.compile (warm-up left out of tokens/s; default off)")
    g.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="recompute activations in the backward pass to fit bigger micro-batches (default: chosen "
                   "from the GPU's free memory, off on a CPU)")
    g.add_argument("--optimizer-8bit", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the inner AdamW's moments in 8 bits (bitsandbytes, CUDA; 2 instead of 8 bytes per "
                   "parameter; default off)")
    g.add_argument("--local-devices", type=_device_list, metavar="DEV,DEV,...",
                   help="DiLoCo runs: train as one peer on several devices of this machine, e.g. cuda:0,cuda:1 "
                   "(inner steps data-parallel across them; default: one device)")
    g = p.add_argument_group("volunteer limits and services")
    g.add_argument("--gpu-memory-fraction", type=float, metavar="F",
                   help="let this process allocate at most this share (0-1] of the GPU's memory (default no limit)")
    g.add_argument("--upload-limit", type=float, metavar="MB_S", dest="upload_limit_mb_s",
                   help="cap what this peer sends to other peers, in MB/s (default unlimited)")
    g.add_argument("--download-limit", type=float, metavar="MB_S", dest="download_limit_mb_s",
                   help="cap what this peer reads from other peers, in MB/s (default unlimited)")
    g.add_argument("--active-hours", metavar="HH:MM-HH:MM[,...]",
                   help="train only in these local-time windows, e.g. 22:00-07:00; pause outside them")
    g.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics on this port (0 = any free port; host: metrics_host, default "
                   "127.0.0.1)")
    _dashboard_flags(g, "serve the web dashboard (run view, this machine, pause/resume) on this port (0 = any "
                     "free port)")


def _run_id_flag(p: argparse.ArgumentParser, what: str) -> None:
    """``--run-id`` (default $PEERD_RUN_ID) for a command that reads a run: ``what`` says which run."""
    p.add_argument("--run-id", type=_run_id, default=os.environ.get("PEERD_RUN_ID"),
                   help=f"{what} (default $PEERD_RUN_ID)")


def _dashboard_flags(g: Any, port_help: str) -> None:
    g.add_argument("--dashboard-port", type=int, metavar="PORT", help=port_help)
    g.add_argument("--dashboard-host", metavar="ADDR",
                   help="address the dashboard binds (default 127.0.0.1; any other needs --dashboard-token)")
    g.add_argument("--dashboard-token", metavar="SECRET",
                   help="secret of 16+ characters the dashboard asks for (?token=) when bound beyond loopback "
                   "(default $PEERD_DASHBOARD_TOKEN)")


def _control_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("finding the daemon")
    g.add_argument("--config", metavar="FILE", help="the daemon's node config TOML")
    g.add_argument("--checkpoint-dir", metavar="DIR", help="the daemon's checkpoint folder (default ~/.peerd/checkpoints)")
    g.add_argument("--control-socket", metavar="PATH", help="the control socket (default <checkpoint-dir>/peerd.sock)")
    p.add_argument("--json", action="store_true", help="print the daemon's whole reply as JSON")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text", help=argparse.SUPPRESS)
    p.add_argument("--log-level", metavar="LEVEL", help=argparse.SUPPRESS)


def _model_source_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("which model")
    g.add_argument("--checkpoint-dir", default="~/.peerd/checkpoints", metavar="DIR",
                   help="a node's checkpoint folder, a run's folder in it, or a folder holding state.safetensors "
                   "(default ~/.peerd/checkpoints)")
    g.add_argument("--run-id", type=_run_id, help="the run whose checkpoint to read (needed if DIR holds several)")
    g.add_argument("--weights", choices=("outer", "local"), default="outer",  # peerd.export.WEIGHTS; it imports torch
                   help="outer: the run's synced model (default); local: this peer's model with its inner steps "
                   "since the last outer round")
    g.add_argument("--model", metavar="NAME", help="the run's model, for checkpoints that do not record it")
    g.add_argument("--seq-len", type=int, metavar="T", help="the run's seq_len, for checkpoints that do not record it")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text", help=argparse.SUPPRESS)
    p.add_argument("--log-level", metavar="LEVEL", help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="peerd",
        description="Peer-to-peer volunteer compute for training neural networks: join a run, contribute your "
        "CPU/GPU, no central coordinator.",
        epilog="Start with `peerd join --help`. Docs: README.md.",
    )
    parser.add_argument("--version", action="version", version=f"peerd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("join",
                       help="join (or start) a training run in the role its run config names (DiLoCo, SWARM, SPES)",
                       description="Join training run RUN_ID: find its peers through the DHT, download the current "
                       "model if the run is under way, train, and average pseudo-gradients with the others every H "
                       "inner steps. The first peer of a run passes --run-config; later peers need only --run-id "
                       "and --initial-peers. Stop with Ctrl-C or SIGTERM: the peer checkpoints and leaves.")
    p.add_argument("--run-id", type=_run_id, default=os.environ.get("PEERD_RUN_ID"),
                   help="the run: NAME (1-64 letters, digits, '_', '-') or NAME@CREATOR (the creator's PeerID or its "
                        "first 24+ characters: accept only the config that peer signed), e.g. shakespeare-demo "
                        "(default $PEERD_RUN_ID)")
    p.add_argument("--run-config", metavar="FILE",
                   help="run config TOML (node_configs/runs/*.toml); required to start a new run, checked against "
                   "the published one otherwise")
    _worker_flags(p)
    _node_flags(p)

    p = sub.add_parser("bootstrap", help="run a DHT-only node that other peers use as --initial-peers",
                       description="Run a DHT-only node. Prints its multiaddrs (one per line on stdout) and serves "
                       "until stopped. Its PeerID stays the same across restarts (see --identity).")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="state folder; holds the control socket for `peerd health` (default ~/.peerd/checkpoints)")
    _node_flags(p)

    p = sub.add_parser("status", help="show the live peers of a run",
                       description="Read the status records that the peers of RUN_ID keep in the DHT.")
    _run_id_flag(p, "name of the run")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _node_flags(p)

    p = sub.add_parser("doctor", help="check that this machine can join a run: one line per check, OK or FAIL",
                       description="Check the basics a volunteer's machine needs to join RUN_ID: the p2pd binary, "
                       "py-libp2p, the bootstrap peers, the run's configuration, whether other peers can dial this "
                       "machine back (and the fix if not), the clock, the training device. One line per check with "
                       "OK or FAIL and a fix; exit code 0 if all are OK, 1 otherwise.")
    _run_id_flag(p, "name of the run")
    p.add_argument("--checkpoint-dir", metavar="DIR", help=argparse.SUPPRESS)
    _node_flags(p)

    p = sub.add_parser("eval", help="held-out loss of a SWARM run's model through its live stage servers",
                       description="Run the held-out batches of RUN_ID (a SWARM run) through the stage servers "
                       "announced in the DHT, forward only. Middle stages with no reachable server are skipped "
                       "(the identity, as SkipPipe trains them) and named; the first and the last stage are needed.")
    _run_id_flag(p, "name of the run")
    p.add_argument("--batches", type=int, metavar="N",
                   help="eval batches of the run's batch_size (default: the run's eval_batches, else 4)")
    p.add_argument("--data", metavar="PATH|GLOB", help="the run's local text (runs with dataset = \"local\")")
    p.add_argument("--json", action="store_true", help="print JSON instead of a line")
    _node_flags(p)

    p = sub.add_parser("dashboard", help="serve a web page showing a run (and this machine's daemon)",
                       description="Serve the dashboard of run RUN_ID on http://127.0.0.1:PORT/: live peers, the "
                       "swarm map, loss and throughput curves (from the peers' status records in the DHT), and this "
                       "machine's daemon (state, limits, pause/resume, volunteer rules) through its control socket. "
                       "Bound beyond loopback it needs a token.")
    _run_id_flag(p, "the run to show")
    _dashboard_flags(p.add_argument_group("dashboard"), "port to serve on (default 8477; 0 = any free port)")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="the local daemon's checkpoint folder, for the 'this machine' panel (default "
                   "~/.peerd/checkpoints)")
    p.add_argument("--control-socket", metavar="PATH", help="the local daemon's control socket")
    _node_flags(p)

    p = sub.add_parser("pause", help="pause the local daemon: it leaves rounds cleanly and stops training",
                       description="Ask the daemon running on this machine (through its control socket) to pause: "
                       "it abandons matchmaking, lets a running all-reduce finish, then trains no more and shows "
                       "role 'paused' in `peerd status` until `peerd resume`.")
    _control_flags(p)
    p = sub.add_parser("resume", help="resume the local daemon after `peerd pause`",
                       description="Lift a `peerd pause`: the daemon catches up with the run and trains again "
                       "(unless it is outside its active hours).")
    _control_flags(p)
    p = sub.add_parser("snooze", help="pause the local daemon for a while: 1h, 4h, tomorrow (or off)",
                       description="Pause the daemon running on this machine for DURATION (1h, 4h, 90m, up to a "
                       "week; tomorrow = until 06:00 local time the next day); `peerd snooze off` lifts it. Other "
                       "pause reasons (peerd pause, volunteer rules) stay as they are.")
    p.add_argument("duration", metavar="DURATION", help="1h, 4h, 90m, tomorrow or off")
    _control_flags(p)
    p = sub.add_parser("health", help="exit 0 if the local daemon is up and made progress recently",
                       description="Ask the local daemon whether it is healthy: up, and completed or joined a round "
                       "within --max-age-s (a paused daemon is healthy). Exit 0 if so, 1 otherwise; prints one "
                       "line. Used by the Docker HEALTHCHECK.")
    p.add_argument("--max-age-s", type=float, metavar="S",
                   help="longest time without a completed or joined round (default: the node's health_max_age_s)")
    _control_flags(p)

    p = sub.add_parser("install-service", help="write a systemd unit that runs `peerd join` as a service",
                       description="Write a systemd unit (Type=notify, watchdog, hardened, a dedicated user, state in "
                       "/var/lib/peerd) that runs `peerd join` for RUN_ID, and print the commands that enable it.")
    _run_id_flag(p, "the run the service joins")
    p.add_argument("--run-config", metavar="FILE", help="run config TOML passed to `peerd join` (first peer of a run)")
    p.add_argument("--config", metavar="FILE", help="node config TOML passed to `peerd join` (limits, addresses)")
    p.add_argument("--initial-peers", nargs="+", metavar="MADDR", help=f"e.g. {EXAMPLE_PEER}")
    p.add_argument("--user", default="peerd", help="dedicated system user the service runs as (default peerd)")
    p.add_argument("--unit-dir", default="/etc/systemd/system", metavar="DIR",
                   help="where to write peerd.service (default /etc/systemd/system)")
    p.add_argument("--watchdog-s", type=int, default=120, metavar="S", help="WatchdogSec (default 120)")
    p.add_argument("--peerd", metavar="PATH", help="absolute path of the peerd executable (default: this one)")
    p.add_argument("--print", action="store_true", dest="print_only", help="print the unit instead of writing it")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text", help=argparse.SUPPRESS)
    p.add_argument("--log-level", metavar="LEVEL", help=argparse.SUPPRESS)

    p = sub.add_parser("export", help="write a checkpoint's model as a Hugging Face Llama (safetensors + config)",
                       description="Write the model of a DiLoCo checkpoint to DIR as model.safetensors + config.json, "
                       "which Hugging Face transformers loads with AutoModelForCausalLM.from_pretrained(DIR) "
                       "(LlamaForCausalLM). Dense models only; token ids are UTF-8 bytes (0-255), or the run's BPE, "
                       "written beside the model as tokenizer.json.")
    _model_source_flags(p)
    p.add_argument("--out", metavar="DIR", help="output folder, created (default: export beside the checkpoint, "
                   "e.g. ~/.peerd/checkpoints/RUN/export; export-local for --weights local)")

    p = sub.add_parser("generate", help="sample text from a checkpoint's model",
                       description="Load the model of a DiLoCo checkpoint and print PROMPT followed by sampled text "
                       "(in the run's tokens: bytes, or its BPE; temperature and top-k sampling), or sample through "
                       "the live stage servers of a SWARM run (--run-id with --initial-peers).")
    _model_source_flags(p)
    p.add_argument("--prompt", required=True, metavar="TEXT", help="text to continue")
    p.add_argument("--max-tokens", type=int, default=200, metavar="N",
                   help="tokens to sample (bytes, or BPE tokens in a BPE run; default 200)")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T",
                   help="divide the logits by T; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=50, metavar="K",
                   help="sample among the K most likely tokens; 0 = all (default 50)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    p.add_argument("--device", default="cpu", metavar="DEV",
                   help="where to run the model: cpu (default), auto, cuda, cuda:N or mps")
    p.add_argument("--initial-peers", nargs="+", metavar="MADDR",
                   help="sample through the live stage servers of SWARM run --run-id instead of a checkpoint "
                   "(middle stages without a server are skipped), via any peer of the run")

    p = sub.add_parser("tokenizer", help="train the subword tokenizer of a new run",
                       description="Tokenizers of runs (`tokenizer = \"bpe:<sha256>\"` in a run config).")
    tsub = p.add_subparsers(dest="tokenizer_command", metavar="ACTION", parser_class=_Parser)
    tsub.required = True
    t = tsub.add_parser("train", help="train a byte-level BPE on a corpus and print its run-config line",
                        description="Train a byte-level BPE tokenizer (Hugging Face tokenizers; deterministic) on "
                        "the training split of a corpus, store it in this node's tokenizer cache "
                        "(<checkpoint-dir>/tokenizers/<sha256>.json), from where `peerd join` serves it to the "
                        "run's peers, and print the line to put in the run config.")
    t.add_argument("--data", default="shakespeare", metavar="PATH|GLOB",
                   help="the corpus: shakespeare (default), UTF-8 text files or .jsonl with a text field")
    t.add_argument("--vocab-size", type=int, default=4096, metavar="N",
                   help="tokens in the vocabulary: 256 bytes + N-256 merges (default 4096)")
    t.add_argument("--checkpoint-dir", default="~/.peerd/checkpoints", metavar="DIR",
                   help="the node whose cache receives the file (default ~/.peerd/checkpoints)")
    t.add_argument("--out", metavar="FILE", help="also write the tokenizer file here")
    t.add_argument("--log-format", choices=LOG_FORMATS, default="text", help=argparse.SUPPRESS)
    t.add_argument("--log-level", metavar="LEVEL", help=argparse.SUPPRESS)

    p = sub.add_parser("config", help="inspect configuration")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION", parser_class=_Parser)
    csub.required = True
    c = csub.add_parser("show", help="print the effective node config (and a run config if given)")
    c.add_argument("--run-config", metavar="FILE", help="also validate and print this run config")
    _worker_flags(c)
    _node_flags(c)
    return parser


def _run_async(coro: Any) -> Any:
    """Run the daemon's event loop on uvloop where it is installed (faster stream I/O), else on asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _node_config(args: argparse.Namespace) -> NodeConfig:
    return load_node_config(args.config, overrides=_node_overrides(args))


#: Node config keys that commands may take as flags (besides the addresses and identity of every DHT command).
NODE_FLAGS = ("device", "threads", "checkpoint_dir", "data", "gpu_memory_fraction", "upload_limit_mb_s",
              "download_limit_mb_s", "active_hours", "metrics_port", "control_socket", "stage", "swarm_role",
              "micro_batch_size", "precision", "compile", "activation_checkpointing", "optimizer_8bit",
              "local_devices",
              "dashboard_port", "dashboard_host", "dashboard_token")


#: Flags spelled differently from their node config key.
FLAG_NAMES = {"upload_limit_mb_s": "--upload-limit", "download_limit_mb_s": "--download-limit",
              "swarm_role": "--role"}


def _node_overrides(args: argparse.Namespace) -> dict[str, Any]:
    names = ("initial_peers", "host_maddrs", "announce_maddrs", "identity", "nat_port_map", "transport",
             "relay", "dht") + NODE_FLAGS
    return {name: getattr(args, name, None) for name in names}


def _require_run_id(args: argparse.Namespace) -> str:
    if not args.run_id:
        raise UsageError(f"peerd {args.command}: --run-id is required (or set PEERD_RUN_ID) (see `peerd "
                         f"{args.command} --help`)")
    return args.run_id


def _cmd_join(args: argparse.Namespace) -> int:
    run_id = _require_run_id(args)
    node = _node_config(args)  # a bad flag fails before the heavy imports below
    from peerd.daemon import join
    from peerd.run_config import load_run_config

    run = load_run_config(args.run_config) if args.run_config else None
    _run_async(join(run_id, node, run))  # checks the node's options against the run before it joins the DHT
    return 0


def _cmd_bootstrap(args: argparse.Namespace) -> int:
    from peerd.daemon import bootstrap

    node = _node_config(args)
    _run_async(bootstrap(node, on_ready=lambda maddr: print(maddr, flush=True)))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from peerd.daemon import read_status

    _require_run_id(args)
    node = _node_config(args)
    if not node.initial_peers:
        raise UsageError("peerd status: --initial-peers is required (any peer of the run)")
    peers, config = _run_async(interruptible(read_status(node, args.run_id)))
    if args.json:
        print(json.dumps({"run_id": args.run_id, "config": config, "peers": peers}, indent=2, sort_keys=True))
        return 0
    live = {p: s for p, s in peers.items() if s.get("role") != "left"}
    print(f"run {args.run_id}: {len(live)} live peer(s)" + ("" if config else " (no configuration published)"))
    from peerd.dashboard.view import loss_unit

    header = ("PeerID", "role", "rounds done", "inner step", "last loss", "tokens/s",
              "eval nats/tok" if loss_unit(config) == "token" else "eval nats/B", "last seen")
    rows = [header]
    now = time.time()
    for peer, s in sorted(live.items(), key=lambda kv: (-(kv[1].get("outer_round") or 0), kv[0])):
        rows.append((
            peer, str(s.get("role")), str(s.get("outer_round")), str(s.get("inner_step")),
            _num(s.get("loss"), "{:.4f}"), _num(s.get("tokens_per_s"), "{:.0f}"),
            _num(s.get("eval_nats_per_byte"), "{:.4f}"), _num(now - s["time"] if s.get("time") else None, "{:.0f} s ago"),
        ))
    if any(s.get("stage") is not None for s in live.values()):
        header += ("stage",)
        rows = [header] + [(*r, str(live[r[0]].get("stage") if live[r[0]].get("stage") is not None else "-"))
                           for r in rows[1:]]
    if any(isinstance(s.get("experts"), list) for s in live.values()):  # SPES: what each peer trains
        header += ("experts",)
        rows = [header] + [(*r, ",".join(map(str, live[r[0]].get("experts") or [])) or "-") for r in rows[1:]]
    if any(s.get("reachable") is not None for s in live.values()):
        header += ("reachable",)
        names = {True: "yes", False: "no", None: "-"}
        rows = [header] + [(*r, "relayed" if live[r[0]].get("relayed") and live[r[0]].get("reachable") is False
                            else names[live[r[0]].get("reachable")]) for r in rows[1:]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    for line in _stage_lines(live, (config or {}).get("swarm", {}).get("stages")):
        print(line)
    for line in _contribution_lines(peers):
        print(line)
    return 0


def _contribution_lines(peers: dict[str, dict]) -> list[str]:
    """The ranked contribution table (:func:`peerd.status.contribution`), nothing if no record carries one."""
    from peerd.status import contribution

    ranked = contribution(peers)
    if not ranked:
        return []
    rows = [("rank", "PeerID", "tokens trained", "share", "rounds")] + [
        (str(r["rank"]), r["peer"], f"{r['tokens']:,}", f"{100 * r['share']:.1f} %", str(r["rounds"])) for r in ranked]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return ["contribution (tokens and outer rounds each peer gave the run; from its signed status record):"] + [
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def _cmd_doctor(args: argparse.Namespace) -> int:
    from peerd.doctor import run_doctor

    _require_run_id(args)
    node = _node_config(args)
    checks = run_doctor(node, args.run_id)
    for check in checks:
        print(check.line(), flush=True)
    return 0 if all(c.ok for c in checks) else 1


#: Port of `peerd dashboard` when none is given.
DASHBOARD_PORT = 8477


def _cmd_dashboard(args: argparse.Namespace) -> int:
    _require_run_id(args)
    if args.dashboard_port is None:
        args.dashboard_port = DASHBOARD_PORT
    node = _node_config(args)
    if not node.initial_peers:
        raise UsageError("peerd dashboard: --initial-peers is required (any peer of the run)")
    _run_async(_serve_dashboard(node, args.run_id))
    return 0


async def _serve_dashboard(node: NodeConfig, run_id: str) -> None:
    from peerd.dashboard.app import Dashboard, control_socket_node
    from peerd.daemon import read_run_status
    from peerd.processes import install_stop_handlers, unless_stopped
    from peerd.transport.factory import open_reader

    stop = asyncio.Event()
    install_stop_handlers(stop, "stopping the dashboard")
    transport = await unless_stopped(stop, open_reader(node))
    if transport is None:
        return  # stopped while the DHT client was starting
    try:
        dashboard = Dashboard(run_id, lambda: read_run_status(transport.discovery, run_id),
                              control_socket_node(node.control_socket_path), node.dashboard_token, node.status_ttl_s)
        try:
            await dashboard.start(node.dashboard_host, node.dashboard_port)
        except OSError as e:
            raise ConnectionError(f"cannot serve the dashboard on {node.dashboard_host}:{node.dashboard_port}: "
                                  f"{e.strerror or e}") from None
        print(f"dashboard of run {run_id} on {dashboard.url()}", flush=True)
        logger.info("dashboard on %s", dashboard.url(), extra={"event": "dashboard", "url": dashboard.url()})
        try:
            await stop.wait()
        finally:
            await dashboard.stop()
    finally:
        await transport.shutdown()


def _stage_lines(live: dict[str, dict], num_stages: Any) -> list[str]:
    """SWARM runs: per stage its servers and summed tokens/s, and the bottleneck (the stage with the least
    throughput; an empty stage first). Nothing for a run without stage records."""
    servers: dict[int, list[str]] = {}
    for peer, s in live.items():
        if isinstance(s.get("stage"), int):
            servers.setdefault(s["stage"], []).append(peer)
    if not servers:
        return []
    count = num_stages if isinstance(num_stages, int) and num_stages > 0 else max(servers) + 1
    totals = {k: sum(live[p].get("tokens_per_s") or 0.0 for p in servers.get(k, [])) for k in range(count)}
    lines = []
    for k in range(count):
        peers = sorted(servers.get(k, []))
        lines.append(f"stage {k}: {len(peers)} server(s), {totals[k]:.0f} tokens/s" + (f": {', '.join(peers)}"
                                                                                       if peers else ""))
    bottleneck = min(range(count), key=lambda k: (bool(servers.get(k)), totals[k], k))
    lines.append(f"bottleneck: stage {bottleneck}")
    return lines


def _num(value: Any, fmt: str) -> str:
    return fmt.format(value) if isinstance(value, (int, float)) else "-"


def _cmd_config(args: argparse.Namespace) -> int:
    import dataclasses

    node, sources = load_node_config_with_sources(args.config, overrides=_node_overrides(args), flag_names=FLAG_NAMES)
    out: dict[str, Any] = {"node": dataclasses.asdict(node), "sources": sources}
    out["node"]["identity"] = str(node.identity_path)  # the default follows checkpoint_dir: show where it lands
    if node.dashboard_token:
        out["node"]["dashboard_token"] = "(set, not shown)"  # a secret: never in logs or pasted configs
    if args.run_config:
        from peerd.run_config import load_run_config

        out["run"] = load_run_config(args.run_config).to_dict()
        out["run_source"] = f"file {args.run_config}"
    print(json.dumps(out, indent=2))
    return 0


def _control(args: argparse.Namespace, payload: dict[str, Any]) -> dict[str, Any]:
    from peerd.service.control import request

    node = _node_config(args)
    path = node.control_socket_path
    if not node.control_socket and not path.exists():  # no worker here: a bootstrap node may be
        bootstrap = node.control_socket_path_for("bootstrap")
        path = bootstrap if bootstrap.exists() else path
    return request(path, payload)


def _cmd_pause_resume(args: argparse.Namespace) -> int:
    reply = _control_reply(args, {"cmd": args.command}, f"peerd {args.command}")
    if reply is None:
        return 1
    if not args.json:
        reasons = "; ".join(reply.get("pause_reasons", {}).values())
        if args.command == "pause":
            print("paused: the peer leaves its round (a running all-reduce finishes first) and trains no more"
                  if reply.get("changed") else f"already paused ({reasons})")
        elif reply.get("paused"):
            print(f"still paused: {reasons}")
        else:
            print("resumed: the peer catches up with the run and trains again" if reply.get("changed")
                  else "not paused: nothing to resume")
    return 0


def _cmd_snooze(args: argparse.Namespace) -> int:
    from peerd.service.rules import snooze_deadline

    try:
        snooze_deadline(args.duration, time.time())  # a typo is a usage error, before asking the daemon
    except ValueError as e:
        raise UsageError(f"peerd snooze: {e}") from None
    reply = _control_reply(args, {"cmd": "snooze", "for": args.duration}, f"peerd snooze")
    if reply is None:
        return 1
    if not args.json:
        until = reply.get("snoozed_until")
        print(f"snoozed until {time.strftime('%a %H:%M', time.localtime(until))}: the peer trains again then"
              if until else "snooze lifted" + (f"; still paused: {'; '.join(reply['pause_reasons'].values())}"
                                               if reply.get("paused") else ""))
    return 0


def _control_reply(args: argparse.Namespace, request: dict, failure: str) -> Optional[dict]:
    """The daemon's reply to ``request`` over its control socket, printed as JSON with ``--json``; None when the
    daemon refused it (then ``failure: <its error>`` is on stderr and the command exits 1)."""
    reply = _control(args, request)
    if args.json:
        print(json.dumps(reply, indent=2, sort_keys=True))
    if not reply.get("ok"):
        print(f"{failure}: {reply.get('error')}", file=sys.stderr)
        return None
    return reply


def _cmd_health(args: argparse.Namespace) -> int:
    if args.max_age_s is not None and not args.max_age_s > 0:
        raise UsageError("peerd health: --max-age-s must be > 0")
    reply = _control_reply(args, {"cmd": "health", "max_age_s": args.max_age_s}, f"unhealthy")
    if reply is None:
        return 1
    healthy = bool(reply.get("healthy"))
    if not args.json:
        print(f"{'healthy' if healthy else 'unhealthy'}: {reply.get('message')}",
              file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


def _cmd_install_service(args: argparse.Namespace) -> int:
    import shutil
    from pathlib import Path

    from peerd.service.systemd import needs_home, render_unit

    run_id = _require_run_id(args)
    peerd = args.peerd or _own_executable() or shutil.which("peerd")
    if not peerd or not os.path.isabs(peerd):
        raise UsageError("peerd install-service: cannot tell where the peerd executable is: pass --peerd PATH")
    exec_args = [peerd, "join", "--run-id", run_id]
    files = [peerd]
    if args.config:
        load_node_config(args.config, environ={})  # refuse a broken file now, not at the service's first start
        exec_args += ["--config", os.path.abspath(args.config)]
        files.append(os.path.abspath(args.config))
    if args.run_config:
        from peerd.run_config import load_run_config

        load_run_config(args.run_config)
        exec_args += ["--run-config", os.path.abspath(args.run_config)]
        files.append(os.path.abspath(args.run_config))
    if args.initial_peers:
        from peerd.multiaddrs import check_multiaddr

        for maddr in args.initial_peers:  # refuse a typo now, not at the service's first start
            try:
                check_multiaddr(maddr, require_peer_id=True)
            except ValueError as e:
                raise UsageError(f"peerd install-service: --initial-peers: {e}") from None
        exec_args += ["--initial-peers", *args.initial_peers]
    try:
        unit = render_unit(exec_args, user=args.user, watchdog_s=args.watchdog_s,
                           protect_home="read-only" if needs_home(files) else "yes")
    except ValueError as e:
        raise UsageError(f"peerd install-service: {e}") from None
    if args.print_only:
        print(unit, end="")
        return 0
    target = Path(args.unit_dir) / "peerd.service"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(unit)
    except OSError as e:
        print(f"peerd install-service: cannot write {target}: {e.strerror or e} (run as root, or pass --unit-dir "
              "or --print)", file=sys.stderr)
        return 1
    state = "/var/lib/peerd/checkpoints"
    print(f"wrote {target}\n"
          f"as root, once:\n"
          f"  useradd --system --home-dir /var/lib/peerd --shell /usr/sbin/nologin {args.user}\n"
          f"  usermod -aG video,render {args.user}    # GPUs only\n"
          f"  systemctl daemon-reload\n"
          f"  systemctl enable --now peerd.service\n"
          f"then:\n"
          f"  systemctl status peerd.service\n"
          f"  journalctl -u peerd.service -f\n"
          f"  sudo -u {args.user} {peerd} pause --checkpoint-dir {state}     # resume, health likewise")
    return 0


def _own_executable() -> Optional[str]:
    """The ``peerd`` script beside this interpreter (a virtualenv's bin/), if there is one."""
    candidate = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "peerd")
    return candidate if os.access(candidate, os.X_OK) else None


def _checkpoint_model(args: argparse.Namespace):
    """(checkpoint file, its model, the tokenizer its run trained with)."""
    from peerd.export import checkpoint_tokenizer, find_checkpoint, load_checkpoint_model

    path = find_checkpoint(args.checkpoint_dir, args.run_id)
    return path, load_checkpoint_model(path, args.weights, args.model, args.seq_len), checkpoint_tokenizer(path)


def _cmd_export(args: argparse.Namespace) -> int:
    from peerd.export import export_llama

    path, model, tokenizer = _checkpoint_model(args)
    out = args.out or path.parent / ("export" if args.weights == "outer" else f"export-{args.weights}")
    files = export_llama(model, out, tokenizer)
    print(f"exported {args.weights} weights of {path} ({model.config.n_layers} layers, d_model "
          f"{model.config.d_model}) to {', '.join(str(f) for f in files)}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from peerd.generate import generate_text

    for name in ("max_tokens", "top_k"):
        if getattr(args, name) < 0:
            raise UsageError(f"peerd generate: --{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not args.temperature >= 0:
        raise UsageError(f"peerd generate: --temperature must be >= 0, got {args.temperature}")
    if args.initial_peers:
        return _generate_through_swarm(args)
    from peerd.devices import device_problem, resolve_device

    problem = f"takes one device, got {args.device!r}" if "," in args.device else device_problem(args.device)
    if problem:
        raise UsageError(f"peerd generate: --device {problem}")
    _, model, tokenizer = _checkpoint_model(args)
    if args.device != "cpu":
        model = model.to(resolve_device(args.device))  # DeviceUnavailable: one line, exit 1
    print(generate_text(model, args.prompt, args.max_tokens, args.temperature, args.top_k, args.seed, tokenizer))
    return 0


def _cmd_tokenizer(args: argparse.Namespace) -> int:
    from pathlib import Path

    from peerd.data import DOC_SEPARATOR, DataError, load_corpus
    from peerd.tokenizer import MAX_VOCAB, MIN_VOCAB, TokenizerCache, train_bpe

    if not MIN_VOCAB <= args.vocab_size <= MAX_VOCAB:
        raise UsageError(f"peerd tokenizer train: --vocab-size must be in {MIN_VOCAB}..{MAX_VOCAB}, got "
                         f"{args.vocab_size}")
    try:
        corpus = load_corpus(args.data)
    except DataError as e:
        print(f"peerd tokenizer train: {e}", file=sys.stderr)
        return 1
    text = corpus.train.numpy().tobytes().decode("utf-8", errors="replace")
    tokenizer = train_bpe(text.split(DOC_SEPARATOR), args.vocab_size)
    path = TokenizerCache(Path(args.checkpoint_dir).expanduser() / "tokenizers").put(tokenizer)
    if args.out:
        tokenizer.save(args.out)
    print(f"trained a byte-level BPE of {tokenizer.vocab_size} tokens on {corpus.name} ({corpus.train.numel():,} "
          f"bytes); stored in {path}{f' and {args.out}' if args.out else ''}", file=sys.stderr)
    print(f'tokenizer = "{tokenizer.spec}"')
    return 0


def _generate_through_swarm(args: argparse.Namespace) -> int:
    from peerd.swarm_infer import generate_swarm, open_swarm_client
    from protocols.skippipe import NoPath

    run_id = _require_run_id(args)
    node = load_node_config(None, overrides={"initial_peers": args.initial_peers})

    async def go() -> tuple[str, tuple[int, ...]]:
        async with open_swarm_client(node, run_id) as (trainer, run, tokenizer):
            try:
                return await generate_swarm(trainer, args.prompt, args.max_tokens, args.temperature, args.top_k,
                                            args.seed, seq_len=run.seq_len, tokenizer=tokenizer)
            except NoPath as e:
                raise ConnectionError(f"run {run_id}: {e}") from None

    text, skipped = _run_async(interruptible(go()))
    print(text)
    print(f"skipped stages: {', '.join(map(str, skipped)) or 'none'}", file=sys.stderr)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    import dataclasses
    import math

    from peerd.data import load_corpus, tokenize_corpus
    from peerd.roles.base import eval_units
    from peerd.swarm_infer import evaluate_swarm, open_swarm_client
    from protocols.skippipe import NoPath

    run_id = _require_run_id(args)
    if args.batches is not None and args.batches < 1:
        raise UsageError(f"peerd eval: --batches must be >= 1, got {args.batches}")
    node = _node_config(args)
    if not node.initial_peers:
        raise UsageError("peerd eval: --initial-peers is required (any peer of the run)")

    async def go():
        async with open_swarm_client(node, run_id) as (trainer, run, tokenizer):
            if run.dataset == "local" and not args.data:
                raise UsageError(f"peerd eval: run {run_id!r} trains on local data: pass --data PATH|GLOB")
            tokens = tokenize_corpus(load_corpus(args.data or "shakespeare"), tokenizer).eval
            batches = args.batches or run.eval_batches or 4
            units = eval_units(tokenizer, tokens, dataclasses.replace(run, eval_batches=batches))
            try:
                return await evaluate_swarm(trainer, tokens, run.seq_len, run.batch_size, batches), units
            except NoPath as e:  # the first or the last stage is unreachable: a runtime failure, one line
                raise ConnectionError(f"run {run_id}: {e}") from None

    result, units = _run_async(interruptible(go()))
    where = (f"through stages {', '.join(map(str, result.path))}; skipped: "
             f"{', '.join(map(str, result.skipped)) or 'none'}")
    if units["eval_unit"] == "byte":
        if args.json:
            print(json.dumps({"run_id": run_id, "nats_per_byte": result.nats_per_byte,
                              "perplexity": result.perplexity, "tokens": result.tokens, "path": list(result.path),
                              "skipped": list(result.skipped)}))
        else:
            print(f"run {run_id}: eval {result.nats_per_byte:.4f} nats/byte (perplexity {result.perplexity:.2f}) "
                  f"over {result.tokens} bytes {where}")
        return 0
    # a BPE run: the loss is per token; per byte (the text its tokens stand for) it compares across tokenizers
    per_token, bytes_per_token = result.nats_per_byte, units.get("eval_bytes_per_token")
    per_byte = per_token / bytes_per_token if bytes_per_token else None
    if args.json:
        print(json.dumps({"run_id": run_id, "nats_per_token": per_token, "nats_per_byte": per_byte,
                          "bits_per_byte": per_byte / math.log(2) if per_byte is not None else None,
                          "perplexity": result.perplexity, "tokens": result.tokens, "path": list(result.path),
                          "skipped": list(result.skipped)}))
    else:
        bits = f", {per_byte / math.log(2):.4f} bits/byte" if per_byte is not None else ""
        print(f"run {run_id}: eval {per_token:.4f} nats/token (perplexity {result.perplexity:.2f}{bits}) over "
              f"{result.tokens} tokens {where}")
    return 0


COMMANDS = {"join": _cmd_join, "bootstrap": _cmd_bootstrap, "status": _cmd_status, "config": _cmd_config,
            "dashboard": _cmd_dashboard, "pause": _cmd_pause_resume, "resume": _cmd_pause_resume, "health": _cmd_health,
            "snooze": _cmd_snooze,
            "install-service": _cmd_install_service, "export": _cmd_export, "generate": _cmd_generate,
            "eval": _cmd_eval, "tokenizer": _cmd_tokenizer, "doctor": _cmd_doctor}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from peerd.telemetry import setup_logging

    args = None
    try:
        args = build_parser().parse_args(argv)
        setup_logging(args.log_format, args.log_level)
        return COMMANDS[args.command](args)
    except (UsageError, ConfigError, RunIdError) as e:
        # usage errors: one line `peerd COMMAND: what is wrong`; runtime errors go through the log (README)
        print(f"{e}" if isinstance(e, UsageError) else f"peerd {args.command if args else ''}: {e}".replace(" :", ":"),
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Interrupted as e:
        print(f"peerd {args.command}: {e}", file=sys.stderr)
        return 128 + e.signum
    except ControlUnavailable as e:  # pause/resume/health without a daemon: one line, and no heavy imports
        print(f"{'unhealthy' if args.command == 'health' else 'peerd ' + args.command}: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        from peerd.checkpoint import CheckpointError
        from peerd.daemon import RunConfigConflict
        from peerd.data import DataError
        from peerd.devices import DeviceUnavailable
        from peerd.identity import IdentityError
        from peerd.service.volunteer import ServiceError

        if isinstance(e, (RunConfigConflict, CheckpointError, DataError, IdentityError, ConnectionError,
                          ServiceError, DeviceUnavailable)):
            logger.error("%s", e)
            return 1
        logger.exception("peerd failed: %s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
