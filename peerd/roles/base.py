"""What every role gets and must provide.

A role is one way of taking part in a run (DiLoCo worker today; SWARM stage server/trainer, SkipPipe, SPES expert
worker next). The daemon builds one :class:`RunContext` (transport already admitted and paced, the run's namespace
and config, stop event, pause gate, bans, status board, checkpoint store, event bus, device) and awaits
``ROLES[run.parallelism](ctx).run(ctx)``. A role returns when ``ctx.stop`` is set or its work is done; it publishes
what happens as typed events (:mod:`peerd.events`), never by special log lines.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol

import torch

from peerd.worker.checkpoint_file import Checkpoint, checkpoint_path, load_checkpoint, save_checkpoint
from peerd.config import NodeConfig
from peerd.data.corpus import ByteTokenizer, DataError, load_corpus, tokenize_corpus
from peerd.events import Banned, EventBus
from peerd.identity.namespace import RunNamespace, RunRef, as_run_ref
from peerd.runtime.processes import reap
from peerd.service.pause import PauseGate
from peerd.roles.registry import ROLES, resolve
from peerd.roles.status_board import StatusBoard
from peerd.run_config import RunConfig
from peerd.data.corpus_store import corpus_cache_dir
from protocols.bans import BanList
from protocols.interfaces import Transport

logger = logging.getLogger(__name__)



class Role(Protocol):
    """A role: ``name`` (its status role) and ``run``, which returns when ``ctx.stop`` is set or the work is done,
    after a last checkpoint."""

    name: str

    async def run(self, ctx: "RunContext") -> None: ...


def parallelism(run: RunConfig) -> str:
    """The run's role name (``diloco`` for configs that predate the field)."""
    return getattr(run, "parallelism", "diloco")


def role_class(name: str) -> Callable[["RunContext"], Role]:
    """The role class registered as ``name``. Raises KeyError naming the known roles."""
    return resolve(ROLES, name, "parallelism")


#: Environment variable naming a ``module:function`` that wraps the run's :class:`RunContext` before the role gets it
#: (``function(ctx) -> RunContext``). Unset in production; the test harness injects faults through it
#: (:meth:`peerd.testing.faults.Faults.environ`), so no production module imports ``peerd.testing``.
CONTEXT_HOOK_ENV = "PEERD_CONTEXT_HOOK"


def wrap_context(ctx: "RunContext", environ: Mapping[str, str] = os.environ) -> "RunContext":
    """``ctx`` passed through the hook that ``environ[CONTEXT_HOOK_ENV]`` names (imported now), or ``ctx`` itself
    when it is unset. Raises ValueError for a value that is no ``module:function``, ImportError or AttributeError
    for one that names nothing."""
    target = environ.get(CONTEXT_HOOK_ENV)
    if not target:
        return ctx
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise ValueError(f"{CONTEXT_HOOK_ENV} must name module:function, got {target!r}")
    return getattr(importlib.import_module(module), attr)(ctx)


def pick_device(device: str) -> torch.device:
    """The device the name ``device`` means here (:func:`peerd.hardware.devices.resolve_device`: ``auto`` -> a CUDA or ROCm
    GPU, else MPS, else the CPU). Raises :class:`peerd.hardware.devices.DeviceUnavailable` (a RuntimeError) in one line if
    it is not there."""
    from peerd.hardware.devices import resolve_device

    return resolve_device(device)


class CheckpointStore:
    """The role's checkpoint file (one per run in the node's checkpoint dir). A failed write is logged, not raised:
    the role keeps training and the next checkpoint may succeed."""

    def __init__(self, path):
        self.path = path

    def load(self) -> Optional[Checkpoint]:
        return load_checkpoint(self.path)

    def save(self, checkpoint: Checkpoint, before_rename: Optional[Callable[[], None]] = None) -> None:
        try:
            save_checkpoint(self.path, checkpoint, before_rename=before_rename)
        except OSError as e:
            logger.error("could not write checkpoint %s: %s", self.path, e)


@dataclass
class RunContext:
    """Everything a role needs from the daemon. ``wrap_sync`` decorates each outer-sync strategy the role builds
    (identity in production; :mod:`peerd.testing.faults` injects faults through it); ``wrap_inner_step`` the DiLoCo
    worker's inner step (identity in production; :mod:`peerd.testing.emulated_device` puts an emulated accelerator's
    step in its place)."""

    run_id: str
    namespace: RunNamespace
    run: RunConfig
    node: NodeConfig
    transport: Transport
    stop: asyncio.Event
    gate: PauseGate
    bans: BanList
    status: StatusBoard
    checkpoints: CheckpointStore
    events: EventBus
    device: torch.device
    wrap_sync: Callable[[Any], Any] = field(default=lambda sync: sync)
    wrap_inner_step: Callable[[Any], Any] = field(default=lambda step: step)
    tokenizer: Any = ByteTokenizer
    """The run's tokenizer (:mod:`peerd.data.tokenizer`; the daemon resolves it before the role starts): its
    ``vocab_size`` sizes the model, :meth:`training_corpus` encodes the corpus with it."""

    def training_corpus(self):
        """The node's corpus (``--data`` or Shakespeare) in the run's tokens, for ``shakespeare`` and ``local`` runs
        (a role draws its batches through :func:`peerd.roles.batch_sources.open_batch_source`, which calls this); a
        local corpus's bytes and BPE ids are cached per machine in ``<checkpoint_dir>/corpus-cache`` (memory-mapped:
        any size trains). Raises DataError (a ``shards:`` or ``hf:`` run, a local-data run without ``--data``,
        unreadable text)."""
        if self.run.dataset not in ("shakespeare", "local"):  # never train on other text than the run names
            raise DataError(f"run {self.run_id!r} names dataset {self.run.dataset!r}: no whole corpus to load here "
                            "(shards: and hf: runs read their batches through "
                            "peerd.roles.batch_sources.open_batch_source)")
        if self.run.dataset == "local" and not self.node.data:
            raise DataError(f"run {self.run_id!r} trains on local data: pass --data PATH|GLOB")
        cache = corpus_cache_dir(self.node)
        return tokenize_corpus(load_corpus(self.node.data or "shakespeare", cache), self.tokenizer, cache)

    @property
    def peer_id(self) -> str:
        return self.transport.streams.peer_id

    @classmethod
    def build(cls, run_ref: RunRef | str, run: RunConfig, node: NodeConfig, transport: Transport,
              stop: Optional[asyncio.Event] = None, gate: Optional[PauseGate] = None,
              events: Optional[EventBus] = None, instance: Optional[str] = None) -> "RunContext":
        """A context with the run's namespace, bans (published as :class:`peerd.events.Banned`), a status board
        under ``ns.status_key`` and the checkpoint file of the run (by name) in ``node.checkpoint_path``.
        ``run_ref``: ``name`` or ``name@creator`` (only the name matters here)."""
        stop = stop if stop is not None else asyncio.Event()
        events = events if events is not None else EventBus()
        ref = as_run_ref(run_ref)
        run_id = ref.name
        ns = RunNamespace(run=ref)
        ban_s = run.averaging.ban_s
        bans = BanList(ban_s, on_ban=lambda peer, reason: events.publish(Banned(peer, reason, ban_s)))
        status = StatusBoard(transport.discovery, ns.status_key, transport.streams.peer_id, node.status_interval_s,
                             node.status_ttl_s, stop, events, instance)
        return cls(run_id, ns, run, node, transport, stop, gate or PauseGate(), bans, status,
                   CheckpointStore(checkpoint_path(node.checkpoint_path, run_id)), events,
                   pick_device(node.local_devices[0] if node.local_devices else node.device))


async def held_out_loss(model: torch.nn.Module, eval_tokens: Any, run: RunConfig) -> Optional[float]:
    """Held-out loss of ``model`` in nats per byte over the run's ``eval_batches`` batches, computed off the event
    loop (where the model is); None if the run's ``eval_batches`` is 0."""
    if not run.eval_batches:
        return None
    from peerd.data.corpus import evaluate

    result = await asyncio.get_running_loop().run_in_executor(
        None, lambda: evaluate(model, eval_tokens, run.seq_len, run.batch_size, run.eval_batches))
    return result.nats_per_byte


def eval_units(tokenizer: Any, eval_tokens: Any, run: RunConfig) -> dict:
    """The unit fields of :class:`peerd.events.Evaluated` / ``RoundDone`` for this run's held-out loss:
    ``{"eval_unit": "byte"}`` for byte-level runs; for a BPE run ``"token"`` and the bytes per token over exactly
    the targets :func:`held_out_loss` predicts (the first ``eval_batches * batch_size`` windows), which converts
    its nats/token into bits/byte comparable across tokenizers."""
    if not hasattr(tokenizer, "token_bytes"):
        return {"eval_unit": "byte"}
    windows = min((eval_tokens.numel() - 1) // run.seq_len, run.eval_batches * run.batch_size)
    if windows <= 0:
        return {"eval_unit": "token"}
    targets = eval_tokens[1:windows * run.seq_len + 1].long()  # the union of every window's targets
    total = int(tokenizer.token_bytes()[targets].sum())
    return {"eval_unit": "token", "eval_bytes_per_token": round(total / targets.numel(), 6)}


async def unless_stopped(ctx: RunContext, coro, what: str = "matchmaking") -> Any:
    """Run ``coro`` but abandon it (returning None) as soon as a stop or a pause is requested."""
    task = asyncio.ensure_future(coro)
    stopper = asyncio.ensure_future(ctx.stop.wait())
    pauser = asyncio.ensure_future(ctx.gate.wait_paused())
    try:
        await asyncio.wait({task, stopper, pauser}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        pauser.cancel()
    if task.done():
        return task.result()
    await reap(task)
    logger.info("%s requested: abandoned %s", "stop" if ctx.stop.is_set() else "pause", what)
    return None


#: Longest a running all-reduce may delay a requested shutdown, in seconds.
SHUTDOWN_GRACE_S = 15.0


async def bounded_on_stop(ctx: RunContext, coro, grace_s: float = SHUTDOWN_GRACE_S) -> Any:
    """Run ``coro``; if a stop is requested meanwhile, give it at most ``grace_s`` more seconds (then None)."""
    task = asyncio.ensure_future(coro)
    stopper = asyncio.ensure_future(ctx.stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if not task.done():
        done, _ = await asyncio.wait({task}, timeout=grace_s)
        if not done:
            await reap(task)
            logger.info("stop requested: abandoned the running all-reduce")
            return None
    return task.result()
