"""Owner-signed DHT records (RELIABILITY row B4, unit level): signing, verification, the hivemind record validator,
the signing discovery wrapper, and the status schema. Every forgery is counted; none may be accepted."""

import asyncio
import logging

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer

from peerd.identity.key import load_or_create_identity
from peerd.identity.signing import (
    InvalidRecord,
    Signer,
    is_peer_id,
    owner_of,
    owner_subkey,
    public_key_of,
    seal,
    unseal,
    verify,
)
from peerd.identity.namespace import RunNamespace
from peerd.status.records import StatusFilter, make_status, status_problem
from peerd.transport.inprocess import Hub
from peerd.identity.signing import key_id
from peerd.transport.records import OwnerRecordValidator, SignedDiscovery

pytestmark = pytest.mark.timeout(60)

KEY = "peerd.unit.status"
EXP = 1_800_000_000.25


def signer() -> Signer:
    return Signer(Ed25519PrivateKey.generate())


# ------------------------------------------------------------------------------------------------------- PeerIDs


def test_peer_ids_embed_the_public_key_and_identity_files_load_as_signers(tmp_path):
    peer_id = load_or_create_identity(tmp_path / "id.key")
    s = Signer.from_identity_file(tmp_path / "id.key")
    assert s.peer_id == peer_id and peer_id.startswith("12D3KooW")
    assert public_key_of(peer_id).public_bytes_raw() == s.public_key
    assert is_peer_id(peer_id)
    rsa_like = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # sha256 multihash: no key inside
    for bad in (rsa_like, "12D3KooW", peer_id[:-1], peer_id + "1", "", None, 42, "0OIl" * 13):
        assert not is_peer_id(bad), bad


def test_owner_subkeys_name_valid_owners_only():
    s = signer()
    assert owner_of(owner_subkey(s.peer_id)) == s.peer_id
    assert owner_of(s.peer_id) is None and owner_of("[owner:nobody]") is None and owner_of(b"[owner:x]") is None


# ------------------------------------------------------------------------------------------------------- envelopes


def test_seal_then_unseal_round_trips_and_portable_records_take_any_expiration():
    s = signer()
    kid, sub = key_id(KEY), owner_subkey(s.peer_id)
    value = {"role": "diloco", "outer_round": 3, "loss": 1.5, "digest": None}
    assert unseal(kid, sub, seal(s, kid, value, EXP), EXP) == value
    portable = seal(s, kid, value, None)
    assert unseal(kid, sub, portable, EXP) == unseal(kid, sub, portable, EXP + 1e6) == value


def test_every_kind_of_forgery_is_refused():
    owner, forger = signer(), signer()
    kid, sub = key_id(KEY), owner_subkey(owner.peer_id)
    honest = seal(owner, kid, {"outer_round": 1}, EXP)
    forged_payload = dict(honest, payload=MSGPackSerializer.dumps({"outer_round": 999}))
    cases = {
        "unsigned value": {"outer_round": 999},
        "unsigned envelope": dict(honest, signature=b"\0" * 64),
        "signed by the forger": seal(forger, kid, {"outer_round": 999}, EXP),
        "altered payload": forged_payload,
        "extra field": dict(honest, note="x"),
        "missing field": {k: v for k, v in honest.items() if k != "expires"},
        "signature wrong type": dict(honest, signature="x" * 64),
        "oversized payload": dict(honest, payload=b"\x90" * (65 * 1024)),
    }
    refused = 0
    for name, envelope in cases.items():
        with pytest.raises(InvalidRecord):
            verify(kid, sub, envelope, EXP)
        refused += 1
    # a valid record of the owner, moved: to another key, to another owner's subkey, to a later expiration
    with pytest.raises(InvalidRecord):
        verify(key_id("peerd.other-run.status"), sub, honest, EXP)
    with pytest.raises(InvalidRecord):
        verify(kid, owner_subkey(forger.peer_id), honest, EXP)
    with pytest.raises(InvalidRecord, match="replayed"):
        verify(kid, sub, honest, EXP + 600)
    refused += 3
    assert refused == len(cases) + 3
    assert verify(kid, sub, honest, EXP)  # and the honest one still passes


# ---------------------------------------------------------------------------------------------- DHT-level validator


def _record(key: str, subkey, value, expiration=EXP) -> DHTRecord:
    return DHTRecord(key_id(key), MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), expiration)


def test_dht_validator_refuses_unsigned_and_forged_owner_records_and_ignores_the_rest():
    owner, forger = signer(), signer()
    kid = key_id(KEY)
    sub = owner_subkey(owner.peer_id)
    v = OwnerRecordValidator()
    assert v.validate(_record(KEY, sub, seal(owner, kid, {"x": 1}, EXP)))
    forgeries = [
        _record(KEY, sub, {"x": 2}),  # unsigned write to another peer's record
        _record(KEY, sub, seal(forger, kid, {"x": 2}, EXP)),  # signed, by the wrong key
        _record(KEY, sub, seal(owner, kid, {"x": 1}, EXP), EXP + 100),  # replayed with a later expiration
        _record(KEY, "[owner:12D3KooWnotapeerid]", {"x": 2}),  # claims an owner that is no PeerID
        _record(KEY, sub, "wrong schema"),
        DHTRecord(kid, MSGPackSerializer.dumps(sub), b"\xc1not msgpack", EXP),
    ]
    accepted = sum(v.validate(r) for r in forgeries)
    assert accepted == 0
    # not owner records: other users of the DHT (avgpeer, plain values) are none of its business
    assert v.validate(_record("avg.x.members", owner.peer_id, {"state": "alive"}))
    assert v.validate(DHTRecord(kid, MSGPackSerializer.dumps(None), MSGPackSerializer.dumps(5), EXP))
    # merges with itself, and survives the trip to hivemind's DHT process
    assert v.merge_with(OwnerRecordValidator())
    import pickle

    assert pickle.loads(pickle.dumps(v)).validate(forgeries[0]) is False


# ---------------------------------------------------------------------------------------------- SignedDiscovery


def test_signed_discovery_signs_own_records_and_drops_forged_ones(caplog):
    async def main():
        hub = Hub()
        alice, mallory = signer(), signer()
        a = SignedDiscovery(hub.transport(alice.peer_id).discovery, alice)
        m_raw = hub.transport(mallory.peer_id).discovery
        exp = a.time() + 60
        assert await a.store(KEY, alice.peer_id, make_status(role="diloco", outer_round=2), exp)
        with pytest.raises(ValueError):
            await a.store(KEY, mallory.peer_id, {"x": 1}, exp)  # a peer stores only its own records
        # the in-process hub validates nothing: every forgery lands, and the reader must drop it
        forged = {
            owner_subkey(mallory.peer_id): {"role": "diloco"},  # unsigned, under an owner subkey
            "[owner:" + alice.peer_id + "x]": {"role": "diloco"},  # not a PeerID
            "12D3KooWphantom": {"role": "diloco", "outer_round": 99},  # no owner subkey at all
        }
        for subkey, value in forged.items():
            await m_raw.store(KEY, subkey, value, exp + 10)
        await m_raw.store("peerd.unit.other", owner_subkey(alice.peer_id),
                          (await hub.transport("x").discovery.get(KEY))[owner_subkey(alice.peer_id)].value, exp)
        with caplog.at_level(logging.WARNING):
            for _ in range(3):  # read repeatedly: each forgery is logged once, counted every time
                seen = await a.get(KEY)
            moved = await a.get("peerd.unit.other")
        assert list(seen) == [alice.peer_id] and seen[alice.peer_id].value["outer_round"] == 2
        assert moved == {}  # alice's record replayed under another key
        assert sum(a.refused.values()) == 3 * len(forged) + 1
        assert len([r for r in caplog.records if getattr(r, "event", None) == "record_refused"]) == len(forged) + 1

    asyncio.run(main())


def test_portable_records_can_be_kept_alive_by_others_but_not_altered():
    async def main():
        hub = Hub()
        creator, keeper = signer(), signer()
        c = SignedDiscovery(hub.transport(creator.peer_id).discovery, creator)
        k = SignedDiscovery(hub.transport(keeper.peer_id).discovery, keeper)
        envelope = c.seal_portable("peerd.unit.config", {"lr": 1})
        assert await k.store_portable("peerd.unit.config", creator.peer_id, envelope, k.time() + 100)
        assert (await k.get("peerd.unit.config"))[creator.peer_id].value == {"lr": 1}
        altered = dict(envelope, payload=MSGPackSerializer.dumps({"lr": 1000}))
        with pytest.raises(InvalidRecord):
            await k.store_portable("peerd.unit.config", creator.peer_id, altered, k.time() + 200)
        status = seal(creator, key_id(KEY), {"x": 1}, 5.0)
        with pytest.raises(InvalidRecord):
            await k.store_portable(KEY, creator.peer_id, status, k.time() + 200)  # bound records stay bound

    asyncio.run(main())


# ----------------------------------------------------------------------------------------------- status schema


@pytest.mark.parametrize("change", [
    {"outer_round": "7"}, {"outer_round": -1}, {"outer_round": True}, {"outer_round": 2**41}, {"inner_step": 1.5},
    {"loss": float("nan")}, {"tokens_per_s": float("inf")}, {"role": ""}, {"role": 7}, {"role": "x" * 33},
    {"digest": "f" * 65}, {"time": None}, {"instance": ""}, {"instance": "i" * 65}, {"instance": 3}, {"v": "1"},
    {"v": -1},
])
def test_status_records_with_the_wrong_schema_are_dropped(change):
    good = make_status(role="diloco", outer_round=3, inner_step=4, loss=2.0, digest="ab" * 8)
    assert status_problem(good) is None
    bad = {**good, **change}
    assert status_problem(bad) is not None
    kept = StatusFilter()({"good": good, "bad": bad})
    assert list(kept) == ["good"]


def test_status_filter_drops_missing_fields_and_non_records():
    good = make_status(role="diloco", outer_round=0)
    missing = {k: v for k, v in good.items() if k != "digest"}
    f = StatusFilter()
    assert f({"a": good, "b": missing, "c": "hello", "d": None}) == {"a": good}
    assert f.dropped == 3
    assert RunNamespace.of("r").status_key == "peerd.r.status"


def test_key_ids_equal_the_dht_ids_hivemind_computes():
    from hivemind.dht.routing import DHTID

    for key in ("peerd.r.status", "peerd.demo.config", "", "ключ", "x" * 300):
        assert key_id(key) == DHTID.generate(source=key).to_bytes()
    assert len(key_id("a")) == 20 and key_id("a") != key_id("b")


# ------------------------------------------------------------------------------------- a DHT that fails


class BrokenDHT:
    """A DHT backend whose reads and writes fail as hivemind's do when its DHT process is gone: with whatever
    error the node raised (here a RuntimeError), not a ConnectionError. Counts the calls."""

    def __init__(self, error: Exception):
        self.error = error
        self.calls = 0
        self.tried = asyncio.Event()

    def time(self):
        return EXP - 100

    async def _fail(self):
        self.calls += 1
        if self.calls >= 6:
            self.tried.set()
        raise self.error

    async def store(self, key, subkey, value, expiration_time):
        await self._fail()

    async def get(self, key):
        await self._fail()


def test_a_failing_dht_backend_raises_one_named_error_with_its_cause():
    from peerd.transport.records import DiscoveryError

    cause = RuntimeError("the DHT process is gone")
    alice = signer()
    discovery = SignedDiscovery(BrokenDHT(cause), alice)

    async def go():
        for call in (discovery.get(KEY), discovery.store(KEY, alice.peer_id, {"x": 1}, EXP)):
            with pytest.raises(DiscoveryError) as raised:
                await call
            assert isinstance(raised.value, ConnectionError) and raised.value.__cause__ is cause

    asyncio.run(go())


def test_the_status_loop_outlives_a_dht_that_keeps_failing():
    """The status board catches ConnectionError only: the backend's untyped error reaches it as a DiscoveryError,
    and the loop goes on reading and publishing."""
    from peerd.roles.status_board import StatusBoard

    alice = signer()
    dht = BrokenDHT(RuntimeError("the DHT process is gone"))
    board = StatusBoard(SignedDiscovery(dht, alice), KEY, alice.peer_id, interval_s=0.0, ttl_s=60.0,
                        stop=asyncio.Event())
    board.set_source(lambda: {"role": "diloco", "outer_round": 1})

    async def go():
        loop = asyncio.ensure_future(board.run())
        await asyncio.wait({loop, asyncio.ensure_future(dht.tried.wait())}, timeout=10,
                           return_when=asyncio.FIRST_COMPLETED)
        assert not loop.done(), loop  # had the error escaped, the loop would have ended with it
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop

    asyncio.run(go())
    assert dht.calls >= 6  # reads and stores went on failing, and the loop went on
