"""The ``peerd`` argument parser: every command, its flags and their help."""

from __future__ import annotations

import argparse
import os
from typing import Any, Optional

from peerd import __version__
from peerd.commands.common import UsageError
from peerd.config import DHT_MODES, HOST_MEMORY_CHECKS, PRECISIONS, RELAY_MODES, SWARM_ROLES, TRANSPORTS
from peerd.runtime.telemetry import LOG_FORMATS

EXAMPLE_PEER = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line instead of usage + message
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def _run_id(value: str):
    """``--run-id`` (or ``PEERD_RUN_ID``) parsed into a :class:`peerd.identity.namespace.RunRef`: the one place a
    run id given to the CLI is parsed; every command and the daemon take the RunRef."""
    from peerd.identity.namespace import RunIdError, RunRef

    try:
        return RunRef.parse(value)
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
    g.add_argument("--host-memory-check", choices=HOST_MEMORY_CHECKS,
                   help="when the run's predicted host-memory peak exceeds this machine's memory and swap: refuse "
                   "(default) or warn and train anyway")
    g.add_argument("--gpu-memory-fraction", type=float, metavar="F",
                   help="let this process allocate at most this share (0-1] of the GPU's memory (default no limit)")
    g.add_argument("--upload-limit", type=float, metavar="MB_S", dest="upload_limit_mb_s",
                   help="cap what this peer sends to other peers, in MB/s (default unlimited)")
    g.add_argument("--download-limit", type=float, metavar="MB_S", dest="download_limit_mb_s",
                   help="cap what this peer reads from other peers, in MB/s (default unlimited)")
    g.add_argument("--uplink", type=float, metavar="MB_S", dest="uplink_mb_s",
                   help="this peer's upload link rate in MB/s (12.5 = 100 Mbit/s), from a speed test or a little "
                   "below: all-reduces pace their connections at shares of it (default unknown: unpaced)")
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
    g.add_argument("--weights", choices=("outer", "local"), default="outer",  # commands.export.WEIGHTS (imports torch)
                   help="outer: the run's synced model (default); local: this peer's model with its inner steps "
                   "since the last outer round")
    g.add_argument("--model", metavar="NAME", help="the run's model, for checkpoints that do not record it")
    g.add_argument("--seq-len", type=int, metavar="T", help="the run's seq_len, for checkpoints that do not record it")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text", help=argparse.SUPPRESS)
    p.add_argument("--log-level", metavar="LEVEL", help=argparse.SUPPRESS)


def _actions(command: argparse.ArgumentParser, name: str):
    """The required ACTION subcommands of ``command`` (``peerd NAME ACTION``), parsed into ``NAME_command``."""
    actions = command.add_subparsers(dest=f"{name}_command", metavar="ACTION", parser_class=_Parser)
    actions.required = True
    return actions


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
    tsub = _actions(p, "tokenizer")
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

    p = sub.add_parser("corpus", help="split a new run's corpus into shards its peers fetch from each other",
                       description="Corpora of runs (`dataset = \"shards:<sha256>\"` in a run config).")
    csub = _actions(p, "corpus")
    c = csub.add_parser("split", help="split a corpus into content-addressed shards and print its run-config line",
                        description="Split a local corpus (the same bytes, separators and final-5% held-out cut "
                        "as --data reads) into shards named by their SHA-256, store them and their manifest in this "
                        "node's shard store (<checkpoint-dir>/corpus-cache/shards), from where `peerd join` serves "
                        "them to the run's peers, and print the line to put in the run config. Each volunteer "
                        "then fetches only the shards it trains on.")
    c.add_argument("path", metavar="PATH|GLOB",
                   help="UTF-8 text files, .jsonl (a text field per line) or .parquet (a text column)")
    c.add_argument("--shard-mb", type=float, default=16.0, metavar="N",
                   help="MiB per shard (default 16: about 1.3 s at 100 Mbit/s)")
    c.add_argument("--checkpoint-dir", default="~/.peerd/checkpoints", metavar="DIR",
                   help="the node whose shard store receives them (default ~/.peerd/checkpoints)")
    c.add_argument("--log-format", choices=LOG_FORMATS, default="text", help=argparse.SUPPRESS)
    c.add_argument("--log-level", metavar="LEVEL", help=argparse.SUPPRESS)

    p = sub.add_parser("config", help="inspect configuration")
    csub = _actions(p, "config")
    c = csub.add_parser("show", help="print the effective node config (and a run config if given)")
    c.add_argument("--run-config", metavar="FILE", help="also validate and print this run config")
    _worker_flags(c)
    _node_flags(c)
    return parser
