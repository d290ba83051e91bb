"""One inner optimizer step on this machine: precision (autocast, loss scaling, TF32) and gradient accumulation.

The run config fixes what the optimization sees (``batch_size`` sequences of ``seq_len`` tokens per inner step);
this module decides how this machine computes that step: in micro-batches that fit its memory (gradients summed
to the full batch's mean-loss gradient) and in the arithmetic its accelerator is fast at. Master weights, the
optimizer state, the outer state and pseudo-gradients stay fp32 in every mode; only the forward/backward
matmuls run in bf16/fp16 under ``torch.autocast`` (Micikevicius et al. 2018, "Mixed Precision Training").
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Optional

import torch
from torch import nn

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """The arithmetic of the forward/backward passes on one device type."""

    name: str
    """``fp32``, ``bf16`` or ``fp16``."""
    device_type: str
    """``torch.device.type`` of the model (``cpu``, ``cuda``)."""

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.name]

    @property
    def loss_scaling(self) -> bool:
        """fp16 gradients underflow without a loss scale; bf16 has fp32's exponent range and needs none."""
        return self.name == "fp16"

    def autocast(self) -> ContextManager:
        """Context for the forward pass: autocast to ``dtype``, or nothing at all for fp32 (bit-identical to
        running without it)."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)


def resolve_precision(requested: str, device: torch.device | str) -> Precision:
    """The precision to train with on ``device`` for the node option ``requested``.

    ``auto``: bf16 on a CUDA GPU that supports it (Ampere and newer), fp16 with loss scaling on an older GPU, fp32
    on CPU (CPU autocast is slower than fp32 on most CPUs). An explicit ``fp32``/``bf16``/``fp16`` is taken as is
    (bf16 and fp16 autocast exist on CPU too). Raises ``ValueError`` for another name.
    """
    device = torch.device(device)
    if requested == "auto":
        if device.type == "cuda":
            return Precision("bf16" if torch.cuda.is_bf16_supported() else "fp16", "cuda")
        return Precision("fp32", device.type)
    if requested not in _DTYPES:
        raise ValueError(f"precision must be auto, fp32, bf16 or fp16, got {requested!r}")
    return Precision(requested, device.type)


def enable_tf32(device: torch.device | str) -> None:
    """Let fp32 matmuls and convolutions on a CUDA device use TF32 tensor cores (10-bit mantissa products, fp32
    accumulation). Process-wide; nothing happens for another device."""
    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def make_optimizer(params: Iterable[nn.Parameter], device_type: str = "cpu", *, hp: Any,
                   eight_bit: bool = False) -> torch.optim.Optimizer:
    """The run's inner AdamW over ``params`` on a device of type ``device_type``: torch's
    (:func:`protocols.diloco.make_inner_optimizer`), or with ``eight_bit`` bitsandbytes' ``AdamW8bit`` (the same
    update with both moments stored blockwise-quantized in 8 bits, Dettmers et al. 2022, "8-bit Optimizers via
    Block-wise Quantization"; CUDA only). ``hp``: the run's :class:`protocols.diloco.DiLoCoHyperparams`.

    Raises ``ValueError`` for ``eight_bit`` off CUDA and ``ImportError`` when bitsandbytes is not installed (the
    node config refuses ``optimizer_8bit`` before either can happen)."""
    from protocols.diloco import make_inner_optimizer

    if not eight_bit:
        return make_inner_optimizer(params, hp, device_type)
    if device_type != "cuda":
        raise ValueError(f"8-bit AdamW (bitsandbytes) needs a CUDA device, got {device_type}")
    import bitsandbytes

    return bitsandbytes.optim.AdamW8bit(params, lr=hp.inner_lr, betas=tuple(hp.inner_betas),
                                        weight_decay=hp.inner_weight_decay)


def micro_batch_count(batch_size: int, micro_batch_size: int) -> int:
    """Micro-batches per inner step: ``batch_size / micro_batch_size`` (``micro_batch_size`` 0 = one).

    Raises ``ValueError`` unless ``micro_batch_size`` is 0 or a positive divisor of ``batch_size`` (unequal
    micro-batches would change the run's batch for this peer only)."""
    if micro_batch_size == 0:
        return 1
    if micro_batch_size < 0 or batch_size % micro_batch_size:
        raise ValueError(f"micro_batch_size ({micro_batch_size}) must divide the run's batch_size ({batch_size})")
    return batch_size // micro_batch_size


class InnerStep:
    """Forward/backward over micro-batches, then one optimizer step; callable as ``step(x, y) -> loss``.

    The gradient is that of the full batch's mean loss: each micro-batch's mean loss is weighted by its share of
    the batch before its backward pass, so ``a`` micro-batches of ``m`` sequences give the gradient of one batch of
    ``m * a`` (equal up to float summation order). The learning rate is the caller's (``set_lr`` before calling).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, batch_size: int,
                 micro_batch_size: int = 0, precision: Optional[Precision] = None, grad_clip_norm: float = 0.0,
                 forward: Optional[Callable] = None, no_sync: Optional[Callable[[], ContextManager]] = None) -> None:
        """
        Args:
            model: returns ``(logits, loss)`` for ``model(x, y)``, loss the mean cross-entropy (nats/token).
            optimizer: over ``model``'s parameters.
            batch_size: B, sequences per inner step (the run's).
            micro_batch_size: sequences per forward/backward pass; 0 = B. Must divide B.
            precision: default fp32 on the model's device.
            grad_clip_norm: clip the total gradient norm (after unscaling) to this; 0 = off.
            forward: callable used instead of ``model`` for the passes (a ``torch.compile``d model).
            no_sync: context for every micro-batch but the last (DistributedDataParallel's ``no_sync``): gradients
                are exchanged once per step, not once per micro-batch.

        Raises:
            ValueError: ``micro_batch_size`` does not divide ``batch_size``.
        """
        self.model = model
        self.optimizer = optimizer
        self.batch_size = batch_size
        self.accumulation = micro_batch_count(batch_size, micro_batch_size)
        self.micro_batch_size = batch_size // self.accumulation
        if precision is None:
            param = next(model.parameters())
            precision = Precision("fp32", param.device.type)
        self.precision = precision
        self.grad_clip_norm = grad_clip_norm
        self.forward = forward if forward is not None else model
        self.no_sync = no_sync
        self.scaler = torch.amp.GradScaler(precision.device_type) if precision.loss_scaling else None

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One inner step on inputs ``x`` and targets ``y``, int64 (B, T) on the model's device.

        Returns the batch's mean loss (nats/token) as a detached 0-d fp32 tensor on the device: reading it
        (``float()``) waits for the device, so callers read it only when they log. With loss scaling, a step whose
        gradients overflowed is skipped by the scaler (the scale is lowered; the loss is still returned).
        """
        if x.shape[0] != self.batch_size:
            raise ValueError(f"expected a batch of {self.batch_size} sequences, got {x.shape[0]}")
        self.optimizer.zero_grad(set_to_none=True)
        total: Optional[torch.Tensor] = None
        for i, (xs, ys) in enumerate(zip(x.split(self.micro_batch_size), y.split(self.micro_batch_size))):
            last = i == self.accumulation - 1
            with (self.no_sync() if self.no_sync is not None and not last else contextlib.nullcontext()):
                with self.precision.autocast():
                    _, loss = self.forward(xs, ys)
                loss = loss.float()
                if self.accumulation > 1:  # one micro-batch: leave the loss untouched (bit-identical to a plain step)
                    loss = loss / self.accumulation
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.grad_clip_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        assert total is not None
        return total
