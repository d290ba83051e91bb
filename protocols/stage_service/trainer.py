"""The trainer's side of a SWARM pipeline: :class:`PipelineTrainer` pushes micro-batches forward and backward through
one server per stage, retries on replicas and spot-checks the servers."""

from __future__ import annotations

import logging
import random
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import nn

from protocols.codecs import decode_tensor, encode_tensor
from protocols.rpc import ProtocolViolation, RpcError, call
from protocols.stage_service.messages import _loss_of, encode_tokens
from protocols.stage_service.server import StageService
from protocols.swarm import NoServer, SwarmConfig, Wiring

logger = logging.getLogger("protocols.stage_service")


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
