"""Declarative fault injection for tests: a schedule of faults that counts what it fired.

    faults = Faults().kill(at_round=3, phase="allreduce").stall(seconds=30, at_round=2).corrupt(at_round=2)

A peer process gets its schedule from the ``PEERD_FAULTS`` environment variable (``Faults.to_json()``; a daemon also
needs the context hook that applies it: :meth:`Faults.environ` gives both), so a test can make one real peer
misbehave. The schedule reaches a role only through wrappers of its context
(:func:`instrument`): the transport's streams (:class:`FaultyTransport`: kill/stall mid-transfer), the checkpoint
store (:class:`FaultyCheckpointStore`) and each outer-sync strategy (:class:`FaultyOuterSync`: which round is
attempted, kill at matchmaking, fail_round, corrupt). Roles and strategies carry no fault hooks. Every fault that fires is logged as a structured ``fault`` event (and counted in
:attr:`Faults.fired`): a test asserts those counts, so an injection that never fired fails the test instead of
passing vacuously.

Faults (``at_round`` is the outer round being attempted, counting from 1):
- ``kill``: SIGKILL this process when it reaches ``phase`` (``matchmaking`` | ``allreduce`` | ``reduce`` |
  ``checkpoint``) of that round. In ``allreduce`` it dies after writing the first ``after_bytes`` bytes of a part
  (a sender dying mid-transfer); in ``reduce`` it dies as a *reducer*: its own part is sealed (the other members'
  slices of its span have arrived and their mean is computed) and it dies just before the first byte of that mean
  goes back to any member, so every sender is left waiting on a dead reducer; in ``checkpoint`` after writing the
  temporary file and before the rename that would publish it.
- ``stall``: in that round's all-reduce, send the first half of every part, then go silent for ``seconds``.
- ``corrupt``: in that round, send pseudo-gradients multiplied by ``scale`` (e.g. -1000: a sign flip and blow-up)
  or, with ``how="nan"``, full of NaN.
- ``fail_round``: make that round's all-reduce fail locally (the peer must roll back).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import struct
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import msgpack
import torch

logger = logging.getLogger(__name__)

ENV = "PEERD_FAULTS"
#: A stall cuts the first write larger than this (bytes): a part's payload, never its frame header.
STALL_MIN_WRITE_BYTES = 1024
PHASES = ("matchmaking", "allreduce", "reduce", "checkpoint")
_PREFIX = struct.Struct(">II")  # protocols.wire's frame prefix: header length, payload length


@dataclass(frozen=True)
class Fault:
    action: str
    at_round: int
    phase: str = "allreduce"
    seconds: float = 0.0
    how: str = "scale"
    scale: float = -1000.0
    after_bytes: int = 4096


def _sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Faults:
    """An ordered schedule of :class:`Fault` with counters of what fired.

    ``on_kill`` replaces the SIGKILL of a ``kill`` fault (in-process tests: e.g. disconnect the peer from an
    in-process hub); when it returns, the code that reached the fault gets ``ConnectionResetError``. A kill fires
    at most once.
    """

    def __init__(self, faults: tuple[Fault, ...] = (), on_kill: Optional[Callable[[], None]] = None):
        self.faults = list(faults)
        self.fired: Counter[str] = Counter()
        self.round = 0
        self.on_kill = on_kill or _sigkill
        self._spent: set[int] = set()  # indices of kill faults that fired
        self._reduce_senders: Counter[int] = Counter()  # round -> parts that reached our reducer (phase "reduce")

    # -------------------------------------------------------------------------------------------- building the schedule

    def _add(self, fault: Fault) -> "Faults":
        if fault.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {fault.phase!r}")
        if fault.at_round < 1:
            raise ValueError(f"at_round counts from 1, got {fault.at_round}")
        self.faults.append(fault)
        return self

    def kill(self, at_round: int, phase: str = "allreduce", after_bytes: int = 4096) -> "Faults":
        return self._add(Fault("kill", at_round, phase, after_bytes=after_bytes))

    def stall(self, seconds: float, at_round: int) -> "Faults":
        return self._add(Fault("stall", at_round, seconds=seconds))

    def corrupt(self, at_round: int, how: str = "scale", scale: float = -1000.0) -> "Faults":
        if how not in ("scale", "nan"):
            raise ValueError(f"how must be 'scale' or 'nan', got {how!r}")
        return self._add(Fault("corrupt", at_round, how=how, scale=scale))

    def fail_round(self, at_round: int) -> "Faults":
        return self._add(Fault("fail_round", at_round))

    def to_json(self) -> str:
        return json.dumps([asdict(f) for f in self.faults])

    @classmethod
    def from_json(cls, text: str) -> "Faults":
        try:
            return cls(tuple(Fault(**item) for item in json.loads(text)))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{ENV} is not a valid fault schedule: {e}") from None

    def environ(self) -> dict[str, str]:
        """Environment variables that make a ``peerd join`` process follow this schedule: the schedule
        (:data:`ENV`) and the hook that applies it to the role's context (:data:`peerd.roles.base.CONTEXT_HOOK_ENV`)."""
        from peerd.roles.base import CONTEXT_HOOK_ENV

        return {ENV: self.to_json(), CONTEXT_HOOK_ENV: f"{__name__}:{instrument_from_env.__name__}"}

    @classmethod
    def from_env(cls) -> Optional["Faults"]:
        text = os.environ.get(ENV)
        return cls.from_json(text) if text else None

    # ------------------------------------------------------------------------------------------------------- firing

    def _due(self, action: str, phase: Optional[str] = None) -> Optional[Fault]:
        for i, fault in enumerate(self.faults):
            if i in self._spent:
                continue
            if fault.action == action and fault.at_round == self.round and (phase is None or fault.phase == phase):
                return fault
        return None

    def _fire(self, fault: Fault, **details) -> None:
        self.fired[fault.action] += 1
        logger.warning("injecting fault %s in round %d", fault.action, self.round,
                       extra={"event": "fault", "action": fault.action, "outer_round": self.round,
                              "phase": fault.phase, **details})
        for handler in logging.getLogger().handlers:
            handler.flush()

    def _die(self, fault: Fault, **details) -> None:
        self._spent.update(i for i, f in enumerate(self.faults) if f is fault)
        self._fire(fault, **details)
        self.on_kill()
        raise ConnectionResetError(f"killed by fault injection ({fault.phase}, round {self.round})")

    def at_phase(self, phase: str) -> None:
        """Called (by a wrapper) when the peer enters ``phase`` of the current round."""
        fault = self._due("kill", phase)
        if fault is not None and phase not in ("allreduce", "reduce"):
            self._die(fault)

    def fail_now(self) -> bool:
        fault = self._due("fail_round")
        if fault is not None:
            self._fire(fault)
            return True
        return False

    def transform_pseudo_gradient(self, tensor: torch.Tensor) -> torch.Tensor:
        fault = self._due("corrupt")
        if fault is None:
            return tensor
        self._fire(fault, how=fault.how)
        if fault.how == "nan":
            return torch.full_like(tensor, float("nan"))
        return tensor * fault.scale

    def wrap_writer(self, writer, handler_name: str):
        """Wrap a stream writer so this round's kill/stall faults act on all-reduce parts we send."""
        if not handler_name.endswith(".reduce"):
            return writer
        kill, stall = self._due("kill", "allreduce"), self._due("stall")
        if kill is None and stall is None:
            return writer
        return _FaultyWriter(writer, self, kill, stall)

    def wrap_handler(self, handler, handler_name: str):
        """Wrap a stream handler so this round's ``reduce`` kill acts on the answers our reducer sends back."""
        if not handler_name.endswith(".reduce"):
            return handler

        async def serve(peer, reader, writer):
            fault = self._due("kill", "reduce")
            if fault is None:
                return await handler(peer, reader, writer)
            self._reduce_senders[self.round] += 1
            return await handler(peer, reader, _KillBeforeAnswerWriter(writer, self, fault))

        return serve


class _FaultyWriter:
    """Passes bytes through until the fault's byte budget is spent, then dies or goes silent."""

    def __init__(self, inner, faults: Faults, kill: Optional[Fault], stall: Optional[Fault]):
        self.inner, self.faults, self.kill, self.stall = inner, faults, kill, stall
        self.written = 0
        self.budget = kill.after_bytes if kill is not None else None
        self.stalled = False

    def write(self, data) -> None:
        data = bytes(data)
        if self.kill is not None and self.written + len(data) >= self.budget:
            self.inner.write(data[: max(0, self.budget - self.written)])
            self.faults._die(self.kill, bytes_sent=self.budget)
        # the frame's prefix and msgpack header go out whole (< 1 KiB); the payload is cut in half
        if self.stall is not None and len(data) > STALL_MIN_WRITE_BYTES and not self.stalled:
            self.inner.write(data[: len(data) // 2])
            self.stalled = True
            self.written += len(data) // 2
            return
        if not self.stalled:
            self.inner.write(data)
            self.written += len(data)

    async def drain(self) -> None:
        if self.stalled:
            self.faults._fire(self.stall, seconds=self.stall.seconds)
            await asyncio.sleep(self.stall.seconds)
        await self.inner.drain()

    def close(self) -> None:
        self.inner.close()


class _KillBeforeAnswerWriter:
    """A reducer's side of one member's stream: holds each frame until its header is complete; a frame with
    ``status == "ok"`` is the reducer's averaged part, and the process dies before any byte of it is written.
    Refusals and other frames pass through unchanged."""

    def __init__(self, inner, faults: Faults, fault: Fault):
        self.inner, self.faults, self.fault = inner, faults, fault
        self.held = b""  # the start of a frame whose header is not complete yet
        self.passing = 0  # bytes of the current (inspected) frame still to pass through

    def write(self, data) -> None:
        data = bytes(data)
        while data:
            if self.passing:
                chunk, data = data[: self.passing], data[self.passing:]
                self.inner.write(chunk)
                self.passing -= len(chunk)
                continue
            self.held += data
            data = b""
            if len(self.held) < _PREFIX.size:
                return
            header_length, payload_length = _PREFIX.unpack_from(self.held)
            if len(self.held) < _PREFIX.size + header_length:
                return
            try:
                header = msgpack.unpackb(self.held[_PREFIX.size:_PREFIX.size + header_length], raw=False)
            except (ValueError, TypeError, msgpack.UnpackException):  # not our frame format: nothing to decide on
                header = None
            if (isinstance(header, dict) and header.get("status") == "ok"
                    and self.faults._due("kill", "reduce") is not None):
                self.faults._die(self.fault, senders=self.faults._reduce_senders[self.faults.round],
                                 answer_bytes=payload_length)
            self.passing = _PREFIX.size + header_length + payload_length
            data, self.held = self.held, b""

    async def drain(self) -> None:
        await self.inner.drain()

    def close(self) -> None:
        self.inner.close()


class FaultyStreams:
    """Wraps :class:`protocols.interfaces.PeerStreams` so writes of opened streams pass through the schedule."""

    def __init__(self, inner, faults: Faults):
        self.inner = inner
        self.faults = faults

    @property
    def peer_id(self) -> str:
        return self.inner.peer_id

    async def add_handler(self, name, handler) -> None:
        await self.inner.add_handler(name, self.faults.wrap_handler(handler, name))

    async def remove_handler(self, name) -> None:
        await self.inner.remove_handler(name)

    async def open(self, peer_id: str, name: str):
        reader, writer = await self.inner.open(peer_id, name)
        return reader, self.faults.wrap_writer(writer, name)


@dataclass
class FaultyTransport:
    """A transport whose streams inject the faults of ``faults``; discovery is passed through."""

    discovery: object
    streams: FaultyStreams

    @classmethod
    def wrap(cls, transport, faults: Faults) -> "FaultyTransport":
        return cls(transport.discovery, FaultyStreams(transport.streams, faults))


# --------------------------------------------------------------------------------------------- role-level wrappers


class FaultyMatchmaker:
    """A matchmaker whose ``form_group`` first passes the ``matchmaking`` phase of the schedule (a kill there)."""

    def __init__(self, inner, faults: Faults):
        self.inner, self.faults = inner, faults

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def form_group(self, *args, **kwargs):
        self.faults.at_phase("matchmaking")
        return await self.inner.form_group(*args, **kwargs)


class FaultyAllReduce:
    """An all-reduce whose ``run`` fails the round (``fail_round``) or corrupts the pseudo-gradient (``corrupt``)
    as the schedule says, before the real exchange."""

    def __init__(self, inner, faults: Faults):
        self.inner, self.faults = inner, faults

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def run(self, group, tensor, weight, out=None):
        from protocols.allreduce import AllReduceFailed

        if self.faults.fail_now():
            raise AllReduceFailed("injected failure")
        return await self.inner.run(group, self.faults.transform_pseudo_gradient(tensor), weight, out)


class FaultyOuterSync:
    """Wraps an outer-sync strategy (:mod:`peerd.roles.outer_sync`): tells the schedule which round is attempted
    and routes the strategy's matchmaking and all-reduce through :class:`FaultyMatchmaker`/:class:`FaultyAllReduce`."""

    def __init__(self, inner, faults: Faults):
        self.inner, self.faults = inner, faults
        for name, wrapper in (("matchmaker", FaultyMatchmaker), ("allreduce", FaultyAllReduce)):
            if hasattr(inner, name):
                setattr(inner, name, wrapper(getattr(inner, name), faults))

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def round(self, local, weight, live, syncing, owned=False, digest=True, retake_local=None):
        self.faults.round = self.inner.state.outer.outer_round + 1
        return await self.inner.round(local, weight, live, syncing, owned, digest, retake_local)

    async def exchange(self, pseudo_gradient, weight, live, syncing, also_expect=()):
        # the delayed overlap calls exchange() directly (the outer step is applied a round later)
        self.faults.round = self.inner.state.outer.outer_round + 1
        return await self.inner.exchange(pseudo_gradient, weight, live, syncing, also_expect)


class FaultyCheckpointStore:
    """A checkpoint store that passes the ``checkpoint`` phase between the durable temporary file and its rename."""

    def __init__(self, inner, faults: Faults):
        self.inner, self.faults = inner, faults

    @property
    def path(self):
        return self.inner.path

    def load(self):
        return self.inner.load()

    def save(self, checkpoint, before_rename=None) -> None:
        def hook() -> None:
            self.faults.at_phase("checkpoint")
            if before_rename is not None:
                before_rename()

        self.inner.save(checkpoint, before_rename=hook)


def instrument(ctx, faults: Optional[Faults]):
    """``ctx`` (a :class:`peerd.roles.base.RunContext`) with ``faults`` injected through its transport, checkpoint
    store and outer-sync strategies; ``ctx`` itself if ``faults`` is None."""
    if faults is None:
        return ctx
    import dataclasses

    return dataclasses.replace(
        ctx, transport=FaultyTransport.wrap(ctx.transport, faults),
        checkpoints=FaultyCheckpointStore(ctx.checkpoints, faults),
        wrap_sync=lambda sync: FaultyOuterSync(ctx.wrap_sync(sync), faults),
    )


def instrument_from_env(ctx):
    """:func:`instrument` with the schedule of ``PEERD_FAULTS`` (a test makes one real peer misbehave)."""
    return instrument(ctx, Faults.from_env())
