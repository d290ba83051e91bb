"""A stage's parameters as one flat vector, here (:func:`flat_parameters`, :func:`load_flat_parameters`) and
downloaded from a peer's server with its outer state (:func:`download_stage_parameters`,
:func:`download_outer_state`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from protocols.codecs import decode_tensor
from protocols.rpc import ProtocolViolation, call

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
