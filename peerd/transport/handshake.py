"""The direct data plane's handshake: TLS 1.3 between certificates bound to the peers' PeerIDs, no plaintext after.

Messages are msgpack frames of :mod:`protocols.wire` (the whole handshake is bounded by the caller)::

    client -> server  {v: 2, to: server PeerID, cert: client certificate (DER)}     in the clear
    server -> client  {v: 2}  or a refusal {v: 2, error, code}                      in the clear
    TLS 1.3 handshake: the server presents its certificate and requires exactly the hello's certificate
    client -> server  {name: handler name}                                          inside TLS
    server -> client  {}  or a refusal {error, code: "not_served"}                  inside TLS; then the stream

The certificates are those of :mod:`peerd.transport.tls` (the libp2p TLS extension binds each certificate's key to
the peer's Ed25519 identity key). The client checks that the server's certificate is bound to the PeerID it dials;
the server learns the client's PeerID from the hello's certificate, checks it, and pins it: OpenSSL accepts exactly
that certificate in the handshake, from a client that proves its key. TLS then encrypts and authenticates every
later byte (AEAD records with per-connection keys from both sides' fresh randoms), so:

- nothing of the stream is readable or alterable on the path: an altered byte fails the record's authentication
  and the connection (the stream ends with an error; nothing altered reaches the handler);
- a recorded handshake cannot be replayed (the server's random differs, the replayed client's CertificateVerify and
  Finished no longer verify) nor reflected to its sender (its certificate names the sender, not the peer it dialled;
  a server also refuses a hello carrying its own PeerID);
- a copied certificate is useless without its key, and a certificate whose extension was not signed by the PeerID's
  key is refused before any TLS;
- there is no plaintext mode to downgrade to: a peer that does not complete TLS gets no stream (the dialer falls back
  to the inner, encrypted p2pd streams). A version-1 (plaintext) hello is refused.

The hello travels in the clear because a server must know which certificate to accept before the handshake
(Python's ``ssl`` has no verify callback; see :class:`peerd.transport.tls.PeerTLS`); it carries only public
data, and the handler name goes inside TLS.
"""

from __future__ import annotations

import ssl
from typing import Any, Callable

from peerd.transport.connection import Connection
from peerd.transport.tls import CertificateRejected, PeerTLS, peer_id_of_certificate
from protocols.wire import ProtocolViolation, read_frame, require, try_write_frame, write_frame

#: Handshake protocol version: 2 = TLS 1.3 (version 1 was a signed plaintext handshake; its hellos are refused).
VERSION = 2
#: Longest handler name accepted (characters).
MAX_NAME_CHARS = 256


class HandshakeFailed(ConnectionError):
    """The other side is not who it should be, or does not follow the handshake (the message says why)."""


class HandshakeRefused(HandshakeFailed):
    """The server answered with a refusal; ``code`` says why (one of :data:`REFUSALS`)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


#: Why a server refuses: another peer listens there (a stale address), the name is not served, or the hello does not
#: follow the protocol (an old version, a certificate that is not bound to a PeerID).
REFUSALS = ("wrong_peer", "not_served", "malformed")


def _refusal(reply: dict[str, Any], peer_id: str, what: str) -> HandshakeRefused:
    code = reply.get("code") if reply.get("code") in REFUSALS else "malformed"
    return HandshakeRefused(f"{peer_id} refused {what}: {str(reply['error'])[:200]}", code)


async def _tls(conn: Connection, context: ssl.SSLContext, server_side: bool) -> None:
    try:
        await conn.start_tls(context, server_side)
    except ssl.SSLError as e:
        raise HandshakeFailed(f"TLS handshake failed: {e}") from None


async def client_handshake(conn: Connection, tls: PeerTLS, server_peer_id: str, name: str) -> None:
    """Secure the fresh connection ``conn`` to ``server_peer_id`` and open ``name`` on it; afterwards the
    connection is the stream's.

    Raises HandshakeRefused if the server refused, HandshakeFailed if TLS failed or the server's certificate is not
    ``server_peer_id``'s, ProtocolViolation on malformed frames, ConnectionError/OSError if the connection broke.
    """
    await write_frame(conn, {"v": VERSION, "to": server_peer_id, "cert": tls.certificate})
    reply, _, _ = await read_frame(conn, max_payload_bytes=0)
    if "error" in reply:
        raise _refusal(reply, server_peer_id, "the hello")
    if require(reply, "v", int) != VERSION:
        raise HandshakeFailed(f"{server_peer_id} speaks version {reply['v']}, not {VERSION}")
    await _tls(conn, tls.client_context, server_side=False)
    try:
        server = peer_id_of_certificate(conn.peer_certificate())
    except CertificateRejected as e:
        raise HandshakeFailed(f"the server's certificate: {e}") from None
    if server != server_peer_id:
        raise HandshakeFailed(f"reached {server}, not {server_peer_id}")
    await write_frame(conn, {"name": name})
    reply, _, _ = await read_frame(conn, max_payload_bytes=0)
    if "error" in reply:
        raise _refusal(reply, server_peer_id, repr(name))


async def server_handshake(conn: Connection, tls: PeerTLS, served: Callable[[str], bool]) -> tuple[str, str]:
    """Serve one handshake on the fresh connection ``conn``; returns ``(client PeerID, handler name)`` once the
    client proved its certificate's key in TLS and named a served handler (``served(name)``).

    Raises HandshakeRefused (after a best-effort refusal frame), HandshakeFailed or ProtocolViolation; the caller
    closes the connection.
    """
    hello, _, _ = await read_frame(conn, max_payload_bytes=0)
    version = require(hello, "v", int)
    code = reason = client = None
    if version != VERSION:
        code, reason = "malformed", f"version {version}: this data plane speaks only version {VERSION} (TLS 1.3)"
    elif require(hello, "to", str) != tls.peer_id:
        code, reason = "wrong_peer", f"this is not {hello['to'][:60]}"
    else:
        certificate = require(hello, "cert", bytes)
        try:
            client = peer_id_of_certificate(certificate)
        except CertificateRejected as e:
            code, reason = "malformed", f"certificate: {e}"
        else:
            if client == tls.peer_id:
                code, reason = "malformed", "a hello of our own PeerID (reflected)"
    if code is not None:
        await try_write_frame(conn, {"v": VERSION, "error": reason, "code": code}, timeout_s=1.0)
        raise HandshakeRefused(f"refused hello: {reason}", code)
    await write_frame(conn, {"v": VERSION})
    await _tls(conn, tls.server_context(certificate), server_side=True)
    if conn.peer_certificate() != certificate:  # OpenSSL accepted only the pinned certificate; never trust less
        raise HandshakeFailed("the client's TLS certificate is not the one of its hello")
    request, _, _ = await read_frame(conn, max_payload_bytes=0)
    name = require(request, "name", str)
    if len(name) > MAX_NAME_CHARS or not served(name):
        await try_write_frame(conn, {"error": f"{name[:80]!r} is not served", "code": "not_served"}, timeout_s=1.0)
        raise HandshakeRefused(f"{client} asked for {name[:80]!r}, which is not served", "not_served")
    await write_frame(conn, {})
    return client, name
