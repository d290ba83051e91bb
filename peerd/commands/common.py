"""What the commands share: the usage error, the node config from the flags, the run id, the event loop."""

from __future__ import annotations

import argparse
import asyncio
from typing import TYPE_CHECKING, Any

from peerd.config import NodeConfig, load_node_config

if TYPE_CHECKING:
    from peerd.identity.namespace import RunRef


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit code 2."""


def run_async(coro: Any) -> Any:
    """Run the daemon's event loop on uvloop where it is installed (faster stream I/O), else on asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def node_config(args: argparse.Namespace) -> NodeConfig:
    return load_node_config(args.config, overrides=node_overrides(args))


#: Node config keys that commands may take as flags (besides the addresses and identity of every DHT command).
NODE_FLAGS = ("device", "threads", "checkpoint_dir", "data", "gpu_memory_fraction", "upload_limit_mb_s",
              "download_limit_mb_s", "uplink_mb_s", "active_hours", "metrics_port", "control_socket", "stage",
              "swarm_role",
              "micro_batch_size", "precision", "compile", "activation_checkpointing", "optimizer_8bit",
              "local_devices", "host_memory_check",
              "dashboard_port", "dashboard_host", "dashboard_token")


#: Flags spelled differently from their node config key.
FLAG_NAMES = {"upload_limit_mb_s": "--upload-limit", "download_limit_mb_s": "--download-limit",
              "uplink_mb_s": "--uplink", "swarm_role": "--role"}


def node_overrides(args: argparse.Namespace) -> dict[str, Any]:
    names = ("initial_peers", "host_maddrs", "announce_maddrs", "identity", "nat_port_map", "transport",
             "relay", "dht") + NODE_FLAGS
    return {name: getattr(args, name, None) for name in names}


def require_run_id(args: argparse.Namespace) -> "RunRef":
    """The parsed ``--run-id``; UsageError if none was given."""
    if not args.run_id:
        raise UsageError(f"peerd {args.command}: --run-id is required (or set PEERD_RUN_ID) (see `peerd "
                         f"{args.command} --help`)")
    return args.run_id
