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
