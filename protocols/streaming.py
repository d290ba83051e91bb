"""Streaming DiLoCo's fragments and their staggered schedule: pure functions, no I/O.

Douillard et al. 2025, "Streaming DiLoCo with overlapping communication", arXiv 2501.18512, sec. 2.2: the model is
cut into F fragments and each fragment has its own outer state and its own outer round every H inner steps, the F
rounds staggered by H/F steps, so that at most one fragment (1/F of the model) is on the wire at a time and the peak
bandwidth is F times lower than syncing the whole model every H steps. The paper's best fragments are *strided*:
fragment p holds the repeated blocks p, p+F, p+2F, ... (so every fragment spans the depth of the network).

Every peer derives the same fragments from the same parameter names (:func:`strided_fragments`) and the same
schedule from (H, F) (:class:`FragmentSchedule`), so peers agree without exchanging either.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["FragmentSchedule", "strided_fragments"]

#: The repeated block a parameter belongs to: the name up to its first numeric component ("blocks.3.attn.w" ->
#: "blocks.3").
_BLOCK = re.compile(r"^((?:[^.]+\.)*?\d+)\.")


def strided_fragments(names: Sequence[str], numels: Sequence[int], fragments: int) -> list[tuple[str, ...]]:
    """Cut parameters into ``fragments`` strided fragments (arXiv 2501.18512, sec. 2.2, "strided" pattern).

    ``names``: parameter names in model order; ``numels``: their element counts. Parameters of the same repeated
    block (``blocks.<i>.*``) stay together; the k-th block goes to fragment ``k % fragments``; each parameter outside
    the blocks (embeddings, final norm) goes, in model order, to the fragment with the fewest elements so far (ties:
    the lowest index). Returns ``fragments`` tuples of names, each in model order; together they hold every name
    exactly once. Raises ValueError if ``fragments < 1``, the lengths differ, or a fragment would be empty.
    """
    if fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {fragments}")
    if len(names) != len(numels):
        raise ValueError(f"{len(names)} names but {len(numels)} element counts")
    block_of: dict[str, str] = {}
    blocks: dict[str, int] = {}  # block -> its index in model order
    for name in names:
        match = _BLOCK.match(name)
        if match:
            block_of[name] = match.group(1)
            blocks.setdefault(match.group(1), len(blocks))
    assign: dict[str, int] = {}
    sizes = [0] * fragments
    for name, numel in zip(names, numels):
        if name in block_of:
            p = blocks[block_of[name]] % fragments
            assign[name] = p
            sizes[p] += numel
    for name, numel in zip(names, numels):
        if name not in block_of:
            p = min(range(fragments), key=lambda i: (sizes[i], i))
            assign[name] = p
            sizes[p] += numel
    out = [tuple(n for n in names if assign[n] == p) for p in range(fragments)]
    empty = [p for p, names_p in enumerate(out) if not names_p]
    if empty:
        raise ValueError(f"{fragments} fragments leave fragment {empty[0]} empty: the model has {len(blocks)} blocks "
                         f"and {len(names) - len(block_of)} other parameters")
    return out


@dataclass(frozen=True)
class FragmentSchedule:
    """When each of F fragments has its outer round, within a cycle of H inner steps.

    Fragment p's round comes after inner step ``(p + 1) * H / F`` of each cycle (steps counted from 1), so fragment
    ``F - 1`` syncs at the end of the cycle, as the whole model does with F = 1 (today's DiLoCo). Raises ValueError
    unless ``1 <= F <= H`` and F divides H.
    """

    inner_steps: int
    fragments: int

    def __post_init__(self) -> None:
        if self.fragments < 1 or self.inner_steps < 1:
            raise ValueError(f"need H >= 1 and F >= 1, got H={self.inner_steps}, F={self.fragments}")
        if self.inner_steps % self.fragments:
            raise ValueError(f"F={self.fragments} fragments must divide H={self.inner_steps} inner steps: each "
                             "fragment syncs every H/F steps")

    @property
    def stride(self) -> int:
        """H / F: inner steps between two consecutive fragment rounds."""
        return self.inner_steps // self.fragments

    def due(self, step_in_cycle: int) -> Optional[int]:
        """The fragment whose round comes after inner step ``step_in_cycle`` (1..H) of a cycle, or None."""
        if step_in_cycle < 1 or step_in_cycle > self.inner_steps or step_in_cycle % self.stride:
            return None
        return step_in_cycle // self.stride - 1

    def next_boundary(self, step_in_cycle: int) -> int:
        """The first step (1..H) of the cycle after ``step_in_cycle`` (0..H-1) at which a fragment round is due."""
        return (step_in_cycle // self.stride + 1) * self.stride
