"""A SWARM pipeline stage served to peers, and the trainer's side that pushes micro-batches through the stages.

Source: SWARM parallelism (Ryabinin et al. 2023, arXiv 2301.11913): each stage is served by several peers; a
trainer sends every micro-batch forward through one server per stage (chosen by :class:`protocols.swarm.Wiring`)
and the activation gradients back through the same servers.

Methods of :class:`StageService` (on :mod:`protocols.rpc`; tensors encoded by :mod:`protocols.codecs`):

- ``forward`` (not on the last stage): header ``{"mb": id, "x": tensor header}`` (stage 0: ``"tokens"``: a
  token header, see :func:`encode_tokens`), payload = the input; reply ``{"y": tensor header}`` + the output
  activations (B, T, C). The server keeps the input for the micro-batch's backward (bounded: ``max_pending``
  micro-batches, each for at most ``pending_timeout_s``; more are refused with code ``"busy"``: back-pressure).
- ``backward``: header ``{"mb": id, "g": tensor header}``, payload = the gradient of the loss w.r.t. this stage's
  output (B, T, C); the server recomputes its forward from the kept input (so it keeps one tensor per micro-batch,
  not an autograd graph, and an optimizer step between forward and backward is harmless), accumulates its
  parameters' gradients and replies ``{"g": tensor header}`` + the gradient w.r.t. its input (stage 0: nothing).
- ``loss`` (last stage only): header ``{"mb": id, "x": tensor header, "x_bytes": n, "targets": token header}``,
  payload = the activations then the targets; forward and backward at once; reply ``{"loss": float, "g": tensor
  header}`` + the gradient w.r.t. the activations.

- ``infer``: forward only, nothing kept and no gradient (evaluation, generation): header as ``forward`` (not on
  the last stage), reply ``{"y": tensor header}`` + the output activations; on the last stage header ``{"mb": id,
  "x": tensor header, "x_bytes": n}`` plus ``"targets": token header`` (payload = activations then targets) for a
  reply ``{"loss": float}``, or without targets (payload = activations) for a reply ``{"logits": tensor header}`` +
  the next-token logits at the last position (B, V).
- ``state``: no payload; reply ``{"params": tensor header, "steps": int}`` + this stage's parameters, flattened
  in ``named_parameters()`` order, fp32 without compression (a server that moves to this stage starts from them).
- ``outer``: no payload; reply ``{"outer": tensor header, "outer_round": int}`` + the stage's outer state (2, N)
  fp32 (theta_outer, outer momentum) of the replicas' outer rounds; refused (``no-outer``) by a server that does
  not average (a mover or a replica that fell behind adopts it).

Peer input is untrusted: sizes are checked before reading, shapes against the model, values must be finite (a NaN
activation is a :class:`ProtocolViolation`), and the sender is banned. A trainer treats a server's non-finite
reply the same way (ban, retry the micro-batch on another server of the stage).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import nn

from protocols.bans import BanList
from protocols.codecs import TensorHeader, decode_tensor, encode_tensor
from protocols.rpc import Message, ProtocolViolation, Refused, Request, RpcError, Service, call
from protocols.swarm import NoServer, SwarmConfig, Wiring

__all__ = [
    "PipelineTrainer", "StageService", "decode_tokens", "download_outer_state", "download_stage_parameters",
    "encode_tokens",
    "flat_parameters", "load_flat_parameters", "outputs_agree",
]

logger = logging.getLogger(__name__)

_MAX_MB_ID = 128


def encode_tokens(tokens: torch.Tensor) -> tuple[dict[str, Any], bytes]:
    """Token ids (B, T) int64 -> (``{"shape": [B, T]}``, int32 little-endian bytes). Raises ValueError."""
    if tokens.dim() != 2 or tokens.dtype != torch.long:
        raise ValueError(f"tokens must be int64 (B, T), got {tokens.dtype} {tuple(tokens.shape)}")
    return {"shape": list(tokens.shape)}, tokens.to(torch.int32).numpy().astype("<i4").tobytes()


def decode_tokens(header: Any, payload: bytes, vocab_size: int) -> torch.Tensor:
    """A peer's token ids: (B, T) int64 with every id in [0, vocab_size). Raises ProtocolViolation."""
    shape = header.get("shape") if isinstance(header, dict) else None
    if (not isinstance(shape, list) or len(shape) != 2
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
        raise ProtocolViolation(f"malformed token shape {shape!r}")
    if len(payload) != 4 * shape[0] * shape[1]:
        raise ProtocolViolation(f"{len(payload)} token bytes for shape {shape}")
    ids = np.frombuffer(payload, dtype="<i4").reshape(shape)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ProtocolViolation(f"token id out of [0, {vocab_size})")
    return torch.from_numpy(ids.astype(np.int64))


def flat_parameters(module: nn.Module) -> torch.Tensor:
    """The module's parameters as one (N,) fp32 CPU tensor, in ``named_parameters()`` order."""
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in module.parameters()])


@torch.no_grad()
def load_flat_parameters(module: nn.Module, flat: torch.Tensor) -> None:
    """Copy a (N,) tensor from :func:`flat_parameters` of the same architecture into ``module``. Raises ValueError
    on a length mismatch."""
    params = list(module.parameters())
    total = sum(p.numel() for p in params)
    if flat.shape != (total,):
        raise ValueError(f"{tuple(flat.shape)} values for {total} parameters")
    offset = 0
    for p in params:
        p.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


async def download_stage_parameters(streams: Any, peer: str, service: str, numel: int,
                                    timeout_s: float) -> torch.Tensor:
    """Stage parameters (``numel``,) fp32 from ``peer``'s ``state`` method. Raises RpcError (ProtocolViolation for
    a reply of another size or with non-finite values)."""
    reply = await call(streams, peer, service, "state", {}, b"", timeout_s=timeout_s, max_reply_bytes=4 * numel)
    return decode_tensor(reply.header.get("params"), reply.payload, shape=(numel,), dtype=torch.float32,
                         codecs=("none",))


async def download_outer_state(streams: Any, peer: str, service: str, numel: int,
                               timeout_s: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(theta_outer (numel,), momentum (numel,), outer_round)`` of a stage from ``peer``'s ``outer`` method, fp32.
    Raises RpcError (ProtocolViolation for a reply of another size, non-finite values or a bad round)."""
    reply = await call(streams, peer, service, "outer", {}, b"", timeout_s=timeout_s,
                       max_reply_bytes=8 * numel + 4096)
    outer_round = reply.header.get("outer_round")
    if not (isinstance(outer_round, int) and not isinstance(outer_round, bool) and 0 <= outer_round < 2**63):
        raise ProtocolViolation(f"bad outer_round {outer_round!r}")
    both = decode_tensor(reply.header.get("outer"), reply.payload, shape=(2, numel), dtype=torch.float32,
                         codecs=("none",))
    if not torch.isfinite(both).all():
        raise ProtocolViolation("non-finite outer state")
    return both[0].clone(), both[1].clone(), outer_round


def outputs_agree(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> bool:
    """Whether two outputs of the same stage on the same input agree: ``||a - b|| <= tolerance * max(||a||, ||b||)``
    (L2 over all elements; shapes must match, else False). Non-finite values never agree."""
    if a.shape != b.shape:
        return False
    a, b = a.to(torch.float64), b.to(torch.float64)
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return False
    return float(torch.linalg.vector_norm(a - b)) <= tolerance * max(float(torch.linalg.vector_norm(a)),
                                                                    float(torch.linalg.vector_norm(b)))


def _loss_of(header: dict[str, Any]) -> float:
    loss = header.get("loss")
    if not isinstance(loss, float) or not np.isfinite(loss):
        raise ProtocolViolation(f"malformed loss {loss!r}")
    return loss


def _mb_id(header: dict[str, Any]) -> str:
    mb = header.get("mb")
    if not isinstance(mb, str) or not 0 < len(mb) <= _MAX_MB_ID:
        raise ProtocolViolation(f"malformed micro-batch id {mb!r}")
    return mb


class _LocalRequest:
    """A request from this very peer, handed to a handler without a stream (:meth:`StageService.call_local`)."""

    def __init__(self, peer: str, header: dict[str, Any], payload: bytes) -> None:
        self.peer, self.header, self.size = peer, header, len(payload)
        self._payload = payload

    async def payload(self, max_bytes: int, timeout_s: Optional[float] = None) -> bytes:
        if self.size > max_bytes:
            raise ProtocolViolation(f"payload of {self.size} bytes exceeds the limit of {max_bytes}")
        return self._payload


@dataclass
class _Kept:
    input: torch.Tensor
    deadline: float


class StageService(Service):
    """Serve one pipeline stage (``forward``, ``backward``, ``loss``; see the module docstring).

    Args:
        name: the service name (handler prefix), e.g. the namespace's prefix plus ``.stage<k>``.
        stage: the stage module: ``first`` / ``last`` attributes, ``config.d_model``, ``config.seq_len``,
            ``config.vocab_size``; called as ``stage(x)`` or (last) ``stage(x, targets)`` -> loss.
        config: codec, size limits, ``max_pending`` and ``pending_timeout_s``.
        optimizer: stepped (then gradients zeroed) after every ``step_every`` backward passes, on the mean of
            their gradients; None = the owner steps (e.g. a role that averages gradients first).
        bans: peers excluded for sending invalid data (a fresh list with ``config.ban_s`` by default).
        device: where the stage's parameters live; tensors arrive and leave on the CPU.
        outer_state: returns the stage's ``(theta_outer (N,), momentum (N,), outer_round)`` for the ``outer``
            method, or None while there is none to serve (None: the method always refuses).
        clock: monotonic seconds (injectable for tests).
        compute_thread: run the stage's compute (forward, backward, optimizer step) in one worker thread of this
            service instead of the event loop, so a long forward (a GPU's, a big stage's) does not hold up the
            peer's other streams; False: compute runs in the event loop.

    Compute runs one request at a time (in the event loop, or in the service's single worker thread), so no step
    interleaves with a forward or backward; code that reads or replaces the stage's parameters from outside goes
    through :meth:`exclusive` to keep that so.

    A request with ``"check": true`` in its header (``forward``, ``loss``) is a spot-check by a trainer: the same
    computation, but nothing is kept, no gradient accumulated and nothing counted; ``loss`` then replies
    ``{"loss": float}`` with no payload.
    """

    def __init__(self, name: str, stage: nn.Module, config: SwarmConfig, *,
                 optimizer: Optional[torch.optim.Optimizer] = None, step_every: int = 1,
                 bans: Optional[BanList] = None, device: str | torch.device = "cpu",
                 outer_state: Optional[Callable[[], Optional[tuple[torch.Tensor, torch.Tensor, int]]]] = None,
                 clock: Callable[[], float] = time.monotonic, compute_thread: bool = False) -> None:
        if step_every < 1:
            raise ValueError(f"step_every must be >= 1, got {step_every}")
        self.name = name
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"stage-{name}") if compute_thread else None
        self.stage, self.config = stage, config
        self.optimizer, self.step_every = optimizer, step_every
        self.bans = bans if bans is not None else BanList(config.ban_s)
        self.device = torch.device(device)
        self.clock = clock
        self.outer_state = outer_state
        self._kept: dict[tuple[str, str], _Kept] = {}
        self.backwards = 0
        self.steps = 0
        self.samples = 0
        self.compute_s = 0.0

    # --- peer input -------------------------------------------------------------------------------------------

    def on_bad_request(self, peer: str, method: str, error: RpcError) -> None:
        logger.warning("stage %s: banning %s for a bad %s request: %s", self.name, peer, method, error)
        self.bans.ban(peer, f"bad {method} request: {error}")

    def _admit(self, request: Request) -> None:
        if self.bans.is_banned(request.peer):
            raise Refused(f"{request.peer} is banned here", code="banned")

    def _activations(self, header: Any, payload: bytes) -> torch.Tensor:
        """Decode (B, T, C) activations, finite, with C = d_model and T <= seq_len."""
        spec = TensorHeader.from_dict(header)
        cfg = self.stage.config
        if len(spec.shape) != 3 or spec.shape[2] != cfg.d_model or not 0 < spec.shape[1] <= cfg.seq_len:
            raise ProtocolViolation(f"activations of shape {list(spec.shape)}, expected (B, T<={cfg.seq_len}, "
                                    f"{cfg.d_model})")
        return decode_tensor(spec, payload, codecs=(self.config.codec, "none"))

    def _input(self, header: dict[str, Any], payload: bytes) -> torch.Tensor:
        if self.stage.first:
            tokens = decode_tokens(header.get("tokens"), payload, self.stage.config.vocab_size)
            if tokens.shape[1] > self.stage.config.seq_len:
                raise ProtocolViolation(f"{tokens.shape[1]} tokens exceed seq_len {self.stage.config.seq_len}")
            return tokens
        return self._activations(header.get("x"), payload)

    def _encode(self, x: torch.Tensor) -> tuple[dict[str, Any], Any]:
        return encode_tensor(x.detach().to("cpu", torch.float32).contiguous(), self.config.codec)

    def _expire(self) -> None:
        now = self.clock()
        for key in [k for k, kept in self._kept.items() if kept.deadline <= now]:
            del self._kept[key]

    # --- methods ----------------------------------------------------------------------------------------------

    async def rpc_forward(self, request: Request) -> tuple[dict[str, Any], Any]:
        self._admit(request)
        if self.stage.last:
            raise Refused("the last stage serves 'loss', not 'forward'", code="unsupported")
        mb = _mb_id(request.header)
        check = request.header.get("check") is True
        self._expire()
        key = (request.peer, mb)
        if not check and key not in self._kept and len(self._kept) >= self.config.max_pending:
            raise Refused(f"{len(self._kept)} micro-batches pending", code="busy")
        x = self._input(request.header, await request.payload(self.config.max_tensor_bytes))

        def forward() -> torch.Tensor:
            with torch.no_grad():
                return self.stage(x.to(self.device))  # (B, T, C)

        y = await self._compute(forward, count=not check)
        if not check:
            self._kept[key] = _Kept(x, self.clock() + self.config.pending_timeout_s)
        header, payload = self._encode(y)
        return {"y": header}, payload

    async def rpc_backward(self, request: Request) -> tuple[dict[str, Any], Any]:
        self._admit(request)
        mb = _mb_id(request.header)
        self._expire()
        kept = self._kept.get((request.peer, mb))
        if kept is None:
            raise Refused(f"no kept input for micro-batch {mb!r} (expired or never sent)", code="unknown")
        grad = self._activations(request.header.get("g"), await request.payload(self.config.max_tensor_bytes))
        if tuple(grad.shape[:2]) != tuple(kept.input.shape[:2]):
            raise ProtocolViolation(f"gradient of shape {list(grad.shape)} for input {list(kept.input.shape)}")
        del self._kept[(request.peer, mb)]

        def backward() -> torch.Tensor:
            x = kept.input.to(self.device)
            if not self.stage.first:
                x.requires_grad_(True)
            with torch.enable_grad():
                y = self.stage(x)  # (B, T, C), recomputed from the kept input
            y.backward(grad.to(self.device))
            self._after_backward(x.shape[0])
            return x

        x = await self._compute(backward)
        if self.stage.first:
            return {}, b""
        header, payload = self._encode(x.grad)
        return {"g": header}, payload

    async def rpc_loss(self, request: Request) -> tuple[dict[str, Any], Any]:
        self._admit(request)
        if not self.stage.last:
            raise Refused("only the last stage serves 'loss'", code="unsupported")
        _mb_id(request.header)
        split = request.header.get("x_bytes")
        payload = await request.payload(self.config.max_tensor_bytes)
        if not isinstance(split, int) or isinstance(split, bool) or not 0 <= split <= len(payload):
            raise ProtocolViolation(f"malformed x_bytes {split!r}")
        view = memoryview(payload)
        x = self._activations(request.header.get("x"), view[:split])
        targets = decode_tokens(request.header.get("targets"), bytes(view[split:]), self.stage.config.vocab_size)
        if tuple(targets.shape) != tuple(x.shape[:2]):
            raise ProtocolViolation(f"targets {list(targets.shape)} for activations {list(x.shape)}")
        if request.header.get("check") is True:
            def check_loss() -> torch.Tensor:
                with torch.no_grad():
                    return self.stage(x.to(self.device), targets.to(self.device))

            return {"loss": float(await self._compute(check_loss, count=False))}, b""

        def loss_and_backward() -> tuple[torch.Tensor, torch.Tensor]:
            xd = x.to(self.device).requires_grad_(True)
            with torch.enable_grad():
                loss = self.stage(xd, targets.to(self.device))
            loss.backward()
            self._after_backward(xd.shape[0])
            return loss.detach(), xd.grad

        loss, grad = await self._compute(loss_and_backward)
        header, out = self._encode(grad)
        return {"loss": float(loss), "g": header}, out

    async def rpc_infer(self, request: Request) -> tuple[dict[str, Any], Any]:
        self._admit(request)
        _mb_id(request.header)
        payload = await request.payload(self.config.max_tensor_bytes)
        if not self.stage.last:
            x = self._input(request.header, payload)
            with torch.no_grad():
                header, out = self._encode(self.stage(x.to(self.device)))  # (B, T, C)
            return {"y": header}, out
        split = request.header.get("x_bytes")
        if not isinstance(split, int) or isinstance(split, bool) or not 0 <= split <= len(payload):
            raise ProtocolViolation(f"malformed x_bytes {split!r}")
        view = memoryview(payload)
        x = self._activations(request.header.get("x"), view[:split])
        with torch.no_grad():
            if request.header.get("targets") is None:
                if split != len(payload):
                    raise ProtocolViolation(f"{len(payload) - split} bytes after the activations, no targets")
                logits = self.stage(x.to(self.device))[:, -1]  # (B, V)
                header, out = encode_tensor(logits.to("cpu", torch.float32).contiguous(), "none")
                return {"logits": header}, out
            targets = decode_tokens(request.header.get("targets"), bytes(view[split:]), self.stage.config.vocab_size)
            if tuple(targets.shape) != tuple(x.shape[:2]):
                raise ProtocolViolation(f"targets {list(targets.shape)} for activations {list(x.shape)}")
            loss = self.stage(x.to(self.device), targets.to(self.device))
        return {"loss": float(loss)}, b""

    async def rpc_state(self, request: Request) -> tuple[dict[str, Any], Any]:
        self._admit(request)
        header, payload = encode_tensor(await self.exclusive(lambda: flat_parameters(self.stage)), "none")
        return {"params": header, "steps": self.steps}, payload

    async def rpc_outer(self, request: Request) -> tuple[dict[str, Any], Any]:
        self._admit(request)
        got = self.outer_state() if self.outer_state is not None else None
        if got is None:
            raise Refused("this server holds no outer state of its stage", code="no-outer")
        theta, momentum, outer_round = got
        header, payload = encode_tensor(torch.stack([theta, momentum]).to("cpu", torch.float32), "none")
        return {"outer": header, "outer_round": outer_round}, payload

    async def call_local(self, peer: str, method: str, header: dict[str, Any], payload: Any) -> Message:
        """Serve a call of this peer's own trainer without a stream (libp2p refuses to dial its own host): the same
        handler and checks as a remote call. Raises what the handler raises (RpcError, ValueError)."""
        parts = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else list(payload)
        data = b"".join(memoryview(part).cast("B").tobytes() for part in parts)
        handler = getattr(self, f"rpc_{method}", None)
        if handler is None:
            raise Refused(f"no method {method!r}", code="unsupported")
        reply_header, reply_payload = await handler(_LocalRequest(peer, dict(header), data))
        parts = [reply_payload] if isinstance(reply_payload, (bytes, bytearray, memoryview)) else list(reply_payload)
        out = b"".join(memoryview(part).cast("B").tobytes() for part in parts)
        return Message(reply_header, out, len(out))

    async def _compute(self, fn: Callable[[], Any], count: bool = True) -> Any:
        """``fn()`` where this stage computes (its worker thread, or here); its time is added to ``compute_s``
        unless ``count`` is False (spot-checks are not the work the throughput describes)."""
        def timed() -> Any:
            start = time.perf_counter()
            out = fn()
            if count:
                self.compute_s += time.perf_counter() - start
            return out

        if self._executor is None:
            return timed()
        return await asyncio.get_running_loop().run_in_executor(self._executor, timed)

    async def exclusive(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` with no forward, backward or step of this stage running meanwhile (e.g. reading or loading
        the stage's parameters while compute runs in the worker thread)."""
        return await self._compute(fn, count=False)

    async def stop(self) -> None:
        await super().stop()
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    def _after_backward(self, samples: int) -> None:
        self.backwards += 1
        self.samples += samples
        if self.optimizer is not None and self.backwards % self.step_every == 0:
            if self.step_every > 1:  # the mean gradient of the step_every micro-batches, not their sum
                for p in self.stage.parameters():
                    if p.grad is not None:
                        p.grad.div_(self.step_every)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.steps += 1

    @property
    def throughput(self) -> Optional[float]:
        """Samples per second of compute (forward + backward) so far, or None before the first backward."""
        return self.samples / self.compute_s if self.samples and self.compute_s > 0 else None

    @property
    def pending(self) -> int:
        """Micro-batches whose input is kept for a backward."""
        return len(self._kept)


# ------------------------------------------------------------------------------------------------------- trainer


class PipelineTrainer:
    """Push micro-batches forward and backward through the stages, one server per stage chosen by ``wiring``.

    A failed call (timeout, unreachable, refusal, invalid reply) bans that server in the wiring and the call is
    retried on another server of the same stage, up to ``config.max_retries`` times; a backward whose server failed
    is redone on a replica as forward + backward from the input this trainer relayed. A micro-batch that runs out
    of servers is dropped, logged and counted; ``wiring.stats`` accounts for every micro-batch sent.

    Spot-checks (reliability row B9, ``config.spot_check_prob``): a checked call's input is recomputed (a
    ``"check"`` request: nothing kept, no gradient) and the outputs compared (:func:`outputs_agree`; the loss on the
    last stage, the activations elsewhere). The referee is this trainer's own copy of the stage when it serves it
    (``local_stage``): trusted, so one disagreement bans the server. Otherwise another replica answers; if it
    disagrees, a third replica decides by majority: the odd one out is banned (the checked server: the call fails
    and is retried on another server, like any failure; a lying checker: banned, the call stands). With only two
    replicas that disagree nobody can tell which lies: the check counts as unresolved (logged, nobody banned).
    Counts in ``wiring.stats`` (``spot_checks``, ``spot_check_bans``, ``spot_check_unresolved``).

    Args:
        streams: this peer's ``PeerStreams``.
        service_of: stage index -> the stages' service name.
        wiring: the stochastic wiring (its servers kept current by the owner).
        config: codec, timeouts, retries, size limits, spot-checks.
        d_model: width of the activations, to check replies.
        local_stage: stage index -> this peer's own :class:`StageService` of that stage, or None: the wiring may
            choose this peer for that stage and it is then called in-process (no dial to itself); the spot-check
            referee.
        rng: draws which calls are spot-checked and the checking replicas.
    """

    def __init__(self, streams: Any, service_of: Callable[[int], str], wiring: Wiring, config: SwarmConfig,
                 *, d_model: int, clock: Callable[[], float] = time.monotonic,
                 local_stage: Optional[Callable[[int], Optional["StageService"]]] = None,
                 rng: Optional[random.Random] = None) -> None:
        self.streams, self.service_of, self.wiring, self.config = streams, service_of, wiring, config
        self.d_model = d_model
        self.clock = clock
        self.local_stage = local_stage
        self.rng = rng if rng is not None else random.Random()
        self._next_id = 0

    @property
    def num_stages(self) -> int:
        return len(self.wiring.stages)

    def _reply_tensor(self, header: Any, payload: bytes, shape: tuple[int, ...]) -> torch.Tensor:
        return decode_tensor(header, payload, shape=shape, dtype=torch.float32, codecs=(self.config.codec, "none"))

    async def _on_some_server(self, stage: int, samples: int, what: str,
                              attempt: Callable[[str], Any], prefer: Optional[str] = None) -> Any:
        """Run ``await attempt(server)`` on a server of ``stage`` (``prefer`` first if it is usable), retrying on
        others; raises NoServer."""
        tried: list[str] = []
        balancer = self.wiring.stages[stage]
        for i in range(self.config.max_retries + 1):
            if i == 0 and prefer in balancer.servers and not balancer.bans.is_banned(prefer):
                server = prefer
            else:
                server = balancer.choose(samples, exclude=tried)
            tried.append(server)
            if i > 0:
                self.wiring.stats.retried += 1
            start = self.clock()
            try:
                result = await attempt(server)
            except (RpcError, ValueError) as e:  # ValueError: a reply that decodes to the wrong thing
                logger.info("stage %d %s on %s failed (%s): trying another server", stage, what, server, e)
                self.wiring.fail(stage, server, f"{what}: {type(e).__name__}: {e}")
                continue
            self.wiring.stages[stage].report(server, samples, self.clock() - start)
            return server, result
        raise NoServer(f"stage {stage} {what}: {len(tried)} servers failed")

    async def _call(self, server: str, stage: int, method: str, header: dict[str, Any], payload: Any):
        own = self.local_stage(stage) if self.local_stage is not None else None
        if own is not None and server == getattr(self.streams, "peer_id", None):
            return await own.call_local(server, method, header, payload)
        return await call(self.streams, server, self.service_of(stage), method, header, payload,
                          timeout_s=self.config.call_timeout_s, max_reply_bytes=self.config.max_tensor_bytes)

    def _stage_input(self, stage: int, mb: str, x: torch.Tensor) -> tuple[dict[str, Any], Any]:
        """The request header and payload of a ``forward`` or ``infer`` call into ``stage`` (not the last) for
        micro-batch ``mb``: stage 0 takes token ids (int64 (B, T), see :func:`encode_tokens`), the others the
        activations (float32 (B, T, d_model)) in the configured codec."""
        if stage == 0:
            tokens_header, payload = encode_tokens(x)
            return {"mb": mb, "tokens": tokens_header}, payload
        x_header, payload = encode_tensor(x, self.config.codec)
        return {"mb": mb, "x": x_header}, payload

    async def _forward(self, stage: int, server: str, mb: str, x: torch.Tensor,
                       checking: bool = False) -> torch.Tensor:
        header, payload = self._stage_input(stage, mb, x)
        check = {"check": True} if checking else {}
        reply = await self._call(server, stage, "forward", {**header, **check}, payload)
        B, T = x.shape[:2]
        y = self._reply_tensor(reply.header.get("y"), reply.payload, (B, T, self.d_model))
        if not checking and self._draw_check(server):
            async def ask(s: str) -> torch.Tensor:
                return await self._forward(stage, s, mb, x, checking=True)

            await self._spot_check(stage, server, y, ask, lambda module: module(x))
        return y

    async def _backward(self, stage: int, server: str, mb: str, x: torch.Tensor, grad: torch.Tensor):
        g_header, payload = encode_tensor(grad, self.config.codec)
        reply = await self._call(server, stage, "backward", {"mb": mb, "g": g_header}, payload)
        if stage == 0:
            return None
        return self._reply_tensor(reply.header.get("g"), reply.payload, tuple(x.shape))

    def _path(self, path: Optional[Sequence[int]]) -> list[int]:
        last = self.num_stages - 1
        if path is None:
            return list(range(self.num_stages))
        path = list(path)
        if not path or path[0] != 0 or path[-1] != last or any(a >= b for a, b in zip(path, path[1:])):
            raise ValueError(f"a path must increase from stage 0 to stage {last}, got {path}")
        return path

    async def step(self, tokens: torch.Tensor, targets: torch.Tensor, path: Optional[Sequence[int]] = None,
                   prefer: Optional[Mapping[int, str]] = None) -> Optional[float]:
        """One micro-batch: forward through the stages of ``path``, loss at the last, gradients back.

        Args:
            tokens, targets: int64 (B, T) on the CPU.
            path: the stages to visit, increasing from 0 to S - 1 (None: all). A stage left out is the identity
                (SkipPipe, arXiv 2502.19913): its input goes on unchanged and gets no gradient.
            prefer: stage -> the server to try first there (e.g. from :func:`protocols.skippipe.schedule`); the
                wiring chooses where none is given or it is banned.

        Raises:
            ValueError: ``path`` does not increase from 0 to S - 1 (nothing is sent then).

        Returns:
            The micro-batch's loss (mean nats per token), or None if it was dropped (counted in
            ``wiring.stats.dropped``).
        """
        visits = self._path(path)  # a bad path raises before the micro-batch counts as sent
        mb = f"{self._next_id}"
        self._next_id += 1
        stats = self.wiring.stats
        stats.sent += 1
        samples = tokens.shape[0]
        prefer = prefer or {}
        inputs: list[torch.Tensor] = []
        used: list[str] = []
        try:
            x = tokens
            for k in visits[:-1]:
                inputs.append(x)
                server, x = await self._on_some_server(
                    k, samples, "forward", lambda s, k=k, x=x: self._forward(k, s, mb, x), prefer.get(k))
                used.append(server)
            x_header, x_payload = encode_tensor(x, self.config.codec)
            t_header, t_payload = encode_tokens(targets)
            header = {"mb": mb, "x": x_header, "x_bytes": len(memoryview(x_payload).cast("B")),
                      "targets": t_header}

            last = self.num_stages - 1

            async def ask_loss(server: str) -> torch.Tensor:
                reply = await self._call(server, last, "loss", {**header, "check": True}, [x_payload, t_payload])
                return torch.tensor([_loss_of(reply.header)])

            async def loss_on(server: str) -> tuple[float, torch.Tensor]:
                reply = await self._call(server, last, "loss", header, [x_payload, t_payload])
                loss = _loss_of(reply.header)
                grad = self._reply_tensor(reply.header.get("g"), reply.payload, tuple(x.shape))
                if self._draw_check(server):
                    await self._spot_check(last, server, torch.tensor([loss]), ask_loss,
                                           lambda module: module(x, targets).reshape(1))
                return loss, grad

            _, (loss, grad) = await self._on_some_server(self.num_stages - 1, samples, "loss", loss_on,
                                                         prefer.get(self.num_stages - 1))
            for i in reversed(range(len(visits) - 1)):
                grad = await self._backward_with_retry(visits[i], used[i], mb, inputs[i], grad)
        except NoServer as e:
            stats.dropped += 1
            logger.warning("micro-batch %s dropped: %s", mb, e)
            return None
        stats.completed += 1
        return loss

    async def infer(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None,
                    path: Optional[Sequence[int]] = None) -> float | torch.Tensor:
        """Forward only (no server keeps anything, no parameter changes) through the stages of ``path`` (None:
        all; a stage left out is the identity).

        Args:
            tokens: int64 (B, T) on the CPU; targets: int64 (B, T) or None.

        Returns:
            The loss (mean nats per token) with targets; the next-token logits at the last position (B, V)
            without. Raises :class:`NoServer` if a visited stage has no server left to try.
        """
        visits = self._path(path)
        mb = f"i{self._next_id}"
        self._next_id += 1
        samples = tokens.shape[0]
        x = tokens
        for k in visits[:-1]:
            async def forward(server: str, k: int = k, x: torch.Tensor = x) -> torch.Tensor:
                header, payload = self._stage_input(k, mb, x)
                reply = await self._call(server, k, "infer", header, payload)
                return self._reply_tensor(reply.header.get("y"), reply.payload, (*tokens.shape, self.d_model))

            _, x = await self._on_some_server(k, samples, "infer", forward)
        x_header, x_payload = encode_tensor(x, self.config.codec)
        header: dict[str, Any] = {"mb": mb, "x": x_header, "x_bytes": len(memoryview(x_payload).cast("B"))}
        parts: list[Any] = [x_payload]
        if targets is not None:
            header["targets"], t_payload = encode_tokens(targets)
            parts.append(t_payload)

        async def last(server: str) -> float | torch.Tensor:
            reply = await self._call(server, self.num_stages - 1, "infer", header, parts)
            if targets is None:
                logits = decode_tensor(reply.header.get("logits"), reply.payload, dtype=torch.float32,
                                       codecs=("none",))
                if logits.dim() != 2 or logits.shape[0] != samples or not torch.isfinite(logits).all():
                    raise ProtocolViolation(f"malformed logits of shape {list(logits.shape)}")
                return logits
            loss = reply.header.get("loss")
            if not isinstance(loss, float) or not np.isfinite(loss):
                raise ProtocolViolation(f"malformed loss {loss!r}")
            return loss

        _, out = await self._on_some_server(self.num_stages - 1, samples, "infer", last)
        return out

    def _draw_check(self, server: str) -> bool:
        p = self.config.spot_check_prob
        return p > 0 and server != getattr(self.streams, "peer_id", None) and self.rng.random() < p

    async def _spot_check(self, stage: int, server: str, output: torch.Tensor,
                          ask: Callable[[str], Any], local: Callable[[nn.Module], torch.Tensor]) -> None:
        """Check ``server``'s ``output`` of ``stage`` (see the class docstring). Raises ProtocolViolation if the
        server is found lying; bans a lying checker; returns otherwise."""
        stats, tol = self.wiring.stats, self.config.spot_check_tolerance
        own = self.local_stage(stage) if self.local_stage is not None else None
        if own is not None:
            stats.spot_checks += 1

            def recompute() -> torch.Tensor:
                with torch.no_grad():
                    return local(own.stage).detach().to("cpu", torch.float32)

            if outputs_agree(output, await own.exclusive(recompute), tol):
                return
            stats.spot_check_bans += 1
            raise ProtocolViolation(f"spot-check: stage {stage} output disagrees with this trainer's own copy")
        balancer = self.wiring.stages[stage]
        others = [s for s in balancer.servers if s != server and not balancer.bans.is_banned(s)]
        self.rng.shuffle(others)
        opinions: list[tuple[str, torch.Tensor]] = []
        for checker in others:
            try:
                opinions.append((checker, await ask(checker)))
            except (RpcError, ValueError) as e:
                self.wiring.fail(stage, checker, f"spot-check: {type(e).__name__}: {e}")
                continue
            if len(opinions) == 1:
                stats.spot_checks += 1
                if outputs_agree(output, opinions[0][1], tol):
                    return
            if len(opinions) == 2:
                break
        if not opinions:
            return  # no replica to check against
        if len(opinions) == 1:
            stats.spot_check_unresolved += 1
            logger.warning("spot-check of stage %d: %s and %s disagree and no third opinion is available",
                           stage, server, opinions[0][0])
            return
        (first, y1), (_, y2) = opinions
        if outputs_agree(y1, y2, tol):
            stats.spot_check_bans += 1
            raise ProtocolViolation(f"spot-check: stage {stage} output disagrees with two replicas")
        if outputs_agree(output, y2, tol):
            stats.spot_check_bans += 1
            logger.warning("spot-check of stage %d: checker %s disagrees with two replicas: banned", stage, first)
            self.wiring.fail(stage, first, "spot-check: output disagrees with two replicas")
            return
        stats.spot_check_unresolved += 1
        logger.warning("spot-check of stage %d: three replicas disagree (%s, %s, ...)", stage, server, first)

    async def _backward_with_retry(self, stage: int, server: str, mb: str, x: torch.Tensor, grad: torch.Tensor):
        try:
            return await self._backward(stage, server, mb, x, grad)
        except (RpcError, ValueError) as e:
            logger.info("stage %d backward on %s failed (%s): redoing it on a replica", stage, server, e)
            self.wiring.fail(stage, server, f"backward: {type(e).__name__}: {e}")
            self.wiring.stats.retried += 1

        async def redo(s: str):
            await self._forward(stage, s, mb, x)
            return await self._backward(stage, s, mb, x, grad)

        _, result = await self._on_some_server(stage, x.shape[0], "backward", redo)
        return result
