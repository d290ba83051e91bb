"""Several accelerators of one machine as one peer: local data parallelism inside each inner step.

A volunteer with N GPUs runs one daemon: one PeerID, one status record, one pseudo-gradient per outer round. Its
inner steps are data-parallel across the N devices (PyTorch DistributedDataParallel, Li et al. 2020, "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB): rank 0 is the daemon's own process and
model (the one the outer sync, checkpoints and evaluation see); ranks 1..N-1 are helper processes started by the
daemon, each holding a replica on its device.

Every inner step rank 0 sends the step's learning rate down a pipe to each helper and broadcasts the step's whole
batch (B, T); rank r trains on rows [r B/N, (r+1) B/N) (in micro-batches if the node asks for them) and DDP averages
the gradients, so every replica takes the same optimizer step as one process on the whole batch (equal up to float
summation order). Whenever rank 0's parameters changed outside an inner step (an outer round, a state download, a
checkpoint resume: every in-place write bumps a parameter's version counter) or its optimizer is new, the next step
first broadcasts rank 0's parameters, optimizer state and loss scale, so the replicas never drift from the daemon's
model. The devices of one peer are all CUDA GPUs (NCCL) or all CPUs (gloo: the CPU-only test path).

Helpers exit when rank 0 closes the group, or when their command pipe breaks (the daemon died).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import logging
import multiprocessing
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from peerd.config import local_devices_problem
from peerd.worker.inner_step import InnerStep, Precision, enable_tf32, make_optimizer, micro_batch_count

logger = logging.getLogger(__name__)

# Commands rank 0 sends to each helper before the collectives they announce.
_STEP, _DIGEST, _STOP = "step", "digest", "stop"
#: Longest a collective may wait for the other ranks; helpers wait for commands on their pipe (no time limit), so
#: this bounds one step's exchanges only.
COLLECTIVE_TIMEOUT_S = 600.0


class LocalDevicesError(ValueError):
    """The node's ``local_devices`` cannot be used on this machine or with this run (the message says why)."""


def check_local_devices(devices: Sequence[str]) -> tuple[str, ...]:
    """Validate the node option ``local_devices`` without touching any device
    (:func:`peerd.config.local_devices_problem`); returns it as a tuple. Raises :class:`LocalDevicesError`."""
    problem = local_devices_problem(devices)
    if problem:
        raise LocalDevicesError(f"local_devices: {problem}")
    return tuple(devices)


def check_devices_present(devices: Sequence[str]) -> None:
    """Raise :class:`LocalDevicesError` if a ``cuda:N`` of ``devices`` does not exist on this machine."""
    gpus = [int(d[5:]) for d in devices if d.startswith("cuda:")]
    if not gpus:
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [f"cuda:{i}" for i in gpus if i >= count]
    if missing:
        raise LocalDevicesError(f"local_devices: {', '.join(missing)} not present (this machine has {count} GPU(s))")


def slice_size(batch_size: int, world: int, micro_batch_size: int = 0) -> int:
    """Sequences per device per inner step: ``batch_size / world``.

    Raises :class:`LocalDevicesError` unless ``world`` divides the run's ``batch_size`` and ``micro_batch_size``
    (0 = the whole slice) divides the slice (unequal slices would weight sequences unequally)."""
    if batch_size % world:
        raise LocalDevicesError(f"the run's batch_size ({batch_size}) must be a multiple of the {world} local devices")
    per_device = batch_size // world
    try:
        micro_batch_count(per_device, micro_batch_size)
    except ValueError:
        raise LocalDevicesError(f"micro_batch_size ({micro_batch_size}) must divide each local device's share of the"
                                f" batch ({batch_size} / {world} = {per_device} sequences)") from None
    return per_device


@dataclass(frozen=True)
class ReplicaSpec:
    """What a helper needs to build the same replica and step as rank 0 (picklable: sent to spawned processes)."""

    model: str
    """The run's model preset (:func:`peerd.models.build_model`)."""
    seq_len: int
    seed: int
    vocab_size: int
    hp: Any
    """The run's :class:`protocols.diloco.DiLoCoHyperparams` (the inner AdamW's betas and weight decay)."""
    batch_size: int
    """B, the run's sequences per inner step (all devices together)."""
    micro_batch_size: int = 0
    precision: str = "fp32"
    """A resolved precision name (``fp32``, ``bf16``, ``fp16``), the same on every rank."""
    grad_clip_norm: float = 0.0
    compile: bool = False
    activation_checkpointing: bool = False
    threads: int = 0
    """CPU threads for torch in each helper (0 = torch's default)."""
    gpu_memory_fraction: float = 0.0
    """The node's cap on each GPU's memory for this peer (0 = none), applied by every helper to its own GPU."""
    optimizer: Optional[Callable[[Iterable[nn.Parameter], str], torch.optim.Optimizer]] = None
    """Picklable ``(parameters, device_type) -> optimizer`` of the same kind as rank 0's (a module-level function
    or a ``functools.partial``); None = the run's inner AdamW (:func:`protocols.diloco.make_inner_optimizer`)."""


def _backend(devices: Sequence[str]) -> str:
    return "nccl" if devices[0].startswith("cuda") else "gloo"


def _current(device: torch.device):
    """Make ``device`` the calling thread's current CUDA device (the role's steps run on pool threads, each with its
    own current device, and NCCL's object collectives use it); nothing on a CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _comm_device(device: torch.device) -> torch.device:
    """Where a rank's collective buffers live: its GPU with NCCL, the CPU with gloo."""
    return device if device.type == "cuda" else torch.device("cpu")


def _wrap(model: nn.Module, device: torch.device, compile: bool):
    """(DDP module, forward callable) for ``model`` on ``device``; constructing DDP broadcasts rank 0's
    parameters to every rank (a collective: all ranks construct it together)."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    return ddp, (torch.compile(ddp) if compile else ddp)


def _step_on_slice(inner: InnerStep, x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of the whole batch through ``inner``; returns the whole batch's mean loss (0-d fp32)."""
    n = x.shape[0] // world
    loss = inner(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
    loss = loss.detach().clone()
    dist.all_reduce(loss)  # the ranks' slices are equal in size: the mean of their means is the batch's mean
    return loss / world


def _broadcast_state(model: nn.Module, optimizer: torch.optim.Optimizer, inner: InnerStep,
                     comm: torch.device, rank: int) -> None:
    """Make every rank's parameters, optimizer state and loss scale rank 0's (a collective)."""
    params = list(model.parameters())
    with torch.no_grad():
        for p in params:
            buf = p.detach() if p.device == comm else p.detach().to(comm)
            dist.broadcast(buf, 0)
            if buf is not p:
                p.copy_(buf)
    layout = [None]
    if rank == 0:
        entries = []
        for i, p in enumerate(params):
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value):
                    entries.append((i, key, tuple(value.shape), value.dtype, value.device == p.device, None))
                else:
                    entries.append((i, key, None, None, None, value))
        scaler = inner.scaler.state_dict() if inner.scaler is not None else None
        layout = [(entries, scaler)]
    dist.broadcast_object_list(layout, 0, device=comm)
    entries, scaler = layout[0]
    state: dict = {}
    for i, key, shape, dtype, on_param_device, value in entries:
        p = params[i]
        if shape is None:
            state.setdefault(p, {})[key] = value
            continue
        if rank == 0:
            buf = optimizer.state[p][key].detach().to(comm).contiguous()
        else:
            buf = torch.empty(shape, dtype=dtype, device=comm)
        dist.broadcast(buf, 0)
        if rank:
            state.setdefault(p, {})[key] = buf.to(p.device if on_param_device else torch.device("cpu"))
    if rank:
        optimizer.state.clear()
        optimizer.state.update(state)
        if inner.scaler is not None:
            inner.scaler = torch.amp.GradScaler(inner.precision.device_type)
            if scaler:
                inner.scaler.load_state_dict(scaler)


def parameter_digest(model: nn.Module) -> str:
    """SHA-256 (hex) over ``model``'s parameters' bytes in order: equal digests = bit-identical replicas."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class LocalDataParallel:
    """Rank 0's side: starts the helpers, wraps the daemon's model in DDP, and makes the inner step of each
    optimizer the daemon builds (:meth:`inner_step`). ``close()`` stops the helpers (always call it)."""

    def __init__(self, model: nn.Module, devices: Sequence[str], spec: ReplicaSpec):
        """
        Args:
            model: the daemon's model, already on ``devices[0]``.
            devices: this peer's devices, rank order (:func:`check_local_devices`); at least two.
            spec: how the helpers build the same replica and step.

        Raises:
            LocalDevicesError: invalid or absent devices, or a batch the devices cannot share equally.
        """
        self.devices = check_local_devices(devices)
        if len(self.devices) < 2:
            raise LocalDevicesError("local data parallelism needs at least two local_devices")
        check_devices_present(self.devices)
        self.world = len(self.devices)
        self.per_device = slice_size(spec.batch_size, self.world, spec.micro_batch_size)
        self.model = model
        self.spec = spec
        self.device = torch.device(self.devices[0])
        self.comm = _comm_device(self.device)
        self._dir = tempfile.mkdtemp(prefix="peerd-local-dp-")
        self._store = os.path.join(self._dir, "store")  # a FileStore: rendezvous without opening a port
        ctx = multiprocessing.get_context("spawn")
        self._pipes = []
        self._helpers = []
        for rank in range(1, self.world):
            ours, theirs = ctx.Pipe()
            helper = ctx.Process(target=_helper_main, args=(rank, self.devices, self._store, spec, theirs),
                                 name=f"peerd-local-dp-{rank}", daemon=True)
            helper.start()
            theirs.close()
            self._pipes.append(ours)
            self._helpers.append(helper)
        self._started = False
        self._closed = False
        self.forward = None

    def _start(self) -> None:
        """Join the process group and wrap the model (blocks until every helper has started: seconds)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(_backend(self.devices), init_method=f"file://{self._store}", rank=0,
                                world_size=self.world, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        self._started = True
        self.ddp, self.forward = _wrap(self.model, self.device, self.spec.compile)

    def inner_step(self, optimizer: torch.optim.Optimizer, precision: Optional[Precision] = None
                   ) -> "DataParallelStep":
        """The inner step of ``optimizer`` (over ``model``'s parameters) across the local devices; the first call
        of each new step re-sends rank 0's state to the helpers."""
        return DataParallelStep(self, optimizer, precision)

    def _send(self, command: tuple) -> None:
        """Send ``command`` to every helper. Raises RuntimeError naming a helper that has exited (its own error,
        e.g. out of memory on its GPU, is in this daemon's stderr), so the step fails instead of waiting for it."""
        for rank, (pipe, helper) in enumerate(zip(self._pipes, self._helpers), start=1):
            if helper.exitcode is not None:
                raise RuntimeError(f"the local-device helper for {self.devices[rank]} exited (code {helper.exitcode})")
            pipe.send(command)

    def replica_digests(self) -> list[str]:
        """Every rank's :func:`parameter_digest`, rank order (a health check: all equal after any step)."""
        with _current(self.device):
            if not self._started:
                self._start()
            self._send((_DIGEST,))
            digests: list = [None] * self.world
            dist.all_gather_object(digests, parameter_digest(self.model))
            return digests

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the helpers and leave the process group; idempotent."""
        if self._closed:
            return
        self._closed = True
        for pipe in self._pipes:
            with contextlib.suppress(OSError, ValueError):  # a helper that already exited
                pipe.send((_STOP,))
        for helper in self._helpers:
            helper.join(timeout_s)
            if helper.is_alive():
                helper.terminate()
                helper.join(5)
        for pipe in self._pipes:
            pipe.close()
        if self._started:
            with contextlib.suppress(RuntimeError, ValueError):  # the backend's own error; ValueError: no group
                dist.destroy_process_group()
        shutil.rmtree(self._dir, ignore_errors=True)


class DataParallelStep:
    """Callable like :class:`peerd.worker.inner_step.InnerStep` (``step(x, y) -> loss``) with the batch shared by the
    local devices; the caller sets the learning rate on ``optimizer`` before each call, as for ``InnerStep``."""

    def __init__(self, dp: LocalDataParallel, optimizer: torch.optim.Optimizer, precision: Optional[Precision]):
        self.dp = dp
        self.optimizer = optimizer
        self.precision = precision if precision is not None else Precision(dp.spec.precision, dp.device.type)
        self._inner: Optional[InnerStep] = None
        self._versions: Optional[tuple[int, ...]] = None  # parameter versions after our last step; None = resend

    @property
    def accumulation(self) -> int:
        return micro_batch_count(self.dp.per_device, self.dp.spec.micro_batch_size)

    def _versions_now(self) -> tuple[int, ...]:
        return tuple(p._version for p in self.dp.model.parameters())

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One inner step on the whole batch ``x``, ``y`` (int64 (B, T) on rank 0's device); returns the batch's
        mean loss (nats/token, 0-d fp32 on the device, not synchronised with the host)."""
        dp = self.dp
        if x.shape[0] != dp.spec.batch_size:
            raise ValueError(f"expected a batch of {dp.spec.batch_size} sequences, got {x.shape[0]}")
        with _current(dp.device):
            return self._step(x, y)

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        dp = self.dp
        if not dp._started:
            dp._start()
        if self._inner is None:
            self._inner = InnerStep(dp.model, self.optimizer, batch_size=dp.per_device,
                                    micro_batch_size=dp.spec.micro_batch_size, precision=self.precision,
                                    grad_clip_norm=dp.spec.grad_clip_norm, forward=dp.forward,
                                    no_sync=dp.ddp.no_sync)
        resend = self._versions is None or self._versions != self._versions_now()
        dp._send((_STEP, float(self.optimizer.param_groups[0]["lr"]), resend))
        if resend:
            _broadcast_state(dp.model, self.optimizer, self._inner, dp.comm, 0)
        xy = torch.stack((x, y)).to(dp.comm)  # (2, B, T): one broadcast for inputs and targets
        dist.broadcast(xy, 0)
        loss = _step_on_slice(self._inner, xy[0].to(dp.device), xy[1].to(dp.device), 0, dp.world)
        self._versions = self._versions_now()
        return loss


def _helper_main(rank: int, devices: Sequence[str], store: str, spec: ReplicaSpec, pipe) -> None:
    """A helper process: build the replica, then follow rank 0's commands until told to stop or the pipe breaks."""
    from peerd.models import build_model
    from protocols.diloco import make_inner_optimizer, set_lr

    if spec.threads:
        torch.set_num_threads(spec.threads)
    device = torch.device(devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if spec.gpu_memory_fraction:
            torch.cuda.set_per_process_memory_fraction(spec.gpu_memory_fraction, device)
    enable_tf32(device)
    comm = _comm_device(device)
    world = len(devices)
    dist.init_process_group(_backend(devices), init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        model = build_model(spec.model, spec.seq_len, spec.seed, spec.vocab_size).to(device)
        if spec.activation_checkpointing and hasattr(model, "activation_checkpointing"):
            model.activation_checkpointing = True
        ddp, forward = _wrap(model, device, spec.compile)
        if spec.optimizer is not None:
            optimizer = spec.optimizer(model.parameters(), device.type)
        else:
            optimizer = make_inner_optimizer(model.parameters(), spec.hp, device.type)
        per_device = spec.batch_size // world
        inner = InnerStep(model, optimizer, batch_size=per_device, micro_batch_size=spec.micro_batch_size,
                          precision=Precision(spec.precision, device.type), grad_clip_norm=spec.grad_clip_norm,
                          forward=forward, no_sync=ddp.no_sync)
        xy = torch.empty((2, spec.batch_size, spec.seq_len), dtype=torch.int64, device=comm)
        while True:
            try:
                command = pipe.recv()
            except (EOFError, OSError):
                return  # rank 0 is gone
            if command[0] == _STOP:
                return
            if command[0] == _DIGEST:
                dist.all_gather_object([None] * world, parameter_digest(model))
                continue
            _, lr, resend = command
            if resend:
                _broadcast_state(model, optimizer, inner, comm, rank)
            set_lr(optimizer, lr)
            dist.broadcast(xy, 0)
            _step_on_slice(inner, xy[0].to(device), xy[1].to(device), rank, world)
    finally:
        with contextlib.suppress(RuntimeError, ValueError):  # the backend's own error; ValueError: never joined
            dist.destroy_process_group()


def replica_spec(run, node, vocab_size: int, precision: Precision) -> ReplicaSpec:
    """The :class:`ReplicaSpec` of a run config and a node config (``precision`` already resolved)."""
    return ReplicaSpec(model=run.model, seq_len=run.seq_len, seed=run.seed, vocab_size=vocab_size, hp=run.diloco,
                       batch_size=run.batch_size, micro_batch_size=node.micro_batch_size, precision=precision.name,
                       grad_clip_norm=run.diloco.grad_clip_norm, compile=node.compile,
                       activation_checkpointing=bool(node.activation_checkpointing), threads=node.threads,
                       gpu_memory_fraction=node.gpu_memory_fraction,
                       optimizer=(functools.partial(make_optimizer, hp=run.diloco, eight_bit=True)
                                  if node.optimizer_8bit else None))


__all__ = ["COLLECTIVE_TIMEOUT_S", "DataParallelStep", "LocalDataParallel", "LocalDevicesError", "ReplicaSpec",
           "check_devices_present", "check_local_devices", "parameter_digest", "replica_spec", "slice_size"]
