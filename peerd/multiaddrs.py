"""Syntax check of libp2p multiaddrs (``/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...``) before anything starts.

Only the text form is checked (the multiaddr spec, github.com/multiformats/multiaddr): ``/``-separated protocol
names, each followed by its value where the protocol takes one. The point is to refuse a typo as a usage error in
the config, instead of p2pd failing to start later. Pure Python on the standard library and ``base58``; importing it
does not import hivemind or torch.
"""

from __future__ import annotations

import ipaddress

import base58

#: Protocols that take a value, and how it is checked ("port", "ip4", "ip6", "peer", "name": any non-empty text).
_WITH_VALUE = {
    "ip4": "ip4", "ip6": "ip6", "ip6zone": "name", "dns": "name", "dns4": "name", "dns6": "name", "dnsaddr": "name",
    "tcp": "port", "udp": "port", "dccp": "port", "sctp": "port", "p2p": "peer", "ipfs": "peer", "sni": "name",
    "certhash": "name", "onion": "name", "onion3": "name", "garlic64": "name", "garlic32": "name",
}
_WITHOUT_VALUE = {
    "quic", "quic-v1", "webtransport", "ws", "wss", "tls", "noise", "http", "https", "p2p-circuit", "webrtc",
    "webrtc-direct", "p2p-webrtc-direct", "utp", "udt", "plaintextv2",
}
#: Multihash codes a PeerID may use: identity (Ed25519 keys, ``12D3KooW...``) and sha2-256 (RSA keys, ``Qm...``).
_PEER_ID_HASHES = {0x00: None, 0x12: 32}


def check_multiaddr(text: str, require_peer_id: bool = False) -> None:
    """Raise ValueError (saying what is wrong with ``text``) unless it is a well-formed multiaddr; with
    ``require_peer_id``, it must also end with ``/p2p/<PeerID>`` (the peer to dial)."""
    if not isinstance(text, str) or not text.startswith("/"):
        raise ValueError(f"invalid multiaddr {text!r}: expected e.g. /ip4/203.0.113.7/tcp/31337"
                         + ("/p2p/12D3KooW..." if require_peer_id else ""))
    parts = text.split("/")[1:]
    if text.endswith("/") and text != "/":
        parts = parts[:-1]
    if not parts or parts == [""]:
        raise ValueError(f"invalid multiaddr {text!r}: empty")
    i, last = 0, None
    while i < len(parts):
        name = parts[i]
        if name == "unix":  # the rest is a filesystem path
            if i + 1 >= len(parts):
                raise ValueError(f"invalid multiaddr {text!r}: /unix needs a path")
            last = name
            break
        if name in _WITHOUT_VALUE:
            i, last = i + 1, name
            continue
        kind = _WITH_VALUE.get(name)
        if kind is None:
            raise ValueError(f"invalid multiaddr {text!r}: unknown protocol {name!r}")
        if i + 1 >= len(parts) or not parts[i + 1]:
            raise ValueError(f"invalid multiaddr {text!r}: /{name} needs a value")
        _check_value(text, name, kind, parts[i + 1])
        i, last = i + 2, name
    if require_peer_id and last not in ("p2p", "ipfs"):
        raise ValueError(f"multiaddr {text!r} does not name a peer: it must end with /p2p/<PeerID> (the peer's "
                         "`peerd bootstrap` output, or the 'listening on' line of a running peer, has it)")


def _check_value(text: str, name: str, kind: str, value: str) -> None:
    try:
        if kind == "port":
            if not value.isdigit() or not 0 <= int(value) <= 65535:
                raise ValueError("not a port number 0-65535")
        elif kind == "ip4":
            ipaddress.IPv4Address(value)
        elif kind == "ip6":
            ipaddress.IPv6Address(value)
        elif kind == "peer":
            check_peer_id(value)
    except ValueError as e:
        raise ValueError(f"invalid multiaddr {text!r}: /{name}/{value}: {e}") from None


def check_peer_id(value: str) -> None:
    """Raise ValueError unless ``value`` is a base58 PeerID (a multihash of the peer's public key)."""
    try:
        raw = base58.b58decode(value)
    except ValueError:
        raise ValueError("not a base58 PeerID") from None
    if len(raw) < 2 or raw[0] not in _PEER_ID_HASHES:
        raise ValueError("not a PeerID (expected 12D3KooW... or Qm...)")
    expected = _PEER_ID_HASHES[raw[0]]
    if raw[1] != len(raw) - 2 or (expected is not None and raw[1] != expected):
        raise ValueError("not a PeerID: wrong length (truncated?)")
