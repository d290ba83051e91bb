// The dashboard page: polls the JSON API every POLL_MS and redraws; no reload, nothing from the internet.
"use strict";
const POLL_MS = 2000;
const ACTION_HEADER = {"X-Peerd-Dashboard": "1", "Content-Type": "application/json"};
const $ = (id) => document.getElementById(id);
const fmt = (v, digits) => (typeof v === "number" ? v.toFixed(digits) : "-");
const short = (peer) => peer.length > 16 ? peer.slice(0, 8) + "…" + peer.slice(-6) : peer;
let xaxis = "time";
let lastHistory = null, lastNode = null;
let lossUnit = "byte";  // a BPE run's losses are per token (run.loss_unit)

async function getJSON(path) {
  const r = await fetch(path, {cache: "no-store", credentials: "same-origin"});
  return r.json();
}

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function renderRun(run) {
  $("run-id").textContent = run.run_id;
  $("live-peers").textContent = run.live_peers;
  $("outer-round").textContent = run.outer_round ?? "-";
  $("run-tps").textContent = fmt(run.tokens_per_s, 0);
  $("best-eval").textContent = fmt(run.best_eval_nats_per_byte, 4);
  lossUnit = run.loss_unit || "byte";
  for (const el of document.querySelectorAll(".loss-unit")) el.textContent = lossUnit === "token" ? "nats/tok" : "nats/B";
  $("parallelism").textContent = run.config ? `${run.config.parallelism} · ${run.config.model}` : "no config";
  $("read-state").textContent = run.read_error ? `reading the run failed: ${run.read_error}` :
    (run.read_at ? `read ${Math.max(0, Math.round(Date.now() / 1000 - run.read_at))} s ago` : "reading the run…");
  const map = $("swarm-map");
  map.textContent = "";
  if (run.stages) {
    for (const s of run.stages.stages) {
      const div = document.createElement("div");
      div.textContent = `stage ${s.stage}: ${s.servers.length} server(s), ${s.tokens_per_s.toFixed(0)} tokens/s` +
        (s.servers.length ? ` — ${s.servers.map(short).join(", ")}` : "");
      if (s.stage === run.stages.bottleneck) { div.className = "bottleneck"; div.textContent += "  (bottleneck)"; }
      map.appendChild(div);
    }
  } else if (run.experts) {
    for (const [e, holders] of Object.entries(run.experts)) {
      const div = document.createElement("div");
      div.textContent = `expert ${e}: ${holders.map(short).join(", ")}`;
      map.appendChild(div);
    }
  } else if (run.groups) {
    map.textContent = Object.entries(run.groups)
      .map(([role, peers]) => `${role} group: ${peers.length} training peer(s)`).join("; ");
  }
}

function renderContribution(rows) {
  const body = $("contribution");
  body.textContent = "";
  for (const r of rows || []) {
    const tr = document.createElement("tr");
    tr.dataset.peer = r.peer;
    const mine = lastNode && lastNode.status && lastNode.status.peer_id === r.peer;
    if (mine) tr.className = "mine";
    tr.appendChild(cell(String(r.rank)));
    tr.appendChild(cell(short(r.peer) + (mine ? " (this machine)" : ""), "peer"));
    tr.lastChild.title = r.peer;
    tr.appendChild(cell(r.tokens.toLocaleString("en-US")));
    tr.appendChild(cell(`${(100 * r.share).toFixed(1)} %`));
    tr.appendChild(cell(String(r.rounds)));
    body.appendChild(tr);
  }
}

function renderPeers(data) {
  const body = $("peers");
  body.textContent = "";
  for (const p of data.peers) {
    const tr = document.createElement("tr");
    tr.dataset.peer = p.peer;
    const mine = lastNode && lastNode.status && lastNode.status.peer_id === p.peer;
    if (mine) tr.className = "mine";
    tr.appendChild(cell(short(p.peer) + (mine ? " (this machine)" : ""), "peer"));
    tr.lastChild.title = p.peer;
    tr.appendChild(cell(p.state, "state-" + p.state));
    tr.appendChild(cell(p.role));
    tr.appendChild(cell(p.stage != null ? `stage ${p.stage}` : (p.experts ? p.experts.join(",") : "-")));
    tr.appendChild(cell(p.outer_round ?? "-"));
    tr.appendChild(cell(p.inner_step ?? "-"));
    tr.appendChild(cell(fmt(p.loss, 4)));
    tr.appendChild(cell(fmt(p.tokens_per_s, 0)));
    tr.appendChild(cell(fmt(p.eval_nats_per_byte, 4)));
    tr.appendChild(cell(`${Math.round(p.last_seen_s)} s ago`));
    tr.appendChild(cell(p.reachable == null ? "-" : (p.reachable ? "yes" : (p.relayed ? "relayed" : "no"))));
    body.appendChild(tr);
  }
}

const LAYOUT = (title, ytitle) => ({
  title: {text: title, font: {size: 13}}, margin: {l: 50, r: 10, t: 30, b: 35}, showlegend: false,
  legend: {orientation: "h", y: -0.2, font: {size: 11}},
  xaxis: {title: {text: xaxis === "time" ? "" : "tokens"}, type: xaxis === "time" ? "date" : "linear"},
  yaxis: {title: {text: ytitle}}, uirevision: xaxis,
});
const CONFIG = {displaylogo: false, responsive: true, displayModeBar: false};

function xs(points) {
  return points.map((p) => xaxis === "time" ? new Date(p[0] * 1000) : p[1]);
}

function renderHistory(h) {
  if (typeof Plotly === "undefined") return;
  const loss = [], evals = [];
  for (const [peer, series] of Object.entries(h.peers)) {
    const lp = series.loss.filter((p) => xaxis === "time" || p[1] != null);
    const ep = series.eval.filter((p) => xaxis === "time" || p[1] != null);
    // one colour per peer, the same in both plots, named in the legend (this machine's peer says so)
    const name = short(peer) + (lastNode && lastNode.status && lastNode.status.peer_id === peer ? " (this machine)" : "");
    const color = peerColor(peer);
    loss.push({x: xs(lp), y: lp.map((p) => p[2]), name, mode: "lines+markers", marker: {size: 4, color},
               line: {color}});
    evals.push({x: xs(ep), y: ep.map((p) => p[2]), name, mode: "lines+markers", marker: {size: 5, color},
                line: {color}});
  }
  Plotly.react("loss-plot", loss, {...LAYOUT("training loss", `nats/${lossUnit}`), showlegend: true}, CONFIG);
  Plotly.react("eval-plot", evals, {...LAYOUT("eval loss (held out)", `nats/${lossUnit}`), showlegend: true}, CONFIG);
  const run = h.run;
  Plotly.react("tps-plot", [{x: run.map((p) => new Date(p[0] * 1000)), y: run.map((p) => p[1]), mode: "lines"}],
    {...LAYOUT("tokens/s of the whole run", "tokens/s"), xaxis: {type: "date"}}, CONFIG);
}

const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                 "#bcbd22", "#17becf"];
const peerColors = new Map();
function peerColor(peer) {  // stable for the page's life: a peer keeps its colour when others come and go
  if (!peerColors.has(peer)) peerColors.set(peer, PALETTE[peerColors.size % PALETTE.length]);
  return peerColors.get(peer);
}

function renderRounds(rounds) {
  if (typeof Plotly === "undefined") return;
  const ok = rounds.filter((r) => r.ok), failed = rounds.filter((r) => !r.ok);
  const last = Math.max(1, ...rounds.map((r) => r.outer_round + (r.ok ? 0 : 1)));
  Plotly.react("bytes-plot", [
    {x: ok.map((r) => r.outer_round), y: ok.map((r) => r.bytes_sent / 1e6), type: "bar", name: "sent"},
    {x: failed.map((r) => r.outer_round + 1), y: failed.map(() => 0), mode: "markers", name: "failed",
     marker: {symbol: "x", size: 10, color: "#b42318"}},
  ], {...LAYOUT("this machine: MB sent per outer round (x: failed)", "MB"),
      // rounds are whole numbers: integer ticks, at most ~10 of them
      xaxis: {title: {text: "outer round"}, tickformat: "d", tick0: 0, dtick: Math.max(1, Math.ceil(last / 10))}},
  CONFIG);
}

function renderNode(node) {
  lastNode = node;
  if (!node.available) {
    $("node-panel").hidden = true;
    $("node-unavailable").textContent = node.error || "no local daemon";
    return;
  }
  $("node-unavailable").textContent = "";
  $("node-panel").hidden = false;
  const s = node.status;
  $("node-peer").textContent = s.peer_id ? short(s.peer_id) : "-";
  $("node-peer").title = s.peer_id || "";
  $("node-state").textContent = s.paused ? "paused" : (s.pause_after_round ? "pausing after this round" : s.state.worker_state);
  $("node-state").className = s.paused ? "state-paused" : "state-online";
  $("node-reasons").textContent = Object.values(s.pause_reasons || {}).join("; ");
  $("snoozed").textContent = s.snoozed_until ? `until ${new Date(s.snoozed_until * 1000).toLocaleString()}` : "";
  $("node-health").textContent = node.health && node.health.ok ? `${node.health.healthy ? "healthy" : "unhealthy"}: ${node.health.message}` : "-";
  const rows = [
    ["run", s.run_id], ["run: rounds done", s.state.outer_round ?? "-"],
    ["this peer: rounds completed / failed", `${s.state.rounds_completed} / ${s.state.rounds_failed}`],
    ["peers seen", s.peers_seen ?? "-"], ["peers banned", (node.bans || []).length], ["device", deviceText(s)], ["threads", s.limits.threads || "torch default"],
    ["GPU memory share", s.limits.gpu_memory_fraction || "no limit"],
    ["upload", bw(s.bandwidth && s.bandwidth.upload, s.limits.upload_limit_mb_s)],
    ["download", bw(s.bandwidth && s.bandwidth.download, s.limits.download_limit_mb_s)],
    ["active hours", s.limits.active_hours || "always"],
    ["other programs' CPU", s.machine.others_cpu_percent == null ? "-" : `${s.machine.others_cpu_percent.toFixed(0)} %`],
    ["on battery", s.machine.on_battery == null ? "no battery" : (s.machine.on_battery ? "yes" : "no")],
  ];
  const body = $("node-limits");
  body.textContent = "";
  for (const [k, v] of rows) {
    const tr = document.createElement("tr");
    tr.appendChild(cell(k));
    tr.appendChild(cell(String(v)));
    body.appendChild(tr);
  }
  if (document.activeElement !== $("rule-cpu")) $("rule-cpu").value = s.rules.pause_when_cpu_busy_percent;
  $("rule-battery").checked = s.rules.pause_on_battery;
  $("rule-gpu").textContent = gpuText(s);
  renderRounds(node.rounds || []);
}

function deviceText(s) {  // what the role trains on, and the setting where it differs ("auto")
  const used = s.device_in_use;
  if (!used) return s.limits.device;
  return used === s.limits.device ? used : `${used} (device = ${s.limits.device})`;
}

function gpuText(s) {
  if (!s.rules.gpu) return "off";
  const used = s.device_in_use;
  if (used && used.startsWith("cuda")) return `on, in use (${used})`;
  return used ? `allowed, not in use (training on ${used})` : "allowed";
}

function bw(side, cap) {
  if (!side) return "-";
  const rate = side.achieved_bytes_per_s ? ` at ${(side.achieved_bytes_per_s / 1e6).toFixed(2)} MB/s` : "";
  return `${(side.bytes / 1e6).toFixed(1)} MB${rate}` + (cap ? ` (cap ${cap} MB/s)` : " (no cap)");
}

async function refresh() {
  try {
    const [run, peers, history, node] = await Promise.all(
      [getJSON("/api/run"), getJSON("/api/peers"), getJSON("/api/history"), getJSON("/api/node")]);
    renderNode(node);  // first: the peer table and the curves mark this machine's peer
    renderRun(run);
    renderContribution(run.contribution);
    renderPeers(peers);
    lastHistory = history;
    renderHistory(history);
  } catch (e) {
    $("read-state").textContent = `dashboard unreachable: ${e}`;
  }
}

async function act(path, body) {
  const r = await fetch(path, {method: "POST", headers: ACTION_HEADER, credentials: "same-origin",
                               body: JSON.stringify(body || {})});
  const reply = await r.json();
  await refresh();
  return reply;
}

for (const b of document.querySelectorAll(".buttons button")) {
  b.addEventListener("click", () => act(`/api/node/${b.dataset.cmd}`));
}
for (const b of document.querySelectorAll(".snooze button")) {
  b.addEventListener("click", () => act("/api/node/snooze", {for: b.dataset.for}));
}
$("rules").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const reply = await act("/api/node/rules", {pause_when_cpu_busy_percent: Number($("rule-cpu").value),
                                              pause_on_battery: $("rule-battery").checked});
  $("rules-result").textContent = reply.ok ? "applied (until restart; node config keys keep them)" : reply.error;
});
$("xaxis").addEventListener("change", () => { xaxis = $("xaxis").value; if (lastHistory) renderHistory(lastHistory); });
refresh();
setInterval(refresh, POLL_MS);
