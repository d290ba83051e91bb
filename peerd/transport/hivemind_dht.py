"""The processes behind hivemind's DHT: the DHT child process tied to this one, or a DHT node inline on a p2pd
this process started, and their bounded stops.

The DHT process and its p2pd die with this process, however it dies (SIGKILL, the OOM killer): an orphan would keep
announcing a dead peer. Nothing runs in a SIGKILLed process, so the DHT process watches its parent itself
(:func:`_die_with_parent`) and takes p2pd, its own child, down with it; an inline p2pd is watched by a tiny shell
process (:func:`_tie_to_this_process`). Signals sent to this process's group (Ctrl-C, ``timeout``) never reach them:
each runs in a session of its own, and this process stops them itself, within a bounded time
(:mod:`peerd.runtime.processes`). Used by :mod:`peerd.transport.hivemind_backend`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from typing import Any, Optional, Sequence

import hivemind
from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator
from hivemind.p2p import P2P, PeerID
from multiaddr import Multiaddr

from peerd.runtime.processes import (
    blocked_stop_signals, in_own_session, leave_terminal_session, stop_processes, tree_of,
)
from peerd.transport.p2pd_errors import P2PD_ERRORS


#: How often the DHT process checks that the daemon that started it is alive, in seconds.
PARENT_POLL_S = 0.25
#: How long p2pd gets to exit on SIGTERM once the daemon is gone, before SIGKILL.
ORPHAN_GRACE_S = 1.0
#: How long the DHT process and its p2pd get to exit after hivemind's shutdown returned, before SIGKILL (hivemind
#: itself waits up to its ``shutdown_timeout``, 3 s, then sends SIGTERM).
DHT_EXIT_GRACE_S = 2.0
#: How long a p2pd this process started gets to exit on SIGTERM, before SIGKILL.
P2PD_EXIT_GRACE_S = 5.0
#: How long the error of a DHT node that failed to start may still take to arrive after its process ended.
DIED_ERROR_GRACE_S = 5.0


def _children_of(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()  # the name in parentheses may contain spaces
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def _descendants_of(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = _children_of(todo.pop())
        out += kids
        todo += kids
    return out


def _die_with_parent(parent_pid: int) -> None:
    """In the DHT process: once ``parent_pid`` is gone (we were reparented), stop p2pd and every other descendant,
    then exit. Runs in a daemon thread; a thread, not ``PR_SET_PDEATHSIG``, because the signal would fire when the
    parent's *thread* that forked us exits (an executor thread), not only when the parent does."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        pids = _descendants_of(os.getpid())
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + ORPHAN_GRACE_S
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") and not _is_zombie(pid)
                                                  for pid in pids):
            time.sleep(0.05)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, name="peerd-parent-watch", daemon=True).start()


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2:].split()[0] == b"Z"


class _TiedDHT(hivemind.DHT):
    """hivemind's DHT process, which exits (with its p2pd) when the process that started it dies.

    ``p2pd_flags``: extra p2pd command-line flags (``{"relayDiscovery": False}``) that hivemind's ``P2P.create``
    has no parameter for; they are added in the DHT process only (:func:`_add_p2pd_flags`)."""

    def __init__(self, *args: Any, p2pd_flags: Optional[dict[str, Any]] = None, **kwargs: Any):
        self._starter_pid = os.getpid()  # set before hivemind.DHT.__init__ forks (start=True)
        self._p2pd_flags = dict(p2pd_flags or {})
        super().__init__(*args, **kwargs)

    def start(self) -> None:
        """Fork the DHT process with the stop signals blocked until it left this process's session."""
        with blocked_stop_signals():
            super().start()

    def run(self) -> None:
        leave_terminal_session()
        _die_with_parent(self._starter_pid)
        if self._p2pd_flags:
            _add_p2pd_flags(self._p2pd_flags)
        super().run()


async def start_dht_process(**kwargs: Any) -> _TiedDHT:
    """A running :class:`_TiedDHT` (``kwargs``: hivemind ``DHT`` keyword arguments), once its node is ready.
    Cancellable (e.g. by Ctrl-C during start-up): then, or if the node fails to start, the DHT process and its
    p2pd are killed before this returns. Raises what the DHT node raised, or ConnectionError if its process died
    before it was ready."""
    dht = _TiedDHT(start=False, **kwargs)  # built here, in the event loop: its ready future can be awaited
    dht.start()
    loop = asyncio.get_running_loop()
    died = loop.create_future()
    loop.add_reader(dht.sentinel, lambda: died.done() or died.set_result(None))

    async def ready() -> None:
        await dht._ready  # hivemind's own start-up future (hivemind is pinned to 1.1.12)

    waiting = asyncio.ensure_future(ready())
    try:
        await asyncio.wait({waiting, died}, return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done():
            # a node that failed to start sends its error, then its process ends (code 0): the error can still be
            # on its way through the pipe when the process is gone, and it says more (and whether to try again)
            await asyncio.wait({waiting}, timeout=DIED_ERROR_GRACE_S)
        if not waiting.done():
            raise ConnectionError(f"the DHT process exited with code {dht.exitcode} before its node was ready")
        waiting.result()
    except BaseException:
        stop_processes(tree_of(dht.pid), grace_s=0.0)
        dht.join(5.0)
        raise
    finally:
        loop.remove_reader(dht.sentinel)
        waiting.cancel()
    return dht


async def stop_dht_process(dht: hivemind.DHT) -> None:
    """Shut the DHT process down (its node stops its p2pd), then SIGKILL whatever of it and its descendants is left
    after :data:`DHT_EXIT_GRACE_S`, and reap it: returns within ~10 s, and nothing of it is left (a DHT process that
    multiprocessing would still see alive would make its exit handler wait for it forever)."""
    loop = asyncio.get_running_loop()
    tree = tree_of(dht.pid) if dht.pid is not None else []

    def stop() -> None:
        with contextlib.suppress(OSError):  # its pipe closed already (the process died, or was shut down before)
            dht.shutdown()  # waits up to hivemind's shutdown_timeout, then SIGTERM
        stop_processes(tree, DHT_EXIT_GRACE_S if dht.is_alive() else 0.0)
        dht.join(5.0)

    await loop.run_in_executor(None, stop)


async def stop_p2pd(p2p: P2P) -> None:
    """hivemind's ``P2P.shutdown`` (SIGTERM to the p2pd it started), bounded: SIGKILL after
    :data:`P2PD_EXIT_GRACE_S`."""
    child = getattr(p2p, "_child", None)
    try:
        await asyncio.wait_for(p2p.shutdown(), P2PD_EXIT_GRACE_S)
    except asyncio.TimeoutError:  # a p2pd that does not stop is killed below
        pass
    if child is not None and child.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(child.wait(), 5.0)


def _add_p2pd_flags(flags: dict[str, Any]) -> None:
    """In the DHT process: every p2pd that hivemind's DHT node starts from now on gets ``flags`` on its command line
    (``-name=value``; booleans as 0/1). hivemind's DHT node builds its p2pd through the ``P2P`` name of its module,
    so that name is pointed at a subclass whose argument builder appends the flags; the parent process (which only
    attaches to the running p2pd) is untouched."""
    import hivemind.dht.node as dht_node

    dht_node.P2P = _p2p_with_flags(dht_node.P2P, flags)


def _p2p_with_flags(base: type[P2P], flags: dict[str, Any], own_session: bool = False) -> type[P2P]:
    """``base`` (hivemind's ``P2P``) whose p2pd command line ends with ``flags`` (``-name=value``); with
    ``own_session``, p2pd runs in a session of its own (:func:`peerd.runtime.processes.in_own_session`)."""
    if not flags and not own_session:
        return base

    class _P2PWithFlags(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def _make_process_args(*args: Any, **kwargs: Any) -> list[str]:
            argv = base._make_process_args(*args, **{**kwargs, **flags})
            return in_own_session(argv) if own_session else argv

    return _P2PWithFlags


async def start_dht_node(p2p: P2P, initial_peers: Sequence[str], startup_timeout_s: float,
                         **node_options: Any) -> DHTNode:
    """A :class:`DHTNode` on ``p2p`` in the running event loop, bootstrapped through ``initial_peers``
    (``node_options``: more ``DHTNode.create`` keyword arguments). hivemind's node pings its initial peers once and
    gives up; a loaded machine answers the ping late, not never (one of 64 workers started together failed there), so
    the ping is repeated every 0.5 s until one answers or ``startup_timeout_s`` (seconds) is spent. Raises
    TimeoutError then, or what ``DHTNode.create`` raises; the caller shuts ``p2p`` down."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + startup_timeout_s
    node = await DHTNode.create(p2p=p2p, initial_peers=list(initial_peers), ensure_bootstrap_success=False,
                                **node_options)
    bootstrap = [PeerID.from_base58(Multiaddr(m)["p2p"]) for m in initial_peers]
    while bootstrap and not node.protocol.routing_table.uid_to_peer_id:
        if loop.time() >= deadline:
            await node.shutdown()
            raise TimeoutError(f"none of the initial peers answered within {startup_timeout_s:g} s")
        await asyncio.gather(*(node.protocol.call_ping(peer) for peer in bootstrap))
        if node.protocol.routing_table.uid_to_peer_id:
            await node.find_nearest_nodes([node.node_id])
        else:
            await asyncio.sleep(0.5)
    return node


def _tie_to_this_process(pid: int) -> subprocess.Popen:
    """A watchdog that stops process ``pid`` (this process's p2pd) once this process is gone, however it died: a
    POSIX shell polling once a second (~1 MB), in a session of its own. Kill it on a clean shutdown."""
    script = ('while kill -0 "$0" 2>/dev/null; do sleep 1; done; '
              'kill -TERM "$1" 2>/dev/null; sleep 1; kill -KILL "$1" 2>/dev/null')
    return subprocess.Popen(["sh", "-c", script, str(os.getpid()), str(pid)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
                            start_new_session=True)  # a Ctrl-C to our group must not end the watch


class InlineDHT:
    """A DHT node in this process's event loop on a p2pd this process started (node config ``dht = "inline"``):
    the part of :class:`hivemind.DHT` that :class:`HivemindTransport` uses (``get_visible_maddrs``, shutdown).
    Same DHT protocol and records as the child-process DHT; peers of both kinds form one DHT."""

    def __init__(self, node: DHTNode, p2p: P2P, maddrs: list[Any], watchdog: Optional[subprocess.Popen]):
        self.node, self.p2p, self._maddrs, self._watchdog = node, p2p, maddrs, watchdog

    @classmethod
    async def create(cls, *, initial_peers: Sequence[str], client_mode: bool, record_validators: Sequence[Any],
                     p2pd_flags: Optional[dict[str, Any]] = None, **p2p_options: Any) -> "InlineDHT":
        """Start p2pd (``p2p_options``: hivemind ``P2P.create`` keyword arguments; ``p2pd_flags``: extra p2pd
        flags) and a DHT node on it. Raises what p2pd or ``DHTNode.create`` raise; nothing is left running then."""
        p2p = await _p2p_with_flags(P2P, dict(p2pd_flags or {}), own_session=True).create(
            initial_peers=list(initial_peers), **p2p_options)
        child = getattr(p2p, "_child", None)
        watchdog = _tie_to_this_process(child.pid) if child is not None else None
        try:
            node = await start_dht_node(p2p, initial_peers, p2p_options.get("startup_timeout", 30.0),
                                        client_mode=client_mode,
                                        record_validator=CompositeValidator(list(record_validators)))
            return cls(node, p2p, await p2p.get_visible_maddrs(), watchdog)
        except BaseException:
            await stop_p2pd(p2p)
            if watchdog is not None:
                watchdog.kill()
                watchdog.wait(5)
            raise

    def get_visible_maddrs(self) -> list[Any]:
        """The multiaddrs (with ``/p2p/<PeerID>``) p2pd announced when it started."""
        return list(self._maddrs)

    async def aclose(self) -> None:
        """Stop the DHT node, then p2pd (idempotent; bounded: p2pd is killed if it does not stop)."""
        with contextlib.suppress(*P2PD_ERRORS):  # its handlers not removed in time: p2pd is stopped next anyway
            await asyncio.wait_for(self.node.shutdown(), P2PD_EXIT_GRACE_S)
        await stop_p2pd(self.p2p)
        if self._watchdog is not None:
            with contextlib.suppress(OSError):
                self._watchdog.kill()
                self._watchdog.wait(5)
            self._watchdog = None
