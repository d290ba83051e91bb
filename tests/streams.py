"""Stream helpers shared by tests."""

import asyncio


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
