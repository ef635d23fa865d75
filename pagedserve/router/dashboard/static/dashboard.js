// pagedserve admin dashboard: polls the admin JSON API and draws it. No framework, no build step.
// Every string from the server reaches the DOM through textContent or an attribute, never as HTML.
"use strict";

const OVERVIEW_PERIOD_MS = 1000;
const HISTORY_PERIOD_MS = 2000;
const CHART_MIN_SPAN_S = 60;   // a chart shows at least a minute, so the first points don't fill it
const CHART_MAX_SPAN_S = 600;
const STALE_AFTER_S = 5;       // a replica whose stats are older than this is marked stale
const CHART_HEIGHT = 84;      // px
const SVG_NS = "http://www.w3.org/2000/svg";
const BLOCK_STATES = [
  // cell char, class, label (the contract's block_map alphabet)
  [".", "free", "free"],
  ["c", "cached", "cached-free"],
  ["u", "used", "in use"],
  ["s", "shared", "shared"],
  ["r", "reserved", "reserved"],
];

const state = { overview: null, history: null, lastOk: 0, failing: false };
const cards = new Map();  // replica_id -> the card's elements, kept across polls

// ---- DOM -------------------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const child of children) {
    if (child !== null && child !== undefined) node.append(child);
  }
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

// Puts nodes first in box, in this order, moving only what is out of place (a moved button would
// lose a click in progress).
function placeInOrder(box, nodes) {
  nodes.forEach((node, i) => {
    if (box.children[i] !== node) box.insertBefore(node, box.children[i] || null);
  });
}

function toast(message, isError) {
  const box = document.getElementById("toasts");
  const t = el("div", { class: isError ? "toast error" : "toast", "data-testid": "toast", role: "status",
    text: message });
  box.append(t);
  setTimeout(() => t.remove(), isError ? 8000 : 4000);
}

// ---- formatting ------------------------------------------------------------------------------

const short = (id) => (id ? String(id).slice(0, 8) : "–");
const fmtInt = (n) => (n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en-US"));
const fmtPct = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`);

function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(n >= 100 || i === 0 ? 0 : 1)} ${units[i]}`;
}

function fmtMs(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const ms = seconds * 1000;
  return ms >= 100 ? ms.toFixed(0) : ms.toFixed(1);
}

// compact, for chart axes and chart titles: 0.5, 12.3, 456, 1.2k, 34k
function fmtShort(v) {
  if (v === null || v === undefined) return "–";
  if (v >= 10000) return `${(v / 1000).toFixed(0)}k`;
  if (v >= 1000) return `${+(v / 1000).toFixed(1)}k`;
  return v >= 100 ? v.toFixed(0) : String(+v.toFixed(1));
}

function fmtAge(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 60) return `${seconds.toFixed(1)} s`;
  return `${Math.floor(seconds / 60)} min ${Math.round(seconds % 60)} s`;
}

// ---- network ---------------------------------------------------------------------------------

async function api(path, options) {
  const r = await fetch(path, { credentials: "same-origin", cache: "no-store", ...options });
  if (r.status === 401) {
    window.location.assign("/dashboard/login");
    throw new Error("not logged in");
  }
  let body = null;
  try { body = await r.json(); } catch (e) { body = null; }
  if (!r.ok) {
    const msg = body && body.error && body.error.message ? body.error.message : `HTTP ${r.status}`;
    throw new Error(msg);
  }
  return body;
}

function post(path) {
  // the cookie alone does not authorise a POST: the header is the CSRF guard
  return api(path, { method: "POST", headers: { "X-Pagedserve-Admin": "1" } });
}

function poll(path, periodMs, onData) {
  async function tick() {
    try {
      onData(await api(path));
      state.lastOk = Date.now();
      state.failing = false;
    } catch (e) {
      state.failing = true;
      state.failure = e.message;
    }
    renderStatus();
    setTimeout(tick, periodMs);
  }
  tick();
}

// ---- header ----------------------------------------------------------------------------------

function renderStatus() {
  const status = document.querySelector("[data-testid=status]");
  if (state.failing) {
    status.className = "status error";
    const since = state.lastOk ? ` (last update ${((Date.now() - state.lastOk) / 1000).toFixed(0)} s ago)` : "";
    setText(status, `connection lost: ${state.failure}${since}`);
  } else {
    status.className = "status";
    setText(status, `live · ${new Date(state.lastOk).toLocaleTimeString()}`);
  }
}

function renderHeader(ov) {
  setText(document.querySelector("[data-testid=model]"), ov.model || "");
  setText(document.querySelector("[data-testid=routing]"), `routing: ${ov.routing || "–"}`);
}

// ---- nodes -----------------------------------------------------------------------------------

function meter(label, fraction, detail) {
  const pct = Math.max(0, Math.min(1, fraction || 0));
  return el("span", { class: "meter" },
    el("span", { text: label }),
    el("span", { class: "bar" }, el("span", { class: pct > 0.9 ? "hot" : "", style: `width:${(100 * pct).toFixed(1)}%` })),
    el("span", { class: "num", text: detail }));
}

function utilisation(node) {
  const box = el("div", { class: "util" });
  if (node.gpu_devices && node.gpu_devices.length) {
    for (const g of node.gpu_devices) {
      const mem = g.mem_total_bytes ? g.mem_used_bytes / g.mem_total_bytes : 0;
      box.append(el("span", { class: "meter", title: g.name || "" },
        el("span", { class: "mono", text: `GPU${g.index}` }),
        meter("util", (g.util_percent || 0) / 100, `${fmtInt(g.util_percent)}%`),
        meter("mem", mem, `${fmtBytes(g.mem_used_bytes)} / ${fmtBytes(g.mem_total_bytes)}`)));
    }
  } else if (node.host) {
    const h = node.host;
    box.append(meter("CPU", (h.cpu_percent || 0) / 100, `${(h.cpu_percent || 0).toFixed(0)}%`));
    const mem = h.mem_total_bytes ? h.mem_used_bytes / h.mem_total_bytes : 0;
    box.append(meter("mem", mem, `${fmtBytes(h.mem_used_bytes)} / ${fmtBytes(h.mem_total_bytes)}`));
  } else {
    box.append(el("span", { class: "meta", text: "no figures" }));
  }
  return box;
}

function renderNodes(nodes) {
  const body = document.getElementById("nodes");
  const rows = nodes.slice().sort((a, b) => (b.alive - a.alive) || (b.is_head - a.is_head)
    || String(a.node_id).localeCompare(String(b.node_id)));
  body.replaceChildren(...rows.map((n) => el("tr",
    { "data-testid": "node-row", "data-node-id": n.node_id, "data-alive": n.alive ? "true" : "false",
      class: n.alive ? "" : "dead" },
    el("td", {},
      el("span", { class: "mono", title: n.node_id, text: short(n.node_id) }), " ",
      el("span", { class: "meta", text: n.address || "" }), " ",
      n.is_head ? el("span", { class: "badge head", text: "head" }) : null),
    el("td", {}, el("span", { class: n.alive ? "badge alive" : "badge dead", "data-testid": "node-state",
      text: n.alive ? "alive" : "dead" })),
    el("td", { class: "num", text: fmtInt(n.cpus) }),
    el("td", { class: "num", text: fmtInt(n.gpus) }),
    el("td", { class: "num", text: fmtBytes(n.memory_bytes) }),
    el("td", { class: "util-cell" }, n.alive ? utilisation(n) : el("span", { class: "meta", text: "–" })),
    el("td", { class: "num", text: fmtInt((n.replicas || []).length) }))));
  if (!rows.length) body.replaceChildren(el("tr", { class: "empty" }, el("td", { colspan: 7, text: "no nodes" })));
}

// ---- replica cards ---------------------------------------------------------------------------

function tile(label) {
  const value = el("div", { class: "v", text: "–" });
  return { node: el("div", { class: "tile" }, el("div", { class: "k", text: label }), value), value };
}

function chartBox(title, series, scale) {
  const now = el("span", { class: "now" });
  const keys = series.map(([, label, color, dashed]) => el("span", {},
    el("span", { class: "key", style: `background:${color};${dashed ? "opacity:.7" : ""}` }), label));
  const plot = svg("svg", { viewBox: `0 0 300 ${CHART_HEIGHT}` });
  const node = el("div", { class: "chart" }, el("div", { class: "chart-title" }, el("b", { text: title }), ...keys, now));
  node.append(plot);
  return { node, plot, now, series, scale };
}

function makeCard(id) {
  const c = { id };
  c.title = el("span", { class: "title mono", title: id, text: short(id) });
  c.where = el("span", { class: "meta" });
  c.ranks = el("span", { class: "ranks" });
  c.draining = el("span", { class: "badge draining", "data-testid": "draining-badge", text: "draining", hidden: true });
  c.stale = el("span", { class: "badge stale", text: "stale", hidden: true });
  c.reset = el("button", { type: "button", "data-testid": "reset-button", "data-replica-id": id,
    title: "Drop this replica's cached-free KV blocks", text: "Reset prefix cache",
    onclick: () => action(c.reset, `/admin/api/replicas/${encodeURIComponent(id)}/reset_prefix_cache`,
      (r) => `Reset prefix cache of ${short(id)}: ${fmtInt(r.dropped_blocks)} blocks dropped`) });
  c.drain = el("button", { type: "button", "data-testid": "drain-button", "data-replica-id": id, text: "Drain",
    onclick: () => {
      const verb = c.drain.dataset.draining === "true" ? "undrain" : "drain";
      action(c.drain, `/admin/api/replicas/${encodeURIComponent(id)}/${verb}`, (r) => {
        setDraining(c, !!(r.drain_requested ?? r.draining), !!r.draining);
        return `${short(id)} ${r.draining ? "draining: new requests go to other replicas" : "undrained"}`;
      });
    } });

  const t = ["running", "waiting", "swapped", "out tok/s", "TTFT p50/p95 ms", "ITL p50/p95 ms", "prefix hit rate",
    "preemptions"].map(tile);
  [c.running, c.waiting, c.swapped, c.tps, c.ttft, c.itl, c.hit, c.preempt] = t.map((x) => x.value);
  c.hit.setAttribute("data-testid", "hit-rate");
  c.hit.setAttribute("data-replica-id", id);

  c.canvas = el("canvas", { "data-testid": "block-map", "data-replica-id": id, role: "img" });
  c.counts = {};
  const legend = el("div", { class: "legend", "data-testid": "block-legend" });
  for (const [, cls, label] of BLOCK_STATES) {
    c.counts[cls] = el("b", { text: "0" });
    legend.append(el("span", {}, el("span", { class: `sw ${cls}` }), `${label} `, c.counts[cls]));
  }
  c.kvMeta = el("span", { class: "meta" });
  legend.append(c.kvMeta);

  c.charts = [
    chartBox("output tok/s", [["output_tokens_per_s", "", "var(--tps)", false]], 1),
    chartBox("TTFT ms", [["ttft_p50_s", "p50", "var(--p50)", false], ["ttft_p95_s", "p95", "var(--p95)", true]], 1000),
    chartBox("ITL ms", [["itl_p50_s", "p50", "var(--p50)", false], ["itl_p95_s", "p95", "var(--p95)", true]], 1000),
  ];

  c.node = el("article", { class: "card", "data-testid": "replica-card", "data-replica-id": id },
    el("div", { class: "card-head" }, el("span", { class: "meta", text: "replica" }), c.title, c.where, c.ranks,
      c.draining, c.stale, el("span", { class: "spacer" }), c.reset, c.drain),
    el("div", { class: "tiles" }, ...t.map((x) => x.node)),
    el("div", { class: "kv" }, c.canvas, legend),
    el("div", { class: "charts" }, ...c.charts.map((x) => x.node)));
  return c;
}

// requested: the admin's mark, which the button toggles; draining: whether the replica still
// drains (it hears a new mark with its next publish, within a second)
function setDraining(c, requested, draining = requested) {
  const shown = requested || draining;
  c.draining.hidden = !shown;
  setText(c.draining, requested ? "draining" : "undraining");
  c.node.classList.toggle("draining", shown);
  c.node.dataset.draining = String(requested);
  c.drain.dataset.draining = String(requested);
  setText(c.drain, requested ? "Undrain" : "Drain");
}

function renderReplicas(replicas) {
  const box = document.getElementById("replicas");
  const seen = new Set();
  const sorted = replicas.slice().sort((a, b) => String(a.replica_id).localeCompare(String(b.replica_id)));
  for (const r of sorted) {
    seen.add(r.replica_id);
    let c = cards.get(r.replica_id);
    if (!c) {
      c = makeCard(r.replica_id);
      cards.set(r.replica_id, c);
    }
    updateCard(c, r);
  }
  placeInOrder(box, sorted.map((r) => cards.get(r.replica_id).node));
  for (const [id, c] of cards) {
    if (!seen.has(id)) { c.node.remove(); cards.delete(id); }
  }
  if (!sorted.length && !box.querySelector(".empty")) {
    box.append(el("div", { class: "panel empty meta", text: "no engine replicas" }));
  } else if (sorted.length) {
    box.querySelectorAll(".empty").forEach((n) => n.remove());
  }
}

function updateCard(c, r) {
  setText(c.where, `node ${short(r.node_id)} · pid ${r.pid ?? "–"}`);
  const ranks = r.ranks || [];
  setText(c.ranks, ranks.length
    ? `TP ${ranks.length}: ${ranks.map((k) => `r${k.rank} ${short(k.node_id)}/${k.pid}`).join(", ")}` : "");
  setDraining(c, !!(r.drain_requested ?? r.draining), !!r.draining);
  c.stale.hidden = !(r.stats_age_s > STALE_AFTER_S);
  c.stale.title = `stats ${Number(r.stats_age_s || 0).toFixed(1)} s old`;

  setText(c.running, fmtInt(r.num_running));
  setText(c.waiting, fmtInt(r.num_waiting));
  setText(c.swapped, fmtInt(r.num_swapped));
  setText(c.tps, r.output_tokens_per_s === null || r.output_tokens_per_s === undefined
    ? "–" : r.output_tokens_per_s.toFixed(1));
  setText(c.ttft, `${fmtMs(r.ttft_p50_s)} / ${fmtMs(r.ttft_p95_s)}`);
  setText(c.itl, `${fmtMs(r.itl_p50_s)} / ${fmtMs(r.itl_p95_s)}`);
  setText(c.hit, fmtPct(r.prefix_hit_rate));
  c.hit.title = `${fmtInt(r.prefix_cache_hits)} of ${fmtInt(r.prefix_cache_queries)} prompt tokens hit the prefix cache`;
  c.hit.dataset.value = String(r.prefix_hit_rate ?? "");
  c.hit.dataset.queries = String(r.prefix_cache_queries ?? 0);
  c.hit.dataset.hits = String(r.prefix_cache_hits ?? 0);
  setText(c.preempt, fmtInt(r.num_preemptions));
  c.node.dataset.generationTokens = String(r.generation_tokens ?? 0);
  c.node.dataset.numRunning = String(r.num_running ?? 0);

  // the pool's exact counts come from the replica's figures; the map's cells may each cover several blocks
  const cells = (r.block_map && r.block_map.cells) || "";
  const perCell = (r.block_map && r.block_map.blocks_per_cell) || 1;
  const tally = { ".": 0, c: 0, u: 0, s: 0, r: 0 };
  for (const ch of cells) if (ch in tally) tally[ch] += 1;
  // referenced blocks split as the map colours them: by one table (in use) or several (shared)
  const referenced = Math.max(0, r.num_blocks - r.free_blocks);
  const shared = Math.min(referenced, tally.s * perCell);
  const counts = {
    free: Math.max(0, r.free_blocks - r.cached_blocks),
    cached: r.cached_blocks,
    used: referenced - shared,
    shared,
    reserved: tally.r * perCell,
  };
  for (const [cls, n] of Object.entries(counts)) setText(c.counts[cls], fmtInt(n));
  setText(c.kvMeta, `· ${fmtInt(r.num_blocks)} blocks, KV usage ${fmtPct(r.kv_cache_usage)}`
    + (perCell > 1 ? `, ${perCell} blocks a cell` : ""));
  const d = c.canvas.dataset;
  d.free = String(counts.free);
  d.cached = String(counts.cached);
  d.used = String(counts.used);
  d.shared = String(counts.shared);
  d.referenced = String(referenced);
  d.numBlocks = String(r.num_blocks);
  d.cells = cells;
  c.canvas.setAttribute("aria-label",
    `KV pool: ${counts.free} free, ${counts.cached} cached-free, ${counts.used} in use, ${counts.shared} shared`);
  drawBlockMap(c.canvas, cells);
}

// ---- block map -------------------------------------------------------------------------------

const blockColors = {};

function drawBlockMap(canvas, cells) {
  if (!blockColors.free) {
    const css = getComputedStyle(document.documentElement);
    for (const [ch, cls] of BLOCK_STATES) blockColors[ch] = css.getPropertyValue(`--blk-${cls}`).trim();
  }
  const width = canvas.clientWidth || 560;
  const n = Math.max(cells.length, 1);
  // cells as big as fit in ~90 px of height, between 4 and 18 px, with a 2 px gap (1 px when small)
  let size = Math.floor(Math.sqrt((width * 90) / n));
  size = Math.max(4, Math.min(18, size));
  const gap = size >= 8 ? 2 : 1;
  const cols = Math.max(1, Math.floor((width + gap) / (size + gap)));
  const rows = Math.ceil(n / cols);
  const height = rows * (size + gap) - gap;
  const dpr = window.devicePixelRatio || 1;
  if (canvas.width !== Math.round(width * dpr) || canvas.height !== Math.round(height * dpr)) {
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(height * dpr);
    canvas.style.height = `${height}px`;
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  for (let i = 0; i < cells.length; i += 1) {
    ctx.fillStyle = blockColors[cells[i]] || "#000";
    ctx.fillRect((i % cols) * (size + gap), Math.floor(i / cols) * (size + gap), size, size);
  }
}

// ---- charts ----------------------------------------------------------------------------------

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}

function drawChart(chart, h, tEnd, span) {
  const plot = chart.plot;
  // the view box follows the drawn width, so that text and strokes are not stretched
  const W = Math.max(120, Math.round(plot.getBoundingClientRect().width) || 300);
  const H = CHART_HEIGHT, L = 30, R = 4, T = 4, B = 14;
  plot.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const t = (h && h.t) || [];
  const values = chart.series.map(([key]) => ((h && h[key]) || []).map((v) => (v === null ? null : v * chart.scale)));
  const last = (arr) => { for (let i = arr.length - 1; i >= 0; i -= 1) if (arr[i] !== null) return arr[i]; return null; };
  setText(chart.now, values.map((arr) => fmtShort(last(arr))).join(" / "));

  const children = [];
  const t0 = tEnd - span;
  let vmax = 0;
  values.forEach((arr) => arr.forEach((v, i) => { if (v !== null && t[i] >= t0 && v > vmax) vmax = v; }));
  const ymax = niceMax(vmax);
  const x = (ti) => L + ((ti - t0) / span) * (W - L - R);
  const y = (v) => T + (1 - v / ymax) * (H - T - B);

  for (const frac of [0.5, 1]) {
    children.push(svg("line", { class: "gridline", x1: L, x2: W - R, y1: y(ymax * frac), y2: y(ymax * frac) }));
  }
  children.push(svg("line", { class: "axis", x1: L, x2: W - R, y1: y(0), y2: y(0) }));
  const label = (txt, attrs) => { const n = svg("text", attrs); n.textContent = txt; return n; };
  children.push(label(fmtShort(ymax), { x: L - 3, y: T + 8, "text-anchor": "end" }));
  children.push(label("0", { x: L - 3, y: y(0) + 3, "text-anchor": "end" }));
  children.push(label(`-${Math.round(span / 60) >= 2 ? `${Math.round(span / 60)} min` : `${Math.round(span)} s`}`,
    { x: L, y: H - 2, "text-anchor": "start" }));
  children.push(label("now", { x: W - R, y: H - 2, "text-anchor": "end" }));

  chart.series.forEach(([, , color, dashed], k) => {
    // nulls (no samples in an interval) break the line instead of drawing it down to zero
    let d = "";
    let pen = false;
    values[k].forEach((v, i) => {
      if (v === null || t[i] < t0) { pen = false; return; }
      d += `${pen ? "L" : "M"}${x(t[i]).toFixed(1)},${y(v).toFixed(1)}`;
      pen = true;
    });
    if (d) {
      const path = svg("path", { class: "line", d, stroke: color });
      if (dashed) path.setAttribute("stroke-dasharray", "4 3");
      children.push(path);
    }
  });
  plot.replaceChildren(...children);
}

function renderHistory(history) {
  // one time axis for every chart, so that replicas compare at a glance
  const series = Object.values((history && history.replicas) || {}).filter((h) => h.t && h.t.length);
  const tEnd = series.length ? Math.max(...series.map((h) => h.t[h.t.length - 1])) : Date.now() / 1000;
  const tStart = series.length ? Math.min(...series.map((h) => h.t[0])) : tEnd;
  const span = Math.min(CHART_MAX_SPAN_S, Math.max(CHART_MIN_SPAN_S, tEnd - tStart));
  for (const [id, c] of cards) {
    const h = history && history.replicas ? history.replicas[id] : null;
    for (const chart of c.charts) drawChart(chart, h, tEnd, span);
  }
}

// ---- router and requests ---------------------------------------------------------------------

function renderDecisions(router) {
  document.getElementById("policy").textContent = router && router.policy ? `policy: ${router.policy}` : "";
  const decisions = (router && router.decisions) || [];
  const outcomes = [...new Set(decisions.map((d) => d.outcome))].sort();
  const byReplica = new Map();
  for (const d of decisions) {
    if (!byReplica.has(d.replica_id)) byReplica.set(d.replica_id, {});
    byReplica.get(d.replica_id)[d.outcome] = (byReplica.get(d.replica_id)[d.outcome] || 0) + d.count;
  }
  document.getElementById("decisions-head").replaceChildren(el("tr", {},
    el("th", { text: "Replica" }), ...outcomes.map((o) => el("th", { class: "num", text: o.replace(/_/g, " ") })),
    el("th", { class: "num", text: "total" })));
  const body = document.getElementById("decisions");
  const ids = [...byReplica.keys()].sort();
  body.replaceChildren(...ids.map((id) => {
    const counts = byReplica.get(id);
    const total = Object.values(counts).reduce((a, b) => a + b, 0);
    return el("tr", { "data-testid": "decision-row", "data-replica-id": id, "data-total": total },
      el("td", { class: "mono", title: id, text: short(id) }),
      ...outcomes.map((o) => el("td", { class: "num", "data-outcome": o, text: fmtInt(counts[o] || 0) })),
      el("td", { class: "num", text: fmtInt(total) }));
  }));
  if (!ids.length) body.replaceChildren(el("tr", { class: "empty" }, el("td", { text: "no decisions yet" })));
}

const requestRows = new Map();  // request_id -> {row, cells}

function renderRequests(requests) {
  const body = document.getElementById("requests");
  document.getElementById("request-count").textContent = `(${requests.length})`;
  const sorted = requests.slice().sort((a, b) => b.age_s - a.age_s);
  const seen = new Set();
  for (const q of sorted) {
    seen.add(q.request_id);
    let entry = requestRows.get(q.request_id);
    if (!entry) {
      const id = q.request_id;
      const cells = { replica: el("td", { class: "mono" }), prompt: el("td", { class: "num" }),
        output: el("td", { class: "num" }), age: el("td", { class: "num" }) };
      const abort = el("button", { type: "button", class: "danger", "data-testid": "abort-button",
        "data-request-id": id, text: "Abort",
        onclick: () => action(abort, `/admin/api/requests/${encodeURIComponent(id)}/abort`,
          (r) => `Aborted ${r.request_id} on ${short(r.replica_id)}`) });
      const row = el("tr", { "data-testid": "request-row", "data-request-id": id },
        el("td", { class: "mono", title: id, text: id }), cells.replica, cells.prompt, cells.output, cells.age,
        el("td", {}, abort));
      entry = { row, cells };
      requestRows.set(id, entry);
    }
    setText(entry.cells.replica, short(q.replica_id));
    entry.cells.replica.title = q.replica_id || "";
    entry.row.dataset.replicaId = q.replica_id || "";
    setText(entry.cells.prompt, fmtInt(q.prompt_tokens));
    setText(entry.cells.output, fmtInt(q.output_tokens));
    setText(entry.cells.age, fmtAge(q.age_s));
  }
  placeInOrder(body, sorted.map((q) => requestRows.get(q.request_id).row));
  for (const [id, entry] of requestRows) {
    if (!seen.has(id)) { entry.row.remove(); requestRows.delete(id); }
  }
  const empty = body.querySelector("tr.empty");
  if (!sorted.length && !empty) body.append(el("tr", { class: "empty" }, el("td", { colspan: 6, text: "none" })));
  else if (sorted.length && empty) empty.remove();
}

// ---- actions ---------------------------------------------------------------------------------

async function action(button, path, describe) {
  button.disabled = true;
  try {
    const reply = await post(path);
    toast(describe(reply), false);
  } catch (e) {
    toast(`${button.textContent} failed: ${e.message}`, true);
  } finally {
    button.disabled = false;
  }
}

// ---- start -----------------------------------------------------------------------------------

function renderOverview(ov) {
  state.overview = ov;
  renderHeader(ov);
  renderNodes(ov.nodes || []);
  renderReplicas(ov.replicas || []);
  renderDecisions(ov.router);
  renderRequests(ov.requests || []);
  if (state.history) renderHistory(state.history);
}

document.getElementById("logout").addEventListener("click", async () => {
  try {
    await fetch("/dashboard/logout", { method: "POST", credentials: "same-origin",
      headers: { "X-Pagedserve-Admin": "1" } });
  } finally {
    window.location.assign("/dashboard/login");
  }
});

poll("/admin/api/overview", OVERVIEW_PERIOD_MS, renderOverview);
poll("/admin/api/history", HISTORY_PERIOD_MS, (h) => { state.history = h; renderHistory(h); });
