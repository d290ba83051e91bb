"""SWARM node config keys (stage, swarm_role) and the stage lines of `peerd status`."""

import pytest

from peerd.commands.status import _stage_lines
from peerd.config import ConfigError, NodeConfig
from peerd.roles.base import RunContext
from peerd.roles.swarm import SwarmRole
from peerd.run_config import load_run_config
from peerd.transport.inprocess import Hub

pytestmark = pytest.mark.timeout(30)


def test_node_config_swarm_keys_are_validated():
    assert NodeConfig().stage is None and NodeConfig().swarm_role == "auto"
    assert NodeConfig(stage=1, swarm_role="trainer").stage == 1
    for bad in ({"stage": -1}, {"stage": True}, {"stage": "1"}, {"swarm_role": "boss"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            NodeConfig(**bad)


def test_the_role_takes_stage_and_trainer_from_the_node_config(tmp_path):
    run = load_run_config("node_configs/runs/swarm-tiny.toml")
    hub = Hub()

    def role(**node):
        ctx = RunContext.build("swarmcfg", run, NodeConfig(checkpoint_dir=str(tmp_path), device="cpu", **node),
                               hub.transport(f"p{len(node)}"))
        return SwarmRole(ctx)

    r = role(stage=1, swarm_role="trainer")
    assert r.stage == 1 and r.trainer_wanted is True
    assert role(swarm_role="server").trainer_wanted is False
    assert role().stage is None and role().trainer_wanted is None
    with pytest.raises(ValueError, match="stage"):
        role(stage=2)  # the run has stages 0-1


def test_status_shows_each_stage_its_servers_and_the_bottleneck():
    live = {"a": {"stage": 0, "tokens_per_s": 300.0}, "b": {"stage": 0, "tokens_per_s": 200.0},
            "c": {"stage": 1, "tokens_per_s": 400.0}, "d": {"role": "diloco"}}
    lines = _stage_lines(live, 2)
    assert lines == ["stage 0: 2 server(s), 500 tokens/s: a, b", "stage 1: 1 server(s), 400 tokens/s: c",
                     "bottleneck: stage 1"]
    assert _stage_lines(live, 3)[-2:] == ["stage 2: 0 server(s), 0 tokens/s", "bottleneck: stage 2"]
    assert _stage_lines({"d": {"role": "diloco", "stage": None}}, None) == []


def test_status_shows_the_experts_each_spes_peer_trains(monkeypatch, capsys):
    import peerd.daemon
    from peerd.commands.main import main
    from peerd.status.records import StatusFilter, make_status

    records = {"p1": make_status(role="spes", outer_round=3, inner_step=4, experts=[0, 5], tokens_trained=1000,
                                 rounds_contributed=2),
               "p2": make_status(role="spes", outer_round=3, inner_step=2, experts=[], tokens_trained=3000,
                                 rounds_contributed=3)}
    assert StatusFilter()(records)["p1"]["experts"] == [0, 5]  # the field passes the readers' checks

    async def read_status(node, run_id):
        return records, None

    monkeypatch.setattr(peerd.daemon, "read_status", read_status)
    peer = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWBtPz6XL3brK5mWeGxqXyUL4BxTNkRTntktMeg3eCo6LZ"
    assert main(["status", "--run-id", "moe", "--initial-peers", peer]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-1] == "experts" and "rounds done" in lines[1]
    assert lines[2].startswith("p1") and lines[2].split()[-1] == "0,5"
    assert lines[3].startswith("p2") and lines[3].split()[-1] == "-"
    # the ranked contribution table: p2 trained more
    at = lines.index(next(line for line in lines if line.startswith("contribution")))
    assert lines[at + 1].split() == ["rank", "PeerID", "tokens", "trained", "share", "rounds"]
    assert lines[at + 2].split() == ["1", "p2", "3,000", "75.0", "%", "3"]
    assert lines[at + 3].split() == ["2", "p1", "1,000", "25.0", "%", "2"]
