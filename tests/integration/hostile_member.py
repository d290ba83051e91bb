"""A hostile peer for the membership test (RELIABILITY rows B4, B5): run as its own process next to a real swarm.

It is a well-formed peer (its own identity, signed records of its own) that is not on the run's allowlist, plus a
raw DHT client that writes forged records. It counts everything it injects and what got through, and writes one
JSON summary to ``--out``:

- B4: forged writes to the run's records (unsigned write to a listed peer's status subkey, a status signed by the
  wrong key, a replay of a genuine status with a later expiration, the creator's config altered, a value with the
  wrong schema, a subkey claiming an owner that is no PeerID). ``forgeries_accepted`` counts those that an
  unvalidating reader of the honest DHT nodes can see afterwards (a forgery uses a later expiration than the honest
  record, so if any honest node had stored it, that reader would see it): must be 0.
- B5: it claims to be a live worker ahead of everyone (a peer tricked by that would download its state), then tries
  to join the listed peers' matchmaking for their current round, download their state, and publish a config of
  its own for the run. ``admissions`` counts listed peers in any group it got into; ``state_downloads`` the states
  it obtained; ``config_hijacks`` fresh resolutions that returned its config. All must be 0.

Usage: ``python -m tests.integration.hostile_member --initial-peers M --run-id R --identity K --creator A
--listed A B --out summary.json [--duration-s 45] [--contested 2]``
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time

from hivemind.utils import MSGPackSerializer

from peerd.run_config import load_run_config
from peerd.daemon import publish_run_config, resolve_run_config
from peerd.roles.outer_sync import group_key
from peerd.testing.localswarm import TINY
from peerd.identity.membership import RunConfigConflict, config_payload
from peerd.identity.signing import Signer, owner_subkey, seal, verify
from peerd.identity.namespace import RunNamespace
from peerd.status.records import make_status
from peerd.transport.hivemind_backend import HivemindTransport
from peerd.identity.signing import key_id
from peerd.transport.records import OwnerRecordValidator, SignedDiscovery
from protocols.matchmaking import MatchmakingConfig, Matchmaker, MatchmakingFailed
from protocols.state_transfer import StateTransferFailed, download_state


async def main(args: argparse.Namespace) -> dict:
    summary: dict = {"forgeries_injected": 0, "forgeries_store_ok": 0, "forgeries_accepted": 0, "honest_kept": 0,
                     "join_attempts": 0, "contested_join_attempts": 0, "admissions": 0, "state_attempts": 0,
                     "state_downloads": 0, "config_publish_refused": 0, "config_hijacks": 0}
    me = Signer.from_identity_file(args.identity)
    peers = dict(initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    transport, forger, checker = await asyncio.gather(
        HivemindTransport.create(identity_path=args.identity, record_validators=[OwnerRecordValidator()], **peers),
        HivemindTransport.create(client_mode=True, **peers),  # raw: no signing, no validation
        HivemindTransport.create(client_mode=True, **peers),  # an unvalidating reader of what honest nodes hold
    )
    transport.discovery = SignedDiscovery(transport.discovery, me)
    try:
        await _forge(args, transport, forger.discovery, checker.discovery, summary)
        await _intrude(args, transport, me, summary)
    finally:
        for t in (transport, forger, checker):
            await t.shutdown()
    return summary


async def _forge(args, transport, raw, checker, summary) -> None:
    """B4: forged writes through a raw DHT client; then read what the honest nodes hold."""
    ns = RunNamespace.of(args.run_id)
    skey, ckey = ns.status_key, ns.config_key
    creator, victim = args.creator, [p for p in args.listed if p != args.creator][0]
    deadline = time.time() + 60
    while True:  # until the listed peers' status records and the run's config are in the DHT
        statuses, configs = await raw.get(skey), await raw.get(ckey)
        if all(owner_subkey(p) in statuses for p in args.listed) and owner_subkey(creator) in configs:
            break
        assert time.time() < deadline, "the listed peers' records did not appear in the DHT"
        await asyncio.sleep(0.5)
    honest_status, honest_config = statuses[owner_subkey(creator)], configs[owner_subkey(creator)]
    later = max(honest_status.expiration_time, honest_config.expiration_time) + 300
    wrong_key = Signer.from_identity_file(args.identity)  # ours: not the creator's
    altered = MSGPackSerializer.loads(honest_config.value["payload"])
    altered["config"] = {**altered["config"], "seed": 666}
    forgeries = [
        (skey, owner_subkey(creator), make_status(role="diloco", outer_round=999)),  # unsigned
        (skey, owner_subkey(creator), seal(wrong_key, key_id(skey), make_status(role="diloco", outer_round=999),
                                           later)),  # signed by the wrong key
        (skey, owner_subkey(creator), honest_status.value),  # replayed with a later expiration
        (ckey, owner_subkey(creator), dict(honest_config.value, payload=MSGPackSerializer.dumps(altered))),  # altered
        (skey, owner_subkey(victim), "wrong schema"),
        (skey, "[owner:12D3KooWnotapeer]", make_status(role="diloco", outer_round=999)),
    ]
    for key, subkey, value in forgeries:
        summary["forgeries_injected"] += 1
        summary["forgeries_store_ok"] += bool(await raw.store(key, subkey, value, later))
    await asyncio.sleep(1.0)
    seen = {skey: await checker.get(skey), ckey: await checker.get(ckey)}
    for key, subkey, value in forgeries:
        found = seen[key].get(subkey)
        if found is not None and (found.value == value or found.expiration_time == later):
            summary["forgeries_accepted"] += 1
    for key, subkey in ((skey, owner_subkey(creator)), (ckey, owner_subkey(creator)), (skey, owner_subkey(victim))):
        found = seen[key].get(subkey)
        if found is not None:
            verify(key_id(key), subkey, found.value, found.expiration_time)  # raises if what is kept is not genuine
            summary["honest_kept"] += 1


async def _intrude(args, transport, me: Signer, summary) -> None:
    """B5: pose as a live worker far ahead, try to join rounds, fetch state, and publish a config."""
    ns = RunNamespace.of(args.run_id)
    prefix = ns.prefix("diloco")  # the DiLoCo role's handler prefix (peerd/roles/fragments.py whole_model)
    discovery: SignedDiscovery = transport.discovery
    run = load_run_config(TINY)
    try:  # the daemon's own path: refused (the named run belongs to its creator; we are not on the allowlist)
        await publish_run_config(transport, args.run_id, dataclasses.replace(run, allowlist=(me.peer_id,)))
    except RunConfigConflict:
        summary["config_publish_refused"] += 1
    # around the daemon: a config of our own, signed by us, under our own subkey (the DHT stores it)
    ours = dataclasses.replace(run, allowlist=tuple(args.listed) + (me.peer_id,), seed=666)
    envelope = discovery.seal_portable(ns.config_key, config_payload(ns.run.name, me.peer_id, ours))
    await discovery.store_portable(ns.config_key, me.peer_id, envelope, discovery.time() + 600)

    # each attempt waits long enough to span the listed peers' next matchmaking
    matchmaker = Matchmaker(transport, prefix, MatchmakingConfig(matchmaking_timeout_s=4.5, request_timeout_s=1.0,
                                                                 poll_interval_s=0.2))
    await matchmaker.start()
    deadline = time.time() + args.duration_s
    while time.time() < deadline and summary["contested_join_attempts"] < args.contested:
        live = await discovery.get(ns.status_key)
        statuses = {p: r.value for p, r in live.items() if p in args.listed}
        if any(s.get("role") == "left" for s in statuses.values()):
            break  # the listed peers are done
        if not statuses:
            await asyncio.sleep(0.5)
            continue
        target = min(s["outer_round"] for s in statuses.values())
        await discovery.store(ns.status_key, me.peer_id,
                              make_status(role="diloco", outer_round=target + 50, inner_step=0, digest="0" * 16),
                              discovery.time() + 10)
        summary["join_attempts"] += 1
        started = discovery.time()
        try:
            group = await matchmaker.form_group(group_key(target), {"digest": "0" * 64}, expected_size=3)
            summary["admissions"] += len(set(group.members) & set(args.listed))
        except MatchmakingFailed:
            pass
        ended = discovery.time()
        registered = await discovery.get(f"{prefix}.mm.{group_key(target)}")  # when did the listed peers matchmake?
        summary["contested_join_attempts"] += any(
            p in args.listed and isinstance(r.value, dict) and started - 1 <= r.value.get("joined", 0) <= ended
            for p, r in registered.items())
        for peer in args.listed:
            summary["state_attempts"] += 1
            try:
                await download_state(transport, prefix, peer, 64 * 1024 * 1024, 3.0)
                summary["state_downloads"] += 1
            except StateTransferFailed:
                pass
    await matchmaker.stop()
    # a fresh joiner of the named run (no pin) resolves the creator's config, never ours
    record = await resolve_run_config(transport, args.run_id, None)
    summary["config_hijacks"] += record.creator != args.creator or record.run.seed == 666


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--initial-peers", nargs="+", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--identity", required=True)
    p.add_argument("--creator", required=True)
    p.add_argument("--listed", nargs="+", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--duration-s", type=float, default=45.0, help="longest time spent trying to get in")
    p.add_argument("--contested", type=int, default=2,
                   help="stop after this many attempts made while listed peers were matchmaking for the same round")
    a = p.parse_args()
    result = asyncio.run(main(a))
    with open(a.out, "w") as f:
        json.dump(result, f)
