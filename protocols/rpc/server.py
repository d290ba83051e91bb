"""The serving side: a :class:`Service` registers its methods as stream handlers and answers each
:class:`Request`; a handler's failure is a typed refusal, never a hung caller."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Sequence, Union

from protocols.interfaces import StreamHandler, StreamReader, StreamWriter
from protocols.rpc.errors import Refused, RpcError, RpcTimeout, Unreachable, _guard, until
from protocols.rpc.framing import (
    CHUNK_BYTES, Payload, _buffers, _check_framing, _check_keys, _continuation_header, _head_of, _read_body,
    _read_head, handler_name,
)
from protocols.rpc.stream import RpcStream
from protocols.wire import ProtocolViolation, read_payload, try_write_frame, write_frame

logger = logging.getLogger("protocols.rpc")

# -------------------------------------------------------------------------------------------------------- serving


class Request:
    """What a handler receives: the caller's PeerID, the request header, its payload (read on demand).

    ``size`` is the payload length the caller announced: a handler checks it before :meth:`payload` reads it.
    """

    def __init__(self, peer: str, header: dict[str, Any], size: int, first: int, stream: RpcStream,
                 is_stream: bool, head_bytes: int):
        self.peer, self.header, self.size = peer, header, size
        self.stream = stream
        self.is_stream = is_stream
        self.head_bytes = head_bytes
        self.replied = False
        self._first = first
        self._payload: Optional[Union[bytes, bytearray]] = None

    async def payload(self, max_bytes: int, timeout_s: Optional[float] = None) -> Union[bytes, bytearray]:
        """The request payload (read once, then cached). Raises ProtocolViolation if ``size > max_bytes`` (before
        reading) or on a truncated/malformed payload, RpcTimeout, Unreachable."""
        if self._payload is None:
            if self.size > max_bytes:
                raise ProtocolViolation(f"payload of {self.size} bytes exceeds the limit of {max_bytes}")
            self._payload, nbytes = await _guard(
                _read_body(self.stream.reader, self.size, self._first, max_bytes), timeout_s,
                f"reading the request of {self.peer}")
            self.stream.bytes_received += nbytes
        return self._payload

    def _claim_framed_payload(self, sizes: Sequence[int]) -> None:
        """Check that the request was framed as ``sizes`` and mark its payload consumed (payload() may not read it
        again). Raises ProtocolViolation, RuntimeError if the payload was already read."""
        _check_framing(sizes)
        if self._payload is not None:
            raise RuntimeError("the payload was already read")
        if self.size != sum(sizes) or self._first != sizes[0]:
            raise ProtocolViolation(f"payload of {self.size} bytes in a first frame of {self._first}, expected "
                                    f"{sum(sizes)} in {sizes[0]}")
        self._payload = b""

    async def payload_frames(self, sizes: Sequence[int],
                             deadline: Optional[float] = None) -> AsyncIterator[Union[bytes, bytearray]]:
        """The request payload frame by frame, for a caller that framed it as ``sizes`` (:func:`call_framed`).

        Checks the announced total and every frame's size before reading it. ``deadline`` (event loop time) bounds
        the whole read. Raises ProtocolViolation (framed otherwise, truncated, malformed), RpcTimeout, Unreachable.
        """
        self._claim_framed_payload(sizes)
        loop = asyncio.get_running_loop()
        reader, what = self.stream.reader, f"reading the request of {self.peer}"

        def left() -> Optional[float]:
            return None if deadline is None else deadline - loop.time()

        data = await _guard(read_payload(reader, sizes[0]), left(), what)
        self.stream.bytes_received += sizes[0]
        yield data
        for k, size in enumerate(sizes[1:], 1):
            length, header_bytes = await _guard(_continuation_header(reader, k, size), left(), what)
            data = await _guard(read_payload(reader, length), left(), what)
            self.stream.bytes_received += header_bytes + length
            yield data

    async def read_frames(self, sizes: Sequence[int], on_frame: Callable[[int, Union[bytes, bytearray]], None],
                          deadline: Optional[float] = None,
                          extend: Optional[Callable[[int], Optional[float]]] = None) -> None:
        """Read the request payload framed as ``sizes`` (:func:`call_framed`), calling ``on_frame(k, payload)`` for
        each frame in order as it arrives: :meth:`payload_frames` with one timer for the whole read instead of one
        per frame (a pipelined reader pays the event loop per frame, so this matters per byte).

        Checks the announced total and every frame's size before reading it. ``deadline`` (event loop time) bounds
        the whole read; ``extend(k)``, called after frame k was handled, may return a new deadline (a reader that
        gives a sender which keeps its pace more time). Raises ProtocolViolation (framed otherwise, truncated,
        malformed), RpcTimeout, Unreachable; whatever ``on_frame`` or ``extend`` raise propagates.
        """
        self._claim_framed_payload(sizes)
        reader = self.stream.reader
        timeout_at = getattr(asyncio, "timeout_at", None)
        scope = None  # the one timer of the read (Python 3.11+); older Pythons bound each frame by the deadline
        current = deadline

        async def frame(k: int, length: int, header_bytes: int) -> None:
            nonlocal current
            on_frame(k, await read_payload(reader, length))
            self.stream.bytes_received += header_bytes + length
            moved = extend(k) if extend is not None else None
            if moved is not None and moved != current:
                current = moved
                if scope is not None:
                    scope.reschedule(moved)

        def bounded(step: Awaitable[Any]) -> Awaitable[Any]:
            """``step`` under the current deadline where no one timer bounds the whole read."""
            return step if scope is not None or current is None else until(step, current)

        async def read_all() -> None:
            await bounded(frame(0, sizes[0], 0))
            for k, size in enumerate(sizes[1:], 1):
                length, header_bytes = await bounded(_continuation_header(reader, k, size))
                await bounded(frame(k, length, header_bytes))

        what = f"reading the request of {self.peer}"
        try:
            if deadline is not None and timeout_at is not None:
                async with timeout_at(deadline) as scope:
                    await read_all()
            else:
                await read_all()
        except asyncio.TimeoutError:
            raise RpcTimeout(f"{what} did not finish by its deadline") from None
        except (ConnectionError, OSError) as e:
            raise Unreachable(f"{what}: {type(e).__name__}: {e}") from e

    async def reply_frame(self, k: int, sizes: Sequence[int], payload: Payload,
                          header: Optional[dict[str, Any]] = None, timeout_s: Optional[float] = None) -> int:
        """Write frame ``k`` of an answer framed as ``sizes`` (frames in order; ``header`` goes with frame 0);
        returns the bytes written. Raises RpcTimeout, Unreachable; ValueError on a frame of the wrong size."""
        views = _buffers(payload)
        if sum(v.nbytes for v in views) != sizes[k]:
            raise ValueError(f"reply frame {k} holds {sum(v.nbytes for v in views)} bytes, not {sizes[k]}")
        if k == 0:
            if self.replied:
                raise RuntimeError("this request was already answered")
            self.replied = True
            head = _head_of({"status": "ok", **_check_keys(header)}, sizes)
        else:
            head = {}
        written = await _guard(write_frame(self.stream.writer, head, views), timeout_s, f"answering {self.peer}")
        self.stream.bytes_sent += written
        return written

    async def reply(self, header: Optional[dict[str, Any]] = None, payload: Payload = b"",
                    timeout_s: Optional[float] = None) -> int:
        """Answer a call now (instead of returning the answer); returns the bytes written.

        Raises RpcTimeout, Unreachable; RuntimeError if already answered.
        """
        if self.replied:
            raise RuntimeError("this request was already answered")
        self.replied = True
        return await self.stream.send(header, payload, timeout_s)

    async def remote_closed(self) -> None:
        """Return once the caller's side of a call is closed or broken (a caller sends nothing after its request,
        so any further byte counts as closed too). Reads the stream: do not use with :meth:`payload` pending."""
        try:
            await self.stream.reader.readexactly(1)
        except Exception:  # boundary: EOF, reset, or a transport's own stream error (p2pd): all mean closed
            pass


#: A method handler: ``await handler(request)`` -> None (answered via request.reply / a stream), a header dict,
#: or ``(header, payload)``. Raising Refused refuses; any other exception is a refusal with code "internal".
MethodHandler = Callable[[Request], Awaitable[Any]]


class Service:
    """A named set of methods served on peer streams; each method is a stream handler ``<name>.<method>``.

    Subclasses set :attr:`name` and define ``async def rpc_<method>(self, request)`` (or override
    :meth:`methods` to return a table). :meth:`start` registers every method, :meth:`stop` removes them.
    A request head must arrive within :attr:`request_timeout_s`; a head that is late or malformed is reported to
    :meth:`on_bad_request` (where a protocol bans the peer) and refused.
    """

    name: str = ""
    request_timeout_s: float = 30.0
    chunk_bytes: int = CHUNK_BYTES
    transport: Any = None

    def methods(self) -> dict[str, MethodHandler]:
        """``{method: handler}``; by default every ``rpc_<method>`` of this object (looked up once)."""
        table = self.__dict__.get("_methods")
        if table is None:
            table = {attr[4:]: getattr(self, attr) for attr in dir(type(self)) if attr.startswith("rpc_")}
            self.__dict__["_methods"] = table
        return table

    def handler_name_of(self, method: str) -> str:
        return handler_name(self.name, method)

    def stream_handler(self, method: str) -> StreamHandler:
        """The stream handler registered for ``method`` (a seam for wrappers and tests)."""
        return functools.partial(self.serve, method)

    async def start(self, transport: Any = None) -> None:
        """Serve every method on ``transport.streams`` (or on ``transport`` itself if it is a PeerStreams; by
        default on :attr:`transport`). Raises ValueError if a handler name is already served."""
        target = transport if transport is not None else self.transport
        streams = getattr(target, "streams", target)
        registered: list[str] = []
        complete = False
        try:
            for method in self.methods():
                name = self.handler_name_of(method)
                await streams.add_handler(name, self.stream_handler(method))
                registered.append(name)
            complete = True
        finally:
            if not complete:  # a name already served, or we were cancelled: serve none of them
                for name in registered:
                    await streams.remove_handler(name)
        self._served = (streams, registered)

    async def stop(self) -> None:
        """Stop serving (no-op if not started)."""
        streams, registered = getattr(self, "_served", (None, []))
        for name in registered:
            await streams.remove_handler(name)
        self._served = (None, [])

    def on_bad_request(self, peer: str, method: str, error: RpcError) -> None:
        """Called when ``peer`` sent a malformed request (ProtocolViolation) or did not deliver it in time
        (RpcTimeout). Default: log. Protocols override it to ban."""
        logger.warning("bad %s request from %s: %s", self.handler_name_of(method), peer, error)

    async def serve(self, method: str, peer: str, reader: StreamReader, writer: StreamWriter) -> None:
        """Serve one incoming stream of ``method``: read the request head, run the handler, answer."""
        stream = RpcStream(reader, writer, peer, caller=False, chunk_bytes=self.chunk_bytes)
        request: Optional[Request] = None
        try:
            try:
                header, total, first, nbytes = await _guard(_read_head(reader), self.request_timeout_s,
                                                            f"the request head of {peer}")
                stream.bytes_received += nbytes
                is_stream = header.pop("_stream", None) is True
                request = Request(peer, header, total, first, stream, is_stream, nbytes)
            except (ProtocolViolation, RpcTimeout) as e:
                self.on_bad_request(peer, method, e)
                raise
            result = await self.methods()[method](request)
            if isinstance(result, dict):
                result = (result, b"")
            if result is not None:
                await request.reply(*result)
            elif not request.is_stream and not request.replied:
                await request.reply()
            if request.is_stream:
                await stream.end()
        except Refused as e:
            await _try_refuse(writer, e.code, e.reason)
        except ProtocolViolation as e:
            if request is not None:  # raised by the handler while reading: head violations were reported above
                self.on_bad_request(peer, method, e)
            await _try_refuse(writer, "protocol", str(e))
        except (RpcTimeout, asyncio.TimeoutError) as e:  # (TimeoutError is an OSError: before the next clause)
            await _try_refuse(writer, "timeout", str(e) or "handler timed out")
        except (Unreachable, ConnectionError, OSError) as e:
            logger.debug("%s: %s went away: %s", self.handler_name_of(method), peer, e)
        except Exception as e:  # noqa: BLE001 - boundary: any failure of a protocol's handler is answered as a
            # refusal ("internal") instead of hanging the caller
            logger.exception("handler %s failed for %s", self.handler_name_of(method), peer)
            await _try_refuse(writer, "internal", f"{type(e).__name__}: {e}")


async def _try_refuse(writer: StreamWriter, code: str, reason: str) -> None:
    await try_write_frame(writer, {"status": "refused", "code": code, "reason": reason[:1000]})
