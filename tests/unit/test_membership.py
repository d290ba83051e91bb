"""Run membership (RELIABILITY rows B4, B5, unit level): the creator-signed run config, binding a run id to its
creator, pins, and the allowlist on the transport and in matchmaking. Forgeries and intrusions are counted; the
control cases show that each attack works where its defense is off."""

import asyncio
import dataclasses

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer

from peerd.config import ConfigError, NodeConfig
from peerd.run_config import RunConfig, load_run_config
from peerd.daemon import explain_config_conflict, publish_run_config, resolve_run_config
from peerd.testing.localswarm import TINY
from peerd.identity.membership import (
    RunConfigConflict,
    choose,
    config_payload,
    load_pin,
    parse_config_record,
    pin_path,
    save_pin,
)
from peerd.identity.namespace import RunIdError, RunNamespace, RunRef
from peerd.identity.signing import InvalidRecord, Signer, owner_subkey, seal


def config_key(run_id: str) -> str:
    return RunNamespace.of(run_id).config_key

from peerd.transport.admission import AdmissionStreams, admit_only
from peerd.transport.inprocess import Hub
from peerd.identity.signing import key_id
from peerd.transport.records import OwnerRecordValidator, SignedDiscovery
from protocols.matchmaking import MatchmakingConfig, Matchmaker, MatchmakingFailed
from protocols.wire import ProtocolViolation, read_frame, write_frame

pytestmark = pytest.mark.timeout(60)


def signer() -> Signer:
    return Signer(Ed25519PrivateKey.generate())


def peer(hub: Hub, s: Signer):
    transport = hub.transport(s.peer_id)
    transport.discovery = SignedDiscovery(transport.discovery, s)
    return transport


def tiny(**changes) -> RunConfig:
    return dataclasses.replace(load_run_config(TINY), **changes)


# ------------------------------------------------------------------------------------------------------- run ids


def test_run_ids_may_name_their_creator():
    s = signer()
    assert RunRef.parse("demo") == RunRef("demo", None)
    assert RunRef.parse(f"demo@{s.peer_id}") == RunRef("demo", s.peer_id)
    assert RunRef.parse(f"demo@{s.peer_id[:24]}") == RunRef("demo", s.peer_id[:24])
    for bad in (f"demo@{s.peer_id[:23]}", "demo@QmYyQSo1c1Ym7orWxLYvCrM2Em"):
        with pytest.raises(RunIdError, match="PeerID"):
            RunRef.parse(bad)


def test_allowlist_must_hold_peer_ids_and_leaves_open_runs_fingerprints_alone():
    s = signer()
    base = load_run_config(TINY)
    assert "allowlist" not in base.to_dict()
    listed = tiny(allowlist=(s.peer_id, s.peer_id))
    assert listed.allowlist == (s.peer_id,) and listed.fingerprint() != base.fingerprint()
    assert RunConfig.from_dict(listed.to_dict()) == listed
    with pytest.raises(ConfigError, match="allowlist"):
        tiny(allowlist=("12D3KooWnot-a-peer",))


# ------------------------------------------------------------------------------------------------ config records


def _record(run_id: str, s: Signer, run: RunConfig, changes=None):
    payload = {**config_payload(run_id, s.peer_id, run), **(changes or {})}
    envelope = seal(s, key_id(config_key(run_id)), payload, None)
    return parse_config_record(run_id, s.peer_id, payload, envelope)


def test_config_records_check_run_creator_key_fingerprint_and_allowlist():
    creator, other = signer(), signer()
    run = tiny()
    good = _record("r", creator, run)
    assert good.run == run and good.creator == creator.peer_id
    bad = {
        "another run": dict(run_id="r2"),
        "another creator": dict(creator=other.peer_id),
        "another public key": dict(public_key=other.public_key.hex()),
        "a stale fingerprint": dict(fingerprint="0" * 16),
        "an invalid config": dict(config={**run.to_dict(), "model": "huge"}),
    }
    for name, change in bad.items():
        with pytest.raises(InvalidRecord):
            _record("r", creator, run, change)
    with pytest.raises(InvalidRecord, match="allowlist"):
        _record("r", creator, tiny(allowlist=(other.peer_id,)))  # an unlisted peer cannot create the run
    with pytest.raises(InvalidRecord, match="schema"):
        parse_config_record("r", creator.peer_id, {"config": run.to_dict()}, {})


def test_choose_accepts_one_fingerprint_and_refuses_to_guess_between_two():
    a, b, forger = signer(), signer(), signer()
    run = tiny()
    same = [_record("r", a, run), _record("r", b, run)]  # peers started together with the same --run-config
    assert [r.creator for r in choose("r", same, None)] == sorted([a.peer_id, b.peer_id])
    competing = same + [_record("r", forger, tiny(seed=666))]
    with pytest.raises(RunConfigConflict, match="refusing to guess"):
        choose("r", competing, None)
    # a named run id, or a pin, picks the run's own config among them
    named = f"r@{a.peer_id[:30]}"
    competing_named = [_record(named, a, run), _record(named, forger, tiny(seed=666))]
    assert [r.creator for r in choose(named, competing_named, None)] == [a.peer_id]
    assert [r.creator for r in choose("r", competing, pinned=same[0])] == sorted([a.peer_id, b.peer_id])
    assert choose("r", [], None) == []


def test_pins_round_trip_and_a_tampered_pin_is_refused(tmp_path):
    creator = signer()
    record = _record("r", creator, tiny())
    path = pin_path(tmp_path, "r")
    save_pin(path, record)
    assert load_pin(path, "r", key_id(config_key("r"))) == record
    assert load_pin(pin_path(tmp_path, "other"), "other", key_id(config_key("other"))) is None
    text = path.read_text()
    path.write_text(text.replace(record.envelope["signature"].hex()[:8], "00000000"))
    with pytest.raises(RunConfigConflict, match="damaged"):
        load_pin(path, "r", key_id(config_key("r")))


# ---------------------------------------------------------------------------------- resolving a run's config (B4)


class ValidatingDiscovery:
    """A DHT node's view: refuses what OwnerRecordValidator refuses (the in-process hub alone validates nothing)."""

    def __init__(self, inner):
        self.inner = inner
        self.validator = OwnerRecordValidator()

    def time(self):
        return self.inner.time()

    async def store(self, key, subkey, value, expiration_time):
        record = DHTRecord(key_id(key), MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value),
                           expiration_time)
        return self.validator.validate(record) and await self.inner.store(key, subkey, value, expiration_time)

    async def get(self, key):
        return await self.inner.get(key)


@pytest.mark.parametrize("dht_validates", [True, False])
def test_forged_and_altered_run_configs_are_never_accepted(tmp_path, dht_validates):
    async def main():
        hub = Hub()
        creator, joiner, forger = signer(), signer(), signer()
        run = tiny()
        c, j, f = peer(hub, creator), peer(hub, joiner), peer(hub, forger)
        key = config_key("b4")
        await resolve_run_config(c, "b4", run, pin_path(tmp_path / "c", "b4"))
        raw = hub.transport("raw").discovery
        dht = ValidatingDiscovery(raw) if dht_validates else raw
        honest = (await raw.get(key))[owner_subkey(creator.peer_id)]
        altered_payload = {**config_payload("b4", creator.peer_id, run), "config": tiny(seed=1).to_dict()}
        attacks = [  # (subkey, value): the creator's record altered (signature kept); an unsigned legacy record
            (owner_subkey(creator.peer_id), dict(honest.value, payload=MSGPackSerializer.dumps(altered_payload))),
            ("config", {"config": tiny(seed=2).to_dict(), "fingerprint": tiny(seed=2).fingerprint()}),
        ]
        stored = [await dht.store(key, subkey, value, honest.expiration_time + 5) for subkey, value in attacks]
        if dht_validates:
            assert stored == [False, True]  # the forged owner record is refused at store time, honest value kept
            assert (await raw.get(key))[owner_subkey(creator.peer_id)] == honest
            got = await resolve_run_config(j, "b4", None, pin_path(tmp_path / "j", "b4"))
            assert got.run == run and got.creator == creator.peer_id  # the unsigned one is dropped by the reader
        else:  # no DHT validation: the forgery overwrote the honest record, and still nobody accepts it
            with pytest.raises(RunConfigConflict, match="no configuration published"):
                await resolve_run_config(j, "b4", None, pin_path(tmp_path / "j", "b4"))
            return
        # a config the forger signed under its own subkey: the pinned joiner ignores it, and a first-time joiner of
        # the plain run id refuses to guess (it does not take the forger's)
        await publish_run_config(f, "b4", tiny(seed=3))
        assert (await resolve_run_config(j, "b4", None, pin_path(tmp_path / "j", "b4"))).run == run
        with pytest.raises(RunConfigConflict, match="refusing to guess"):
            await resolve_run_config(peer(hub, signer()), "b4", None, pin_path(tmp_path / "new", "b4"))

    asyncio.run(main())


def test_named_runs_accept_only_their_creator_and_only_it_can_create_them(tmp_path):
    async def main():
        hub = Hub()
        creator, joiner, forger = signer(), signer(), signer()
        run_id = f"b4@{creator.peer_id[:24]}"
        with pytest.raises(RunConfigConflict, match="only it can publish"):
            await resolve_run_config(peer(hub, forger), run_id, tiny(seed=3))  # squatting a named run
        f = peer(hub, forger)
        # even by going around the daemon's check, the forger's config is ignored by joiners
        envelope = f.discovery.seal_portable(config_key(run_id), config_payload("b4", forger.peer_id, tiny(seed=3)))
        await f.discovery.store_portable(config_key(run_id), forger.peer_id, envelope, f.discovery.time() + 60)
        with pytest.raises(RunConfigConflict, match="accepts only a configuration signed by") as refused:
            await resolve_run_config(peer(hub, joiner), run_id, None)
        assert creator.peer_id[:24] in str(refused.value) and forger.peer_id in str(refused.value)
        await resolve_run_config(peer(hub, creator), run_id, tiny())
        assert (await resolve_run_config(peer(hub, joiner), run_id, None)).creator == creator.peer_id

    asyncio.run(main())


def test_a_named_run_id_is_the_run_of_its_name(tmp_path):
    """The creator of `demo` advises `demo@<its PeerID>`: that joiner finds the config (keys derive from the name),
    as does a joiner naming a 24-character prefix; the creator may itself start with `demo@<own PeerID>`."""
    async def main():
        hub = Hub()
        creator, joiner, other = signer(), signer(), signer()
        published = await resolve_run_config(peer(hub, creator), "demo", tiny(), pin_path(tmp_path / "c", "demo"))
        for run_id in (f"demo@{creator.peer_id}", f"demo@{creator.peer_id[:24]}", "demo"):
            found = await resolve_run_config(peer(hub, joiner), run_id, None)
            assert found.creator == creator.peer_id and found.fingerprint == published.fingerprint
        assert pin_path(tmp_path, f"demo@{creator.peer_id}") == pin_path(tmp_path, "demo")
        # a joiner naming another creator is refused, naming both
        with pytest.raises(RunConfigConflict) as refused:
            await resolve_run_config(peer(hub, joiner), f"demo@{other.peer_id}", None)
        assert other.peer_id in str(refused.value) and creator.peer_id in str(refused.value)
        # the creator of a new run may name itself from the start
        own = f"solo@{creator.peer_id}"
        record = await resolve_run_config(peer(hub, creator), own, tiny(seed=5))
        assert record.envelope["payload"] and record.creator == creator.peer_id
        assert (await resolve_run_config(peer(hub, joiner), "solo", None)).fingerprint == tiny(seed=5).fingerprint()

    asyncio.run(main())


def test_a_pinned_peer_restores_a_lost_config_and_rejects_a_replacement(tmp_path):
    async def main():
        hub = Hub()
        creator, joiner, forger = signer(), signer(), signer()
        await resolve_run_config(peer(hub, creator), "pinned", tiny())
        pin = pin_path(tmp_path, "pinned")
        assert (await resolve_run_config(peer(hub, joiner), "pinned", None, pin)).run == tiny()
        hub._records.clear()  # every peer gone for CONFIG_TTL_S: the DHT forgot the run
        await resolve_run_config(peer(hub, forger), "pinned", tiny(seed=9))  # and someone else "creates" it
        # the documented residual risk of plain run ids: a first-time joiner cannot tell, and takes it
        assert (await resolve_run_config(peer(hub, signer()), "pinned", None)).creator == forger.peer_id
        # the pinned peer refuses the replacement and re-publishes the run's own config
        with pytest.raises(RunConfigConflict, match="disagrees"):
            await resolve_run_config(peer(hub, joiner), "pinned", tiny(seed=9), pin)
        record = await resolve_run_config(peer(hub, joiner), "pinned", None, pin)
        assert record.run == tiny() and record.creator == creator.peer_id
        # from then on a first-time joiner sees both and refuses to guess
        with pytest.raises(RunConfigConflict, match="refusing to guess"):
            await resolve_run_config(peer(hub, signer()), "pinned", None)

    asyncio.run(main())


# ------------------------------------------------------------------------------------------------ allowlist (B5)


def test_an_unlisted_peer_cannot_publish_the_run_config(tmp_path):
    async def main():
        hub = Hub()
        listed, outsider = signer(), signer()
        run = tiny(allowlist=(listed.peer_id,))
        with pytest.raises(RunConfigConflict, match="not on its allowlist"):
            await resolve_run_config(peer(hub, outsider), "b5", run)
        # bypassing the daemon: the record lands in the DHT, but no peer accepts a config its creator is not on
        o = peer(hub, outsider)
        envelope = o.discovery.seal_portable(config_key("b5"), config_payload("b5", outsider.peer_id, run))
        await o.discovery.store_portable(config_key("b5"), outsider.peer_id, envelope, o.discovery.time() + 60)
        with pytest.raises(RunConfigConflict, match="no configuration published"):
            await resolve_run_config(peer(hub, signer()), "b5", None)
        assert (await resolve_run_config(peer(hub, listed), "b5", run)).creator == listed.peer_id

    asyncio.run(main())


def test_admission_streams_refuse_unlisted_callers_before_the_handler_runs():
    async def main():
        hub = Hub()
        served = []

        async def handler(remote, reader, writer):
            served.append(remote)
            header, _, _ = await read_frame(reader, 0)
            await write_frame(writer, {"echo": header["x"]})

        guarded = AdmissionStreams(hub.transport("listed").streams, {"listed", "friend"})
        await guarded.add_handler("h", handler)
        friend, stranger = hub.transport("friend").streams, hub.transport("stranger").streams
        reader, writer = await friend.open("listed", "h")
        await write_frame(writer, {"x": 1})
        assert (await read_frame(reader, 0))[0] == {"echo": 1}
        reader, writer = await stranger.open("listed", "h")
        await write_frame(writer, {"x": 2})
        with pytest.raises(ProtocolViolation, match="stream ended"):  # closed unanswered
            await read_frame(reader, 0)
        assert served == ["friend"] and guarded.refused == {"stranger": 1}
        with pytest.raises(ConnectionRefusedError):
            await guarded.open("stranger", "h")

    asyncio.run(main())


@pytest.mark.parametrize("intruder", ["a-intruder", "z-intruder"])  # sorts first (would lead) / last (would follow)
@pytest.mark.parametrize("allowlist", [False, True])
def test_an_unlisted_peer_never_joins_a_round(intruder, allowlist):
    """Three peers matchmake for the same round; the intruder is not on the allowlist. Control (no allowlist): it
    is admitted. With the allowlist: admissions = 0 and the listed peers still average together."""

    async def main():
        hub = Hub()
        listed = ["m-listed-1", "m-listed-2"]
        cfg = MatchmakingConfig(matchmaking_timeout_s=2.0, request_timeout_s=0.5, poll_interval_s=0.1)

        def transport(name):
            t = hub.transport(name)
            return admit_only(t, listed) if allowlist and name in listed else t

        def refuse_unlisted(own, peer_id, info):  # the worker's admit callback with an allowlist
            return None if not allowlist or peer_id in listed else "not on the run's allowlist"

        makers = {name: Matchmaker(transport(name), "b5", cfg, admit=refuse_unlisted) for name in listed + [intruder]}
        for m in makers.values():
            await m.start()

        async def attempt(name):
            try:
                return await makers[name].form_group("round0", {}, expected_size=3)
            except MatchmakingFailed as e:
                return e

        groups = dict(zip(makers, await asyncio.gather(*(attempt(n) for n in makers))))
        # admissions: listed peers that ended up in a group with the intruder, as either side sees it
        together = set() if isinstance(groups[intruder], Exception) else set(groups[intruder].members) & set(listed)
        together |= {n for n in listed if not isinstance(groups[n], Exception) and intruder in groups[n].members}
        admitted = len(together)
        print(f"B5 matchmaking, intruder {intruder}, allowlist {allowlist}: admissions = {admitted}")
        if not allowlist:
            assert admitted > 0  # control: the attack works on an open run
        else:
            assert admitted == 0
            for name in listed:
                assert groups[name].members == tuple(sorted(listed)), groups

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_a_joiner_without_initial_peers_is_told_it_searched_only_its_own_dht():
    missing = RunConfigConflict("run 'demo' has no configuration published in the DHT")
    alone = explain_config_conflict(missing, NodeConfig(), None)
    assert isinstance(alone, RunConfigConflict)
    assert str(alone).startswith(str(missing)) and "no --initial-peers given" in str(alone)
    peer = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWBtPz6XL3brK5mWeGxqXyUL4BxTNkRTntktMeg3eCo6LZ"
    assert explain_config_conflict(missing, NodeConfig(initial_peers=(peer,)), None) is missing
    assert explain_config_conflict(missing, NodeConfig(), load_run_config(TINY)) is missing  # a creator: no hint
