"""The default transport: hivemind's Kademlia DHT for discovery and its libp2p daemon (p2pd) for peer streams.

The DHT runs in a child process with its own p2pd; this process attaches a second client to the same p2pd
(``DHT.replicate_p2p``), so both share one PeerID and one set of listening sockets. Peer streams are raw libp2p
streams (``add_binary_stream_handler``): peerd frames them itself (:mod:`protocols.wire`), avoiding a protobuf message
per tensor part.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time

from peerd.transport.linger import CLOSE_LINGER_S, until_remote_closes
from protocols.interfaces import Record, StreamHandler

logger = logging.getLogger(__name__)


class HivemindDiscovery:
    """:class:`protocols.interfaces.Discovery` on a running :class:`hivemind.DHT`."""

    def __init__(self, dht: hivemind.DHT):
        self.dht = dht

    def time(self) -> float:
        return get_dht_time()

    async def store(self, key: str, subkey: str, value: Any, expiration_time: float) -> bool:
        return bool(await self.dht.store(key, value, expiration_time, subkey=subkey, return_future=True))

    async def get(self, key: str) -> dict[str, Record]:
        found = await self.dht.get(key, latest=True, return_future=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        now = self.time()
        return {
            str(subkey): Record(item.value, item.expiration_time)
            for subkey, item in found.value.items()
            if item.expiration_time > now
        }


# the p2pd close-order quirk: a served stream stays open until the remote closed it (see peerd.transport.linger)
_until_remote_closes = until_remote_closes


class HivemindStreams:
    """:class:`protocols.interfaces.PeerStreams` on p2pd binary streams."""

    def __init__(self, p2p: P2P):
        self.p2p = p2p
        self._peer_id = p2p.peer_id.to_base58()
        self._served: set[str] = set()

    @property
    def peer_id(self) -> str:
        return self._peer_id

    async def add_handler(self, name: str, handler: StreamHandler) -> None:
        if name in self._served:
            raise ValueError(f"handler {name!r} is already served")

        async def serve(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await handler(info.peer_id.to_base58(), reader, writer)
            except Exception:
                logger.exception("stream handler %s failed for %s", name, info.peer_id)
            else:
                await _until_remote_closes(reader, CLOSE_LINGER_S)
            finally:
                with contextlib.suppress(Exception):
                    writer.close()

        await self.p2p.add_binary_stream_handler(name, serve)
        self._served.add(name)

    async def remove_handler(self, name: str) -> None:
        if name in self._served:
            self._served.discard(name)
            with contextlib.suppress(Exception):
                await self.p2p.remove_binary_stream_handler(name)

    async def open(self, peer_id: str, name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), name)
        except (ConnectionError, OSError):
            raise
        except Exception as e:  # p2pd reports dial failures as ControlFailure / P2PDaemonError
            raise ConnectionError(f"cannot open {name!r} to {peer_id}: {e}") from e
        return reader, writer


@dataclass
class HivemindTransport:
    """Discovery and streams of one peer on hivemind. Create with :meth:`create`, release with :meth:`shutdown`."""

    dht: hivemind.DHT
    discovery: HivemindDiscovery
    streams: HivemindStreams

    @classmethod
    async def create(
        cls,
        *,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
        announce_maddrs: Sequence[str] = (),
        identity_path: Optional[str] = None,
        nat_port_map: bool = False,
        client_mode: bool = False,
        startup_timeout_s: float = 30.0,
        record_validators: Sequence[Any] = (),
    ) -> "HivemindTransport":
        """Start a DHT node (child process + p2pd) and attach streams to it.

        ``record_validators`` (hivemind ``RecordValidatorBase`` instances, e.g.
        :class:`peerd.transport.records.OwnerRecordValidator`) check every record this node is asked to store and
        every record it reads from others.

        Raises ConnectionError if none of ``initial_peers`` can be reached.
        """
        kwargs: dict[str, Any] = dict(
            initial_peers=list(initial_peers),
            host_maddrs=list(host_maddrs),
            identity_path=identity_path,
            nat_port_map=nat_port_map,
            use_relay=False,
            use_auto_relay=False,
            use_ipfs=False,
            check_if_identity_free=False,
            client_mode=client_mode,
            startup_timeout=startup_timeout_s,
            record_validators=list(record_validators),
        )
        if announce_maddrs:
            kwargs["announce_maddrs"] = list(announce_maddrs)
        loop = asyncio.get_running_loop()
        try:
            dht = await loop.run_in_executor(None, lambda: hivemind.DHT(start=True, **kwargs))
        except Exception as e:
            raise ConnectionError(f"could not start the DHT node: {e}") from e
        p2p = await dht.replicate_p2p()
        return cls(dht, HivemindDiscovery(dht), HivemindStreams(p2p))

    @property
    def peer_id(self) -> str:
        return self.streams.peer_id

    def visible_maddrs(self) -> list[str]:
        """Full multiaddrs (with ``/p2p/<PeerID>``) other peers can use as ``--initial-peers``."""
        return [str(m) for m in self.dht.get_visible_maddrs()]

    async def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            await self.streams.p2p.shutdown()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.dht.shutdown)
