"""How much device memory a dense preset's inner steps need, and the micro-batch and activation checkpointing that
make a run fit this machine's device.

Pure functions of the architecture, the run (``seq_len``, ``batch_size``, vocabulary) and the node's choices
(precision, micro-batch, checkpointing, 8-bit AdamW); only :func:`device_budget` looks at a device. Sizes are in
bytes; P = parameters, L = layers, C = ``d_model``, F = MLP hidden, H = heads, V = vocabulary, N = tokens of one
micro-batch (``micro_batch_size * seq_len``), e = bytes of the compute precision (4 for fp32, 2 for bf16/fp16).

The peak is the larger of two phases, plus a reserve on a GPU (:data:`CUDA_RESERVE_BYTES` and
:data:`CUDA_RESERVE_FRACTION`: the caching allocator's rounding and fragmentation, cuBLAS and attention
workspaces):

- **forward/backward**: fp32 weights 4P + AdamW moments 8P (2P + 8 bytes per 256-element block in 8 bits:
  bitsandbytes' blockwise 8-bit state with an fp32 absmax per block; tensors under 4,096 elements keep fp32 state)
  + fp32 gradients 4P when gradients are accumulated over several micro-batches (with one micro-batch they are
  allocated while the activations are being freed, so the step phase covers them) + autocast's copies of the matmul
  weights in the compute precision, e (L (4C^2 + 3CF) + VC), held for the backward pass + the activations saved
  for backward + the loss's transient buffers (8V + 2eC bytes per token: the fp32 gradient of the log-softmax and
  of the logits, the LM head's input gradient).
- **optimizer step**: weights, moments and gradients, 16P (AdamW's fused CUDA kernel and bitsandbytes' kernels
  need no temporaries; torch's foreach AdamW on a CPU holds one more fp32 copy of the parameters, 4P).

Activations saved for backward, per token, counted from the tensors autograd saves for this architecture
(:class:`peerd.models.transformer.Transformer`: pre-norm, RoPE, SDPA attention, SwiGLU; counted in torch 2.13 with
``torch.autograd.graph.saved_tensors_hooks``, see ``tests/unit/test_memory.py``):

- per block: 4 (5C + H + 2) + e (8C + 4F): the fp32 residual stream at both RMSNorms (inputs and normalized
  values), the per-row RMS and attention log-sum-exp (fp32), q, k, v, the attention output, the inputs of the
  four projections and the SwiGLU's gate, up and product in the compute precision;
- outside the blocks: 4 (2C + V + 1) + eC + 16: the final norm, the fp32 log-softmax over the vocabulary, the
  LM head's input, the int64 token ids and targets.

With activation checkpointing (:attr:`Transformer.activation_checkpointing`, one checkpoint per block) a block
keeps only its fp32 input, 4C per token, and one block's activations are rebuilt at a time in the backward pass:
L * 4C + one block + outside the blocks. The forward pass still holds autocast's weight copies (its cache lives as
long as the ``autocast`` region), the backward pass one block's.

Sources: the 16 bytes per parameter of mixed-precision AdamW training (Rajbhandari et al. 2020, "ZeRO", sec. 3.1,
without the fp16 weight copy, which autocast makes per op here); activation recomputation per block (Chen et al.
2016, "Training Deep Nets with Sublinear Memory Cost"; Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", sec. 4 for per-layer activation counts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from peerd.hardware.devices import off_the_round

GIB = 1 << 30
#: Bytes a CUDA run keeps free beyond the prediction: the caching allocator's 2 MiB blocks and fragmentation,
#: cuBLAS's and the attention kernels' workspaces.
CUDA_RESERVE_BYTES = 512 << 20
#: ... plus this share of the predicted peak.
CUDA_RESERVE_FRACTION = 0.05
#: A micro-batch of at least this many tokens keeps a GPU's matmuls busy; below it the planner prefers activation
#: checkpointing (a third more compute) with a bigger micro-batch over many small ones.
MIN_EFFICIENT_TOKENS = 4096
#: bitsandbytes' 8-bit optimizers keep an fp32 absmax per block of this many elements of each moment, and fp32
#: moments for tensors smaller than :data:`BNB_MIN_8BIT_SIZE`.
BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096

_COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def format_bytes(n: int) -> str:
    """``n`` bytes as GiB with one decimal, or MiB below 1 GiB."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.0f} MiB"


@dataclass(frozen=True)
class Shape:
    """What the memory of a dense transformer depends on."""

    d_model: int
    n_layers: int
    n_heads: int
    mlp_hidden: int
    vocab_size: int

    @classmethod
    def of(cls, preset: Any, vocab_size: int) -> "Shape":
        """The shape of a :class:`peerd.models.registry.ModelPreset` (or its name) over ``vocab_size`` tokens.
        Raises ``ValueError`` for a mixture-of-experts preset (no activation model for routed experts)."""
        from peerd.models.registry import get_preset

        preset = get_preset(preset) if isinstance(preset, str) else preset
        if preset.family != "dense":
            raise ValueError(f"no memory model for {preset.family} preset {preset.name!r} (dense presets only)")
        s = preset.shape
        return cls(s["d_model"], s["n_layers"], s["n_heads"], s["mlp_hidden"], vocab_size)

    @property
    def matmul_parameters(self) -> int:
        """Parameters that enter matmuls (autocast copies them): projections, MLP and the tied LM head."""
        c, f = self.d_model, self.mlp_hidden
        return self.n_layers * (4 * c * c + 3 * c * f) + self.vocab_size * c

    @property
    def parameters(self) -> int:
        """All parameters (the tied embedding once); equals ``ModelPreset.parameter_count(vocab_size)``."""
        c = self.d_model
        return self.matmul_parameters + self.n_layers * 2 * c + c

    @property
    def small_parameters(self) -> int:
        """Parameters in tensors under :data:`BNB_MIN_8BIT_SIZE` elements (the RMSNorm weights here)."""
        c = self.d_model
        return (self.n_layers * 2 + 1) * c if c < BNB_MIN_8BIT_SIZE else 0


def block_activation_bytes_per_token(shape: Shape, compute_bytes: int) -> int:
    """Bytes one block saves for backward per token (module docstring); ``compute_bytes``: e."""
    c, f, h = shape.d_model, shape.mlp_hidden, shape.n_heads
    return 4 * (5 * c + h + 2) + compute_bytes * (8 * c + 4 * f)


def head_activation_bytes_per_token(shape: Shape, compute_bytes: int) -> int:
    """Bytes saved for backward per token outside the blocks: final norm, LM head, loss, token ids."""
    return 4 * (2 * shape.d_model + shape.vocab_size + 1) + compute_bytes * shape.d_model + 16


def activation_bytes(shape: Shape, tokens: int, compute_bytes: int, checkpointing: bool) -> int:
    """Activations alive at the start of the backward pass of a micro-batch of ``tokens`` tokens."""
    block = block_activation_bytes_per_token(shape, compute_bytes)
    head = head_activation_bytes_per_token(shape, compute_bytes)
    if checkpointing:
        per_token = shape.n_layers * 4 * shape.d_model + block + head
    else:
        per_token = shape.n_layers * block + head
    return tokens * per_token


def optimizer_bytes(shape: Shape, eight_bit: bool = False) -> int:
    """AdamW's two moments: fp32 (8P), or bitsandbytes' blockwise 8-bit state."""
    if not eight_bit:
        return 8 * shape.parameters
    small = shape.small_parameters
    big = shape.parameters - small
    return 2 * big + 2 * 4 * math.ceil(big / BNB_BLOCK) + 8 * small


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted device memory of one inner step, in bytes, by what holds it (module docstring)."""

    weights: int
    gradients: int
    optimizer: int
    weight_copies: int
    """autocast's copies of the matmul weights in the compute precision (0 for fp32)."""
    activations: int
    """Saved for backward at the start of the backward pass (one micro-batch)."""
    transient: int
    """The loss's and LM head's gradient buffers at the start of the backward pass."""
    accumulating: bool
    """Gradients are held across micro-batches (more than one per step)."""
    step_temporaries: int
    """Extra memory of the optimizer step (CPU foreach AdamW)."""
    reserve: int
    """Kept free on a GPU for the allocator and kernel workspaces."""
    eval_copy: int = 0
    """A second copy of the fp32 weights that round evaluations run on while training goes on (background
    evaluation, Streaming fragments, the delayed overlap), 4P; 0 without one."""

    @property
    def forward_backward(self) -> int:
        grads = self.gradients if self.accumulating else 0
        return (self.weights + self.optimizer + grads + self.weight_copies + self.activations + self.transient
                + self.eval_copy)

    @property
    def optimizer_step(self) -> int:
        return self.weights + self.optimizer + self.gradients + self.step_temporaries + self.eval_copy

    @property
    def peak(self) -> int:
        """The predicted peak of the process's allocated device memory, reserve included."""
        return max(self.forward_backward, self.optimizer_step) + self.reserve

    @property
    def model_state(self) -> int:
        """Weights, gradients and optimizer state (independent of the batch)."""
        return self.weights + self.gradients + self.optimizer


def estimate(shape: Shape, *, seq_len: int, micro_batch_size: int, accumulation: int = 1, precision: str = "bf16",
             checkpointing: bool = False, optimizer_8bit: bool = False, device_type: str = "cuda",
             eval_copy: bool = False) -> MemoryEstimate:
    """The predicted memory of an inner step of ``accumulation`` micro-batches of ``micro_batch_size`` sequences of
    ``seq_len`` tokens. ``precision``: fp32, bf16 or fp16 (resolved, not ``auto``); ``device_type``: where it
    trains (``cuda`` adds the reserve; ``cpu`` counts foreach AdamW's temporary copy); ``eval_copy``: evaluations
    run on a copy of the weights (:attr:`MemoryEstimate.eval_copy`). Raises ``ValueError`` for
    an unknown precision or a size below 1."""
    if precision not in _COMPUTE_BYTES:
        raise ValueError(f"precision must be one of {', '.join(_COMPUTE_BYTES)}, got {precision!r}")
    if min(seq_len, micro_batch_size, accumulation) < 1:
        raise ValueError(f"seq_len, micro_batch_size and accumulation must be >= 1, got {seq_len}, "
                         f"{micro_batch_size}, {accumulation}")
    e = _COMPUTE_BYTES[precision]
    p = shape.parameters
    tokens = micro_batch_size * seq_len
    copies = 0 if e == 4 else e * shape.matmul_parameters
    acts = activation_bytes(shape, tokens, e, checkpointing)
    if checkpointing and copies:
        # the forward pass holds every weight copy and the block inputs; the backward pass one block's copies and
        # activations: the larger of the two is what the estimate's forward/backward phase must hold
        block_copies = e * (4 * shape.d_model ** 2 + 3 * shape.d_model * shape.mlp_hidden)
        forward = copies + tokens * (shape.n_layers * 4 * shape.d_model
                                     + head_activation_bytes_per_token(shape, e))
        backward = block_copies + acts
        copies, acts = 0, max(forward, backward)
    transient = tokens * (8 * shape.vocab_size + 2 * e * shape.d_model)
    temporaries = 4 * p if device_type == "cpu" and not optimizer_8bit else 0
    est = MemoryEstimate(4 * p, 4 * p, optimizer_bytes(shape, optimizer_8bit), copies, acts, transient,
                         accumulation > 1, temporaries, 0, 4 * p if eval_copy else 0)
    if device_type != "cuda":
        return est
    reserve = CUDA_RESERVE_BYTES + int(CUDA_RESERVE_FRACTION * max(est.forward_backward, est.optimizer_step))
    return MemoryEstimate(**{**est.__dict__, "reserve": reserve})


@dataclass(frozen=True)
class Plan:
    """How this machine computes the run's inner step, and what it is predicted to need."""

    micro_batch_size: int
    activation_checkpointing: bool
    estimate: MemoryEstimate
    budget: Optional[int]
    """Bytes the device has for this process (None: unknown)."""

    @property
    def fits(self) -> bool:
        return self.budget is None or self.estimate.peak <= self.budget

    def describe(self, seq_len: int, where: str = "") -> str:
        """One line: the predicted peak, the budget and the choices, e.g. ``predicted peak 17.9 GiB of 23.5 GiB
        free on cuda:0 (NVIDIA GeForce RTX 4090): micro-batch 4 x 1024 tokens, activation checkpointing on``."""
        budget = f" of {format_bytes(self.budget)} free" if self.budget is not None else ""
        return (f"predicted peak {format_bytes(self.estimate.peak)}{budget}{' on ' + where if where else ''}: "
                f"micro-batch {self.micro_batch_size} x {seq_len} tokens, activation checkpointing "
                f"{'on' if self.activation_checkpointing else 'off'}"
                + (", evaluations on a copy of the weights" if self.estimate.eval_copy else ""))


def plan(shape: Shape, *, seq_len: int, batch_size: int, budget: Optional[int], precision: str = "bf16",
         micro_batch_size: int = 0, checkpointing: Optional[bool] = None, optimizer_8bit: bool = False,
         device_type: str = "cuda", eval_copy: bool = False) -> Plan:
    """The micro-batch and checkpointing for ``batch_size`` sequences per inner step within ``budget`` bytes.

    A ``micro_batch_size`` > 0 or a ``checkpointing`` that is not None is the user's and is kept. Otherwise, in
    this order: the largest divisor of ``batch_size`` that fits without checkpointing and still holds
    :data:`MIN_EFFICIENT_TOKENS` tokens (or the whole batch); else the largest that fits with checkpointing; else
    the largest that fits without. With ``budget`` None (unknown) or nothing fitting: the user's values, else the
    whole batch without checkpointing where nothing is known, or the plan of the lowest peak where nothing fits
    (``Plan.fits`` is then False). Raises ``ValueError`` when ``micro_batch_size`` does not divide ``batch_size``.
    """
    if micro_batch_size and batch_size % micro_batch_size:
        raise ValueError(f"micro_batch_size ({micro_batch_size}) must divide the run's batch_size ({batch_size})")
    sizes = [micro_batch_size] if micro_batch_size else [m for m in range(batch_size, 0, -1) if batch_size % m == 0]
    modes = [checkpointing] if checkpointing is not None else [False, True]

    def make(m: int, ckpt: bool) -> Plan:
        est = estimate(shape, seq_len=seq_len, micro_batch_size=m, accumulation=batch_size // m, precision=precision,
                       checkpointing=ckpt, optimizer_8bit=optimizer_8bit, device_type=device_type,
                       eval_copy=eval_copy)
        return Plan(m, ckpt, est, budget)

    if budget is None:
        return make(sizes[0], bool(modes[0]))
    candidates = [make(m, ckpt) for ckpt in modes for m in sizes]
    fitting = [p for p in candidates if p.fits]
    efficient = [p for p in fitting if not p.activation_checkpointing
                 and (p.micro_batch_size == batch_size or p.micro_batch_size * seq_len >= MIN_EFFICIENT_TOKENS)]
    for group in (efficient, [p for p in fitting if p.activation_checkpointing], fitting):
        if group:
            return max(group, key=lambda p: p.micro_batch_size)
    return min(candidates, key=lambda p: p.estimate.peak)


def device_budget(device: Any, memory_fraction: float = 0.0) -> Optional[tuple[int, str]]:
    """``(bytes this process may still allocate, a name)`` for ``device`` (a ``torch.device``): a GPU's free memory
    (``torch.cuda.mem_get_info``: ROCm builds answer through it too), capped at ``memory_fraction`` of its total when
    that is set (``gpu_memory_fraction``), less what this process holds already; an Apple GPU's recommended working
    set; None for a CPU (host memory is shared with the rest of the machine and swaps)."""
    import torch

    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if memory_fraction:
            free = min(free, int(memory_fraction * total) - torch.cuda.memory_reserved(device))
        return max(free, 0), f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "mps" and hasattr(torch.mps, "recommended_max_memory"):
        return max(torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory(), 0), f"{device}"
    return None


def fit_node(node: Any, run: Any, device: Any, vocab_size: int,
             budget: Optional[tuple[int, str]] = None) -> tuple[Any, Optional[str]]:
    """``node`` (a :class:`peerd.config.NodeConfig`) with the ``micro_batch_size`` and ``activation_checkpointing``
    that fit ``run`` (a :class:`peerd.run_config.RunConfig`) on ``device`` (values the user set are kept; where
    ``background_eval`` is unset on a GPU, on where the evaluation's copy of the weights leaves that plan as it is,
    off where it would need a smaller micro-batch or checkpointing or not fit), and the
    one-line prediction to print (None where there is none: another parallelism than DiLoCo, a mixture-of-experts
    model). On a CPU nothing is chosen (the whole batch, no checkpointing unless set) and the line gives the peak
    for host memory. ``budget``: ``(bytes, name)`` instead of asking the device (:func:`device_budget`).

    Raises :class:`peerd.config.ConfigError` with one line when the run cannot fit, or ``optimizer_8bit`` is set
    for a device that is no CUDA GPU."""
    import dataclasses

    from peerd.config import ConfigError

    if node.optimizer_8bit and device.type != "cuda":
        reason = f"bitsandbytes' 8-bit AdamW needs a CUDA GPU, this peer trains on {device}"
        raise ConfigError(f"optimizer_8bit: {reason}", key="optimizer_8bit", reason=reason)
    shape = dense_shape(run, vocab_size)
    if shape is None:
        return node, None
    found = budget if budget is not None else device_budget(device, node.gpu_memory_fraction)

    def plan_with(eval_copy: bool) -> Plan:
        return node_plan(node, run, shape, device, found[0] if found else None, eval_copy)

    chosen = plan_with(evaluates_on_a_copy(node, run, device))
    background_eval = node.background_eval
    if background_eval is None and chosen.estimate.eval_copy and not evaluates_on_a_copy(
            dataclasses.replace(node, background_eval=False), run, device):
        # background evaluation by default only where its copy leaves the inner step's plan as it is: a smaller
        # micro-batch or activation checkpointing would cost every step more than the evaluation costs a round
        alone = plan_with(False)
        background_eval = (chosen.fits and (chosen.micro_batch_size, chosen.activation_checkpointing)
                           == (alone.micro_batch_size, alone.activation_checkpointing))
        chosen = chosen if background_eval else alone
    where = found[1] if found else str(device)
    line = f"{run.model}: {chosen.describe(run.seq_len, where)}"
    if not chosen.fits:
        fixed = (["micro_batch_size"] if node.micro_batch_size else []) + \
            (["activation_checkpointing"] if node.activation_checkpointing is not None else [])
        fix = (f"unset {' and '.join(fixed)} to let peerd choose" if fixed else
               "free GPU memory" + ("" if node.optimizer_8bit else ", set optimizer_8bit = true") +
               ", or join a run of a smaller model")
        raise ConfigError(f"{run.model} does not fit {where}: {chosen.describe(run.seq_len)}; {fix}",
                          key="micro_batch_size", reason=f"does not fit {where}")
    if found is None:  # nothing known about free memory: the user's values, the whole batch by default
        return dataclasses.replace(node, activation_checkpointing=bool(node.activation_checkpointing)), line
    return dataclasses.replace(node, micro_batch_size=chosen.micro_batch_size, background_eval=background_eval,
                               activation_checkpointing=chosen.activation_checkpointing), line


def dense_shape(run: Any, vocab_size: int) -> Optional[Shape]:
    """The shape of ``run``'s model (a :class:`peerd.run_config.RunConfig`) over ``vocab_size`` tokens where its
    memory is predicted (a dense model trained with DiLoCo); None otherwise (SWARM, SPES, a mixture of experts)."""
    if getattr(run, "parallelism", "diloco") != "diloco":
        return None
    try:
        return Shape.of(run.model, vocab_size)
    except ValueError:
        return None


def node_plan(node: Any, run: Any, shape: Shape, device: Any, budget: Optional[int], eval_copy: bool) -> Plan:
    """:func:`plan` for ``run``'s batch split over ``node``'s local devices, with ``node``'s precision, micro-batch,
    checkpointing and 8-bit choices on ``device`` (a ``torch.device``) within ``budget`` bytes (None: unknown)."""
    from peerd.worker.inner_step import resolve_precision

    return plan(shape, seq_len=run.seq_len, batch_size=run.batch_size // max(1, len(node.local_devices)),
                budget=budget, precision=resolve_precision(node.precision, device).name,
                micro_batch_size=node.micro_batch_size, checkpointing=node.activation_checkpointing,
                optimizer_8bit=node.optimizer_8bit, device_type=device.type, eval_copy=eval_copy)


def evaluates_on_a_copy(node: Any, run: Any, device: Any) -> bool:
    """Whether the worker keeps a second copy of the weights for its round evaluations: the run evaluates and either
    evaluates in the background (:func:`peerd.hardware.devices.off_the_round`) or theta_local differs from theta_outer
    after a round (Streaming fragments, the delayed overlap; :mod:`peerd.worker.evaluation`)."""
    diloco = run.diloco
    return bool(run.eval_batches) and (off_the_round(node.background_eval, device) or diloco.fragments > 1
                                       or diloco.overlap == "delayed")
