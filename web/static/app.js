// The dashboard: polls /api/metrics and /api/loadgen/status every second and draws them.
"use strict";

const POLL_MS = 1000;
const HISTORY = 120; // sparkline points: two minutes at one poll a second

const history = { throughput: [], ttft: [] };

const $ = (id) => document.getElementById(id);

function setText(id, text) {
  const el = $(id);
  if (el.textContent !== text) el.textContent = text;
}

function fmtInt(n) {
  return Math.round(n).toLocaleString("en-US");
}

function fmtRate(n) {
  return n >= 100 ? n.toFixed(0) : n.toFixed(1);
}

function fmtPct(fraction) {
  return (100 * fraction).toFixed(1) + " %";
}

// Seconds as a readable duration: 850 µs, 12.3 ms, 1.42 s.
function fmtSeconds(s) {
  if (!s) return "0 ms";
  if (s < 0.001) return (s * 1e6).toFixed(0) + " µs";
  if (s < 1) return (s * 1e3).toFixed(s < 0.1 ? 1 : 0) + " ms";
  return s.toFixed(2) + " s";
}

// ---------------------------------------------------------------- API key

// With OPS_AUTH=keys the page's data needs the API key, and driving load needs it whenever the
// server has keys. The page asks for it once and keeps it in sessionStorage (this tab only,
// gone when the tab closes); it travels as a Bearer header, never in a URL.
const KEY_STORAGE = "gemma-serve.api-key";

class Unauthorized extends Error {}

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  return key ? { Authorization: "Bearer " + key } : {};
}

function askForKey(message) {
  $("key-form").hidden = false;
  setText("key-message", message);
}

function useKey(key) {
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
  $("key-form").hidden = true;
  $("api-key").value = "";
  setText("key-message", "");
}

// The JSON body of a response; a refused key asks for one, other errors throw their message.
async function readJSON(response, what) {
  const payload = await response.json().catch(() => ({}));
  if (response.ok) return payload;
  const message = payload.error ? payload.error.message : what + ": HTTP " + response.status;
  if (response.status === 401) {
    askForKey(message);
    throw new Unauthorized(message);
  }
  throw new Error(message);
}

async function getJSON(url) {
  const response = await fetch(url, { cache: "no-store", headers: authHeaders() });
  return readJSON(response, url);
}

// ---------------------------------------------------------------- metrics

function pushHistory(series, value) {
  series.push(value);
  if (series.length > HISTORY) series.shift();
}

function renderLatency(prefix, summary) {
  for (const q of ["p50", "p95", "p99"]) setText(`${prefix}-${q}`, fmtSeconds(summary[q]));
  setText(`${prefix}-n`, fmtInt(summary.count));
}

function barRow(className, dataset, name, parts, numText) {
  // One labelled horizontal bar: parts are [css class, fraction of the width] pairs.
  const row = document.createElement("div");
  row.className = "bar-row " + className;
  Object.assign(row.dataset, dataset);
  const label = document.createElement("span");
  label.className = "name";
  label.textContent = name;
  const stack = document.createElement("div");
  stack.className = "stack";
  for (const [cls, fraction] of parts) {
    const part = document.createElement("span");
    part.className = cls;
    part.style.width = 100 * fraction + "%";
    stack.append(part);
  }
  const num = document.createElement("span");
  num.className = "num";
  num.textContent = numText;
  row.append(label, stack, num);
  return row;
}

function renderKv(kv) {
  const pool = kv.shared_pages;
  const groups = Object.entries(kv.groups);
  let rows;
  if (pool) {
    // One page pool the groups share: each row is what its group takes of it, in pages.
    const total = pool.total || 1;
    rows = groups.map(([name, g]) => {
      const inUse = g.in_use * g.pages_per_block;
      const cached = g.cached_unused * g.pages_per_block;
      const parts = [["in-use", inUse / total], ["cached", cached / total]];
      return barRow("kv-group", { group: name }, name, parts, `${fmtInt(inUse)} / ${fmtInt(cached)} pages`);
    });
    rows.push(barRow("kv-group", { group: "free" }, "free", [["free", pool.free / total]], `${fmtInt(pool.free)} pages`));
    const blocks = groups.map(([name, g]) => `${name} ${g.pages_per_block}`);
    setText("kv-summary", `${fmtInt(pool.total)} pages × ${kv.block_size} tokens · pages a block: ${blocks.join(", ")}`);
  } else {
    // A pool per group, sized by layer kind: sliding-window groups hold less than full attention.
    rows = groups.map(([name, g]) => {
      const total = g.in_use + g.cached_unused + g.free || 1;
      const parts = [["in-use", g.in_use / total], ["cached", g.cached_unused / total], ["free", g.free / total]];
      return barRow("kv-group", { group: name }, name, parts, `${g.in_use} / ${g.cached_unused} / ${g.free}`);
    });
    const sizes = groups.map(([name, g]) => `${name} ${fmtInt(g.total)}`);
    setText("kv-summary", `${sizes.join(" · ")} blocks × ${kv.block_size} tokens`);
  }
  $("kv-groups").replaceChildren(...rows);
  const p = kv.prefix_cache;
  setText("prefix-tokens", `${fmtInt(p.hit_tokens)} / ${fmtInt(p.query_tokens)}`);
  setText("prefix-exact", fmtInt(p.exact_hits));
  setText("prefix-nodes", fmtInt(p.nodes));
}

function tenantBar(cls, value, max, label) {
  const track = document.createElement("div");
  track.className = "track";
  const fill = document.createElement("span");
  fill.className = cls;
  fill.style.width = max > 0 ? (100 * value) / max + "%" : "0%";
  track.append(fill);
  const num = document.createElement("span");
  num.className = "num";
  num.textContent = label;
  return [track, num];
}

function renderTenants(tenants, fairness) {
  const entries = Object.entries(tenants).sort(([a], [b]) => a.localeCompare(b));
  const container = $("tenants");
  setText("service-gap", fmtInt(fairness.max_service_gap));
  setText("service-gap-pair", fairness.gap_pair ? `(${fairness.gap_pair.join(" / ")})` : "(none)");
  setText("service-gap-max", fmtInt(fairness.max_service_gap_seen));
  if (entries.length === 0) return;
  const served = (t) => t.prompt_tokens + t.output_tokens;
  const maxTokens = Math.max(...entries.map(([, t]) => served(t)));
  const maxService = Math.max(...entries.map(([, t]) => t.service));
  const maxCounter = Math.max(...entries.map(([, t]) => t.counter ?? 0));
  container.replaceChildren(
    ...entries.map(([name, t]) => {
      const row = document.createElement("div");
      row.className = "tenant";
      row.dataset.tenant = name;
      const who = document.createElement("div");
      who.className = "who";
      const title = document.createElement("b");
      title.textContent = name;
      const detail = document.createElement("span");
      detail.textContent = `${t.running} running (${t.prefilling} prefilling) · ${t.waiting} waiting`;
      const ttft = document.createElement("span");
      ttft.className = "ttft-p95";
      const latency = fairness.tenants[name]?.ttft_s;
      ttft.textContent = latency && latency.count ? `TTFT p95 ${fmtSeconds(latency.p95)}` : "TTFT p95 —";
      who.append(title, detail, document.createElement("br"), ttft);
      const bars = document.createElement("div");
      bars.className = "bars";
      bars.append(...tenantBar("tokens", served(t), maxTokens, fmtInt(served(t)) + " tok"));
      bars.append(...tenantBar("service", t.service, maxService, fmtInt(t.service) + " w"));
      const counter = t.counter ?? 0;
      const counterLabel = t.counter === null ? "— (no VTC)" : fmtInt(counter) + " vtc";
      bars.append(...tenantBar("counter", counter, maxCounter, counterLabel));
      row.append(who, bars);
      return row;
    })
  );
}

// A line with a soft fill under it, scaled to the series' own maximum.
function drawSparkline(canvas, values, color) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  if (canvas.width !== width * ratio) canvas.width = width * ratio;
  if (canvas.height !== height * ratio) canvas.height = height * ratio;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.strokeStyle = "#263142";
  ctx.beginPath();
  ctx.moveTo(0, height - 0.5);
  ctx.lineTo(width, height - 0.5);
  ctx.stroke();
  if (values.length < 2) return;
  const max = Math.max(...values) || 1;
  const step = width / (HISTORY - 1);
  const x0 = width - step * (values.length - 1);
  const y = (v) => height - 2 - (v / max) * (height - 6);
  ctx.beginPath();
  values.forEach((v, i) => (i === 0 ? ctx.moveTo(x0, y(v)) : ctx.lineTo(x0 + i * step, y(v))));
  ctx.strokeStyle = color;
  ctx.lineWidth = 1.5;
  ctx.stroke();
  ctx.lineTo(width, height);
  ctx.lineTo(x0, height);
  ctx.closePath();
  ctx.globalAlpha = 0.15;
  ctx.fillStyle = color;
  ctx.fill();
  ctx.globalAlpha = 1;
}

function drawSparklines() {
  const css = getComputedStyle(document.documentElement);
  drawSparkline($("spark-throughput"), history.throughput, css.getPropertyValue("--accent").trim());
  drawSparkline($("spark-ttft"), history.ttft, css.getPropertyValue("--ttft").trim());
}

function renderProfile(profile) {
  if (!profile.steps) return;
  setText("profile-summary", `${profile.step_ms.toFixed(1)} ms a step, last ${profile.steps} steps`);
  $("step-phases").replaceChildren(
    ...Object.entries(profile.phases).map(([name, p]) =>
      barRow("step-phase", { phase: name }, name, [["in-use", p.share]], `${p.ms.toFixed(2)} ms · ${fmtPct(p.share)}`)
    )
  );
}

function renderMetrics(snap) {
  const m = snap.metrics;
  const s = snap.scheduler;
  setText("model", snap.model);
  setText("policy", "policy " + s.policy);
  setText("steps", fmtInt(snap.steps));
  setText("running", fmtInt(s.num_running));
  setText("waiting", fmtInt(s.num_waiting));
  setText("throughput", fmtRate(m.throughput_tokens_per_s));
  setText("finished", fmtInt(s.num_finished));
  setText("aborted", fmtInt(s.num_aborted));
  setText("kv-usage", fmtPct(snap.kv.usage));
  setText("prefix-hit-rate", fmtPct(snap.kv.prefix_cache.hit_rate));
  setText("preemptions", fmtInt(s.num_preemptions));
  setText("window", `(last ${m.window_s.toFixed(0)} s)`);
  renderLatency("ttft", m.ttft_s);
  renderLatency("tpot", m.tpot_s);
  renderLatency("e2e", m.e2e_s);
  renderKv(snap.kv);
  renderProfile(snap.step_profile);
  renderTenants(s.tenants, snap.fairness);
  pushHistory(history.throughput, m.throughput_tokens_per_s);
  pushHistory(history.ttft, m.ttft_s.p50);
  setText("spark-throughput-now", fmtRate(m.throughput_tokens_per_s) + " tok/s");
  setText("spark-ttft-now", fmtSeconds(m.ttft_s.p50));
  drawSparklines();
}

// ---------------------------------------------------------------- load generator

function renderLoadgen(status) {
  const state = $("lg-state");
  state.textContent = status.state;
  state.className = status.state;
  $("lg-start").disabled = status.state === "running";
  $("lg-stop").disabled = status.state !== "running";
  if (status.state === "idle") return;
  setText("lg-elapsed", `${status.elapsed_s.toFixed(1)} s · tenants ${status.tenants.join(", ")}`);
  setText("lg-sent", fmtInt(status.sent));
  setText("lg-completed", fmtInt(status.completed));
  setText("lg-failed", fmtInt(status.failed));
  setText("lg-cancelled", fmtInt(status.cancelled));
  setText("lg-inflight", fmtInt(status.in_flight));
  setText("lg-rps", status.requests_per_s.toFixed(2));
  const { ttft_s: ttft, e2e_s: e2e } = status.latency;
  setText("lg-ttft", `${fmtSeconds(ttft.p50)} / ${fmtSeconds(ttft.p95)}`);
  setText("lg-e2e", `${fmtSeconds(e2e.p50)} / ${fmtSeconds(e2e.p95)}`);
  setText("lg-error", status.last_error ? "last error: " + status.last_error : "");
}

function formConfig() {
  const config = {
    users: Number($("lg-users").value),
    tenants: Number($("lg-tenants").value),
    prompt_words: Number($("lg-prompt-words").value),
    max_tokens: Number($("lg-max-tokens").value),
    api: $("lg-api").value,
  };
  config[$("lg-stop-kind").value] = Number($("lg-stop-value").value);
  if ($("lg-shared").checked) config.system_prompt = $("lg-system-prompt").value;
  return config;
}

async function postLoadgen(action, body) {
  const response = await fetch("/api/loadgen/" + action, {
    method: "POST",
    headers: { "Content-Type": "application/json", ...authHeaders() },
    body: body === undefined ? "{}" : JSON.stringify(body),
  });
  return readJSON(response, action);
}

async function onLoadgenAction(action, body) {
  setText("lg-message", "");
  try {
    renderLoadgen(await postLoadgen(action, body));
  } catch (err) {
    setText("lg-message", err.message);
  }
}

// ---------------------------------------------------------------- polling

async function poll() {
  try {
    const [snap, status] = await Promise.all([getJSON("/api/metrics"), getJSON("/api/loadgen/status")]);
    renderMetrics(snap);
    renderLoadgen(status);
    $("live").className = "live on";
    setText("live", "live");
  } catch (err) {
    $("live").className = "live off";
    setText("live", err instanceof Unauthorized ? "API key needed" : "offline");
  }
  setTimeout(poll, POLL_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    useKey($("api-key").value.trim());
  });
  $("lg-form").addEventListener("submit", (event) => {
    event.preventDefault();
    onLoadgenAction("start", formConfig());
  });
  $("lg-stop").addEventListener("click", () => onLoadgenAction("stop"));
  $("lg-shared").addEventListener("change", (event) => {
    $("lg-system-prompt").disabled = !event.target.checked;
  });
  window.addEventListener("resize", drawSparklines);
  poll();
});
