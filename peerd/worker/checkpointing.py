"""The DiLoCo worker's checkpoint: written after every round and on leaving, read back on a restart.

Tensors: theta_outer, the outer momentum and theta_local (every fragment's, concatenated in fragment order), the
inner optimizer's state and a sparse codec's error feedback. Metadata: the run's id and fingerprint, the outer round
(and each fragment's), the step counters, the round quota, the sampler's position, the tokens trained, and what
``peerd export`` needs to rebuild the model. With the node's ``background_checkpoint`` a copy is written by one
writer thread (writes land in order, never overlap).
"""

from __future__ import annotations

import concurrent.futures
from typing import Callable, Optional

import torch

from peerd.hardware.devices import off_the_round
from peerd.worker.checkpoint_file import Checkpoint, CheckpointError, load_optimizer_tensors, optimizer_tensors
from peerd.events import CheckpointResumed


class OuterCheckpoint:
    """Part of :class:`peerd.worker.outer_worker.OuterWorker`: :meth:`save_checkpoint` and :meth:`resume`."""

    def _start_writer(self) -> None:
        background = off_the_round(self.ctx.node.background_checkpoint, torch.device(self.device))
        self.writer = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="peerd-checkpoint")
                       if background else None)  # one thread: writes land in order
        self.snapshot = HostSnapshot()
        self._last_write: Optional[concurrent.futures.Future] = None

    def save_checkpoint(self, final: bool = False) -> None:
        """Write the checkpoint; with the node's ``background_checkpoint`` a copy is written by the writer thread
        (``final``: and waited for, with every write before it)."""
        # fresh tensors (concatenations) hold still; the optimizer's state changes with the next inner step
        flats = [p.fragment.flatten(self.model) for p in self.parts]  # fresh copies
        fresh = {"theta_local": torch.cat(flats) if len(flats) > 1 else flats[0]}
        feedbacks = self.feedbacks()
        if feedbacks:  # what the sparse codec has not sent yet: lost on a restart otherwise
            fresh["error_feedback"] = torch.cat([f.error for f in feedbacks])
        changing = optimizer_tensors(self.optimizer, to_cpu=self.writer is None)
        metadata = {
            "run_id": self.ctx.run_id, "run_fingerprint": self.run_cfg.fingerprint(),
            "outer_round": self.outer.outer_round, "steps_since_sync": self.steps_since_sync,
            "samples_since_sync": self.samples_since_sync, "round_quota": self.round_quota,
            "sampler": self.sampler.state_dict(), "tokens": self.stats.tokens, "rounds_ok": self.stats.rounds_ok,
            "model": self.run_cfg.model, "seq_len": self.run_cfg.seq_len,  # what `peerd export` rebuilds
            "tokenizer": self.run_cfg.tokenizer,
        }
        metadata.update(self.rounds.checkpoint_metadata())
        outers = [p.outer for p in self.parts]
        if self.writer is None:
            self.ctx.checkpoints.save(Checkpoint(_tensors(outers, fresh, changing), metadata))
            return
        # the writer thread concatenates theta_outer and the momentum itself: outer states are immutable. What
        # changes while it writes (the optimizer's state) is copied to host memory (a copy on the GPU would take the
        # memory the inner steps were planned with, peerd.hardware.memory) without the boundary waiting for it
        copied, ready = self.snapshot.take(changing, reuse=self._last_write is None or self._last_write.done())

        def write() -> None:
            ready()
            self.ctx.checkpoints.save(Checkpoint(_tensors(outers, fresh, copied), metadata))

        self._last_write = self.writer.submit(write)
        if final:
            self.writer.shutdown(wait=True)
            self.writer = None

    def wait_for_write(self) -> bool:
        """Block until the last background checkpoint write is on disk (re-raising its error); False where none
        was written in the background (``background_checkpoint`` off, or nothing saved yet)."""
        if self._last_write is None:
            return False
        self._last_write.result()
        return True

    def feedbacks(self) -> list:
        """Each fragment's error feedback (a sparse codec's unsent remainder), or [] without a sparse codec."""
        feedbacks = [getattr(sync, "feedback", None) for sync in self.syncs]
        return [] if None in feedbacks else feedbacks

    def resume(self) -> None:
        """Continue from the local checkpoint if there is one; publishes :class:`peerd.events.CheckpointResumed`.
        Raises CheckpointError if it was written under another configuration of the run, or is incomplete."""
        checkpoint = self.load_checkpoint()
        if checkpoint is None:
            return
        path = self.ctx.checkpoints.path
        meta = checkpoint.metadata
        t = checkpoint.tensors
        try:
            rounds = meta["fragment_rounds"] if len(self.parts) > 1 else [int(meta["outer_round"])]
            for part, outer, local in zip(self.parts, self._outer_states(t["theta_outer"], t["momentum"], rounds),
                                          self._split(t["theta_local"])):
                part.outer = outer
                part.round_start_theta = outer.theta
                part.fragment.load_(self.model, local)
            feedbacks = self.feedbacks()
            if feedbacks and "error_feedback" in t:  # a checkpoint from before it was kept: the error restarts at 0
                for feedback, error in zip(feedbacks, self._split(t["error_feedback"])):
                    feedback.record(error.clone(), torch.zeros_like(error))
            self.rounds.resume(meta)
            load_optimizer_tensors(self.optimizer, t, self.device)
            self.sampler.load_state_dict(meta["sampler"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {path} is incomplete or mismatched: {e}") from None
        self.steps_since_sync = int(meta["steps_since_sync"])
        self.samples_since_sync = int(meta["samples_since_sync"])
        self.round_quota = int(meta["round_quota"])
        self.stats.tokens = int(meta.get("tokens", 0))
        self.stats.rounds_ok = int(meta.get("rounds_ok", 0))  # the contribution counts on across restarts
        self.ctx.events.publish(CheckpointResumed(self.outer.outer_round, self.digest(), str(path),
                                                  self.steps_since_sync))

    def _save_final_checkpoint(self) -> None:
        self.save_checkpoint(final=True)
        if self.local_dp is not None:
            self.local_dp.close()


def _tensors(outers: list, fresh: dict[str, torch.Tensor], optimizer: dict[str, torch.Tensor]) -> dict:
    """The checkpoint's tensors: theta_outer and the momentum of the fragments' outer states ``outers``, concatenated
    in fragment order ((P,) fp32), then theta_local, the optimizer's state and the error feedback."""
    tensors = {"theta_outer": torch.cat([o.theta for o in outers]) if len(outers) > 1 else outers[0].theta,
               "momentum": torch.cat([o.momentum for o in outers]) if len(outers) > 1 else outers[0].momentum,
               "theta_local": fresh["theta_local"]}
    tensors.update(optimizer)
    if "error_feedback" in fresh:
        tensors["error_feedback"] = fresh["error_feedback"]
    return tensors


class HostSnapshot:
    """Host-memory copies of tensors that change after a boundary (the inner optimizer's state), for a checkpoint
    written in the background, taken without the caller waiting for them.

    Tensors on a CUDA GPU are copied into page-locked buffers kept from one checkpoint to the next (allocating
    gigabytes of page-locked memory is slow), asynchronously on the tensor's current stream: the next inner step's
    kernels, queued on that stream after the copies, cannot change a tensor before it is copied, and the host goes on
    at once. Before, the boundary waited for a copy into ordinary memory and then a second copy (a 1.1B model's
    AdamW state is 9 GB). CPU tensors are copied at once.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, tensors: dict[str, torch.Tensor], reuse: bool) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
        """(host copies of ``tensors``, a function that returns once the copies are complete; call it before
        reading them). ``reuse``: the buffers of the previous snapshot may be overwritten (its write finished);
        otherwise fresh ones are allocated and kept for the next time."""
        if not reuse:
            self._buffers = {}
        copies, devices = {}, set()
        for name, t in tensors.items():
            if not t.is_cuda:
                copies[name] = t.detach().to("cpu", copy=True)
                continue
            buf = self._buffers.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = self._buffers[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            copies[name] = buf.copy_(t.detach(), non_blocking=True)
            devices.add(t.device)
        events = []
        for device in devices:
            events.append(torch.cuda.Event())
            events[-1].record(torch.cuda.current_stream(device))

        def ready() -> None:
            for event in events:
                event.synchronize()

        return copies, ready
