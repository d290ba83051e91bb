"""Who is who in a run, and what they sign.

- :mod:`peerd.identity.key`: a peer's persistent Ed25519 identity key file and its PeerID.
- :mod:`peerd.identity.signing`: signed DHT records (owner, key and expiration bound by an Ed25519 signature).
- :mod:`peerd.identity.namespace`: run ids (``name`` or ``name@creator``) and every DHT key and group key of a run.
- :mod:`peerd.identity.membership`: the creator-signed run config, how a run id binds to its creator, the allowlist.
"""
