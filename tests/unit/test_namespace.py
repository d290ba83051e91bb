"""peerd/identity/namespace.py: run ids (RunRef) and the run namespace (every DHT key and handler prefix of a run)."""

import itertools

import pytest

from peerd.identity.namespace import CREATOR_MIN_PREFIX, RunIdError, RunNamespace, RunRef, network_key

pytestmark = pytest.mark.timeout(10)

PEER = "12D3KooWQ4s6d1Yvb2tnUfSxA1wZtSuAeW4uBhXCtB6z3N6fmH5Y"  # 52 characters, base58btc


def test_parse_plain_and_named_run_ids():
    assert RunRef.parse("demo") == RunRef("demo") and str(RunRef.parse("demo")) == "demo"
    full = RunRef.parse(f"demo@{PEER}")
    assert full == RunRef("demo", PEER) and str(full) == f"demo@{PEER}"
    short = RunRef.parse(f"demo@{PEER[:CREATOR_MIN_PREFIX]}")
    assert short.creator == PEER[:24] and short.name == "demo"
    assert RunRef.parse("A-b_9").name == "A-b_9" and RunRef.parse("x" * 64).name == "x" * 64


@pytest.mark.parametrize("bad", [
    "", "bad/name", "a.b", ".", "-lead", "_lead", "x" * 65, "sp ace", "colon:x", "eq=1", "ünï", "a\n",
    "demo@", "@" + PEER, f"demo@{PEER[:23]}", f"demo@{PEER}X", "demo@QmYyQSo1c1Ym7orWxLYvCrM2Emxxxxxx",
    f"demo@{PEER[:20]}0OIl{PEER[24:30]}",  # not base58
    f"demo@{PEER}@{PEER}", f"a.b@{PEER}",
])
def test_invalid_run_ids_raise_one_line(bad):
    with pytest.raises(RunIdError) as e:
        RunRef.parse(bad)
    assert "\n" not in str(e.value)


def test_accepts_the_creator_and_its_prefixes_only():
    assert RunRef("demo").accepts(PEER)
    assert RunRef("demo", PEER[:24]).accepts(PEER) and RunRef("demo", PEER).accepts(PEER)
    other = PEER[:24] + "z" + PEER[25:]
    assert RunRef("demo", PEER[:24]).accepts(other) and not RunRef("demo", PEER).accepts(other)
    assert not RunRef("demo", PEER[:23] + "z").accepts(PEER)


def test_keys_derive_from_the_name_alone_and_are_stable():
    plain, named = RunNamespace(RunRef("demo")), RunNamespace(RunRef("demo", PEER))
    assert plain == RunNamespace.of("demo") and RunNamespace.of(plain) is plain
    for ns in (plain, named, RunNamespace.of(f"demo@{PEER[:24]}")):
        # today's strings: peers of older versions use them too
        assert ns.status_key == "peerd.demo.status" and ns.config_key == "peerd.demo.config"
        assert ns.prefix("diloco") == "peerd.demo.diloco"
        assert ns.dht_key("x") == "peerd.demo.x"
    assert network_key("dataplane") == "peerd.dataplane"
    scoped = plain.scoped(stage=1)
    assert scoped.prefix("diloco") == "peerd.demo.stage=1.diloco"
    assert scoped.scoped(fragment="f0").dht_key("mm") == "peerd.demo.stage=1.fragment=f0.mm"
    # run-wide records stay run-wide in every scope: `peerd status` and the config see the whole run
    assert scoped.status_key == plain.status_key and scoped.config_key == plain.config_key


def test_scopes_and_runs_never_collide():
    runs = ["a", "b", "a-b", "stage", "a_stage", "1"]
    scopes = [{}, {"stage": 1}, {"expert": 1}, {"stage": 2}, {"fragment": "f0"}, {"stage": 1, "expert": 1},
              {"expert": 1, "stage": 1}, {"stage": "1-expert"}]
    services = ["diloco", "diloco_x", "stage", "expert", "status", "config"]
    seen: dict[str, tuple] = {}
    for run, scope, service in itertools.product(runs, scopes, services):
        ns = RunNamespace.of(run).scoped(**scope)
        for kind, text in (("prefix", ns.prefix(service)), ("key", ns.dht_key(service))):
            ident = (run, tuple(scope.items()), service)
            if text in seen:
                assert seen[text] == ident, (text, seen[text], ident)
            seen[text] = ident
    for name in ("dataplane", "status"):
        assert network_key(name) not in seen  # network keys have two parts, run keys at least three


@pytest.mark.parametrize("scope", [{"stage": "a.b"}, {"stage": "x=y"}, {"st.age": 1}, {"stage": ""},
                                   {"stage": -1}, {"stage": "a/b"}])
def test_scope_values_are_validated_like_names(scope):
    with pytest.raises(RunIdError):
        RunNamespace.of("demo").scoped(**scope)


def test_a_scope_cannot_be_given_twice_and_key_names_are_validated():
    with pytest.raises(RunIdError, match="twice"):
        RunNamespace.of("demo").scoped(stage=1).scoped(stage=2)
    for bad in ("a.b", "", "x=1"):
        with pytest.raises(RunIdError):
            RunNamespace.of("demo").dht_key(bad)
        with pytest.raises(RunIdError):
            RunNamespace.of("demo").prefix(bad)
        with pytest.raises(RunIdError):
            network_key(bad)
