"""Lifecycle of a peer: identity -> transport -> run config (fetch or publish) -> role -> clean exit.

Nothing here parses flags (that is ``peerd.cli``); everything here can be driven from tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Optional

from peerd.config import ConfigError, NodeConfig, RunConfig
from peerd.identity import load_or_create_identity
from peerd.telemetry import config_key, status_key
from peerd.transport.hivemind_backend import HivemindTransport
from peerd.volunteer import VolunteerServices

logger = logging.getLogger(__name__)

#: Lifetime of the published run config in the DHT; every live peer re-publishes it well before it expires.
CONFIG_TTL_S = 600.0
CONFIG_REFRESH_S = 60.0


class RunConfigConflict(RuntimeError):
    """The local --run-config disagrees with the configuration published for the run, or none exists."""


def install_stop_handlers(stop: asyncio.Event) -> None:
    """SIGINT/SIGTERM set ``stop``; a second signal restores the default (an impatient user can still kill us)."""
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            loop.remove_signal_handler(signum)
            signal.raise_signal(signum)
            return
        logger.info("received %s: finishing up (checkpoint, then leave)", signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)


async def start_transport(node: NodeConfig, client_mode: bool = False) -> HivemindTransport:
    identity = str(node.identity_path)
    peer_id = load_or_create_identity(identity)
    logger.info("PeerID %s (identity %s)", peer_id, identity)
    return await HivemindTransport.create(
        initial_peers=node.initial_peers,
        host_maddrs=node.host_maddrs,
        announce_maddrs=node.announce_maddrs,
        identity_path=identity,
        nat_port_map=node.nat_port_map,
        client_mode=client_mode,
    )


async def resolve_run_config(transport, run_id: str, local: Optional[RunConfig]) -> RunConfig:
    """The run's config: the published one (checked against ``local`` if given), or ``local`` published now.

    Raises RunConfigConflict if they disagree (naming the differing keys) or if neither exists.
    """
    records = await transport.discovery.get(config_key(run_id))
    published = records.get("config")
    if published is None:
        if local is None:
            raise RunConfigConflict(
                f"run {run_id!r} has no configuration published in the DHT (is any peer of it online?);"
                " the first peer of a run must pass --run-config FILE"
            )
        await publish_run_config(transport, run_id, local)
        logger.info("published the configuration of new run %s (fingerprint %s)", run_id, local.fingerprint())
        return local
    try:
        remote = RunConfig.from_dict(published.value["config"], source=f"configuration published for run {run_id!r}")
    except (ConfigError, KeyError, TypeError) as e:
        raise RunConfigConflict(f"the configuration published for run {run_id!r} is invalid: {e}") from None
    if local is not None and local.fingerprint() != remote.fingerprint():
        diff = _diff(local.to_dict(), remote.to_dict())
        raise RunConfigConflict(
            f"--run-config disagrees with the configuration published for run {run_id!r}: "
            + "; ".join(f"{k}: local {a!r} vs published {b!r}" for k, a, b in diff)
        )
    return remote


async def publish_run_config(transport, run_id: str, run: RunConfig) -> None:
    discovery = transport.discovery
    value = {"config": run.to_dict(), "fingerprint": run.fingerprint()}
    await discovery.store(config_key(run_id), "config", value, discovery.time() + CONFIG_TTL_S)


async def keep_run_config_alive(transport, run_id: str, run: RunConfig) -> None:
    while True:
        await asyncio.sleep(CONFIG_REFRESH_S)
        with contextlib.suppress(Exception):
            await publish_run_config(transport, run_id, run)


def _diff(a: dict, b: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff(va, vb, f"{prefix}{key}.")
        elif va != vb:
            out.append((prefix + key, va, vb))
    return out


async def join(run_id: str, node: NodeConfig, local_run: Optional[RunConfig]) -> None:
    """Join (or create) run ``run_id`` as a DiLoCo worker until stopped or the run's round limit."""
    from peerd.limits import apply_cpu_threads, apply_gpu_memory_fraction
    from peerd.roles.diloco_worker import DiLoCoWorker, pick_device  # torch-heavy; keep `peerd --help` fast

    stop = asyncio.Event()
    install_stop_handlers(stop)
    async with VolunteerServices(node, "diloco", stop, run_id=run_id) as services:
        apply_cpu_threads(node.threads)
        apply_gpu_memory_fraction(node.gpu_memory_fraction, pick_device(node.device))
        transport = await start_transport(node)
        keeper = None
        try:
            logger.info("listening on %s", " ".join(transport.visible_maddrs()))
            run = await resolve_run_config(transport, run_id, local_run)
            keeper = asyncio.ensure_future(keep_run_config_alive(transport, run_id, run))
            worker = DiLoCoWorker(run_id, run, node, services.pace(transport), stop, gate=services.gate)
            services.watch_peers(transport.discovery, run_id)
            services.ready(f"joined run {run_id}")
            await worker.run_forever()
        finally:
            if keeper is not None:
                keeper.cancel()
            await transport.shutdown()


async def bootstrap(node: NodeConfig, on_ready=print) -> None:
    """Run a DHT-only node until stopped; ``on_ready`` receives each visible multiaddr."""
    stop = asyncio.Event()
    install_stop_handlers(stop)
    async with VolunteerServices(node, "bootstrap", stop) as services:
        transport = await start_transport(node)
        try:
            for maddr in transport.visible_maddrs():
                on_ready(maddr)
            logger.info("bootstrap node up; give peers --initial-peers with one of the addresses above")
            services.ready("bootstrap node up")
            await stop.wait()
        finally:
            await transport.shutdown()


async def read_status(node: NodeConfig, run_id: str) -> tuple[dict[str, dict], Optional[dict]]:
    """Live status records and the published config of ``run_id``, read through a short-lived DHT client."""
    transport = await HivemindTransport.create(
        initial_peers=node.initial_peers, host_maddrs=("/ip4/127.0.0.1/tcp/0",), client_mode=True,
    )
    try:
        records = await transport.discovery.get(status_key(run_id))
        config = (await transport.discovery.get(config_key(run_id))).get("config")
        return {p: r.value for p, r in records.items() if isinstance(r.value, dict)}, (config.value if config else None)
    finally:
        await transport.shutdown()
