"""The ``peerd`` command line. Parses arguments and calls :mod:`peerd.daemon`; nothing else imports this module.

Exit codes: 0 clean stop, 1 runtime failure, 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
import time
from typing import Any, Optional, Sequence

from peerd import __version__
from peerd.config import ConfigError, NodeConfig, RunConfig, load_node_config, load_run_config

logger = logging.getLogger("peerd")

RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
EXAMPLE_PEER = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line instead of usage + message
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def _run_id(value: str) -> str:
    if not RUN_ID.match(value):
        raise argparse.ArgumentTypeError(
            f"invalid run id {value!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return value


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
                   help="Ed25519 identity key file, created on first run (default ~/.peerd/identity.key)")
    g.add_argument("--nat-port-map", action=argparse.BooleanOptionalAction, default=None,
                   help="ask the router for a port mapping via UPnP/NAT-PMP (default off)")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="text for people, json (one object per line) for log shippers")
    p.add_argument("--log-level", metavar="LEVEL", help="DEBUG, INFO, WARNING... (default: $PEERD_LOGLEVEL or INFO)")


def _worker_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("worker")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), help="where to train (default auto)")
    g.add_argument("--threads", type=int, metavar="N", help="CPU threads for torch (default: torch's choice)")
    g.add_argument("--checkpoint-dir", metavar="DIR", help="checkpoint folder (default ~/.peerd/checkpoints)")
    g.add_argument("--data", metavar="PATH|GLOB", help="train on this local UTF-8 text instead of the run's corpus")


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

    p = sub.add_parser("join", help="join (or start) a training run as a DiLoCo worker",
                       description="Join training run RUN_ID: find its peers through the DHT, download the current "
                       "model if the run is under way, train, and average pseudo-gradients with the others every H "
                       "inner steps. The first peer of a run passes --run-config; later peers need only --run-id "
                       "and --initial-peers. Stop with Ctrl-C or SIGTERM: the peer checkpoints and leaves.")
    p.add_argument("--run-id", required=True, type=_run_id, help="name of the run, e.g. shakespeare-demo")
    p.add_argument("--run-config", metavar="FILE",
                   help="run config TOML (node_configs/runs/*.toml); required to start a new run, checked against "
                   "the published one otherwise")
    _worker_flags(p)
    _node_flags(p)

    p = sub.add_parser("bootstrap", help="run a DHT-only node that other peers use as --initial-peers",
                       description="Run a DHT-only node. Prints its multiaddrs (one per line on stdout) and serves "
                       "until stopped. Its PeerID stays the same across restarts (see --identity).")
    _node_flags(p)

    p = sub.add_parser("status", help="show the live peers of a run",
                       description="Read the status records that the peers of RUN_ID keep in the DHT.")
    p.add_argument("--run-id", required=True, type=_run_id, help="name of the run")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _node_flags(p)

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
    overrides: dict[str, Any] = {
        "initial_peers": args.initial_peers, "host_maddrs": args.host_maddrs, "announce_maddrs": args.announce_maddrs,
        "identity": args.identity, "nat_port_map": args.nat_port_map,
    }
    for name in ("device", "threads", "checkpoint_dir", "data"):
        overrides[name] = getattr(args, name, None)
    return load_node_config(args.config, overrides=overrides)


def _cmd_join(args: argparse.Namespace) -> int:
    from peerd.daemon import join

    node = _node_config(args)
    run = load_run_config(args.run_config) if args.run_config else None
    _run_async(join(args.run_id, node, run))
    return 0


def _cmd_bootstrap(args: argparse.Namespace) -> int:
    from peerd.daemon import bootstrap

    node = _node_config(args)
    _run_async(bootstrap(node, on_ready=lambda maddr: print(maddr, flush=True)))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from peerd.daemon import read_status

    node = _node_config(args)
    if not node.initial_peers:
        raise UsageError("peerd status: --initial-peers is required (any peer of the run)")
    peers, config = _run_async(read_status(node, args.run_id))
    if args.json:
        print(json.dumps({"run_id": args.run_id, "config": config, "peers": peers}, indent=2, sort_keys=True))
        return 0
    live = {p: s for p, s in peers.items() if s.get("role") != "left"}
    print(f"run {args.run_id}: {len(live)} live peer(s)" + ("" if config else " (no configuration published)"))
    header = ("PeerID", "role", "outer round", "inner step", "last loss", "tokens/s", "eval nats/B", "last seen")
    rows = [header]
    now = time.time()
    for peer, s in sorted(live.items(), key=lambda kv: (-(kv[1].get("outer_round") or 0), kv[0])):
        rows.append((
            peer, str(s.get("role")), str(s.get("outer_round")), str(s.get("inner_step")),
            _num(s.get("loss"), "{:.4f}"), _num(s.get("tokens_per_s"), "{:.0f}"),
            _num(s.get("eval_nats_per_byte"), "{:.4f}"), _num(now - s["time"] if s.get("time") else None, "{:.0f} s ago"),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    return 0


def _num(value: Any, fmt: str) -> str:
    return fmt.format(value) if isinstance(value, (int, float)) else "-"


def _cmd_config(args: argparse.Namespace) -> int:
    import dataclasses

    node = _node_config(args)
    out: dict[str, Any] = {"node": dataclasses.asdict(node)}
    if args.run_config:
        out["run"] = load_run_config(args.run_config).to_dict()
    print(json.dumps(out, indent=2))
    return 0


COMMANDS = {"join": _cmd_join, "bootstrap": _cmd_bootstrap, "status": _cmd_status, "config": _cmd_config}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from peerd.telemetry import setup_logging

    try:
        args = build_parser().parse_args(argv)
        setup_logging(args.log_format, args.log_level)
        return COMMANDS[args.command](args)
    except (UsageError, ConfigError) as e:
        print(f"peerd: error: {e}" if isinstance(e, ConfigError) else f"{e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from peerd.checkpoint import CheckpointError
        from peerd.daemon import RunConfigConflict
        from peerd.data import DataError
        from peerd.identity import IdentityError

        if isinstance(e, (RunConfigConflict, CheckpointError, DataError, IdentityError, ConnectionError)):
            logger.error("%s", e)
            return 1
        logger.exception("peerd failed: %s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
