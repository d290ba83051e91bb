"""`peerd doctor`: the basics a volunteer's machine needs to join a run, one line per check with OK or FAIL and a fix.

Checks, in order: the p2pd binary runs here; py-libp2p is importable (the transport without Go); the bootstrap
peers answer (a short-lived node of ours joins the DHT through them, with a throw-away identity so a running daemon
keeps its own); the run's configuration is published; other peers can dial this machine back (the dial-back check
of :mod:`protocols.reachability`, on the node config's listen addresses); this clock agrees with the peers' status
records; the run's predicted peak memory fits the training device (with the micro-batch and checkpointing
``peerd join`` will choose) and the host memory; the training device is usable. A check that cannot run because an earlier one failed
says so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from peerd.config import ConfigError, NodeConfig
from peerd.runtime.processes import interruptible

if TYPE_CHECKING:
    from peerd.identity.namespace import RunRef

#: A peer's clock may differ from the others' by this many seconds before records go wrong (status records live
#: ``status_ttl_s``, 30 s by default; signed records carry times).
CLOCK_SKEW_S = 10.0


@dataclass
class Check:
    """One line of the report: ``name``, ``ok``, what was found (``detail``) and, if not ok, what to do (``fix``)."""

    name: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self) -> str:
        text = f"{'OK  ' if self.ok else 'FAIL'}  {self.name:<12} {self.detail}"
        return text + (f"; fix: {self.fix}" if self.fix and not self.ok else "")


def check_p2pd() -> Check:
    from peerd.transport.libp2p_backend import p2pd_problem

    problem = p2pd_problem()
    if problem is None:
        return Check("p2pd", True, "hivemind's p2pd binary is an executable for this machine")
    return Check("p2pd", False, problem, "reinstall hivemind (pip install --force-reinstall hivemind), or use "
                 "transport = \"libp2p\" (no Go binary needed)")


def check_libp2p() -> Check:
    from peerd.transport.libp2p_backend import libp2p_available

    problem = libp2p_available()
    if problem is None:
        return Check("py-libp2p", True, "py-libp2p and trio are installed (transport = \"libp2p\" works)")
    return Check("py-libp2p", False, problem, "scripts/setup installs it; only needed where p2pd cannot run")


def check_device(node: NodeConfig) -> Check:
    try:
        from peerd.roles.base import pick_device
        from peerd.service.rules import effective_device

        device = pick_device(effective_device(node.device, node.gpu))
    except RuntimeError as e:  # DeviceUnavailable, or torch failing to bring the GPU up: reported, not raised
        return Check("device", False, str(e), "set device = \"cpu\" or \"auto\", or install a GPU build of torch "
                     "(CUDA or ROCm)")
    from peerd.hardware.devices import describe_device

    return Check("device", True, f"training on {describe_device(device)}")


def check_memory(node: NodeConfig, run: Any, budget: Optional[tuple[int, str]] = None,
                 host: Optional[tuple[int, int, int]] = None) -> list[Check]:
    """The run's predicted peak memory on this machine's training device (:func:`peerd.hardware.memory.fit_node`)
    and in its host memory (:func:`peerd.hardware.host_memory.fit_host`), one check each: FAIL when it cannot fit.
    ``run``: a :class:`peerd.run_config.RunConfig`; ``budget``: ``(bytes, name)`` instead of asking the device,
    ``host``: ``(physical, swap, available)`` instead of asking the machine (tests). Empty where there is no
    prediction (another parallelism, a mixture-of-experts model, a BPE vocabulary whose file is not here yet)."""
    from peerd.hardware.host_memory import fit_host
    from peerd.hardware.memory import fit_node
    from peerd.roles.base import pick_device
    from peerd.service.rules import effective_device
    from peerd.data.tokenizer import TokenizerCache, parse_spec, tokenizer_dir

    digest = parse_spec(run.tokenizer)
    if digest is None:
        vocab = 256
    else:
        tokenizer = TokenizerCache(tokenizer_dir(node)).get(digest)
        if tokenizer is None:
            return []
        vocab = tokenizer.vocab_size
    try:
        device = pick_device(effective_device(node.local_devices[0] if node.local_devices else node.device, node.gpu))
        node, line = fit_node(node, run, device, vocab, budget)
    except (ConfigError, RuntimeError) as e:  # RuntimeError: no device (DeviceUnavailable, torch's GPU errors)
        return [_memory_failure("memory", e)]
    checks = [Check("memory", True, line)] if line else []
    try:
        found = fit_host(node, run, device, vocab, budget=host)
    except ConfigError as e:
        return [*checks, _memory_failure("host memory", e)]
    return [*checks, Check("host memory", True, found[0])] if found else checks


def _memory_failure(name: str, error: Exception) -> Check:
    """A FAIL line for a prediction that refused (ConfigError: its fix after the "; ") or could not be made."""
    if isinstance(error, ConfigError):
        detail, _, fix = str(error).partition("; ")
        return Check(name, False, detail, fix)
    return Check(name, False, f"no prediction: {error}", "see the device line")


def clock_check(record_times: list[float], now: float, skew_s: float = CLOCK_SKEW_S) -> Check:
    """Our clock against the peers' status records (each written at most a refresh interval ago): a record from
    the future means our clock is behind; the newest record being old only means quiet peers, so only the future
    is checked against ``skew_s``, and the past against a generous bound (records live at most a few minutes)."""
    if not record_times:
        return Check("clock", True, "no live peer to compare with (checked again once the run has peers)")
    ahead = max(record_times) - now
    if ahead > skew_s:
        return Check("clock", False, f"this clock is {ahead:.0f} s behind the run's peers",
                     "enable time synchronisation (NTP: `timedatectl set-ntp true`)")
    behind = now - max(record_times)
    if behind > 300.0:
        return Check("clock", False, f"this clock is {behind:.0f} s ahead of the newest status record",
                     "enable time synchronisation (NTP: `timedatectl set-ntp true`)")
    return Check("clock", True, f"within {max(ahead, 0.0):.1f} s of the newest peer record")


async def network_checks(node: NodeConfig, run_id: "RunRef | str", identity_dir: Optional[str] = None) -> list[Check]:
    """bootstrap, run config, reachability and clock, through a short-lived node of ours."""
    from peerd.daemon import read_run_status, serve_dialback
    from peerd.identity.namespace import RunNamespace, as_run_ref
    from peerd.status.records import dialable_peers
    from peerd.transport.dialback import check_transport, helpers_for
    from peerd.transport.factory import open_transport

    checks = []
    if not node.initial_peers:
        return [Check("bootstrap", False, "no initial peers given", "pass --initial-peers (any peer of the run)")]
    with tempfile.TemporaryDirectory(dir=identity_dir) as tmp:
        probe = dataclasses.replace(node, identity=str(Path(tmp) / "doctor.key"))
        note = ""
        try:
            try:
                transport = await open_transport(probe, bootstrap_retry_s=())  # a check answers now
            except ConnectionError:
                fixed = [m for m in node.host_maddrs if _port(m) not in (None, 0)]
                if not fixed:
                    raise
                # the configured port may be held by this machine's running daemon: check the rest on any port
                probe = dataclasses.replace(probe, host_maddrs=tuple(_with_port(m, 0) for m in node.host_maddrs))
                transport = await open_transport(probe, bootstrap_retry_s=())  # a check answers now
                note = f" (checked on another port: {fixed[0]} could not be used, a running daemon may hold it)"
        except Exception as e:  # noqa: BLE001 - every failure is a FAIL line
            detail = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            return [Check("bootstrap", False, f"could not join the DHT through {len(node.initial_peers)} initial "
                          f"peer(s): {detail}", "check the --initial-peers addresses (copy them from the run's "
                          "page or `peerd bootstrap` output) and that outgoing TCP is allowed")]
        dialback = None
        try:
            checks.append(Check("bootstrap", True, f"joined the DHT through {len(node.initial_peers)} initial "
                                f"peer(s)"))
            dialback = await serve_dialback(transport)
            ref = as_run_ref(run_id)
            statuses, config = await read_run_status(transport.discovery, ref)
            live = {p: s for p, s in statuses.items() if s.get("role") != "left"}
            if config is None:
                checks.append(Check("run", False, f"run {ref.name!r} has no configuration published",
                                    "check the run id; the run's creator (or any of its peers) must be online"))
            else:
                checks.append(Check("run", True, f"run {ref.name!r}: configuration {config['fingerprint'][:12]} "
                                    f"by {config['creator'][:16]}..., {len(live)} live peer(s)"))
                from peerd.run_config import RunConfig

                checks.extend(check_memory(node, RunConfig.from_dict(config["config"])))
            helpers = await helpers_for(node, dialable_peers(transport.discovery, RunNamespace(ref).status_key))
            verdict = await check_transport(transport, helpers, node.announce_maddrs, node.relay)
            checks.append(reachability_check(verdict, note))
            checks.append(clock_check([s["time"] for s in live.values()], time.time()))
        finally:
            if dialback is not None:
                await dialback.stop()
            await transport.shutdown()
    return checks


def reachability_check(verdict: Any, note: str = "") -> Check:
    """The ``reachable`` line of a dial-back verdict (:class:`protocols.reachability.Verdict`): OK if others can
    dial this peer, or reach it through a relay (a full participant, slower: the line says how to be dialed
    directly); FAIL with the fix otherwise."""
    if verdict.relayed and not verdict.reachable:
        return Check("reachable", True, verdict.line() + note)
    fix = "" if verdict.reachable else verdict.line().split("; ", 1)[-1]
    return Check("reachable", bool(verdict.reachable), verdict.line().split(";", 1)[0] + note, fix)


def run_doctor(node: NodeConfig, run_id: "RunRef | str", network: Any = None) -> list[Check]:
    """Every check, in report order. ``network``: replaces :func:`network_checks` (tests)."""
    checks = [check_p2pd(), check_libp2p()]
    try:
        checks += asyncio.run(interruptible((network or network_checks)(node, run_id)))
    except Exception as e:  # noqa: BLE001 - one line, never a traceback
        checks.append(Check("network", False, f"{type(e).__name__}: {e}", "run again with --log-level DEBUG"))
    checks.append(check_device(node))
    return checks


def _port(maddr: str) -> Optional[int]:
    parts = maddr.split("/")
    if "tcp" in parts and parts.index("tcp") + 1 < len(parts) and parts[parts.index("tcp") + 1].isdigit():
        return int(parts[parts.index("tcp") + 1])
    return None


def _with_port(maddr: str, port: int) -> str:
    parts = maddr.split("/")
    if "tcp" in parts and parts.index("tcp") + 1 < len(parts):
        parts[parts.index("tcp") + 1] = str(port)
    return "/".join(parts)
