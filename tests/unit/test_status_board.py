"""The status board: this peer's record in the run's namespace, and a duplicate identity stopping the daemon."""

import asyncio
import time

import pytest

from peerd.config import NodeConfig
from peerd.events import DuplicateIdentitySeen, EventBus
from peerd.roles.base import RunContext
from peerd.roles.status_board import DuplicateIdentity
from peerd.run_config import RunConfig
from peerd.status.records import make_status, status_problem
from peerd.transport.inprocess import Hub

pytestmark = pytest.mark.timeout(30)


def _ctx(hub, name, tmp_path, events=None) -> RunContext:
    node = NodeConfig(checkpoint_dir=str(tmp_path / name), device="cpu", status_interval_s=0.05)
    return RunContext.build("dup", RunConfig(model="tiny"), node, hub.transport(name), events=events)


def test_status_record_carries_the_daemon_instance_under_todays_key(tmp_path):
    async def main():
        hub = Hub()
        ctx = _ctx(hub, "peer-a", tmp_path)
        assert ctx.namespace.status_key == "peerd.dup.status" and ctx.namespace.prefix("diloco") == "peerd.dup.diloco"
        ctx.status.set_source(lambda: {"role": "diloco", "outer_round": 3})
        await ctx.status.publish()
        record = (await ctx.status.records())["peer-a"]
        assert status_problem(record) is None
        assert record["instance"] == ctx.status.instance and record["outer_round"] == 3
        assert ctx.status.conflict is None and not ctx.stop.is_set()

    asyncio.run(main())


def test_record_without_instance_from_an_older_peer_is_valid():
    record = make_status(role="diloco", outer_round=1)
    del record["instance"]
    assert status_problem(record) is None
    assert status_problem({**record, "instance": 7}) == "instance is not a string of 1-64 characters: 7"


def test_second_daemon_with_the_same_peer_id_stops_the_first_loudly(tmp_path):
    async def main():
        hub = Hub()
        seen = []
        first = _ctx(hub, "twin", tmp_path, EventBus(seen.append))
        first.status.set_source(lambda: {"role": "diloco", "outer_round": 0})
        task = asyncio.ensure_future(first.status.run())
        await asyncio.sleep(0.1)
        assert not first.stop.is_set()  # alone: our own record never counts
        second = _ctx(hub, "twin", tmp_path / "b")  # same PeerID (a copied identity file), another process
        second.status.set_source(lambda: {"role": "diloco", "outer_round": 0})
        await second.status.publish()
        await asyncio.wait_for(first.stop.wait(), timeout=5)
        task.cancel()
        assert isinstance(first.status.conflict, DuplicateIdentity)
        message = str(first.status.conflict)
        assert "twin" in message and "--identity" in message and "--checkpoint-dir" in message
        assert [type(e) for e in seen] == [DuplicateIdentitySeen] and seen[0].other_instance == second.status.instance

    asyncio.run(main())


def test_a_crashed_predecessors_record_does_not_count(tmp_path):
    async def main():
        hub = Hub()
        old = make_status(role="diloco", outer_round=2, instance="0123456789abcdef")
        old["time"] = time.time() - 5  # written before this daemon started
        await hub.transport("x").discovery.store("peerd.dup.status", "me", old, time.time() + 60)
        left = _ctx(hub, "me", tmp_path)
        await left.status.records()
        assert left.status.conflict is None and not left.stop.is_set()
        forged = make_status(role="diloco", outer_round=2, instance="fedcba9876543210")  # written now: live
        await hub.transport("x").discovery.store("peerd.dup.status", "me", forged, time.time() + 120)
        await left.status.records()
        assert isinstance(left.status.conflict, DuplicateIdentity) and left.stop.is_set()

    asyncio.run(main())
