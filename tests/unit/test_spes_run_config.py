"""The ``[spes]`` table and the MoE model names in the run config; ``build_model`` builds either kind."""

import dataclasses

import pytest

from peerd.config import ConfigError
from peerd.models import MoETransformer, Transformer, build_model
from peerd.run_config import RunConfig, load_run_config
from protocols.spes import SpesConfig

pytestmark = pytest.mark.timeout(60)


def test_spes_run_config_round_trips_and_validates(tmp_path):
    path = tmp_path / "spes.toml"
    path.write_text('model = "tiny-moe"\nparallelism = "spes"\nseq_len = 64\n'
                    "[spes]\nsync_steps = 50\nmin_holders = 2\nmerge_interval = 100\nalpha_0 = 0.02\n")
    run = load_run_config(path)
    assert run.spes == SpesConfig(sync_steps=50, min_holders=2, merge_interval=100, alpha_0=0.02)
    assert run.to_dict()["spes"]["min_holders"] == 2
    again = RunConfig.from_dict(run.to_dict())
    assert again == run and again.fingerprint() == run.fingerprint()
    assert dataclasses.replace(run, spes=SpesConfig(sync_steps=51)).fingerprint() != run.fingerprint()
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        RunConfig(model="tiny", parallelism="spes")
    for method in ("gossip", "moshpit"):  # SPES averages by all-reduce: no other method is silently replaced
        with pytest.raises(ConfigError, match="spes.*allreduce"):
            RunConfig.from_dict({"model": "tiny-moe", "parallelism": "spes", "averaging": {"method": method}})
    for exchange, compression in (("ring", "fp16"), ("gather", "topk")):  # nor the butterfly by another exchange
        with pytest.raises(ConfigError, match=f"spes.*exchange must be 'reduce', got '{exchange}'"):
            RunConfig.from_dict({"model": "tiny-moe", "parallelism": "spes", "averaging": {
                "allreduce": {"exchange": exchange, "compression": compression}}})
    with pytest.raises(ConfigError, match=r"\[spes\].*sync_steps"):
        RunConfig.from_dict({"model": "tiny-moe", "parallelism": "spes", "spes": {"sync_steps": 0}})
    with pytest.raises(ConfigError, match="no_such_key"):
        RunConfig.from_dict({"model": "tiny-moe", "parallelism": "spes", "spes": {"no_such_key": 1}})
    with pytest.raises(ConfigError, match="table"):
        RunConfig.from_dict({"model": "tiny-moe", "parallelism": "spes", "spes": 3})


def test_runs_without_spes_publish_what_they_always_did():
    assert "spes" not in RunConfig().to_dict() and "spes" not in RunConfig(model="tiny-moe").to_dict()


def test_build_model_builds_dense_and_moe_models():
    assert isinstance(build_model("tiny", 32, 0), Transformer)
    assert isinstance(build_model("tiny-moe", 32, 0), MoETransformer)
    with pytest.raises(ValueError, match="tiny-moe"):
        build_model("huge", 32, 0)


def test_the_spes_preset_loads():
    from pathlib import Path

    run = load_run_config(Path(__file__).resolve().parents[2] / "node_configs" / "runs" / "spes-tiny.toml")
    assert run.parallelism == "spes" and run.model == "tiny-moe" and run.spes.sync_steps == 20
