"""Run configs that can evolve: fingerprints of today's presets are frozen (golden values computed before the
protocol sub-tables and the fingerprint rule existed), a field added with its default leaves fingerprints alone
while ``to_dict`` stays complete, and the protocols own their configs ([averaging.<protocol>] sub-tables)."""

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import pytest

import peerd.run_config as rc
from peerd.config_loading import ConfigError, build_config
from peerd.run_config import AveragingConfig, RunConfig, load_run_config
from protocols.gossip import GossipConfig
from protocols.state_transfer import StateTransferConfig

pytestmark = pytest.mark.timeout(30)

RUNS = Path(__file__).resolve().parents[2] / "node_configs" / "runs"
PEER = "12D3KooWQ4s6d1Yvb2tnUfSxA1wZtSuAeW4uBhXCtB6z3N6fmH5Y"

#: Computed with the flat [averaging] table and the plain to_dict() hash (before this scheme), never recomputed.
GOLDEN = {"shakespeare-demo": "5b90ddd602a01c49", "shakespeare-small": "236ebf75e269f6e2",
          "tiny-test": "22ca47662af595eb"}
GOLDEN_DEFAULT = "65fb1cfe5392e4f6"
GOLDEN_TINY_ALLOWLIST = "d5ff4a11e4ccb274"
GOLDEN_FLAT = ("c0b1e956dac04122", {"model": "tiny", "seq_len": 64, "averaging": {
    "method": "gossip", "gossip_partners": 3, "aggregation": "centered_clip", "clip_tau": 2.0, "compression": "int8",
    "sender_timeout_s": 7, "reducer_timeout_s": 9, "matchmaking_timeout_s": 1.2, "request_timeout_s": 0.5}})


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_todays_presets_keep_todays_fingerprints(name):
    run = load_run_config(RUNS / f"{name}.toml")
    assert run.fingerprint() == GOLDEN[name]
    assert RunConfig.from_dict(run.to_dict()).fingerprint() == GOLDEN[name]  # what joiners compute


def test_default_allowlisted_and_flat_configs_keep_their_fingerprints():
    assert RunConfig().fingerprint() == GOLDEN_DEFAULT
    tiny = load_run_config(RUNS / "tiny-test.toml")
    assert dataclasses.replace(tiny, allowlist=(PEER,)).fingerprint() == GOLDEN_TINY_ALLOWLIST
    expected, flat = GOLDEN_FLAT
    run = RunConfig.from_dict(flat)
    assert run.fingerprint() == expected
    # the flat keys keep their old meaning: compression and sender timeout were also the gossip's, state downloads
    # waited reducer_timeout_s, the poll interval was min(0.5, matchmaking_timeout_s / 4)
    assert run.averaging.gossip() == GossipConfig(partners_per_round=3, compression="int8", exchange_timeout_s=7.0)
    assert run.averaging.state_transfer() == StateTransferConfig(download_timeout_s=9.0)
    assert run.averaging.matchmaking().poll_interval_s == pytest.approx(0.3)
    # the published form has sub-tables and reads back to the same config and fingerprint
    assert RunConfig.from_dict(run.to_dict()) == run and "gossip_partners" not in run.to_dict()["averaging"]


def test_decoupled_protocol_settings_change_the_fingerprint():
    tiny = load_run_config(RUNS / "tiny-test.toml")
    avg = tiny.averaging
    for change in (dict(gossip_config=dataclasses.replace(avg.gossip(), exchange_timeout_s=11.0)),
                   dict(gossip_config=dataclasses.replace(avg.gossip(), compression="int8")),
                   dict(state_transfer_config=StateTransferConfig(download_timeout_s=99.0)),
                   dict(matchmaking_config=dataclasses.replace(avg.matchmaking(), poll_interval_s=0.25))):
        changed = dataclasses.replace(tiny, averaging=dataclasses.replace(avg, **change))
        assert changed.fingerprint() != tiny.fingerprint(), change
        assert RunConfig.from_dict(changed.to_dict()) == changed


def test_parallelism_is_validated_and_fingerprint_neutral_at_its_default():
    run = RunConfig()
    assert run.parallelism == "diloco" and run.to_dict()["parallelism"] == "diloco"  # published: complete
    assert run.fingerprint() == GOLDEN_DEFAULT
    with pytest.raises(ConfigError, match="parallelism"):
        RunConfig.from_dict({"parallelism": "pipeline"})
    # a record published before the field existed reads as the default, with the same fingerprint
    old = {k: v for k, v in run.to_dict().items() if k != "parallelism"}
    assert RunConfig.from_dict(old).fingerprint() == GOLDEN_DEFAULT


def test_a_field_added_later_with_its_default_keeps_checkpoints_and_pins(monkeypatch):
    """Simulate a future version: RunConfig gains ``stage_count: int = 1``. A checkpoint/pin written before it
    (holding today's fingerprint) still matches the config with the field at its default; set to anything else, it
    is another configuration."""
    before = load_run_config(RUNS / "tiny-test.toml")

    @dataclass(frozen=True)
    class Future(RunConfig):
        stage_count: int = 1

    after = Future(**{f.name: getattr(before, f.name) for f in dataclasses.fields(RunConfig)})
    monkeypatch.setattr(rc, "RunConfig", Future)  # defaults of the class the fingerprint compares against
    assert after.to_dict()["stage_count"] == 1  # published form stays complete
    assert after.fingerprint() == before.fingerprint() == GOLDEN["tiny-test"]
    assert dataclasses.replace(after, stage_count=2).fingerprint() != GOLDEN["tiny-test"]


def test_a_protocol_field_added_later_with_its_default_keeps_fingerprints(monkeypatch):
    @dataclass(frozen=True)
    class FutureGossip(GossipConfig):
        fanout_jitter: float = 0.0

    monkeypatch.setitem(rc.PROTOCOL_TABLES, "gossip", ("gossip_config", FutureGossip))
    tiny = load_run_config(RUNS / "tiny-test.toml")
    assert isinstance(tiny.averaging.gossip(), FutureGossip)
    assert tiny.to_dict()["averaging"]["gossip"]["fanout_jitter"] == 0.0
    assert tiny.fingerprint() == GOLDEN["tiny-test"]
    g = dataclasses.replace(tiny.averaging.gossip(), fanout_jitter=0.5)
    changed = dataclasses.replace(tiny, averaging=dataclasses.replace(tiny.averaging, gossip_config=g))
    assert changed.fingerprint() != GOLDEN["tiny-test"]


def test_flat_keys_and_sub_tables_do_not_mix_and_errors_name_table_and_file(tmp_path):
    with pytest.raises(ConfigError, match="mixed with the sub-tables"):
        RunConfig.from_dict({"averaging": {"compression": "fp16", "allreduce": {"compression": "fp16"}}})
    path = tmp_path / "run.toml"
    for text, needle in [
        ('[averaging.allreduce]\nsender_timeout_s = "10"\n', "averaging].allreduce: sender_timeout_s must be"),
        ("[averaging.gossip]\nexchange_timout_s = 3\n", "exchange_timout_s"),
        ("[averaging.matchmaking]\nmin_group_size = 1.5\n", "min_group_size must be int"),
        ('[averaging.allreduce]\ncompression = "zstd"\n', "zstd"),
        ("[averaging.state_transfer]\ndownload_timeout_s = 0\n", "download_timeout_s must be positive"),
        ("[averaging]\nbogus = 1\n", "bogus"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError, match="run.toml") as e:
            load_run_config(path)
        assert needle in str(e.value), (text, str(e.value))


def test_build_config_checks_typing_annotations():
    @dataclass(frozen=True)
    class Sample:
        a: int | None = None
        b: Optional[str] = None
        c: tuple[str, ...] = ()
        d: Literal["x", "y"] = "x"
        e: float = 0.0
        f: tuple[int, int] = (0, 0)
        g: bool = False

    ok = build_config(Sample, {"a": 3, "b": None, "c": ["p", "q"], "d": "y", "e": 2, "f": [1, 2], "g": True}, "s")
    assert ok == Sample(3, None, ("p", "q"), "y", 2.0, (1, 2), True) and isinstance(ok.e, float)
    assert build_config(Sample, {"c": "one"}, "s").c == ("one",)
    for bad in ({"a": "3"}, {"a": True}, {"a": 1.5}, {"b": 3}, {"c": [1]}, {"d": "z"}, {"e": "1"}, {"e": True},
                {"f": [1]}, {"f": [1, "2"]}, {"g": 1}, {"zz": 1}):
        key = next(iter(bad))
        with pytest.raises(ConfigError, match=f"file.toml: .*{key}"):
            build_config(Sample, bad, "file.toml")
    assert typing.get_type_hints(AveragingConfig)["gossip_config"] is GossipConfig


def test_swarm_table_round_trips_and_leaves_diloco_configs_unchanged():
    from peerd.run_config import RunConfig

    default = RunConfig()
    assert "swarm" not in default.to_dict()
    swarm = RunConfig.from_dict({"parallelism": "swarm", "model": "tiny", "swarm": {"stages": 2, "codec": "int8"}})
    assert swarm.swarm.stages == 2 and swarm.swarm.codec == "int8"
    assert swarm.to_dict()["swarm"]["stages"] == 2
    assert RunConfig.from_dict(swarm.to_dict()) == swarm
    assert swarm.fingerprint() != RunConfig(parallelism="swarm", model="tiny").fingerprint()
