"""A standalone averaging peer: averages a synthetic vector with other such peers, for tests and benchmarks.

Each peer joins the DHT, starts from ``randn(numel)`` seeded by its index, waits until ``--expect`` peers are
present, then runs ``--rounds`` rounds of a topology (allreduce | moshpit | gossip) and writes one JSON line per
round to ``--out``: round, seconds, bytes, group size or exchanges, and a sketch of its vector (the values at 4096
fixed coordinates, the same on every peer) from which consensus distance can be estimated across peers. The final
vector is saved next to it (``<out>.final.pt``). Gossip peers keep serving exchanges after their own rounds until
every peer is done (or ``--linger-s`` passes), so late partners are not left alone.

With ``--attempts 2`` a failed all-reduce is retried once right away among the survivors under a fresh group key,
as the DiLoCo worker does; a failed attempt changes nothing. ``PEERD_FAULTS`` (:mod:`peerd.testing.faults`) makes this peer
misbehave on schedule (round r of the schedule = this peer's r-th round); ``fault`` events go to stderr as JSON lines.

Usage: ``python -m peerd.testing.avgpeer --index 0 --expect 4 --topology moshpit --out /tmp/p0.jsonl [--initial-peers M]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time

import torch

from peerd.roles.registry import OUTER_SYNCS
from peerd.testing.faults import Faults, FaultyTransport
from peerd.runtime.telemetry import JsonFormatter
from peerd.transport.factory import retry_unreachable
from peerd.transport.hivemind_backend import HivemindTransport
from peerd.transport.light import LightTransport
from protocols.allreduce import AllReduceConfig, AllReduceFailed, ButterflyAllReduce
from protocols.codecs import CODECS
from protocols.gossip import GossipAverager, GossipConfig
from protocols.matchmaking import MatchmakingConfig, Matchmaker, MatchmakingFailed
from protocols.moshpit import MoshpitAverager, round_to_join

SKETCH = 4096


def initial_vector(index: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + index))


def sketch_indices(numel: int) -> torch.Tensor:
    count = min(SKETCH, numel)
    return torch.randperm(numel, generator=torch.Generator().manual_seed(7))[:count]


def out_path(template: str, index: int) -> str:
    """The output file of peer ``index``: ``template`` with ``{index}`` filled in (unchanged if it has none)."""
    return template.replace("{index}", str(index))


async def run(args: argparse.Namespace) -> None:
    """Run ``args.peers`` peers (indices ``args.index`` ...) in this process; light transports unless one
    ordinary peer was asked for."""
    light = args.light or args.peers > 1
    indices = range(args.index, args.index + args.peers)
    if not light:
        network = await retry_unreachable(lambda: HivemindTransport.create(
            initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False
        ))
        await run_peer(args, args.index, out_path(args.out, args.index), network)
        return
    # p2pd start-up is mostly waiting on the daemon: start the peers' daemons a few at a time; with tens of them
    # starting on a loaded box the bootstrap node can answer one too late (p2pd exits): that one tries again
    networks: list[LightTransport] = []
    for start in range(0, len(indices), 8):
        batch = indices[start:start + 8]
        started = await asyncio.gather(*(retry_unreachable(lambda: LightTransport.create(
            initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False,
        )) for _ in batch), return_exceptions=True)
        networks += [n for n in started if not isinstance(n, BaseException)]
        failed = [e for e in started if isinstance(e, BaseException)]
        if failed:  # the daemons that did start are stopped, not left to the closing loop
            await asyncio.gather(*(n.shutdown() for n in networks))
            raise failed[0]
    await asyncio.gather(*(run_peer(args, i, out_path(args.out, i), n) for i, n in zip(indices, networks)))


async def run_peer(args: argparse.Namespace, index: int, path: str, network) -> None:
    """One averaging peer on ``network`` (released at the end), writing its JSON lines to ``path``."""
    faults = Faults.from_env()
    transport = FaultyTransport.wrap(network, faults) if faults is not None else network
    out = open(path, "a", buffering=1)
    try:
        me = network.peer_id
        key = f"avg.{args.run_id}.members"
        discovery = transport.discovery

        progress = {"state": "alive", "round": 0}

        async def members(include_done: bool = True) -> dict[str, dict]:
            records = await discovery.get(key)
            return {p: r.value for p, r in records.items()
                    if isinstance(r.value, dict) and (include_done or r.value.get("state") != "done")}

        async def announce(state: str) -> None:
            progress["state"] = state
            await discovery.store(key, me, dict(progress), discovery.time() + args.member_ttl_s)

        async def heartbeat() -> None:  # a killed peer disappears from the member list within member_ttl_s
            while True:
                await asyncio.sleep(args.member_ttl_s / 3)
                await announce(progress["state"])

        state = {"x": initial_vector(index, args.numel), "w": float(args.weight)}
        prefix = f"avg.{args.run_id}"
        mm_timeout = args.matchmaking_timeout_s
        mm = Matchmaker(transport, prefix, MatchmakingConfig(
            mm_timeout, min(2.0, mm_timeout / 2), min(0.2, mm_timeout / 4), max_wait_s=args.max_wait_s))
        ar = ButterflyAllReduce(transport, prefix, AllReduceConfig(args.compression, args.timeout_s, 2 * args.timeout_s))
        gossip = GossipAverager(
            transport, prefix, GossipConfig(args.partners, args.compression, args.timeout_s),
            get_state=lambda: (state["x"], state["w"]),
            set_state=lambda x, w: state.update(x=x, w=w), seed=index,
        )
        for component in (mm, ar, gossip):
            await component.start()
        moshpit = MoshpitAverager(mm, ar, args.group_size, args.rendezvous)

        deadline = time.time() + args.start_timeout_s
        while len(await members()) < args.expect - 1 and time.time() < deadline:
            await announce("alive")
            await asyncio.sleep(0.3)
        await announce("alive")
        while len(await members()) < args.expect and time.time() < deadline:
            await asyncio.sleep(0.3)
        idx = sketch_indices(args.numel)
        print(json.dumps({"event": "start", "peer": me, "index": index}), file=out)
        beat = asyncio.ensure_future(heartbeat())

        r = 0
        for _ in range(args.rounds):
            others = await members(include_done=False)
            if args.topology == "moshpit":  # a peer that fell behind its groupmates skips to where they are
                r = round_to_join(me, {p: int(v.get("round", 0)) for p, v in others.items()}, r, args.group_size)
            progress["round"] = r
            await announce("alive")
            if args.topology == "moshpit" and args.rendezvous == "group":
                # the grid of round r must be the one its groupmates computed: peers that already finished every
                # round took part in round r too (a straggler that left them out would compute another grid)
                others = {**(await members()), **others}
            live = sorted(others) if me in others else sorted([*others, me])
            started = time.perf_counter()
            record = {"event": "round", "round": r + 1, "peer": me, "index": index}
            if args.arrival_jitter_s:  # arrive spread out, as after rounds of different lengths on a loaded box
                await asyncio.sleep(random.Random(f"{index}:{r}").uniform(0.0, args.arrival_jitter_s))
            if faults is not None:
                faults.round = r + 1
                faults.at_phase("matchmaking")
            try:
                if args.topology == "gossip":
                    res = await gossip.gossip_round(live)
                    record.update(exchanges=res.exchanges, busy=res.busy, failed=res.failed,
                                  bytes_sent=res.bytes_sent, bytes_received=res.bytes_received, ok=res.exchanges > 0)
                else:
                    if args.topology == "moshpit":
                        res = await moshpit.average(r, state["x"], state["w"], live,
                                                    coming=live if args.wait_for_view else None)
                    else:
                        res = await _allreduce(mm, ar, r, state, live, args.attempts, record)
                    state["x"] = res.averaged
                    state["w"] = state["w"] * res.group_size  # this peer now speaks for its group
                    record.update(group_size=res.group_size, bytes_sent=res.bytes_sent,
                                  bytes_received=res.bytes_received, ok=True)
            except (MatchmakingFailed, AllReduceFailed) as e:
                record.update(ok=False, error=str(e), bytes_sent=0, bytes_received=0)
            record["seconds"] = round(time.perf_counter() - started, 4)
            record["sketch"] = state["x"][idx].tolist()
            print(json.dumps(record), file=out)
            r += 1
            progress["round"] = r
            if args.round_interval_s:
                await asyncio.sleep(args.round_interval_s)

        torch.save(state["x"], f"{path}.final.pt")
        beat.cancel()
        await announce("done")
        if args.topology == "gossip":
            linger_until = time.time() + args.linger_s
            while time.time() < linger_until:
                if all(v.get("state") == "done" for v in (await members()).values()):
                    break
                await asyncio.sleep(0.5)
            torch.save(state["x"], f"{path}.final.pt")
        print(json.dumps({"event": "done", "peer": me, "served": gossip.served}), file=out)
    finally:
        out.close()
        await network.shutdown()


async def _allreduce(mm: Matchmaker, ar: ButterflyAllReduce, r: int, state: dict, live: list[str], attempts: int,
                     record: dict):
    """Round ``r`` of the all-reduce topology among the peers of this peer's view ``live``; a failed attempt is
    retried among the survivors (``attempts`` in all). Failed attempts are listed in ``record["failed_attempts"]``;
    raises the last failure.

    The first attempt waits for exactly the peers of the view (``expected_members``): with many peers the arrivals
    at a round spread out by as long as the previous round's all-reduce took to finish on each of them (tens of
    seconds for 64 peers on two cores), far longer than an idle window, and a rendezvous that sealed on the idle
    window left most of the swarm to groups of late peers (64 peers: 43% of peer-rounds averaged alone). A peer of
    the view that died is left out after two probes (see :meth:`Matchmaker.form_group`)."""
    record["failed_attempts"] = []
    expected = len(live)
    for attempt in range(1, attempts + 1):
        key = f"allreduce.r{r}" if attempt == 1 else f"allreduce.r{r}.attempt{attempt}"
        # a peer that comes after the seal averages with the other late peers rather than failing its round
        if attempt == 1:
            group = await mm.form_group(key, {}, expected_members=live, on_late="next")
        else:
            group = await mm.form_group(key, {}, expected_size=expected, on_late="next")
        record.update(attempts=attempt, members=list(group.members))
        try:
            return await ar.run(group, state["x"], state["w"])
        except AllReduceFailed as e:
            record["failed_attempts"].append(str(e))
            if attempt == attempts:
                raise
            expected = max(1, len(group.members) - 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", type=int, required=True, help="this peer's number (seeds its vector)")
    p.add_argument("--expect", type=int, required=True, help="peers to wait for before round 1")
    p.add_argument("--topology", choices=tuple(OUTER_SYNCS), required=True)
    p.add_argument("--out", required=True, help="JSON-lines output file; with --peers > 1 it must contain {index}")
    p.add_argument("--peers", type=int, default=1,
                   help="peers hosted by this process (indices --index ...), each with its own p2pd and an in-process "
                        "DHT node (light peers)")
    p.add_argument("--light", action="store_true", help="a light peer even when --peers is 1")
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--run-id", default="avg")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--numel", type=int, default=100_000)
    p.add_argument("--weight", type=float, default=1.0)
    p.add_argument("--compression", choices=CODECS, default="none")
    p.add_argument("--group-size", type=int, default=2, help="moshpit target group size M")
    p.add_argument("--rendezvous", choices=("round", "group"), default="round",
                   help="moshpit: one rendezvous of all peers per round (round), or each peer meets only its grid "
                        "groupmates (group: the sharded rendezvous, for large swarms whose views agree)")
    p.add_argument("--wait-for-view", action="store_true",
                   help="moshpit, round rendezvous: wait for exactly the peers of this peer's view (dead ones are "
                        "probed out) instead of sealing after an idle window (MoshpitAverager.average's coming)")
    p.add_argument("--partners", type=int, default=2, help="gossip partners per round k")
    p.add_argument("--timeout-s", type=float, default=10.0)
    p.add_argument("--matchmaking-timeout-s", type=float, default=10.0)
    p.add_argument("--max-wait-s", type=float, default=None,
                   help="longest a peer matchmakes while its group keeps growing (default 3 x --matchmaking-timeout-s)")
    p.add_argument("--member-ttl-s", type=float, default=8.0)
    p.add_argument("--start-timeout-s", type=float, default=60.0)
    p.add_argument("--round-interval-s", type=float, default=0.0, help="pause between rounds")
    p.add_argument("--arrival-jitter-s", type=float, default=0.0,
                   help="before each round, wait a random 0..this many seconds (seeded by index and round)")
    p.add_argument("--linger-s", type=float, default=30.0)
    p.add_argument("--verbose-logger", action="append", default=[], metavar="NAME",
                   help="log this logger (e.g. protocols.matchmaking) at DEBUG, not WARNING; repeatable")
    p.add_argument("--attempts", type=int, default=1,
                   help="all-reduce attempts per round; a failed one is retried among the survivors (worker: 2)")
    args = p.parse_args()
    if args.max_wait_s is not None and args.max_wait_s < args.matchmaking_timeout_s:
        p.error("--max-wait-s must be >= --matchmaking-timeout-s")
    if args.peers < 1:
        p.error(f"--peers must be >= 1, got {args.peers}")
    if args.peers > 1 and "{index}" not in args.out:
        p.error("--out must contain {index} when --peers > 1 (one output file per peer)")
    torch.set_num_threads(1)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    for name in args.verbose_logger:
        logging.getLogger(name).setLevel(logging.DEBUG)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
