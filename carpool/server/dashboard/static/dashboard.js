// carpool's dashboard: polls /dashboard/data every REFRESH_MS and draws it with a small canvas renderer of its
// own (no library, nothing fetched from elsewhere). Charts over time are kept here, in the page: HISTORY points.
"use strict";

const REFRESH_MS = 2000;
const HISTORY = 150; // five minutes at one point every two seconds
const TIERS = ["priority", "default", "flex", "batch"];
const COLORS = { priority: "#f85149", default: "#58a6ff", flex: "#3fb950", batch: "#d29922",
                 prefill: "#d2a8ff", decode: "#58a6ff", value: "#3fb950" };
const history = {}; // model name -> [{t, document's model entry}]
let refreshes = 0;

const $ = (id) => document.getElementById(id);
const integer = (v) => Math.round(v).toLocaleString("en-US");
const percent = (v) => (v === null || v === undefined ? "-" : (100 * v).toFixed(1) + " %");
const ms = (seconds) => (seconds === null || seconds === undefined ? "-" : (1000 * seconds).toFixed(1) + " ms");
const dollars = (v) => (v === null || v === undefined ? "-" : "$" + v.toFixed(6));

function text(id, value) { $(id).textContent = value; }

function element(tag, attrs = {}, children = []) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const child of children) node.append(child);
  return node;
}

function table(id, head, rows) {
  const node = $(id);
  node.replaceChildren(element("tr", {}, head.map((h) => element("th", {}, [h]))),
    ...rows.map((row) => element("tr", {}, row.map((cell) => element("td", {}, [String(cell)])))));
}

// The renderer: a canvas sized to its box at the screen's pixel density, with a dim grid and labelled axes.
function canvasContext(id) {
  const canvas = $(id);
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, width, height };
}

function scaled(value, max) {
  return value.toFixed(max >= 40 ? 0 : max >= 4 ? 1 : 2);
}

function niceMax(value) {
  if (!(value > 0)) return 1;
  const magnitude = Math.pow(10, Math.floor(Math.log10(value)));
  for (const step of [1, 2, 2.5, 5, 10]) if (step * magnitude >= value) return step * magnitude;
  return 10 * magnitude;
}

function axes(ctx, width, height, max, format) {
  const left = 52, bottom = height - 16;
  ctx.strokeStyle = "#2b3540";
  ctx.fillStyle = "#8b96a3";
  ctx.textAlign = "right";
  for (let i = 0; i <= 4; i++) {
    const y = 6 + (bottom - 6) * (1 - i / 4);
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(width, y); ctx.stroke();
    ctx.fillText(format((max * i) / 4), left - 4, y + 4);
  }
  return { left, top: 6, bottom, right: width - 4 };
}

// series: [{label, color, values: [number|null]}], one value per history point, oldest first.
// points: the x axis's length (the page's HISTORY by default); shorter series end at its right edge.
function lineChart(id, series, suffix = "", points = HISTORY) {
  const { ctx, width, height } = canvasContext(id);
  const all = series.flatMap((s) => s.values).filter((v) => v !== null && v !== undefined);
  const max = niceMax(Math.max(0, ...all));
  const box = axes(ctx, width, height, max, (v) => scaled(v, max) + suffix);
  const dx = (box.right - box.left) / Math.max(1, points - 1);
  let legendX = box.left + 4;
  for (const s of series) {
    ctx.strokeStyle = s.color;
    ctx.lineWidth = 1.6;
    ctx.beginPath();
    let drawing = false;
    const offset = points - s.values.length;
    s.values.forEach((v, i) => {
      if (v === null || v === undefined) { drawing = false; return; }
      const x = box.left + (offset + i) * dx, y = box.bottom - ((box.bottom - box.top) * v) / max;
      if (drawing) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      drawing = true;
    });
    ctx.stroke();
    ctx.fillStyle = s.color;
    ctx.textAlign = "left";
    ctx.fillText(s.label, legendX, height - 3);
    legendX += ctx.measureText(s.label).width + 14;
  }
}

// bars: [{label, value}] drawn left to right.
function barChart(id, bars, title) {
  const { ctx, width, height } = canvasContext(id);
  const max = niceMax(Math.max(0, ...bars.map((b) => b.value)));
  const box = axes(ctx, width, height, max, (v) => scaled(v, max));
  const slot = (box.right - box.left) / Math.max(1, bars.length);
  ctx.textAlign = "center";
  bars.forEach((bar, i) => {
    const h = ((box.bottom - box.top) * bar.value) / max;
    ctx.fillStyle = COLORS.value;
    ctx.fillRect(box.left + i * slot + 2, box.bottom - h, slot - 4, h);
    ctx.fillStyle = "#8b96a3";
    ctx.fillText(bar.label, box.left + (i + 0.5) * slot, height - 3);
  });
  ctx.textAlign = "right";
  ctx.fillStyle = "#e6e9ec";
  ctx.fillText(title, width - 4, 16);
}

// level: "" (green), "warn" or "bad"; a budget turns amber at 80 % spent and red once spent.
function progress(label, detail, share, level = "") {
  return element("div", { class: "progress" }, [
    element("div", { class: "label" }, [element("span", {}, [label]), element("span", {}, [detail])]),
    element("div", { class: "bar " + level }, [element("div", { style: `width: ${Math.min(100, 100 * share)}%` })]),
  ]);
}

function bucketBars(distribution) {
  // Buckets below the first observation and above the last are left out: the shape is what matters.
  const used = distribution.map((b) => b.count > 0);
  const first = used.indexOf(true), last = used.lastIndexOf(true);
  if (first < 0) return [];
  return distribution.slice(first, last + 1).map((b) => ({ label: "≤" + b.le, value: b.count }));
}

function renderModel(doc, model) {
  const points = (history[model.name] = history[model.name] || []);
  points.push(model);
  if (points.length > HISTORY) points.shift();
  const series = (pick) => points.map(pick);
  const w = model.window;

  text("output-tps", w.output_tokens_per_second.toFixed(1));
  text("total-requests", integer(model.totals.requests));
  text("total-prompt-tokens", integer(model.totals.prompt_tokens));
  text("total-generation-tokens", integer(model.totals.generation_tokens));
  text("total-preemptions", integer(model.totals.preemptions));
  lineChart("chart-tps", [
    { label: "output tok/s", color: COLORS.value, values: series((m) => m.window.output_tokens_per_second) },
    { label: "prompt tok/s", color: COLORS.prefill, values: series((m) => m.window.prompt_tokens_per_second) }]);

  table("ttft-table", ["tier", "p50", "p99", "requests"],
    TIERS.map((t) => [t, ms(w.ttft[t].p50), ms(w.ttft[t].p99), integer(w.ttft[t].count)]));
  lineChart("chart-ttft", TIERS.map((t) => ({ label: t + " p99", color: COLORS[t],
    values: series((m) => (m.window.ttft[t].p99 === null ? null : 1000 * m.window.ttft[t].p99)) })), " ms");

  table("itl-table", ["tier", "p50", "p99", "gaps"],
    TIERS.map((t) => [t, ms(w.itl[t].p50), ms(w.itl[t].p99), integer(w.itl[t].count)]));
  lineChart("chart-itl", TIERS.map((t) => ({ label: t + " p99", color: COLORS[t],
    values: series((m) => (m.window.itl[t].p99 === null ? null : 1000 * m.window.itl[t].p99)) })), " ms");

  text("prefill-share", percent(w.prefill_share));
  text("decode-share", percent(w.prefill_share === null ? null : 1 - w.prefill_share));
  text("busy-share", percent(w.busy_share));
  lineChart("chart-phase", [{ label: "prefill share %", color: COLORS.prefill,
    values: series((m) => (m.window.prefill_share === null ? null : 100 * m.window.prefill_share)) },
    { label: "engine busy %", color: COLORS.decode, values: series((m) => 100 * m.window.busy_share) }], "%");

  text("step-budget", integer(model.gauges.step_token_budget));
  text("step-max-seqs", integer(model.gauges.step_max_seqs));
  text("step-reason", model.step_budget_reason || "-");
  barChart("chart-step-tokens", bucketBars(w.step_tokens), "tokens per step");
  barChart("chart-step-seqs", bucketBars(w.step_seqs), "sequences per step");

  text("kv-usage", percent(model.gauges.kv_cache_usage));
  text("running", integer(model.gauges.running));
  text("waiting", integer(model.gauges.waiting));
  lineChart("chart-kv",
    [{ label: "KV in use %", color: COLORS.value, values: series((m) => 100 * m.gauges.kv_cache_usage) }], "%");

  table("queue-table", ["tier", ...TIERS], [["queued", ...TIERS.map((t) => integer(model.queued[t]))]]);
  lineChart("chart-queue", TIERS.map((t) => ({ label: t, color: COLORS[t], values: series((m) => m.queued[t]) })));

  text("hit-rate-window", percent(w.prefix_cache_hit_rate));
  text("hit-rate-total", percent(model.gauges.prefix_cache_hit_rate));
  const pins = model.pins;
  text("pins-blocks", Object.entries(pins.blocks).map(([ttl, n]) => `${ttl}: ${integer(n)}`).join(", ") || "none");
  text("pins-bytes", `${(pins.bytes / 2 ** 20).toFixed(1)} MiB`);
  text("pins-events", `${integer(pins.hits)} / ${integer(pins.expiries)} / ${integer(pins.refused)}`);
  lineChart("chart-hits", [{ label: "hit rate % (window)", color: COLORS.value,
    values: series((m) => (m.window.prefix_cache_hit_rate === null ? null : 100 * m.window.prefix_cache_hit_rate)) }],
    "%");
}

function budgetBar(k) {
  const label = `${k.tenant} (${k.key_id}${k.scopes.length ? ", " + k.scopes.join(" ") : ""})`;
  if (k.budget === null) return progress(label, `${dollars(k.spent)} this ${k.period}, no budget`, 0);
  const share = k.budget > 0 ? k.spent / k.budget : 1;
  return progress(label, `${dollars(k.spent)} of ${dollars(k.budget)} per ${k.period}`, share,
    share >= 1 ? "bad" : share >= 0.8 ? "warn" : "");
}

// Live requests a minute, the last hour as they came and the next as the days before forecast it.
function renderTraffic(traffic) {
  if (!traffic) {
    text("traffic-summary", "no ledger on this server: no forecast");
    return;
  }
  const clock = (t) => new Date(t * 1000).toISOString().slice(11, 16);
  const now = traffic.actual.findIndex((v) => v === null);
  text("traffic-summary", `${clock(traffic.minutes[0])} to ${clock(traffic.minutes[traffic.minutes.length - 1])} ` +
    `UTC, now ${clock(traffic.minutes[now])}: requests a minute`);
  lineChart("chart-traffic", [
    { label: "forecast", color: COLORS.batch, values: traffic.forecast },
    { label: "actual", color: COLORS.default, values: traffic.actual },
  ], "", traffic.minutes.length);
}

// Revenue against the machine's bill since the server started (today, UTC, at most): `carpool serve --hourly-price`.
function renderMargin(margin) {
  if (!margin) {
    text("margin-summary", "start the server with --hourly-price (and a ledger) to see the margin");
    table("margin-tier-table", [], []);
    table("margin-tenant-table", [], []);
    $("margin-below-cost").replaceChildren();
    return;
  }
  text("margin-summary", `machine at $${margin.hourly_price}/hour: ${dollars(margin.machine_cost)} since the ` +
    `server started, ${percent(margin.utilization)} busy`);
  const rows = (key) => (r) => [r[key], dollars(r.revenue), dollars(r.machine_cost), dollars(r.margin)];
  table("margin-tier-table", ["tier", "revenue", "machine cost", "margin"], margin.by_tier.map(rows("tier")));
  table("margin-tenant-table", ["tenant", "revenue", "machine cost", "margin"], margin.by_tenant.map(rows("tenant")));
  $("margin-below-cost").replaceChildren(...margin.below_cost.map((b) => element("div", { class: "below-cost" }, [
    `${b.model}, tier ${b.tier}: list output $${b.list_output_per_1m.toFixed(4)} per 1M tokens, below the ` +
    `machine's $${b.cost_output_per_1m.toFixed(4)} at this utilization`])));
}

function renderServer(doc) {
  table("tier-cost-table", ["tier", "tokens", "cost", "$ / 1K tokens"],
    TIERS.map((t) => [t, integer(doc.tiers[t].tokens), dollars(doc.tiers[t].cost),
                      dollars(doc.tiers[t].cost_per_1k_tokens)]));

  const ledger = doc.ledger;
  if (!ledger) {
    table("tenant-table", ["no ledger on this server (--api-key mode): no tenants"], []);
    $("budgets").replaceChildren(element("div", { class: "empty" }, ["no ledger on this server: no budgets"]));
  } else {
    table("tenant-table", ["tenant", "requests", "tokens", "cost", "$ / 1K tokens"],
      ledger.tenants.map((r) => [r.tenant, integer(r.requests), integer(r.tokens), dollars(r.cost),
                                 dollars(r.cost_per_1k_tokens)]));
    $("budgets").replaceChildren(...(ledger.budgets.length ? ledger.budgets.map(budgetBar)
      : [element("div", { class: "empty" }, ["no keys"])]));
  }
  renderMargin(ledger && ledger.margin);
  renderTraffic(ledger && ledger.traffic);

  const batches = doc.batches;
  $("batches").replaceChildren(...(!batches ? [element("div", { class: "empty" }, ["the Batch API is off"])]
    : !batches.length ? [element("div", { class: "empty" }, ["no batches yet"])]
    : batches.map((b) => progress(`${b.id} · ${b.status}`,
        `${integer(b.completed)} done, ${integer(b.failed)} failed of ${integer(b.total)}`,
        b.total ? (b.completed + b.failed) / b.total : 0, b.failed ? "warn" : ""))));
}

function render(doc) {
  const select = $("model");
  const names = doc.models.map((m) => m.name);
  if (select.options.length !== names.length) {
    select.replaceChildren(...names.map((n) => element("option", { value: n }, [n])));
  }
  select.style.display = names.length > 1 ? "" : "none";
  const model = doc.models.find((m) => m.name === select.value) || doc.models[0];
  for (const m of doc.models) if (m !== model) {
    (history[m.name] = history[m.name] || []).push(m);
    if (history[m.name].length > HISTORY) history[m.name].shift();
  }
  renderModel(doc, model);
  renderServer(doc);
  const state = $("state");
  state.textContent = doc.ready ? "ready" : "warming up";
  state.className = doc.ready ? "ok" : "warming";
  text("updated", new Date(doc.time * 1000).toLocaleTimeString());
  text("window", doc.window_seconds.toFixed(0));
}

async function refresh() {
  const key = sessionStorage.getItem("carpool-key");
  try {
    const response = await fetch("/dashboard/data", { headers: key ? { Authorization: "Bearer " + key } : {} });
    const body = await response.json();
    if (!response.ok) {
      $("key-form").classList.add("shown");
      text("message", body.error ? body.error.message : response.statusText);
      $("state").textContent = "no access";
      $("state").className = "error";
      return;
    }
    text("message", "");
    render(body);
    refreshes += 1;
    document.body.dataset.refreshes = refreshes;
    document.body.dataset.time = body.time;
  } catch (error) {
    $("state").textContent = "unreachable";
    $("state").className = "error";
    text("message", String(error));
  }
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("carpool-key", $("key").value);
  $("key-form").classList.remove("shown");
  refresh();
});
$("model").addEventListener("change", refresh);
refresh();
setInterval(refresh, REFRESH_MS);
