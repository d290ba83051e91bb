"""Lifecycle of a peer: identity -> transport -> run config (fetch or publish) -> role -> clean exit.

Every DHT record a peer stores is signed by its identity key and every record it reads is verified
(:mod:`peerd.transport.records`); the run config is signed by the run's creator and bound to the run name
(:mod:`peerd.identity.membership`); a run's allowlist is enforced on the role's transport (:mod:`peerd.transport.admission`).

Nothing here parses flags (that is :mod:`peerd.commands`); everything here can be driven from tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Optional

from peerd.config import NodeConfig
from peerd.identity.key import hold_identity
from peerd.run_config import RunConfig
from peerd.identity.membership import (
    RUN_CREATOR_MIN_PREFIX,
    RunConfigConflict,
    RunConfigRecord,
    choose,
    config_payload,
    load_pin,
    parse_config_record,
    pin_path,
    save_pin,
)
from peerd.identity.namespace import RunNamespace, RunRef, as_run_ref
from peerd.runtime.processes import install_stop_handlers, unless_stopped
from peerd.identity.signing import InvalidRecord, key_id
from peerd.status.records import StatusFilter
from peerd.transport.admission import admit_only
from peerd.transport.factory import open_reader, open_transport, start_data_plane
from peerd.transport.records import SignedDiscovery
from peerd.service.volunteer import VolunteerServices

logger = logging.getLogger(__name__)

#: Lifetime of the published run config in the DHT; every live peer re-publishes it well before it expires.
CONFIG_TTL_S = 600.0
CONFIG_REFRESH_S = 60.0


#: How often a joiner without ``--run-config`` looks again for the run's config while it waits for the creator to
#: publish it (the second terminal of a quick start is often started first; node config ``config_wait_s``).
CONFIG_POLL_S = 2.0


async def _config_records(discovery: SignedDiscovery, ref: RunRef, key: str) -> list[RunConfigRecord]:
    records = []
    for owner, found in (await discovery.get_signed(key)).items():
        try:
            records.append(parse_config_record(ref.name, owner, found.value, found.envelope))
        except InvalidRecord as e:
            logger.warning("ignoring an invalid config for run %s signed by %s: %s", ref.name, owner, e,
                           extra={"event": "config_refused", "creator": owner, "reason": str(e)})
    return records


async def resolve_run_config(transport, run_id: RunRef | str, local: Optional[RunConfig],
                             pin: Optional[Path] = None, wait_s: float = 0.0,
                             stop: Optional[asyncio.Event] = None) -> Optional[RunConfigRecord]:
    """The run's creator-signed config (rules in :mod:`peerd.identity.membership`), checked against ``local`` if given;
    or ``local``, signed by us and published now, if the run has none. ``pin``: where this peer pins (and later
    checks) the config it accepted. ``transport.discovery`` must be a :class:`SignedDiscovery` with our key.
    Without ``local``, a run with no config yet is looked up again every CONFIG_POLL_S seconds for up to ``wait_s``
    seconds (one log line says so); None if ``stop`` is set meanwhile.

    Raises RunConfigConflict if the published config disagrees with ``local`` (naming the differing keys), is
    ambiguous or differs from the pinned one, if neither exists (after ``wait_s``), if the run id names another
    creator than the one who signed the published config (naming both) or names another creator and nothing is
    published, or if we would publish a config whose allowlist does not list us. Raises RunIdError if ``run_id`` is
    malformed.
    """
    discovery: SignedDiscovery = transport.discovery
    ref = as_run_ref(run_id)  # a malformed run id fails here, before anything is published
    run_id = ref.name
    key = RunNamespace(ref).config_key
    pinned = load_pin(pin, run_id, key_id(key)) if pin is not None else None
    records = await _config_records(discovery, ref, key)
    if not records and pinned is None and local is None and wait_s > 0:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        logger.info("run %s has no configuration published yet: waiting up to %.0f s for its creator (the first peer,"
                    " started with --run-config) to publish it; Ctrl-C stops", run_id, wait_s,
                    extra={"event": "config_wait", "wait_s": wait_s})
        stop = stop or asyncio.Event()
        while not records and loop.time() < deadline:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), min(CONFIG_POLL_S, max(0.0, deadline - loop.time())))
            if stop.is_set():
                return None
            records = await _config_records(discovery, ref, key)
        if not records:
            raise RunConfigConflict(f"run {run_id!r} still has no configuration published in the DHT after "
                                    f"{wait_s:.0f} s (is its first peer online, with --run-config?)")
    accepted = choose(ref, records, pinned)
    if not accepted and pinned is not None:
        logger.info("the DHT lost the configuration of run %s: re-publishing the pinned one (creator %s)", run_id,
                    pinned.creator)
        await keep_config_record(transport, ref, pinned)
        accepted = [pinned]
    if not accepted:
        others = sorted(r.creator for r in records if not ref.accepts(r.creator))
        if others and (local is None or not ref.accepts(discovery.signer.peer_id)):
            raise RunConfigConflict(
                f"run {run_id!r}: the run id {ref} accepts only a configuration signed by {ref.creator}, but the "
                f"published one is signed by {', '.join(others)}; check the PeerID after '@' (ask the run's creator)"
            )
        if local is None:
            raise RunConfigConflict(
                f"run {run_id!r} has no configuration published in the DHT (is any peer of it online?);"
                " the first peer of a run must pass --run-config FILE"
            )
        accepted = [await publish_run_config(transport, ref, local)]
        logger.info("published the configuration of new run %s (fingerprint %s), signed by this peer; joiners that "
                    "give the run id %s accept only configs signed by this peer", run_id, local.fingerprint(),
                    RunRef(run_id, discovery.signer.peer_id[:RUN_CREATOR_MIN_PREFIX]),
                    extra={"event": "config_published", "fingerprint": local.fingerprint()})
    record = accepted[0]
    remote = record.run
    if local is not None and local.fingerprint() != remote.fingerprint():
        diff = _diff(local.to_dict(), remote.to_dict())
        raise RunConfigConflict(
            f"--run-config disagrees with the configuration published for run {run_id!r}: "
            + "; ".join(f"{k}: local {a!r} vs published {b!r}" for k, a, b in diff)
        )
    if pin is not None and pinned is None:
        save_pin(pin, record)
    return record


async def publish_run_config(transport, run_id: RunRef | str, run: RunConfig) -> RunConfigRecord:
    """Sign ``run`` as this run's creator and store it under the run name's config key. Raises RunConfigConflict if
    the run id names another creator or the config's allowlist does not list us (such a config would be refused by
    every peer)."""
    discovery: SignedDiscovery = transport.discovery
    me = discovery.signer.peer_id
    ref = as_run_ref(run_id)
    run_id = ref.name
    if not ref.accepts(me):
        raise RunConfigConflict(
            f"run {str(ref)!r} belongs to the peer {ref.creator}, not to this peer ({me}); only it can publish the "
            "run's configuration, and none is published now (is any peer of the run online?)"
        )
    if run.allowlist and me not in run.allowlist:
        raise RunConfigConflict(f"cannot publish the configuration of run {run_id!r}: this peer ({me}) is not on "
                                "its allowlist")
    key = RunNamespace(ref).config_key
    envelope = discovery.seal_portable(key, config_payload(run_id, me, run))
    record = RunConfigRecord(me, run, envelope)
    await keep_config_record(transport, ref, record)
    return record


async def keep_config_record(transport, run_id: RunRef | str, record: RunConfigRecord) -> bool:
    """(Re-)store the creator's signed config record for another CONFIG_TTL_S."""
    discovery: SignedDiscovery = transport.discovery
    return await discovery.store_portable(RunNamespace.of(run_id).config_key, record.creator, record.envelope,
                                          discovery.time() + CONFIG_TTL_S)


async def keep_run_config_alive(transport, run_id: RunRef | str, record: RunConfigRecord) -> None:
    """Every live peer re-stores the creator's record, unchanged: the run's config outlives its creator."""
    while True:
        await asyncio.sleep(CONFIG_REFRESH_S)
        with contextlib.suppress(ConnectionError):  # the DHT unreachable now: stored again next time
            await keep_config_record(transport, run_id, record)


def _diff(a: dict, b: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff(va, vb, f"{prefix}{key}.")
        elif va != vb:
            out.append((prefix + key, va, vb))
    return out


async def join(run_id: RunRef | str, node: NodeConfig, local_run: Optional[RunConfig]) -> None:
    """Join (or create) run ``run_id`` (``name`` or ``name@creator``, a string or a RunRef) in the role its config
    names (``parallelism``, :data:`peerd.roles.registry.ROLES`) until stopped or the role is done. Everything but the
    choice of the config is keyed by the run name. Raises :class:`peerd.roles.status_board.DuplicateIdentity` if
    another live daemon uses this peer's identity."""
    from peerd.service.limits import apply_cpu_threads, apply_gpu_memory_fraction
    from peerd.hardware.devices import describe_device
    # torch-heavy: keep --help fast
    from peerd.roles.base import RunContext, parallelism, pick_device, role_class, wrap_context
    from peerd.hardware.host_memory import fit_host
    from peerd.hardware.memory import fit_node
    from peerd.roles.tokenizer_sync import resolve_tokenizer, serve_tokenizers
    from peerd.data.tokenizer import TokenizerCache, tokenizer_dir

    from peerd.worker.preflight import check_local_checkpoint, check_node_against_run
    from peerd.service.rules import effective_device

    ref = as_run_ref(run_id)
    run_id = ref.name
    node = dataclasses.replace(node, device=effective_device(node.device, node.gpu))
    if local_run is not None:  # before the DHT: a bad option must not publish a run it cannot join
        check_node_against_run(node, local_run)
    check_local_checkpoint(node, run_id)
    stop = asyncio.Event()
    install_stop_handlers(stop)
    hold = hold_identity(node.identity_path_for("worker"))  # before any service: a second daemon stops right here
    async with VolunteerServices(node, "worker", stop, run_id=run_id) as services:  # the role: once known
        apply_cpu_threads(node.threads)
        device = pick_device(node.local_devices[0] if node.local_devices else node.device)  # absent: one line, exit 1
        logger.info("training device: %s", describe_device(device))
        apply_gpu_memory_fraction(node.gpu_memory_fraction, device)  # the helpers of other local devices apply theirs
        transport = await unless_stopped(stop, open_transport(node, hold=hold))
        if transport is None:
            return  # stopped while the DHT node was starting
        services.peer_id = transport.peer_id
        keeper = data_plane = files = dashboard = dialback = reach = None
        try:
            logger.info("listening on %s", " ".join(transport.visible_maddrs()))
            dialback = await serve_dialback(transport)
            try:
                record = await resolve_run_config(transport, ref, local_run, pin_path(node.checkpoint_path, ref),
                                                  wait_s=node.config_wait_s if node.initial_peers else 0.0,
                                                  stop=stop)
            except RunConfigConflict as e:
                raise explain_config_conflict(e, node, local_run) from None
            if record is None:
                return  # stopped while waiting for the run's config
            run = record.run
            if record.creator != transport.peer_id:  # the creator logged its "published" line already
                logger.info("joining run %s: configuration %s signed by %s (model %s, %s)", run_id, record.fingerprint,
                            record.creator, run.model, parallelism(run))
            check_node_against_run(node, run)  # a config from the DHT: checked only now
            if run.allowlist and transport.peer_id not in run.allowlist:
                raise RunConfigConflict(f"this peer ({transport.peer_id}) is not on the allowlist of run {run_id!r};"
                                        " ask the run's creator to add it")
            keeper = asyncio.ensure_future(keep_run_config_alive(transport, ref, record))
            if node.dashboard_port is not None:  # up before the role's slow build (model, corpus), so it shows joining
                dashboard = await start_dashboard(node, ref, transport.discovery, services)
            data_plane = await start_data_plane(node, transport)
            role_transport = admit_only(services.pace(data_plane or transport), run.allowlist)
            ctx = RunContext.build(ref, run, node, role_transport, stop, services.gate, services.events)
            services.device_in_use = str(ctx.device)
            ctx = wrap_context(ctx)
            tokenizers = TokenizerCache(tokenizer_dir(node))
            files = serve_tokenizers(role_transport, ctx.namespace, tokenizers)  # joiners fetch the run's file here
            await files.start()
            ctx.tokenizer = await resolve_tokenizer(run.tokenizer, tokenizers, role_transport, ctx.namespace, stop)
            if ctx.tokenizer is None:
                return  # stopped while waiting for the tokenizer file
            ctx.node, memory = fit_node(ctx.node, run, ctx.device, ctx.tokenizer.vocab_size)  # refuses what can't fit
            if memory:
                logger.info("memory: %s", memory)
            host = fit_host(ctx.node, run, ctx.device, ctx.tokenizer.vocab_size)  # refuses what can't fit
            if host:
                logger.log(logging.WARNING if host[1] else logging.INFO, "memory: %s", host[0])
            role = role_class(parallelism(run))(ctx)
            services.set_role(role.name)
            services.watch_peers(role_transport.discovery, ctx.namespace.status_key)
            reach = asyncio.ensure_future(_check_reachability(transport, node, ctx, data_plane))
            services.ready(f"joined run {run_id}")
            await role.run(ctx)
            if ctx.status.conflict is not None:
                raise ctx.status.conflict
        finally:
            if reach is not None:
                reach.cancel()
            if dialback is not None:
                await dialback.stop()
            if dashboard is not None:
                await dashboard.stop()
            if keeper is not None:
                keeper.cancel()
            if files is not None:
                await files.stop()
            if data_plane is not None:
                await data_plane.streams.stop()
            await transport.shutdown()


def explain_config_conflict(error: RunConfigConflict, node: NodeConfig,
                            local_run: Optional[RunConfig]) -> RunConfigConflict:
    """``error`` from :func:`resolve_run_config`, with a hint where the cause is likely this node's flags: a joiner
    without ``--run-config`` and without initial peers searched only a DHT of its own (a common first slip)."""
    if node.initial_peers or local_run is not None:
        return error
    return RunConfigConflict(f"{error}; no --initial-peers given, so this peer looked only in a DHT of its own: "
                             "pass any peer's multiaddr (e.g. a bootstrap node's)")


async def serve_dialback(transport):
    """Serve the dial-back check (:mod:`protocols.reachability`) for any peer; None if it cannot be served."""
    from peerd.transport.dialback import dialback_service
    from peerd.transport.p2pd_errors import P2PD_ERRORS

    service = dialback_service(transport)
    try:
        await service.start(transport)
    except P2PD_ERRORS as e:  # p2pd refused the handler, or it is served already: a peer that cannot help still trains
        logger.warning("not serving the dial-back check: %s", e)
        return None
    return service


async def _check_reachability(transport, node: NodeConfig, ctx, data_plane=None) -> None:
    """The join's reachability line; the status record carries the verdict. A peer that listens on loopback only
    (tests, the local demo) is reachable from this machine alone: it says so and asks nobody. The direct data plane
    (``data_plane``, if started) publishes its address only while the verdict says others can dial this peer, so
    that nobody waits for a connect to a peer behind a NAT (streams to it go through p2pd)."""
    from peerd.status.records import dialable_peers
    from peerd.transport.dialback import listens_on_loopback_only, watch_reachability

    streams = data_plane.streams if data_plane is not None else None
    if listens_on_loopback_only(node.host_maddrs):
        logger.info("reachable from this machine only: listening on loopback (host_maddrs %s); set host_maddrs to "
                    "/ip4/0.0.0.0/tcp/PORT for peers on other machines", " ".join(node.host_maddrs),
                    extra={"event": "reachability", "reachable": None})
        return  # the data plane published its address at start: every peer that can reach us shares this machine
    publishing: set[asyncio.Task] = set()

    def record(verdict) -> None:
        ctx.status.reachable = verdict.reachable
        ctx.status.relayed = verdict.relayed
        if streams is not None:
            task = asyncio.ensure_future(streams.set_dialable(verdict.reachable is True))
            publishing.add(task)
            task.add_done_callback(publishing.discard)

    try:
        await watch_reachability(transport, node, dialable_peers(transport.discovery, ctx.namespace.status_key),
                                 on_verdict=record)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # boundary: a background check; it informs the volunteer, it never stops training
        logger.warning("the reachability check failed: %s", e)


async def start_dashboard(node: NodeConfig, ref: RunRef, discovery, services: VolunteerServices):
    """Serve the web dashboard inside this daemon (node config ``dashboard_port``/``_host``/``_token``): the run as
    this daemon's DHT view shows it, and this machine through the control socket's handler. Raises ServiceError if
    the port cannot be bound."""
    from peerd.dashboard.app import Dashboard
    from peerd.service.volunteer import ServiceError

    dashboard = Dashboard(ref.name, lambda: read_run_status(discovery, ref), services.handle,
                          node.dashboard_token, node.status_ttl_s)
    services.events.subscribe(dashboard.observe)
    try:
        await dashboard.start(node.dashboard_host, node.dashboard_port)
    except OSError as e:
        raise ServiceError(f"cannot serve the dashboard on {node.dashboard_host}:{node.dashboard_port}: {e}"
                           ) from None
    logger.info("dashboard on %s", dashboard.url(), extra={"event": "dashboard", "url": dashboard.url()})
    return dashboard


async def bootstrap(node: NodeConfig, on_ready=print) -> None:
    """Run a DHT-only node until stopped; ``on_ready`` receives each visible multiaddr."""
    stop = asyncio.Event()
    install_stop_handlers(stop, "leaving the DHT")  # a bootstrap node has no training state to checkpoint
    hold = hold_identity(node.identity_path_for("bootstrap"))
    async with VolunteerServices(node, "bootstrap", stop) as services:
        transport = await unless_stopped(stop, open_transport(node, role="bootstrap", hold=hold))
        if transport is None:
            return  # stopped while the DHT node was starting
        dialback = None
        try:
            dialback = await serve_dialback(transport)
            for maddr in transport.visible_maddrs():
                on_ready(maddr)
            logger.info("bootstrap node up; give peers --initial-peers with one of the addresses above")
            services.ready("bootstrap node up")
            await stop.wait()
        finally:
            if dialback is not None:
                await dialback.stop()
            await transport.shutdown()


async def read_status(node: NodeConfig, run_id: RunRef | str) -> tuple[dict[str, dict], Optional[dict]]:
    """Live status records and the published config of run ``run_id``, read through a short-lived DHT client.

    Only records signed by their owner and with the status schema are returned (the others are logged). The config
    is the run's as :func:`peerd.identity.membership.choose` decides (None if there is none or it is ambiguous):
    ``{config, fingerprint, creator, creators}``.
    """
    transport = await open_reader(node)
    try:
        return await read_run_status(transport.discovery, run_id)
    finally:
        await transport.shutdown()


async def read_run_status(discovery, run_id: RunRef | str) -> tuple[dict[str, dict], Optional[dict]]:
    """:func:`read_status` through an open ``discovery`` (the dashboard keeps one open)."""
    ref = as_run_ref(run_id)
    ns = RunNamespace(ref)
    statuses = StatusFilter(logger)(await discovery.get(ns.status_key))
    records = []
    for owner, found in (await discovery.get_signed(ns.config_key)).items():
        with contextlib.suppress(InvalidRecord):
            records.append(parse_config_record(ref.name, owner, found.value, found.envelope))
    try:
        accepted = choose(ref, records, pinned=None)
    except RunConfigConflict as e:
        logger.warning("%s", e)
        accepted = []
    config = None
    if accepted:
        config = {"config": accepted[0].run.to_dict(), "fingerprint": accepted[0].fingerprint,
                  "creator": accepted[0].creator, "creators": [r.creator for r in accepted]}
    return statuses, config
