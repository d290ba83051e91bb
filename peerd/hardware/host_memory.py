"""How much host (CPU) memory a DiLoCo peer needs at its peak, and whether this machine has it.

A 1.1B-parameter model fits a 24 GB card (:mod:`peerd.hardware.memory`), but its outer state, the round's vectors
and the checkpoint's copies live in host memory: tens of GB, more than many volunteers' machines have. The peak is
at the outer round's boundary. Terms for P parameters, fp32 vectors of 4P bytes (counted from the code of the
whole-model all-reduce round, :meth:`peerd.roles.outer_sync.AllReduceSync.round`, and the checkpoint,
:mod:`peerd.worker.checkpointing`):

- **always**: the outer state, theta_outer and the outer momentum, 8P; where the model trains on the CPU, the model
  itself (the inner step's peak, :func:`peerd.hardware.memory.estimate`, host memory being the device's memory);
  where a GPU trains with checkpoints written in the background, the page-locked snapshot of the inner optimizer's
  state kept between checkpoints (8P, or the 8-bit state's size);
- **the round** (the largest fragment's share f of P with Streaming DiLoCo's fragments): theta_local's copy, which
  becomes the pseudo-gradient, then (whole-model rounds with a dense codec) the average and then the new
  theta_outer, 4fP; the averaged pseudo-gradient in a buffer of its own, 4fP, where the round cannot take
  theta_local again after a failed attempt (fragments: the model trains on meanwhile; the delayed overlap) or the
  error feedback of a sparse codec reads the sent vector afterwards; the new momentum 4fP; the butterfly's own part
  in a group of n (4 + b + 4 + b) fP / n with a codec of b bytes a value (the part round-tripped through the codec,
  its encoding, the reducer's sum, the sealed mean), counted for n = 2, the smallest group that averages (a peer
  alone averages nothing: its result is its pseudo-gradient's own buffer, 8fP in all); the delayed overlap holds
  the average in flight a round longer, 4fP more;
- **the checkpoint** after the round: a fresh copy of theta_local, 4P (page-locked, held until the background write
  is done), plus theta_outer and the momentum concatenated across fragments, 8P, when there are several;
- a fixed part for the interpreter with torch and the daemon loaded (:data:`PROCESS_BYTES`; a CUDA context adds
  :data:`CUDA_CONTEXT_BYTES`).

The peak is the fixed part, what is always held, and the larger of the round and the checkpoint. A peer whose
predicted peak exceeds the machine's memory and swap is refused with one line (it would be killed for memory at its
first boundary, or swap for minutes); one above what is available now gets a warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from peerd.hardware.memory import GIB, dense_shape, evaluates_on_a_copy, format_bytes, node_plan, optimizer_bytes
from protocols.codecs import get_codec
from protocols.partition import CHUNK_ALIGN

#: Resident memory of a daemon's process before the model: the interpreter, torch, the daemon's modules (measured
#: ~0.6 GiB on the CPU; the DHT process and p2pd are separate processes, ~0.2 GiB together).
PROCESS_BYTES = 1 * GIB
#: Host memory of a CUDA context and its libraries (cuBLAS, cuDNN) mapped into the process.
CUDA_CONTEXT_BYTES = 2 * GIB


@dataclass(frozen=True)
class HostEstimate:
    """Predicted host memory of a DiLoCo peer, in bytes, by what holds it (module docstring)."""

    process: int
    outer_state: int
    model: int
    """The model's inner step where it trains on the CPU (0 where a GPU trains)."""
    snapshot: int
    """The background checkpoint's page-locked copy of the inner optimizer's state (GPU only)."""
    round: int
    checkpoint: int

    @property
    def peak(self) -> int:
        return self.process + self.outer_state + self.model + self.snapshot + max(self.round, self.checkpoint)

    def describe(self) -> str:
        held = [("outer state", self.outer_state), ("model", self.model), ("checkpoint snapshot", self.snapshot)]
        parts = ", ".join(f"{name} {format_bytes(n)}" for name, n in held if n)
        return (f"{parts}, the round {format_bytes(self.round)}, the checkpoint {format_bytes(self.checkpoint)}, "
                f"the process {format_bytes(self.process)}")


def host_estimate(parameters: int, *, device_type: str, codec: str = "fp16", fragments: int = 1,
                  delayed: bool = False, background_checkpoint: bool = False, optimizer_state: int = 0,
                  inner_step: int = 0, group_size: int = 2) -> HostEstimate:
    """The predicted host memory of a DiLoCo peer of ``parameters`` (P) on ``device_type`` (``cpu``, ``cuda``,
    ``mps``): ``codec`` the all-reduce's compression, ``fragments`` Streaming DiLoCo's F, ``delayed`` the delayed
    overlap, ``background_checkpoint`` checkpoints written by a thread from a page-locked snapshot,
    ``optimizer_state`` the inner optimizer's bytes (its snapshot's size), ``inner_step`` the inner step's peak where
    the model trains on the CPU, ``group_size`` the all-reduce group's n (2 holds the most; 1, a peer averaging
    alone, the least). Raises ``ValueError`` for P, F or n below 1."""
    if min(parameters, fragments, group_size) < 1:
        raise ValueError(f"parameters, fragments and group_size must be >= 1, got {parameters}, {fragments}, "
                         f"{group_size}")
    p, b = parameters, get_codec(codec).encoded_size(CHUNK_ALIGN) / CHUNK_ALIGN  # bytes a value on the wire
    share = -(-p // fragments)  # the largest fragment
    gpu = device_type == "cuda"
    # the average over the pseudo-gradient's buffer: whole-model rounds (theta_local can be taken again after a
    # failed attempt) without the error feedback (it reads the sent vector after the exchange)
    in_place = fragments == 1 and not delayed and not get_codec(codec).sparse
    averaged = (0 if in_place else 4 * share) + int((8 + 2 * b) * share) // group_size if group_size > 1 else 0
    round_bytes = 2 * 4 * share + averaged + (4 * share if delayed else 0)
    checkpoint = 4 * p + (8 * p if fragments > 1 else 0)
    return HostEstimate(
        process=PROCESS_BYTES + (CUDA_CONTEXT_BYTES if gpu else 0), outer_state=8 * p,
        model=0 if device_type != "cpu" else inner_step,
        snapshot=optimizer_state if gpu and background_checkpoint else 0, round=round_bytes, checkpoint=checkpoint)


def host_budget() -> tuple[int, int, int]:
    """(physical memory, swap, available now) of this machine in bytes (``psutil``)."""
    import psutil

    vm, swap = psutil.virtual_memory(), psutil.swap_memory()
    return vm.total, swap.total, vm.available


def fit_host(node: Any, run: Any, device: Any, vocab_size: int,
             budget: Optional[tuple[int, int, int]] = None) -> Optional[tuple[str, bool]]:
    """``(one line to print, whether it is a warning)`` for ``run`` (a :class:`peerd.run_config.RunConfig`) on this
    peer (``node`` a :class:`peerd.config.NodeConfig` already fitted by :func:`peerd.hardware.memory.fit_node`,
    training on ``device``), or None where there is no prediction (another parallelism than DiLoCo, a
    mixture-of-experts model). ``budget``: ``(physical, swap, available)`` in bytes instead of asking the machine.
    A warning is a peak above what is available now; the line then says what to do.

    Raises :class:`peerd.config.ConfigError` with one line when the peak exceeds physical memory and swap, unless
    ``node.host_memory_check`` is ``"warn"`` (then that is a warning line too)."""
    from peerd.config import ConfigError
    from peerd.hardware.devices import off_the_round

    shape = dense_shape(run, vocab_size)
    if shape is None:
        return None
    inner = 0
    if device.type == "cpu":  # the model trains in host memory: the inner step's plan (fit_node's, unbudgeted)
        inner = node_plan(node, run, shape, device, None, evaluates_on_a_copy(node, run, device)).estimate.peak
    est = host_estimate(shape.parameters, device_type=device.type, codec=run.averaging.allreduce().compression,
                        fragments=run.diloco.fragments, delayed=run.diloco.overlap == "delayed",
                        background_checkpoint=off_the_round(node.background_checkpoint, device),
                        optimizer_state=optimizer_bytes(shape, node.optimizer_8bit), inner_step=inner)
    total, swap, available = budget if budget is not None else host_budget()
    line = (f"{run.model}: host memory predicted peak {format_bytes(est.peak)} of {format_bytes(total)} "
            f"({format_bytes(available)} available now): {est.describe()}")
    if est.peak > total + swap:
        reason = f"needs ~{format_bytes(est.peak)} of host memory, this machine has {format_bytes(total)}"
        if node.host_memory_check == "warn":
            return (f"{line}; more than its memory and {format_bytes(swap)} of swap: training anyway "
                    "(host_memory_check = warn), the kernel may stop this peer at a round boundary"), True
        raise ConfigError(f"{run.model} does not fit this machine's memory: {reason} "
                          f"(+{format_bytes(swap)} swap); join a run of a smaller model, use a machine with more "
                          "memory, or set host_memory_check = \"warn\" to train anyway", reason=reason,
                          key="host_memory_check")
    short = est.peak > available
    if short:
        line += "; more than is available now: close other programs, or expect swapping at the round boundary"
    return line, short
