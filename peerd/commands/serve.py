"""The commands that serve until stopped: ``join``, ``bootstrap`` and ``dashboard``."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import TYPE_CHECKING

from peerd.commands.common import UsageError, node_config, require_run_id, run_async
from peerd.config import NodeConfig

if TYPE_CHECKING:
    from peerd.identity.namespace import RunRef

logger = logging.getLogger("peerd")


def cmd_join(args: argparse.Namespace) -> int:
    run_id = require_run_id(args)
    node = node_config(args)  # a bad flag fails before the heavy imports below
    from peerd.daemon import join
    from peerd.run_config import load_run_config

    run = load_run_config(args.run_config) if args.run_config else None
    run_async(join(run_id, node, run))  # checks the node's options against the run before it joins the DHT
    return 0


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from peerd.daemon import bootstrap

    node = node_config(args)
    run_async(bootstrap(node, on_ready=lambda maddr: print(maddr, flush=True)))
    return 0


#: Port of `peerd dashboard` when none is given.
DASHBOARD_PORT = 8477


def cmd_dashboard(args: argparse.Namespace) -> int:
    require_run_id(args)
    if args.dashboard_port is None:
        args.dashboard_port = DASHBOARD_PORT
    node = node_config(args)
    if not node.initial_peers:
        raise UsageError("peerd dashboard: --initial-peers is required (any peer of the run)")
    run_async(_serve_dashboard(node, args.run_id))
    return 0


async def _serve_dashboard(node: NodeConfig, run_id: "RunRef") -> None:
    from peerd.dashboard.app import Dashboard, control_socket_node
    from peerd.daemon import read_run_status
    from peerd.runtime.processes import install_stop_handlers, unless_stopped
    from peerd.transport.factory import open_reader

    stop = asyncio.Event()
    install_stop_handlers(stop, "stopping the dashboard")
    transport = await unless_stopped(stop, open_reader(node))
    if transport is None:
        return  # stopped while the DHT client was starting
    try:
        dashboard = Dashboard(str(run_id), lambda: read_run_status(transport.discovery, run_id),
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
