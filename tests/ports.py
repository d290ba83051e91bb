"""Port helpers shared by tests."""

import asyncio


async def closed_port() -> int:
    """A 127.0.0.1 TCP port that nothing listens on (bound, then closed: a connect to it is refused)."""
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    return port
