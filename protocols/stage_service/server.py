"""The server's side of a SWARM pipeline stage: :class:`StageService` (its methods: :mod:`protocols.stage_service`)."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from protocols.bans import BanList
from protocols.codecs import TensorHeader, decode_tensor, encode_tensor
from protocols.rpc import Message, ProtocolViolation, Refused, Request, RpcError, Service
from protocols.stage_service.messages import _mb_id, decode_tokens
from protocols.stage_service.parameters import flat_parameters
from protocols.swarm import SwarmConfig

logger = logging.getLogger("protocols.stage_service")


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
