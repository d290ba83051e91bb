"""What the dashboard shows, assembled from the run's status records (pure functions, no I/O).

Inputs are what :func:`peerd.daemon.read_run_status` returns (the records ``peerd status --json`` prints): PeerID ->
status record (schema-checked, :mod:`peerd.status.records`) and the run's published config. Times are Unix seconds, losses
nats per byte, or per token for a run with a BPE tokenizer (:func:`loss_unit`), throughput tokens per second.
"""

from __future__ import annotations

from typing import Any, Optional

from peerd.roles.registry import ROLES
from peerd.status.records import contribution

#: Status roles that are no training peer (yet, or any more).
IDLE_ROLES = ("left", "paused", "starting", "syncing")


def peer_state(record: dict, now: float, ttl_s: float) -> str:
    """``left``, ``paused``, ``joining`` (starting or downloading state), ``stale`` (no record refresh for more
    than 3/4 of its lifetime: about to drop out of the run's view) or ``online``."""
    role = record.get("role")
    if role == "left":
        return "left"
    if role == "paused":
        return "paused"
    if role in ("starting", "syncing"):
        return "joining"
    if now - record.get("time", now) > 0.75 * ttl_s:
        return "stale"
    return "online"


def peers_view(peers: dict[str, dict], now: float, ttl_s: float = 30.0) -> list[dict[str, Any]]:
    """One row per peer that has not left, most advanced first: the record's fields (no history) plus ``peer``,
    ``state`` (:func:`peer_state`) and ``last_seen_s`` (seconds since its record was written)."""
    rows = []
    for peer, record in peers.items():
        if record.get("role") == "left":
            continue
        row = {k: v for k, v in record.items() if k != "history"}
        row.update(peer=peer, state=peer_state(record, now, ttl_s), last_seen_s=round(max(0.0, now - record["time"]), 1))
        rows.append(row)
    rows.sort(key=lambda r: (-(r.get("outer_round") or 0), r["peer"]))
    return rows


def stage_map(rows: list[dict], num_stages: Any) -> Optional[dict[str, Any]]:
    """SWARM runs: ``{"stages": [{stage, servers, tokens_per_s}], "bottleneck": k}`` (the stage with the least
    throughput, an empty stage first); None for runs without stage records."""
    servers: dict[int, list[dict]] = {}
    for row in rows:
        if isinstance(row.get("stage"), int) and row["state"] != "left":
            servers.setdefault(row["stage"], []).append(row)
    if not servers:
        return None
    count = num_stages if isinstance(num_stages, int) and num_stages > 0 else max(servers) + 1
    stages = [{"stage": k, "servers": sorted(r["peer"] for r in servers.get(k, [])),
               "tokens_per_s": sum(r.get("tokens_per_s") or 0.0 for r in servers.get(k, []))} for k in range(count)]
    bottleneck = min(stages, key=lambda s: (bool(s["servers"]), s["tokens_per_s"], s["stage"]))["stage"]
    return {"stages": stages, "bottleneck": bottleneck}


def expert_map(rows: list[dict]) -> Optional[dict[str, list[str]]]:
    """SPES runs whose records carry ``experts`` (a list of expert indices): expert -> holders; else None."""
    holders: dict[str, list[str]] = {}
    for row in rows:
        experts = row.get("experts")
        if isinstance(experts, (list, tuple)):
            for e in experts:
                holders.setdefault(str(e), []).append(row["peer"])
    return holders or None


def loss_unit(config: Optional[dict]) -> str:
    """What a run's losses (training and eval, the status field ``eval_nats_per_byte`` included) are per:
    ``"token"`` for a BPE tokenizer (``tokenizer = "bpe:..."``), else ``"byte"``. ``config``: the published run config
    as :func:`peerd.daemon.read_run_status` returns it, or None (no config published: byte-level assumed)."""
    tokenizer = ((config or {}).get("config") or {}).get("tokenizer", "bytes")
    return "token" if str(tokenizer).startswith("bpe:") else "byte"


def run_view(run_id: str, peers: dict[str, dict], config: Optional[dict], now: float,
             ttl_s: float = 30.0) -> dict[str, Any]:
    """The run panel: counts and totals over live peers, the published config's summary, the swarm map."""
    rows = peers_view(peers, now, ttl_s)
    training = [r for r in rows if r["state"] == "online"]
    run_cfg = (config or {}).get("config") or {}
    rounds = [r["outer_round"] for r in rows if isinstance(r.get("outer_round"), int)]
    evals = [r["eval_nats_per_byte"] for r in rows if isinstance(r.get("eval_nats_per_byte"), (int, float))]
    roles: dict[str, int] = {}
    for r in rows:
        roles[str(r.get("role"))] = roles.get(str(r.get("role")), 0) + 1
    return {
        "run_id": run_id, "time": now, "live_peers": len(rows), "training_peers": len(training), "roles": roles,
        "outer_round": max(rounds, default=None),
        "tokens_per_s": round(sum(r.get("tokens_per_s") or 0.0 for r in training), 1),
        "best_eval_nats_per_byte": min(evals, default=None), "loss_unit": loss_unit(config),
        "config": None if config is None else {
            "fingerprint": config.get("fingerprint"), "creator": config.get("creator"),
            "parallelism": run_cfg.get("parallelism", "diloco"), "model": run_cfg.get("model"),
            "method": (run_cfg.get("averaging") or {}).get("method"), "max_outer_rounds": run_cfg.get("max_outer_rounds")},
        "groups": {role: sorted(r["peer"] for r in rows if r.get("role") == role) for role in ROLES
                   if any(r.get("role") == role for r in rows)},
        "stages": stage_map(rows, (run_cfg.get("swarm") or {}).get("stages")),
        "experts": expert_map(rows),
        "contribution": contribution(peers),
    }


def history_view(peers: dict[str, dict], sampled: dict[str, list[list]], run_samples: list[list]
                 ) -> dict[str, Any]:
    """Curves per peer (``{"loss": [[time, tokens, loss, tokens_per_s]...], "eval": [[time, tokens, eval]...]}``):
    a record's own ``history`` (:mod:`peerd.status.history`), or for a peer whose records carry none what this dashboard
    sampled itself (``sampled``: PeerID -> [[time, tokens, loss, tokens_per_s, eval], ...]).
    ``run``: [[time, total tokens/s of live peers, live peers], ...] as this dashboard saw it."""
    out: dict[str, Any] = {}
    for peer in sorted(set(peers) | set(sampled)):
        hist = (peers.get(peer) or {}).get("history") or {}
        if hist.get("loss") or hist.get("eval"):
            out[peer] = {"loss": list(hist.get("loss", [])), "eval": list(hist.get("eval", []))}
            continue
        # a peer of an older version: no history in its records, only what this dashboard saw
        points = sampled.get(peer, [])
        out[peer] = {"loss": [[t, tok, loss, tps] for t, tok, loss, tps, _ in points if loss is not None],
                     "eval": [[t, tok, ev] for t, tok, _, _, ev in points if ev is not None]}
    return {"peers": out, "run": list(run_samples)}
