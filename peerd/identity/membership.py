"""Who a run belongs to: its creator-signed config, how a run id binds to its creator, and its allowlist.

**The config record.** The peer that creates a run signs its config with its identity key and stores it under
``(RunNamespace.config_key, [owner:<creator PeerID>])`` (``peerd.<run name>.config``) as a *portable* signed record
(:mod:`peerd.identity.signing`): the payload ``{run_id, creator, public_key, fingerprint, config}`` (``run_id`` holds the run
*name*, without any ``@creator``) is signed together with the DHT key, so it cannot be moved to another run. DHT nodes refuse anything under the creator's subkey that the creator did not sign, so the
honest record cannot be overwritten or altered; every peer of the run re-stores it (unchanged) to keep it alive
after the creator leaves. A verifier checks the signature with the key embedded in the creator's PeerID, that
``public_key`` is that key, that ``creator``/``run_id`` match where the record was found, and that ``fingerprint``
is the config's.

**Which creator.** Anyone can sign a config for any run name under their *own* subkey, so a reader must know whose
config is the run's. In order:

1. A run id of the form ``name@<creator PeerID prefix>`` (:class:`peerd.identity.namespace.RunRef`: the full PeerID or its
   first ``RUN_CREATOR_MIN_PREFIX`` characters or more, e.g. ``shakespeare@12D3KooWQ4s6d1Yvb2tnUfSx``) is the same
   run as ``name`` (same keys) but accepts only configs signed by a PeerID with that prefix. Finding another key
   with the same 24-character prefix takes ~58^16 key generations.
2. Otherwise a peer that joined the run before *pins* (trust on first use) the fingerprint and signed record it
   accepted, in ``<checkpoint_dir>/<run name>/run-config.json``, and afterwards accepts only that fingerprint (and
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
from peerd.identity.namespace import CREATOR_MIN_PREFIX, RunRef, as_run_ref
from peerd.run_config import RunConfig
from peerd.identity.signing import InvalidRecord, public_key_of, verify

logger = logging.getLogger(__name__)

#: Shortest creator PeerID prefix a run id may carry: "12D3KooW" (the same for every Ed25519 PeerID) + 16 chars.
RUN_CREATOR_MIN_PREFIX = CREATOR_MIN_PREFIX
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


def config_payload(run_name: str, creator: str, run: RunConfig) -> dict[str, Any]:
    """What the creator signs: the config bound to the run *name* (``RunRef.name``, never ``name@creator``), the
    creator and its public key."""
    public = public_key_of(creator).public_bytes_raw().hex()
    return {"run_id": run_name, "creator": creator, "public_key": public, "fingerprint": run.fingerprint(),
            "config": run.to_dict()}


def parse_config_record(run_name: str, owner: str, value: Any, envelope: dict) -> RunConfigRecord:
    """Check a config payload found (signature already verified) under ``owner``'s subkey of run ``run_name``.

    Raises InvalidRecord naming what is wrong: missing fields, another run or creator, a public key that is not the
    creator's, a config that does not parse, a fingerprint that does not match, a creator not on the allowlist.
    """
    if not isinstance(value, dict) or set(value) != {"run_id", "creator", "public_key", "fingerprint", "config"}:
        raise InvalidRecord("not a run config record (wrong schema)")
    if value["run_id"] != run_name or value["creator"] != owner:
        raise InvalidRecord(f"signed for run {value['run_id']!r} by {value['creator']}, found under run "
                            f"{run_name!r} of {owner}")
    if value["public_key"] != public_key_of(owner).public_bytes_raw().hex():
        raise InvalidRecord("its public key is not the one of the creator's PeerID")
    try:
        run = RunConfig.from_dict(value["config"], source=f"configuration published for run {run_name!r}")
    except (ConfigError, TypeError, AttributeError) as e:
        raise InvalidRecord(f"invalid config: {e}") from None
    if run.fingerprint() != value["fingerprint"]:
        raise InvalidRecord(f"fingerprint {value['fingerprint']!r} is not the config's ({run.fingerprint()})")
    if run.allowlist and owner not in run.allowlist:
        raise InvalidRecord(f"its creator {owner} is not on its allowlist")
    return RunConfigRecord(owner, run, envelope)


def choose(run: RunRef | str, records: list[RunConfigRecord],
           pinned: Optional[RunConfigRecord]) -> list[RunConfigRecord]:
    """The records that are the run's config (all with one fingerprint), by the rules in the module docstring;
    [] if none is published. Raises RunConfigConflict when the candidates are ambiguous."""
    ref = as_run_ref(run)
    run_id = ref.name
    if ref.creator is not None:
        others = [r for r in records if not ref.accepts(r.creator)]
        for r in others:
            logger.warning("ignoring a config for run %s signed by %s: the run id names creator %s", run_id,
                           r.creator, ref.creator, extra={"event": "config_refused", "creator": r.creator})
        records = [r for r in records if ref.accepts(r.creator)]
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


def pin_path(checkpoint_dir: str | os.PathLike, run: RunRef | str) -> Path:
    """Where a peer pins the run config it accepted: next to its checkpoint of the run (by run name)."""
    return Path(checkpoint_dir) / as_run_ref(run).name / PIN_FILENAME


def load_pin(path: Path, run_name: str, config_key_id: bytes) -> Optional[RunConfigRecord]:
    """The pinned record, re-verified; None if there is no pin. Raises RunConfigConflict if the file is damaged."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        envelope = {"payload": bytes.fromhex(data["payload"]), "expires": None,
                    "signature": bytes.fromhex(data["signature"])}
        creator = data["creator"]
        import msgpack

        from peerd.identity.signing import owner_subkey

        verify(config_key_id, owner_subkey(creator), envelope, 0.0)
        value = msgpack.unpackb(envelope["payload"], raw=False)
        return parse_config_record(run_name, creator, value, envelope)
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
