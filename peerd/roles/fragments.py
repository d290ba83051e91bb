"""Named parameter fragments: the unit an outer-sync strategy averages.

A :class:`Fragment` names a set of a model's parameters, the group scope its rounds use, and its weight. DiLoCo
syncs the whole model as one fragment (:func:`whole_model`); SWARM syncs one fragment per stage, SPES the shared
parameters plus one per expert, Streaming DiLoCo (Douillard et al. 2025, sec. 2.2) F staggered fragments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from peerd.identity.namespace import RunNamespace
from protocols.diloco import OuterState


@dataclass(frozen=True)
class Fragment:
    """``parameters``: names from ``model.named_parameters()``, in model order. ``scope``: the prefix of its group
    keys and stream handlers. ``weight``: its share in a round's weighting (1.0: the samples it saw)."""

    name: str
    parameters: tuple[str, ...]
    scope: str
    weight: float = 1.0

    def _params(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        named = dict(model.named_parameters())
        return [named[n] for n in self.parameters]

    def numel(self, model: torch.nn.Module) -> int:
        return sum(p.numel() for p in self._params(model))

    def flatten(self, model: torch.nn.Module) -> torch.Tensor:
        """Fresh fp32 CPU copy of the fragment's parameters, concatenated in order. Returns (P,), in page-locked
        (pinned) host memory when they live on a CUDA GPU: the copies then run asynchronously at the bus's speed
        (one wait at the end), and the outer state derived from it stays pinned for the copies back."""
        params = self._params(model)
        pinned = any(p.is_cuda for p in params)
        flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32, pin_memory=pinned)  # (P,)
        offset = 0
        for p in params:
            flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1), non_blocking=pinned)
            offset += p.numel()
        if pinned:
            torch.cuda.synchronize(next(p.device for p in params if p.is_cuda))
        return flat

    def load_(self, model: torch.nn.Module, flat: torch.Tensor) -> None:
        """Copy ``flat`` (P,) into the fragment's parameters in place. Raises ValueError on a wrong shape."""
        params = self._params(model)
        total = sum(p.numel() for p in params)
        if flat.dim() != 1 or flat.numel() != total:
            raise ValueError(f"fragment {self.name!r} has {total} parameters, got a tensor of shape {tuple(flat.shape)}")
        offset = 0
        with torch.no_grad():
            for p in params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p).to(device=p.device, dtype=p.dtype))
                offset += p.numel()


def whole_model(model: torch.nn.Module, ns: RunNamespace, role: str) -> Fragment:
    """The whole model as one fragment named ``model``. Its group keys are the role's own (``ns.prefix(role)``,
    unscoped): a run that syncs the whole model uses the keys it always did."""
    return Fragment("model", tuple(name for name, _ in model.named_parameters()), ns.prefix(role))


def fragment(model: torch.nn.Module, name: str, parameters: tuple[str, ...], ns: RunNamespace, role: str,
             weight: float = 1.0) -> Fragment:
    """A fragment of some of ``model``'s parameters, with group keys scoped to it (``ns.scoped(fragment=name)``).
    Raises KeyError naming a parameter the model does not have."""
    named = dict(model.named_parameters())
    missing = [p for p in parameters if p not in named]
    if missing:
        raise KeyError(f"fragment {name!r}: the model has no parameters {missing}")
    return Fragment(name, tuple(parameters), ns.scoped(fragment=name).prefix(role), weight)


class FragmentState:
    """The outer state of one fragment, shared by the role and the fragment's outer-sync strategy.

    ``outer``: theta_outer and momentum (:class:`OuterState`; replaced, never mutated). ``round_start_theta``: the
    theta_outer the current local steps started from (the mixing methods' pseudo-gradient is taken against it, as
    gossip may mix ``outer`` meanwhile). ``gossip_weight``: the weight this peer's state carries in gossip.
    """

    def __init__(self, fragment: Fragment, outer: OuterState, gossip_weight: float):
        self.fragment = fragment
        self.outer = outer
        self.round_start_theta = outer.theta
        self.gossip_weight = gossip_weight

    def reset_to_outer(self, model: torch.nn.Module, outer: Optional[OuterState] = None) -> None:
        """theta_local := theta_outer (``outer`` adopted first if given); the next local steps start from it."""
        if outer is not None:
            self.outer = outer
        theta = self.outer.theta
        if not theta.is_pinned() and any(p.is_cuda for p in self.fragment._params(model)):
            # a GPU trains: theta_outer moves to page-locked memory once (a resumed or downloaded state comes in
            # ordinary memory); OuterState.apply keeps every later theta there
            self.outer = OuterState(theta.pin_memory(), self.outer.momentum, self.outer.outer_round)
        self.fragment.load_(model, self.outer.theta)
        self.round_start_theta = self.outer.theta
