"""Who a run belongs to: its creator-signed config, how a run id binds to its creator, and its allowlist.

**The config record.** The peer that creates a run signs its config with its identity key and stores it under
``(peerd.<run_id>.config, [owner:<creator PeerID>])`` as a *portable* signed record (:mod:`peerd.signing`): the
payload ``{run_id, creator, public_key, fingerprint, config}`` is signed together with the DHT key, so it cannot be
moved to another run. DHT nodes refuse anything under the creator's subkey that the creator did not sign, so the
honest record cannot be overwritten or altered; every peer of the run re-stores it (unchanged) to keep it alive
after the creator leaves. A verifier checks the signature with the key embedded in the creator's PeerID, that
``public_key`` is that key, that ``creator``/``run_id`` match where the record was found, and that ``fingerprint``
is the config's.

**Which creator.** Anyone can sign a config for any run id under their *own* subkey, so a reader must know whose
config is the run's. In order:

1. A run id of the form ``name@<creator PeerID prefix>`` (``RUN_CREATOR_MIN_PREFIX`` characters or more of the
   creator's PeerID, e.g. ``shakespeare@12D3KooWQ4s6d1Yvb2tnUfSx``) accepts only configs signed by a PeerID with
   that prefix. Finding another key with the same 24-character prefix takes ~58^16 key generations.
2. Otherwise a peer that joined the run before *pins* (trust on first use) the fingerprint and signed record it
   accepted, in ``<checkpoint_dir>/<run_id>/run-config.json``, and afterwards accepts only that fingerprint (and
   can re-publish the pinned record if the DHT lost it).
3. Otherwise (a plain run id, first join) it accepts the valid configs present if they all have one fingerprint
   (peers started together with the same ``--run-config`` each sign it), and refuses to join, naming the creators,
   if they differ.

Residual risk, by design of plain run ids: a first-time joiner of a plain run id whose honest config is not in the
DHT (run not created yet, or every peer gone for CONFIG_TTL_S) accepts whatever config someone else signed under
that name; and anyone can make first-time joiners of a plain run id refuse to join by publishing a competing
config. Named run ids (``name@creator``) are immune to both.

**Allowlist.** A config with a non-empty ``allowlist`` is valid only if its creator is on it, so a peer not on the
run's allowlist cannot publish (create) the run's config; the daemon also refuses to join such a run, and the
worker's transport refuses such peers' streams and hides their records (:mod:`peerd.transport.admission`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from peerd.config import ConfigError
from peerd.run_config import RunConfig
from peerd.signing import InvalidRecord, public_key_of, verify

logger = logging.getLogger(__name__)

#: Shortest creator PeerID prefix a run id may carry: "12D3KooW" (the same for every Ed25519 PeerID) + 16 chars.
RUN_CREATOR_MIN_PREFIX = 24
PIN_FILENAME = "run-config.json"


class RunConfigConflict(RuntimeError):
    """The run's configuration is missing, forged, ambiguous, or disagrees with ours, or we may not publish it."""


@dataclass(frozen=True)
class RunConfigRecord:
    """A valid creator-signed run config: who signed it, the config, and the envelope as stored in the DHT."""

    creator: str
    run: RunConfig
    envelope: dict

    @property
    def fingerprint(self) -> str:
        return self.run.fingerprint()


def split_run_id(run_id: str) -> tuple[str, Optional[str]]:
    """``name@prefix`` -> (name, creator PeerID prefix); a plain run id -> (run_id, None).

    Raises RunConfigConflict if the prefix is too short to bind the run to a key or is no Ed25519 PeerID prefix.
    """
    name, sep, prefix = run_id.partition("@")
    if not sep:
        return run_id, None
    if len(prefix) < RUN_CREATOR_MIN_PREFIX or not prefix.startswith("12D3KooW"):
        raise RunConfigConflict(
            f"run id {run_id!r}: after '@' give the creator's PeerID (12D3KooW...) or at least its first "
            f"{RUN_CREATOR_MIN_PREFIX} characters"
        )
    return name, prefix


def config_payload(run_id: str, creator: str, run: RunConfig) -> dict[str, Any]:
    """What the creator signs: the config bound to the run id, the creator and its public key."""
    public = public_key_of(creator).public_bytes_raw().hex()
    return {"run_id": run_id, "creator": creator, "public_key": public, "fingerprint": run.fingerprint(),
            "config": run.to_dict()}


def parse_config_record(run_id: str, owner: str, value: Any, envelope: dict) -> RunConfigRecord:
    """Check a config payload found (signature already verified) under ``owner``'s subkey of run ``run_id``.

    Raises InvalidRecord naming what is wrong: missing fields, another run or creator, a public key that is not the
    creator's, a config that does not parse, a fingerprint that does not match, a creator not on the allowlist.
    """
    if not isinstance(value, dict) or set(value) != {"run_id", "creator", "public_key", "fingerprint", "config"}:
        raise InvalidRecord("not a run config record (wrong schema)")
    if value["run_id"] != run_id or value["creator"] != owner:
        raise InvalidRecord(f"signed for run {value['run_id']!r} by {value['creator']}, found under run "
                            f"{run_id!r} of {owner}")
    if value["public_key"] != public_key_of(owner).public_bytes_raw().hex():
        raise InvalidRecord("its public key is not the one of the creator's PeerID")
    try:
        run = RunConfig.from_dict(value["config"], source=f"configuration published for run {run_id!r}")
    except (ConfigError, TypeError, AttributeError) as e:
        raise InvalidRecord(f"invalid config: {e}") from None
    if run.fingerprint() != value["fingerprint"]:
        raise InvalidRecord(f"fingerprint {value['fingerprint']!r} is not the config's ({run.fingerprint()})")
    if run.allowlist and owner not in run.allowlist:
        raise InvalidRecord(f"its creator {owner} is not on its allowlist")
    return RunConfigRecord(owner, run, envelope)


def choose(run_id: str, records: list[RunConfigRecord], pinned: Optional[RunConfigRecord]) -> list[RunConfigRecord]:
    """The records that are the run's config (all with one fingerprint), by the rules in the module docstring;
    [] if none is published. Raises RunConfigConflict when the candidates are ambiguous."""
    _, prefix = split_run_id(run_id)
    if prefix is not None:
        others = [r for r in records if not r.creator.startswith(prefix)]
        for r in others:
            logger.warning("ignoring a config for run %s signed by %s: the run id names creator %s...", run_id,
                           r.creator, prefix, extra={"event": "config_refused", "creator": r.creator})
        records = [r for r in records if r.creator.startswith(prefix)]
    if pinned is not None:
        for r in records:
            if r.fingerprint != pinned.fingerprint:
                logger.warning("ignoring a config for run %s signed by %s: fingerprint %s differs from the pinned %s",
                               run_id, r.creator, r.fingerprint, pinned.fingerprint,
                               extra={"event": "config_refused", "creator": r.creator})
        return sorted((r for r in records if r.fingerprint == pinned.fingerprint), key=lambda r: r.creator)
    fingerprints = sorted({r.fingerprint for r in records})
    if len(fingerprints) > 1:
        listing = "; ".join(f"{fp} signed by {', '.join(sorted(r.creator for r in records if r.fingerprint == fp))}"
                            for fp in fingerprints)
        raise RunConfigConflict(
            f"run {run_id!r} has {len(fingerprints)} different configurations signed by different peers ({listing});"
            f" refusing to guess: join with the run id {run_id}@<the creator's PeerID> (ask the run's creator)"
        )
    return sorted(records, key=lambda r: r.creator)


# ------------------------------------------------------------------------------------------------------------ pins


def pin_path(checkpoint_dir: str | os.PathLike, run_id: str) -> Path:
    """Where a peer pins the run config it accepted: next to its checkpoint of the run."""
    return Path(checkpoint_dir) / run_id / PIN_FILENAME


def load_pin(path: Path, run_id: str, config_key_id: bytes) -> Optional[RunConfigRecord]:
    """The pinned record, re-verified; None if there is no pin. Raises RunConfigConflict if the file is damaged."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        envelope = {"payload": bytes.fromhex(data["payload"]), "expires": None,
                    "signature": bytes.fromhex(data["signature"])}
        creator = data["creator"]
        import msgpack

        from peerd.signing import owner_subkey

        verify(config_key_id, owner_subkey(creator), envelope, 0.0)
        value = msgpack.unpackb(envelope["payload"], raw=False)
        return parse_config_record(run_id, creator, value, envelope)
    except (OSError, ValueError, KeyError, TypeError) as e:  # InvalidRecord is a ValueError
        raise RunConfigConflict(f"the pinned run config {path} is damaged ({e}); delete it to trust the DHT "
                                f"again") from None


def save_pin(path: Path, record: RunConfigRecord) -> None:
    """Pin ``record`` (atomically; the file holds the creator's signed record, nothing secret)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"creator": record.creator, "fingerprint": record.fingerprint,
            "payload": record.envelope["payload"].hex(), "signature": record.envelope["signature"].hex()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
