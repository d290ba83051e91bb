"""The py-libp2p transport: hivemind's DHT and peerd's streams on a pure-Python libp2p host, no Go binary.

Same interface and same wire protocols as :mod:`peerd.transport.hivemind_backend` (p2pd), so peers of both kinds
form one swarm: hivemind's DHT and hivemind's ``P2P`` client run unchanged; only the daemon behind that client
differs. :class:`PyLibp2pP2P` is a ``hivemind.p2p.P2P`` whose daemon is :mod:`peerd.transport.libp2p_daemon` (a
py-libp2p host speaking the p2pd control protocol) instead of the ``p2pd`` binary.

Threading and process model::

    peerd daemon process (asyncio)          DHT process (asyncio, hivemind)     libp2p daemon process (trio)
    PyLibp2pP2P client  --unix socket-->    P2P.replicate client --unix--->     py-libp2p host + Kademlia
    (peer streams)                          (hivemind DHT RPCs)                 (TCP, noise/TLS, yamux)

asyncio and trio never share a thread or a process: py-libp2p's protobuf modules cannot be imported beside
hivemind's (both define ``crypto.pb.KeyType`` in protobuf's default pool), so the trio side lives in its own process
and the hand-off between the two is the p2pd control protocol over unix sockets, the same one p2pd serves. The
libp2p daemon exits when this process closes its stdin (:meth:`PyLibp2pP2P.shutdown`) or dies (the pipe's EOF);
the DHT process dies with this process (:class:`peerd.transport.hivemind_dht._TiedDHT`). Both run in sessions of
their own, so that a Ctrl-C to this process's group reaches this process only (:mod:`peerd.runtime.processes`).

Identity: the daemon reads the same Ed25519 key file as p2pd (:mod:`peerd.identity.key`): same PeerID on both backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import secrets
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import hivemind.p2p.p2p_daemon_bindings.p2pclient as p2pclient
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from peerd.transport.hivemind_backend import HivemindDiscovery, HivemindStreams, HivemindTransport, dht_start_error
from peerd.transport.hivemind_dht import start_dht_process, stop_dht_process
from peerd.transport.p2pd_errors import P2PD_ERRORS

logger = logging.getLogger(__name__)

#: Printed by :mod:`peerd.transport.libp2p_daemon` once it serves (kept in step with its READY_LINE).
READY_LINE = "peerd-libp2p-daemon ready"
#: How long the daemon gets to exit after its stdin closed, before SIGTERM.
EXIT_GRACE_S = 3.0


def libp2p_available() -> Optional[str]:
    """None if py-libp2p is importable in a child process, else why not (one line)."""
    for module in ("libp2p", "trio"):
        if importlib.util.find_spec(module) is None:
            return f"python package {module!r} is not installed (pip install 'peerd[libp2p]')"
    return None


class PyLibp2pP2P(P2P):
    """``hivemind.p2p.P2P`` on a py-libp2p daemon process. Create with :meth:`create_daemon`; everything else
    (protobuf and binary stream handlers, unary calls, ``peer_id``, visible multiaddrs, the peer list, ``replicate``)
    is hivemind's own client code talking to that daemon."""

    @classmethod
    async def create_daemon(
        cls,
        *,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
        announce_maddrs: Sequence[str] = (),
        identity_path: Optional[str] = None,
        startup_timeout_s: float = 30.0,
        relay: str = "off",
    ) -> "PyLibp2pP2P":
        """Start the daemon process and connect hivemind's client to it (``relay``: see
        :func:`peerd.transport.libp2p_relay.wants_reservation`). Raises P2PDaemonError if it does not start within
        ``startup_timeout_s`` (its stderr goes to ours)."""
        self = cls()
        uid = secrets.token_urlsafe(8)
        control = f"/tmp/peerd-libp2p-{uid}.sock"
        self._daemon_listen_maddr = Multiaddr(f"/unix{control}")
        self._client_listen_maddr = Multiaddr(cls._UNIX_SOCKET_PREFIX + f"p2pclient-{uid}.sock")
        args = [sys.executable, "-m", "peerd.transport.libp2p_daemon", "--control", control,
                "--host-addrs", ",".join(map(str, host_maddrs)),
                "--announce-addrs", ",".join(map(str, announce_maddrs)),
                "--bootstrap", ",".join(map(str, initial_peers)), "--relay", relay,
                "--log-level", logging.getLevelName(min(logging.getLogger().getEffectiveLevel(), logging.WARNING))]
        if identity_path is not None:
            args += ["--identity", str(identity_path)]
        env = os.environ.copy()
        # the daemon imports this very peerd (e.g. a worktree on PYTHONPATH), not whatever else is installed
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self._child = await asyncio.create_subprocess_exec(  # own session: a Ctrl-C to our group is ours to handle
            *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env, start_new_session=True)
        self._alive = True
        try:
            while True:
                line = await asyncio.wait_for(self._child.stdout.readline(), startup_timeout_s)
                if not line:
                    raise P2PDaemonError(f"the py-libp2p daemon exited with code {await self._child.wait()}")
                if line.decode(errors="replace").strip() == READY_LINE:
                    break
            self._reader_task = asyncio.create_task(self._drain_stdout())
            self._client = await p2pclient.Client.create(
                control_maddr=self._daemon_listen_maddr, listen_maddr=self._client_listen_maddr,
                persistent_conn_max_msg_size=DEFAULT_MAX_MSG_SIZE)
            await self._ping_daemon()
        except asyncio.TimeoutError:
            await self.shutdown()
            raise P2PDaemonError(f"the py-libp2p daemon did not start in {startup_timeout_s:.1f} s") from None
        except BaseException:
            await self.shutdown()
            raise
        return self

    async def _drain_stdout(self) -> None:
        while await self._child.stdout.readline():
            pass

    async def shutdown(self) -> None:
        """Close the client, then the daemon's stdin (it exits cleanly), SIGTERM after EXIT_GRACE_S, SIGKILL after
        as long again."""
        child = self._child
        if child is not None and child.returncode is None and child.stdin is not None:
            with contextlib.suppress(asyncio.TimeoutError):  # not gone in time: SIGTERM next
                if self._client is not None:
                    self._client.close()
                child.stdin.close()
                await asyncio.wait_for(child.wait(), EXIT_GRACE_S)
        with contextlib.suppress(asyncio.TimeoutError):  # not gone in time: SIGKILL next
            await asyncio.wait_for(super().shutdown(), EXIT_GRACE_S)
        if child is not None and child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(child.wait(), 5.0)


#: ELF ``e_machine`` of the architectures p2pd may be built for, by ``platform.machine()``.
_ELF_MACHINES = {"x86_64": 0x3E, "amd64": 0x3E, "aarch64": 0xB7, "arm64": 0xB7, "i686": 0x03, "i386": 0x03}


def p2pd_problem() -> Optional[str]:
    """None if hivemind's bundled ``p2pd`` binary can run on this machine, else why not (one line).

    Checked without running it (p2pd takes seconds of CPU to start, even for ``-help``): the file exists, is
    executable, and is an ELF executable for this OS and architecture. ``PEERD_P2PD_BINARY`` overrides the path
    (packagers; tests that make p2pd unavailable)."""
    import platform

    binary = os.environ.get("PEERD_P2PD_BINARY")
    if binary is None:
        spec = importlib.util.find_spec("hivemind")
        if spec is None or not spec.submodule_search_locations:
            return "hivemind is not installed"
        binary = os.path.join(spec.submodule_search_locations[0], "hivemind_cli", "p2pd")
    if not os.path.isfile(binary):
        return f"no p2pd binary at {binary}"
    if not os.access(binary, os.X_OK):
        return f"{binary} is not executable"
    try:
        with open(binary, "rb") as f:
            head = f.read(20)
    except OSError as e:
        return f"cannot read {binary}: {e}"
    system, machine = platform.system(), platform.machine().lower()
    want = _ELF_MACHINES.get(machine)
    if system != "Linux" or head[:4] != b"\x7fELF" or want is None or int.from_bytes(head[18:20], "little") != want:
        return f"{binary} is not an executable for {system}/{machine}"
    return None


def choose_backend(transport: str) -> tuple[str, str]:
    """``(backend, why)`` for the node config's ``transport``: ``p2pd`` and ``libp2p`` as given; ``auto`` = p2pd
    where its binary runs, else py-libp2p. Raises ConnectionError if ``auto`` finds neither usable."""
    if transport != "auto":
        return transport, f"transport = {transport}"
    problem = p2pd_problem()
    if problem is None:
        return "p2pd", "transport = auto: the p2pd binary runs here"
    missing = libp2p_available()
    if missing is not None:
        raise ConnectionError(f"no transport: {problem}, and {missing}")
    return "libp2p", f"transport = auto: {problem}; using py-libp2p"


class LibP2PTransport(HivemindTransport):
    """:class:`peerd.transport.hivemind_backend.HivemindTransport` (same discovery, streams, ``visible_maddrs``)
    whose P2P runs on py-libp2p. Create with :meth:`create`, release with :meth:`shutdown`."""

    @classmethod
    async def create(
        cls,
        *,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
        announce_maddrs: Sequence[str] = (),
        identity_path: Optional[str] = None,
        nat_port_map: bool = False,
        client_mode: bool = False,
        startup_timeout_s: float = 30.0,
        record_validators: Sequence[Any] = (),
        relay: str = "off",
        dht: str = "process",
    ) -> "LibP2PTransport":
        """Start the py-libp2p daemon, then a DHT node on it (child process). ``relay`` (off | auto | always): reserve
        circuit relay slots on the initial peers (:mod:`peerd.transport.libp2p_relay`; ``auto`` = when no listen
        address is public; never for a ``client_mode`` node). ``nat_port_map`` and ``dht`` are accepted for symmetry
        and ignored: py-libp2p's UPnP stays off. Raises ConnectionError if the daemon or the DHT node cannot start
        or none of ``initial_peers`` answers."""
        problem = libp2p_available()
        if problem is not None:
            raise ConnectionError(f"the libp2p transport is unavailable: {problem}")
        try:
            p2p = await PyLibp2pP2P.create_daemon(initial_peers=initial_peers, host_maddrs=host_maddrs,
                                                  announce_maddrs=announce_maddrs, identity_path=identity_path,
                                                  startup_timeout_s=startup_timeout_s,
                                                  relay="off" if client_mode else relay)
        except P2PD_ERRORS as e:
            raise ConnectionError(f"could not start the py-libp2p daemon: {e}") from e
        try:
            dht = await start_dht_process(initial_peers=list(initial_peers), p2p=p2p, client_mode=client_mode,
                                          record_validators=list(record_validators))
        except BaseException as e:
            await p2p.shutdown()
            if isinstance(e, Exception):
                raise dht_start_error(e, initial_peers) from e
            raise
        return cls(dht, HivemindDiscovery(dht), HivemindStreams(p2p))

    async def shutdown(self) -> None:
        """The DHT process first (it talks through our daemon), then the daemon."""
        try:
            await stop_dht_process(self.dht)
            await self.streams.p2p.shutdown()
        finally:
            for callback in self.on_shutdown:
                callback()
            self.on_shutdown.clear()
