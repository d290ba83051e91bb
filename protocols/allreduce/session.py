"""One group's reduction as this peer's reducer sees it: the state shared by the handlers of the members' parts,
the sealer and the answers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from protocols.allreduce.aggregate import ChunkedPartReducer
from protocols.codecs import Codec
from protocols.matchmaking import Group


@dataclass
class _ReduceSession:
    group: Group
    part_numel: int
    bounds: list[tuple[int, int]]
    codec: Codec
    reducer: ChunkedPartReducer
    deadline: float
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set on every chunk arrival and exclusion (the sealer clears it before it waits)."""
    sealed: list = field(default_factory=list)
    """The encoded aggregate of each sealed chunk, in order: the same bytes go to every member."""
    sealed_event: asyncio.Event = field(default_factory=asyncio.Event)
    """Replaced by a fresh event and set on every seal."""
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    excluded: dict[str, str] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    answers: int = 0
    answered: asyncio.Event = field(default_factory=asyncio.Event)
    late_logged: bool = False
    late: list = field(default_factory=list)
    """Members whose request arrived after the sender deadline (read and answered, never added), or who kept sending
    at their pace after it (their chunks sealed without them read and dropped): never banned."""
    downloads: list = field(default_factory=list)
    """Every member's part that arrived whole, as a :data:`protocols.allreduce.parts.TimedStream` (each chunk's
    seconds from our start, and bytes)."""
    answer_written: Callable[[str], None] = lambda peer: None
    """Called with a member once our answer to it was handed over, or will not be (it failed, or was abandoned)."""
    gone: set = field(default_factory=set)
    """Members whose reducer our call could not get an answer from: not waited for (neither excluded nor banned; a
    part they still send is taken for the chunks not sealed yet)."""

    def resolved(self, k: int) -> bool:
        """Every member delivered chunk ``k``, was excluded or is gone."""
        delivered = self.reducer.delivered
        return all(m in self.excluded or m in self.gone or delivered.get(m, 0) > k for m in self.group.members)
