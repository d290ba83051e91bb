"""TLS 1.3 for the direct data plane, with certificates bound to the peers' PeerIDs as in the libp2p TLS spec.

Every byte of a direct connection is encrypted and integrity-protected by TLS 1.3 (Python's :mod:`ssl`, i.e.
OpenSSL); this module only makes and checks the certificates that tie a TLS key to a PeerID, following the libp2p
TLS handshake specification (github.com/libp2p/specs, ``tls/tls.md``):

- each peer makes a fresh certificate key (ECDSA P-256) and a self-signed X.509 certificate for it, carrying the
  extension :data:`EXTENSION_OID` whose value is the DER ``SignedKey ::= SEQUENCE { publicKey OCTET STRING,
  signature OCTET STRING }``: ``publicKey`` is the libp2p ``PublicKey`` protobuf of the peer's Ed25519 identity key
  (the bytes its PeerID embeds), ``signature`` is that identity key's signature over :data:`SIGNATURE_PREFIX` + the
  certificate's DER ``SubjectPublicKeyInfo``;
- :func:`peer_id_of_certificate` checks a received certificate (validity window, self-signature, the extension's
  signature) and returns the PeerID it is bound to. TLS itself proves that the other side holds the certificate's
  key (its CertificateVerify signs the handshake transcript, fresh randoms of both sides), so a certificate that
  passes both is the PeerID's own for this connection: it cannot be replayed, reflected or used by anyone else.

The extension is not marked critical: OpenSSL rejects certificates with critical extensions it does not know when
it verifies a pinned certificate (see :class:`PeerTLS.server_context`). The DER is encoded and decoded by
``cryptography.hazmat.asn1``; nothing here encrypts, and nothing cryptographic is implemented here.
"""

from __future__ import annotations

import datetime
import os
import shutil
import ssl
import tempfile
from typing import Optional

import base58
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat import asn1
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from peerd.identity.signing import InvalidRecord, Signer, public_key_of

#: The libp2p Public Key Extension (libp2p TLS spec).
EXTENSION_OID = x509.ObjectIdentifier("1.3.6.1.4.1.53594.1.1")
#: What the identity key signs before the certificate's SubjectPublicKeyInfo (libp2p TLS spec).
SIGNATURE_PREFIX = b"libp2p-tls-handshake:"
#: A certificate is valid from an hour before it was made (clocks of peers differ) for this long (days); a
#: certificate lives as long as its process, so this bounds how long a process may run between restarts.
CERTIFICATE_DAYS = 365
_BACKDATE = datetime.timedelta(hours=1)
#: Largest certificate accepted from a peer (bytes); ours are ~500.
MAX_CERTIFICATE_BYTES = 4096
#: Server contexts (one per client certificate) a peer keeps for reuse.
SERVER_CONTEXTS = 256
#: Identity multihash prefix of a PeerID (code 0x00, then the protobuf's length): the rest is the protobuf.
_IDENTITY_MULTIHASH = b"\x00"


class CertificateRejected(ValueError):
    """A peer's certificate is not a valid libp2p TLS certificate (the message says why)."""


@asn1.sequence
class SignedKey:
    """The extension's value (libp2p TLS spec): the host key (libp2p ``PublicKey`` protobuf) and its signature."""

    public_key: bytes
    signature: bytes


def _public_key_protobuf(peer_id: str) -> bytes:
    """The libp2p ``PublicKey`` protobuf that ``peer_id`` (an Ed25519 PeerID: an identity multihash) embeds."""
    raw = base58.b58decode(peer_id)
    return raw[2:]


def _peer_id_of_protobuf(protobuf: bytes) -> str:
    """The PeerID of a libp2p ``PublicKey`` protobuf; CertificateRejected unless it is an Ed25519 key."""
    if len(protobuf) > 127:
        raise CertificateRejected("the host key is not an Ed25519 key")
    peer_id = base58.b58encode(_IDENTITY_MULTIHASH + bytes([len(protobuf)]) + protobuf).decode()
    try:
        public_key_of(peer_id)
    except InvalidRecord:
        raise CertificateRejected("the host key is not an Ed25519 key") from None
    return peer_id


def _spki(cert: x509.Certificate) -> bytes:
    return cert.public_key().public_bytes(serialization.Encoding.DER,
                                          serialization.PublicFormat.SubjectPublicKeyInfo)


def make_certificate(signer: Signer, now: Optional[datetime.datetime] = None,
                     days: int = CERTIFICATE_DAYS) -> tuple[bytes, bytes]:
    """A fresh certificate key and its self-signed certificate bound to ``signer``'s PeerID.

    Returns ``(certificate DER, private key PEM)``. ``now`` and ``days`` exist for tests of expired certificates.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    now = now or datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(x509.NameOID.SERIAL_NUMBER, signer.peer_id)])
    spki = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    signed = SignedKey(public_key=_public_key_protobuf(signer.peer_id), signature=signer.sign(SIGNATURE_PREFIX + spki))
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE)
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.UnrecognizedExtension(EXTENSION_OID, asn1.encode_der(signed)), critical=False)
            .sign(key, hashes.SHA256()))
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.DER), pem


def peer_id_of_certificate(der: bytes, now: Optional[datetime.datetime] = None) -> str:
    """The PeerID a peer's certificate (DER) is bound to, after checking it as the libp2p TLS spec requires: one
    parseable X.509 certificate, inside its validity window, self-signed, with the extension whose signature by the
    embedded Ed25519 host key covers the certificate's key. Raises CertificateRejected saying which check failed.

    This does not prove the sender holds the certificate's key: only a completed TLS handshake does.
    """
    if not isinstance(der, bytes) or not 0 < len(der) <= MAX_CERTIFICATE_BYTES:
        raise CertificateRejected("no certificate, or one of the wrong size")
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError as e:
        raise CertificateRejected(f"not an X.509 certificate: {e}") from None
    now = now or datetime.datetime.now(datetime.timezone.utc)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise CertificateRejected(f"outside its validity ({cert.not_valid_before_utc} to {cert.not_valid_after_utc})")
    try:
        cert.verify_directly_issued_by(cert)
    except (ValueError, TypeError, InvalidSignature):
        raise CertificateRejected("not validly self-signed") from None
    try:
        extension = cert.extensions.get_extension_for_oid(EXTENSION_OID).value
        signed = asn1.decode_der(SignedKey, extension.value)
    except (x509.ExtensionNotFound, ValueError, AttributeError):
        raise CertificateRejected("no valid libp2p public key extension") from None
    peer_id = _peer_id_of_protobuf(signed.public_key)
    try:
        public_key_of(peer_id).verify(signed.signature, SIGNATURE_PREFIX + _spki(cert))
    except InvalidSignature:
        raise CertificateRejected(f"the extension's signature does not verify with the key of {peer_id}") from None
    return peer_id


class PeerTLS:
    """This peer's certificate and its TLS 1.3 contexts (the files live in a private temporary folder until
    :meth:`close`, because :meth:`ssl.SSLContext.load_cert_chain` reads files only).

    Clients do not let OpenSSL judge the server's self-signed certificate (``CERT_NONE``) and check it with
    :func:`peer_id_of_certificate` after the handshake; a server learns the client's certificate before the
    handshake (the direct data plane's hello) and pins it: OpenSSL then accepts exactly that certificate, and only
    from a client that proves its key.
    """

    def __init__(self, signer: Signer):
        self.peer_id = signer.peer_id
        self.certificate, key_pem = make_certificate(signer)
        self._folder = tempfile.mkdtemp(prefix="peerd-tls-")  # mode 0700
        self._certfile = os.path.join(self._folder, "cert.pem")
        self._keyfile = os.path.join(self._folder, "key.pem")
        cert_pem = ssl.DER_cert_to_PEM_cert(self.certificate).encode()
        for path, data in ((self._certfile, cert_pem), (self._keyfile, key_pem)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        self._server_contexts: dict[bytes, ssl.SSLContext] = {}
        self.client_context = self._context(ssl.PROTOCOL_TLS_CLIENT)
        self.client_context.check_hostname = False
        self.client_context.verify_mode = ssl.CERT_NONE  # checked by peer_id_of_certificate after the handshake

    def _context(self, protocol: int) -> ssl.SSLContext:
        context = ssl.SSLContext(protocol)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.maximum_version = ssl.TLSVersion.TLSv1_3
        context.load_cert_chain(self._certfile, self._keyfile)
        return context

    def server_context(self, client_certificate: bytes) -> ssl.SSLContext:
        """A server context that requires the client to present (and prove the key of) ``client_certificate``;
        one per client certificate, reused for its later connections (the last :data:`SERVER_CONTEXTS` kept)."""
        context = self._server_contexts.pop(client_certificate, None)
        if context is None:
            context = self._new_server_context(client_certificate)
        self._server_contexts[client_certificate] = context  # most recently used last
        while len(self._server_contexts) > SERVER_CONTEXTS:
            self._server_contexts.pop(next(iter(self._server_contexts)))
        return context

    def _new_server_context(self, client_certificate: bytes) -> ssl.SSLContext:
        context = self._context(ssl.PROTOCOL_TLS_SERVER)
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=client_certificate)
        context.num_tickets = 0  # no session resumption: every connection proves the certificate's key again
        return context

    def close(self) -> None:
        shutil.rmtree(self._folder, ignore_errors=True)
