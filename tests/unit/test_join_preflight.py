"""What `peerd join` checks before it touches the network (node options against the run config, the local
checkpoint, a run config given as a node config) and how a joiner waits for a run's config."""

import asyncio
import dataclasses

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import peerd.daemon as daemon
from peerd.worker.checkpoint_file import Checkpoint, CheckpointError, checkpoint_path, save_checkpoint
from peerd.config import RUN_CONFIG_KEYS, ConfigError, NodeConfig, load_node_config
from peerd.identity.membership import RunConfigConflict
from peerd.worker.preflight import check_local_checkpoint, node_run_error
from peerd.run_config import RunConfig, load_run_config
from peerd.identity.signing import Signer
from peerd.testing.localswarm import TINY
from peerd.transport.inprocess import Hub
from peerd.transport.records import SignedDiscovery

pytestmark = pytest.mark.timeout(60)

SWARM = "node_configs/runs/swarm-tiny.toml"


def test_node_options_are_checked_against_the_run():
    run = load_run_config(TINY)  # batch_size 8, DiLoCo
    assert node_run_error(NodeConfig(micro_batch_size=4), run) is None
    assert node_run_error(NodeConfig(), run) is None
    error = node_run_error(NodeConfig(micro_batch_size=3), run)
    assert error.key == "micro_batch_size" and "use one of 1, 2, 4, 8" in str(error)
    assert node_run_error(NodeConfig(stage=0), run).key == "stage"
    assert node_run_error(NodeConfig(local_devices=("cpu", "cpu"), micro_batch_size=4), run) is None
    assert node_run_error(NodeConfig(local_devices=("cpu", "cpu"), micro_batch_size=3), run).key == "local_devices"
    swarm = load_run_config(SWARM)
    assert node_run_error(NodeConfig(stage=0), swarm) is None
    assert "local_devices" in str(node_run_error(NodeConfig(local_devices=("cpu", "cpu")), swarm))


def test_a_bad_option_stops_join_before_the_dht_and_publishes_nothing(monkeypatch, tmp_path):
    opened = []

    async def open_transport(*args, **kwargs):  # never reached: counted to prove it
        opened.append(args)
        raise AssertionError("join opened the DHT")

    monkeypatch.setattr(daemon, "open_transport", open_transport)
    node = NodeConfig(micro_batch_size=3, checkpoint_dir=str(tmp_path), device="cpu")
    with pytest.raises(ConfigError, match="micro_batch_size"):
        asyncio.run(daemon.join("x", node, load_run_config(TINY)))
    assert opened == [] and not (tmp_path / "identity.key").exists()


def test_a_damaged_checkpoint_is_found_before_join_and_the_error_says_what_to_do(monkeypatch, tmp_path):
    node = NodeConfig(checkpoint_dir=str(tmp_path), device="cpu")
    assert check_local_checkpoint(node, "demo") is None  # none: nothing to check
    path = checkpoint_path(tmp_path, "demo")
    flat = torch.arange(1000, dtype=torch.float32)
    save_checkpoint(path, Checkpoint({"theta_outer": flat}, {"outer_round": 3}))
    assert check_local_checkpoint(node, "demo") == path
    whole = path.read_bytes()
    for damaged in (whole[: len(whole) - 100], b"\x00" * 64, whole[:8] + b"{not json" + whole[17:]):
        path.write_bytes(damaged)
        with pytest.raises(CheckpointError) as refused:
            check_local_checkpoint(node, "demo")
        assert str(path) in str(refused.value) and "move it away" in str(refused.value)
        assert "starts fresh from the swarm" in str(refused.value)

    opened = []

    async def open_transport(*args, **kwargs):
        opened.append(args)
        raise AssertionError("join opened the DHT")

    monkeypatch.setattr(daemon, "open_transport", open_transport)
    with pytest.raises(CheckpointError, match="move it away"):
        asyncio.run(daemon.join("demo", node, load_run_config(TINY)))
    assert opened == []


def test_a_run_config_given_as_node_config_is_named(tmp_path):
    with pytest.raises(ConfigError, match="is a run config .*pass it as --run-config") as refused:
        load_node_config(TINY, environ={})
    assert "unknown key" not in str(refused.value)
    node = tmp_path / "node.toml"
    node.write_text("device = 'cpu'\n")
    assert load_node_config(str(node), environ={}).device == "cpu"


def test_the_run_config_keys_that_give_a_run_config_away_are_run_config_keys():
    assert RUN_CONFIG_KEYS <= {f.name for f in dataclasses.fields(RunConfig)}
    assert not RUN_CONFIG_KEYS & {f.name for f in dataclasses.fields(NodeConfig)}


def _peer(hub: Hub):
    signer = Signer(Ed25519PrivateKey.generate())
    transport = hub.transport(signer.peer_id)
    transport.discovery = SignedDiscovery(transport.discovery, signer)
    return transport


class CountingLookups:
    """Wraps a discovery's get_signed: counts the joiner's config lookups and signals the first."""

    def __init__(self, discovery):
        self.inner, self.calls, self.first = discovery.get_signed, 0, asyncio.Event()
        discovery.get_signed = self

    async def __call__(self, key):
        self.calls += 1
        self.first.set()
        return await self.inner(key)


def test_a_joiner_started_before_the_creator_waits_for_the_config(monkeypatch, caplog):
    monkeypatch.setattr(daemon, "CONFIG_POLL_S", 0.05)

    async def main():
        hub = Hub()
        joiner, creator = _peer(hub), _peer(hub)
        lookups = CountingLookups(joiner.discovery)
        waiting = asyncio.ensure_future(daemon.resolve_run_config(joiner, "demo", None, wait_s=60))
        await lookups.first.wait()
        published = await daemon.resolve_run_config(creator, "demo", load_run_config(TINY))
        found = await waiting
        return published, found, lookups.calls

    with caplog.at_level("INFO", logger="peerd.daemon"):
        published, found, calls = asyncio.run(main())
    assert found.creator == published.creator and found.fingerprint == published.fingerprint
    assert calls >= 2
    assert "has no configuration published yet: waiting up to 60 s" in caplog.text and "Ctrl-C" in caplog.text


def test_the_wait_for_a_config_is_bounded_and_stops_on_ctrl_c(monkeypatch):
    monkeypatch.setattr(daemon, "CONFIG_POLL_S", 0.05)

    async def main():
        hub = Hub()
        with pytest.raises(RunConfigConflict, match="still has no configuration published .* after 0 s"):
            await daemon.resolve_run_config(_peer(hub), "demo", None, wait_s=0.2)
        stop = asyncio.Event()
        joiner = _peer(hub)
        lookups = CountingLookups(joiner.discovery)
        waiting = asyncio.ensure_future(daemon.resolve_run_config(joiner, "demo", None, wait_s=60, stop=stop))
        await lookups.first.wait()
        stop.set()
        return await asyncio.wait_for(waiting, 10)

    assert asyncio.run(main()) is None
