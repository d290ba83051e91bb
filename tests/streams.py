"""Stream helpers shared by tests."""

import asyncio
import types


class CountingReader:
    """Wraps a stream reader and counts every byte consumed from it (a partial read that hit EOF included), so a
    test can assert that a size check refused a message before its body was read."""

    def __init__(self, inner):
        self.inner, self.n = inner, 0

    async def readexactly(self, n):
        try:
            data = await self.inner.readexactly(n)
        except asyncio.IncompleteReadError as e:
            self.n += len(e.partial)
            raise
        self.n += len(data)
        return data


class StreamsWrapper:
    """Streams that pass everything to ``inner``; a test subclasses it and overrides :meth:`open` to observe or
    disturb the streams a peer opens."""

    def __init__(self, inner):
        self.inner = inner

    @property
    def peer_id(self):
        return self.inner.peer_id

    async def add_handler(self, name, handler):
        await self.inner.add_handler(name, handler)

    async def remove_handler(self, name):
        await self.inner.remove_handler(name)

    async def open(self, peer_id, name):
        return await self.inner.open(peer_id, name)


class BrokenReader:
    """A handler's reader of one stream whose connection is lost once ``budget`` bytes were read: ConnectionResetError,
    as a multiplexed connection's streams raise when it drops. Counts each break in ``fired``."""

    def __init__(self, inner, budget: int, fired: list):
        self.inner, self.budget, self.fired = inner, budget, fired
        self.read = 0

    async def readexactly(self, n):
        if self.read + n > self.budget:
            self.fired.append(n)
            raise ConnectionResetError("connection lost")
        data = await self.inner.readexactly(n)
        self.read += len(data)
        return data

    def __getattr__(self, name):
        return getattr(self.inner, name)


class BreakingHandler(StreamsWrapper):
    """Serves the streams that ``victim`` opens to handlers named ``*suffix`` through a :class:`BrokenReader`."""

    def __init__(self, inner, suffix: str, victim: str, budget: int, fired: list):
        super().__init__(inner)
        self.suffix, self.victim, self.budget, self.fired = suffix, victim, budget, fired

    async def add_handler(self, name, handler):
        if not name.endswith(self.suffix):
            return await self.inner.add_handler(name, handler)

        async def breaking(peer, reader, writer):
            if peer == self.victim:
                reader = BrokenReader(reader, self.budget, self.fired)
            return await handler(peer, reader, writer)

        await self.inner.add_handler(name, breaking)


def breaking_transport(transport, suffix: str, victim: str, budget: int, fired: list):
    """``transport`` (discovery + streams) whose handlers named ``*suffix`` read ``victim``'s streams through a
    :class:`BrokenReader` (see :class:`BreakingHandler`)."""
    return types.SimpleNamespace(discovery=transport.discovery,
                                 streams=BreakingHandler(transport.streams, suffix, victim, budget, fired))
