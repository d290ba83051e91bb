"""``peerd status``: the live peers of a run, read from their status records in the DHT."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from peerd.commands.common import UsageError, node_config, require_run_id, run_async
from peerd.runtime.processes import interruptible


def cmd_status(args: argparse.Namespace) -> int:
    from peerd.daemon import read_status

    require_run_id(args)
    node = node_config(args)
    if not node.initial_peers:
        raise UsageError("peerd status: --initial-peers is required (any peer of the run)")
    peers, config = run_async(interruptible(read_status(node, args.run_id)))
    if args.json:
        print(json.dumps({"run_id": str(args.run_id), "config": config, "peers": peers}, indent=2, sort_keys=True))
        return 0
    live = {p: s for p, s in peers.items() if s.get("role") != "left"}
    print(f"run {args.run_id}: {len(live)} live peer(s)" + ("" if config else " (no configuration published)"))
    from peerd.dashboard.view import loss_unit

    header = ("PeerID", "role", "rounds done", "inner step", "last loss", "tokens/s",
              "eval nats/tok" if loss_unit(config) == "token" else "eval nats/B", "last seen")
    rows = [header]
    now = time.time()
    for peer, s in sorted(live.items(), key=lambda kv: (-(kv[1].get("outer_round") or 0), kv[0])):
        rows.append((
            peer, str(s.get("role")), str(s.get("outer_round")), str(s.get("inner_step")),
            _num(s.get("loss"), "{:.4f}"), _num(s.get("tokens_per_s"), "{:.0f}"),
            _num(s.get("eval_nats_per_byte"), "{:.4f}"), _num(now - s["time"] if s.get("time") else None, "{:.0f} s ago"),
        ))
    if any(s.get("stage") is not None for s in live.values()):
        header += ("stage",)
        rows = [header] + [(*r, str(live[r[0]].get("stage") if live[r[0]].get("stage") is not None else "-"))
                           for r in rows[1:]]
    if any(isinstance(s.get("experts"), list) for s in live.values()):  # SPES: what each peer trains
        header += ("experts",)
        rows = [header] + [(*r, ",".join(map(str, live[r[0]].get("experts") or [])) or "-") for r in rows[1:]]
    if any(s.get("reachable") is not None for s in live.values()):
        header += ("reachable",)
        names = {True: "yes", False: "no", None: "-"}
        rows = [header] + [(*r, "relayed" if live[r[0]].get("relayed") and live[r[0]].get("reachable") is False
                            else names[live[r[0]].get("reachable")]) for r in rows[1:]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    for line in _stage_lines(live, (config or {}).get("swarm", {}).get("stages")):
        print(line)
    for line in _contribution_lines(peers):
        print(line)
    return 0


def _contribution_lines(peers: dict[str, dict]) -> list[str]:
    """The ranked contribution table (:func:`peerd.status.records.contribution`), nothing if no record carries one."""
    from peerd.status.records import contribution

    ranked = contribution(peers)
    if not ranked:
        return []
    rows = [("rank", "PeerID", "tokens trained", "share", "rounds")] + [
        (str(r["rank"]), r["peer"], f"{r['tokens']:,}", f"{100 * r['share']:.1f} %", str(r["rounds"])) for r in ranked]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return ["contribution (tokens and outer rounds each peer gave the run; from its signed status record):"] + [
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def _stage_lines(live: dict[str, dict], num_stages: Any) -> list[str]:
    """SWARM runs: per stage its servers and summed tokens/s, and the bottleneck (the stage with the least
    throughput; an empty stage first). Nothing for a run without stage records."""
    servers: dict[int, list[str]] = {}
    for peer, s in live.items():
        if isinstance(s.get("stage"), int):
            servers.setdefault(s["stage"], []).append(peer)
    if not servers:
        return []
    count = num_stages if isinstance(num_stages, int) and num_stages > 0 else max(servers) + 1
    totals = {k: sum(live[p].get("tokens_per_s") or 0.0 for p in servers.get(k, [])) for k in range(count)}
    lines = []
    for k in range(count):
        peers = sorted(servers.get(k, []))
        lines.append(f"stage {k}: {len(peers)} server(s), {totals[k]:.0f} tokens/s" + (f": {', '.join(peers)}"
                                                                                       if peers else ""))
    bottleneck = min(range(count), key=lambda k: (bool(servers.get(k)), totals[k], k))
    lines.append(f"bottleneck: stage {bottleneck}")
    return lines


def _num(value: Any, fmt: str) -> str:
    return fmt.format(value) if isinstance(value, (int, float)) else "-"
