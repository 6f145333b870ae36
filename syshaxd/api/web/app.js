// syshax's status page and chat playground. It reads what the daemon serves (/v1/syshax/status, /v1/models,
// /tokenize, /v1/chat/completions) and only shows it: no status logic lives here. The API key, when the daemon needs
// one, is kept in this page's memory alone: never stored, never put in a URL.
"use strict";

const POLL_MS = 2000;
let apiKey = "";
let model = "";
const history = [];  // the chat so far: {role, content}
let inFlight = null;  // the answer being streamed: its AbortController, which the Stop button fires

const $ = (id) => document.getElementById(id);
const NUMBER = new Intl.NumberFormat("en-US", { maximumFractionDigits: 1 });
const num = (v) => NUMBER.format(v);  // 179,492.3: thousands separated, at most one decimal

function headers(extra = {}) {
  return apiKey ? { ...extra, Authorization: `Bearer ${apiKey}` } : extra;
}

function showError(text) {
  const box = $("error");
  box.textContent = text || "";
  box.hidden = !text;
}

async function getJSON(path) {
  const resp = await fetch(path, { headers: headers(), cache: "no-store" });
  if (resp.status === 401) {
    $("key-form").hidden = false;
    throw new Error("This daemon needs an API key: enter it above.");
  }
  const body = await resp.json();
  if (!resp.ok) throw new Error(body.error ? body.error.message : `HTTP ${resp.status}`);
  return body;
}

// --- status --------------------------------------------------------------------------------------------------

function cpuList(cpus) {
  const out = [];
  for (let i = 0; i < cpus.length; i++) {
    let j = i;
    while (j + 1 < cpus.length && cpus[j + 1] === cpus[j] + 1) j++;
    out.push(i === j ? `${cpus[i]}` : `${cpus[i]}-${cpus[j]}`);
    i = j;
  }
  return out.join(",");
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB"];
  let u = 0;
  while (n >= 1024 && u < units.length - 1) { n /= 1024; u++; }
  return `${n.toFixed(u ? 1 : 0)} ${units[u]}`;
}

function fill(dl, rows) {
  dl.replaceChildren();
  for (const [term, value] of rows) {
    const dt = document.createElement("dt");
    const dd = document.createElement("dd");
    dt.textContent = term;
    dd.textContent = value;
    dl.append(dt, dd);
  }
}

function counts(obj) {
  const parts = Object.entries(obj || {}).map(([k, v]) => `${k} ${v}`);
  return parts.length ? parts.join(", ") : "none";
}

function renderWorkers(workers) {
  const body = $("workers").tBodies[0];
  body.replaceChildren();
  for (const w of workers) {
    const s = w.stats;
    const cells = [w.name, w.backend, w.role, w.state, w.pid ?? "", cpuList(w.cpus),
      `${s.running}/${s.max_batch_size}` + (s.waiting ? ` +${s.waiting}` : ""),
      `${(100 * s.kv_usage).toFixed(0)}%`, s.tokens_per_second.toFixed(1)];
    const tr = document.createElement("tr");
    cells.forEach((text, i) => {
      const td = document.createElement("td");
      td.textContent = text;
      if (i === 3) { td.className = `state-${w.state}`; if (w.error) td.title = w.error; }
      tr.append(td);
    });
    body.append(tr);
  }
}

function embeddingRow(m) {
  // an embedding model of [[models]]: its worker, or a row saying it is unloaded until asked for
  if (m.worker) return { ...m.worker, name: `${m.worker.name} (${m.pooling === "rank" ? "reranker" : `${m.dimensions}-d`})` };
  return { name: `embed-${m.name}`, backend: "", role: "embed", state: "unloaded", pid: null, cpus: [],
    error: "", stats: { running: 0, max_batch_size: 1, waiting: 0, kv_usage: 0, tokens_per_second: 0 } };
}

function chatModelRow(m) {
  // a chat model of [[models]]: its own daemon (pid, memory), loaded or not
  return { name: `model ${m.name}`, backend: "syshaxd", role: m.mode, state: m.state, pid: m.pid, cpus: [],
    error: m.error, stats: { running: 0, max_batch_size: 0, waiting: 0, kv_usage: 0, tokens_per_second: 0 } };
}

function ms(v) {
  if (v === null || v === undefined) return "-";
  return `${num(v >= 100 ? Math.round(v) : v)} ms`;  // 8,769 ms, 12.5 ms
}

function render(st) {
  $("mode").textContent = `mode ${st.mode}`;
  const ready = $("ready");
  ready.textContent = st.draining ? "draining" : st.ready ? "ready" : "not ready";
  ready.className = "pill " + (st.draining ? "warn" : st.ready ? "ok" : "bad");
  renderWorkers([...st.workers, ...(st.embedding_models || []).map(embeddingRow),
    ...(st.chat_models || []).map(chatModelRow)]);
  fill($("requests"), [["in flight", st.in_flight], ["queued", st.queued],
    ["capacity", `${st.capacity} (queue ${st.max_queue_size})`], ["HTTP active", st.http_active],
    ["worker deaths", `resent ${st.rescued.resent}, resumed ${st.rescued.resumed}, lost ${st.rescued.lost}`]]);
  const routes = [["routed", counts(st.routes)], ["refused", counts(st.refused)]];
  if (st.auto) {
    routes.push(["auto decisions", counts(st.auto.decisions)]);
    if (st.auto.last) routes.push(["last decision", `${st.auto.last.route}: ${st.auto.last.reason}`]);
  }
  fill($("routes"), routes);
  if (st.kv) {
    const r = st.kv.ring;
    fill($("ring"), [["used", `${bytes(r.used_bytes)} of ${bytes(r.capacity)} (${(100 * r.occupancy).toFixed(0)}%)`],
      ["records", `written ${st.kv.records_written}, read ${st.kv.records_read}, held ${st.kv.records_held}`],
      ["moved", bytes(st.kv.bytes_moved)], ["fallbacks", counts(st.kv.fallbacks)]]);
  } else {
    fill($("ring"), [["ring", `none in ${st.mode} mode`]]);
  }
  const p = st.prefix_cache;
  if (p) {
    const rows = [["blocks", `${p.blocks} of ${p.capacity_blocks} (${p.block_tokens} tokens each)`],
      ["memory", `${bytes(p.bytes)} of ${bytes(p.capacity_bytes)}`],
      ["hit rate", p.queries ? `${(100 * p.hits / p.queries).toFixed(1)}% of ${num(p.queries)} prompt tokens` : "no lookups yet"],
      ["stored", p.stored], ["evictions", p.evictions]];
    const d = p.disk;  // the disk tier: blocks kept across restarts
    if (d) {
      rows.push(["on disk", d.state === "open"
        ? `${bytes(d.bytes)} of ${bytes(d.capacity_bytes)}, ${num(d.blocks)} blocks` : d.state]);
      if (d.state === "open") rows.push(["read back", `${num(d.loaded)} blocks (${bytes(d.bytes_read)})`]);
    }
    fill($("prefix"), rows);
  } else {
    fill($("prefix"), [["prefix cache", "off"]]);
  }
  const points = st.recent.points;
  const summary = st.recent.summary || { ttft_ms: {}, tpot_ms: {} };
  const t0 = points[0].t, t1 = points[points.length - 1].t;
  const rates = points.map((q) => q.tokens_per_s);
  let lastRate = 0;  // the newest bucket fills as it goes: the one before it is the last whole one
  if (rates.length > 1) lastRate = rates[rates.length - 2];
  $("throughput-figures").textContent = `last ${num(lastRate)} tok/s · peak ${num(Math.max(0, ...rates))} tok/s`;
  linearChart($("chart-throughput"), t0, t1, "tok/s", [["throughput", points.map((q) => [q.t, q.tokens_per_s])]]);
  const tt = summary.ttft_ms, tp = summary.tpot_ms;
  $("latency-figures").textContent = `TTFT last ${ms(tt.last)}, p50 ${ms(tt.p50)}, p99 ${ms(tt.p99)} · ` +
    `TPOT last ${ms(tp.last)}, p50 ${ms(tp.p50)}, p99 ${ms(tp.p99)}`;
  logChart($("chart-latency"), t0, t1, "ms", [["ttft", points.map((q) => [q.t, q.ttft_ms]), tt],
    ["tpot", points.map((q) => [q.t, q.tpot_ms]), tp]]);
  $("load").textContent = `${st.in_flight} in flight`;
}

const SVG = "http://www.w3.org/2000/svg";
const CHART = { W: 400, H: 130, L: 44, R: 22, T: 6, B: 16 };

function svg(name, attrs, text) {
  const el = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

// the axes, the time labels, and each tick [value, label] across the plot at y(value)
function frame(el, t0, t1, unit, ticks, y, scale) {
  const { W, H, L, R, T, B } = CHART;
  el.setAttribute("data-scale", scale);
  el.replaceChildren(svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }),
    svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }),
    svg("text", { class: "unit", x: 2, y: H - 4 }, unit),
    svg("text", { x: L, y: H - 4 }, `-${Math.round((t1 - t0) / 60)} min`),
    svg("text", { x: W - R - 16, y: H - 4 }, "now"));
  for (const [value, label] of ticks) {
    const at = y(value).toFixed(1);
    el.append(svg("line", { class: "tick", x1: L, y1: at, x2: W - R, y2: at }),
      svg("text", { class: "tick-label", x: L - 3, y: Number(at) + 3, "text-anchor": "end" }, label));
  }
  return (t) => L + (W - L - R) * (t - t0) / Math.max(1, t1 - t0);
}

// lines of [t, value] (value null: no sample there, the line breaks)
function plot(el, cls, pts, x, y) {
  let run = [];
  const flush = () => {  // a lone sample is a dot, a run of them a line
    if (run.length > 1) el.append(svg("polyline", { class: cls, points: run.join(" ") }));
    if (run.length === 1) {
      const [cx, cy] = run[0].split(",");
      el.append(svg("circle", { class: `${cls} dot`, cx, cy, r: 2 }));
    }
    run = [];
  };
  for (const [t, v] of pts) {
    if (v === null) { flush(); continue; }
    run.push(`${x(t).toFixed(1)},${y(v).toFixed(1)}`);
  }
  flush();
}

// 1, 2 or 5 times a power of ten, at or above v
function niceCeil(v) {
  const p = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 5, 10].map((m) => m * p).find((c) => c >= v);
}

function linearChart(el, t0, t1, unit, lines) {
  const { H, T, B } = CHART;
  const values = lines.flatMap(([, pts]) => pts.map(([, v]) => v)).filter((v) => v !== null);
  const top = niceCeil(Math.max(1, ...values));
  const y = (v) => (H - B) - (H - B - T) * v / top;
  const x = frame(el, t0, t1, unit, [[0, "0"], [top / 2, num(top / 2)], [top, num(top)]], y, "linear");
  for (const [cls, pts] of lines) plot(el, cls, pts, x, y);
}

// a log scale, so that one slow request (a long prompt's TTFT) does not flatten the rest; each line with its
// window's p50 and p99 across the plot
function logChart(el, t0, t1, unit, lines) {
  const { W, H, R, T, B } = CHART;
  const marks = lines.flatMap(([, , q]) => [q.p50, q.p99]);
  const values = lines.flatMap(([, pts]) => pts.map(([, v]) => v)).concat(marks).filter((v) => v > 0);
  let lo = 10 ** Math.floor(Math.log10(Math.min(...values, 1e9)));
  let hi = niceCeil(Math.max(...values, 1e-9));
  if (!values.length) { lo = 1; hi = 1000; }
  if (hi <= lo) hi = lo * 10;
  const span = Math.log10(hi) - Math.log10(lo);
  const y = (v) => (H - B) - (H - B - T) * (Math.log10(Math.max(v, lo)) - Math.log10(lo)) / span;
  const ticks = [];
  for (let v = lo; v <= hi * 1.0001; v *= 10) ticks.push([v, num(v)]);  // each power of ten
  if (ticks[ticks.length - 1][0] < hi / 1.0001) ticks.push([hi, num(hi)]);  // and the top
  const x = frame(el, t0, t1, `${unit} (log)`, ticks, y, "log");
  const labelled = [];  // the quantile labels' heights so far: one never hides another
  for (const [cls, pts, q] of lines) {
    plot(el, cls, pts, x, y);
    for (const name of ["p50", "p99"]) {
      if (q[name] === null || q[name] === undefined) continue;
      const at = y(q[name]);
      let textY = at + 3;
      while (labelled.some((u) => Math.abs(u - textY) < 8)) textY -= 8;
      labelled.push(textY);
      el.append(svg("line", { class: `${cls} ${name}`, x1: CHART.L, y1: at.toFixed(1), x2: W - R, y2: at.toFixed(1) }),
        svg("text", { class: `${cls} ${name}-label`, x: W - R + 2, y: textY.toFixed(1) }, name));
    }
  }
}

async function poll() {
  try {
    if (!model) {
      const models = await getJSON("/v1/models");
      model = models.data[0].id;
      $("model").textContent = model;
      // the playground's picker: the chat models (the daemon's own first, then those of [[models]])
      const pick = $("model-pick");
      for (const m of models.data.filter((d) => (d.syshax || {}).kind !== "embedding")) {
        const option = document.createElement("option");
        option.value = option.textContent = m.id;
        pick.append(option);
      }
      pick.addEventListener("change", () => { model = pick.value; $("model").textContent = model; });
    }
    render(await getJSON("/v1/syshax/status"));
    showError("");
  } catch (err) {
    showError(err.message);
  }
}

// --- chat ----------------------------------------------------------------------------------------------------

// a request field the daemon names in an error (`param`) -> the input that holds it here
const FIELDS = [["response_format", "schema"], ["temperature", "temperature"], ["max_tokens", "max-tokens"],
  ["max_completion_tokens", "max-tokens"], ["messages", "message"]];
const LABELS = { schema: "JSON schema", temperature: "Temperature", "max-tokens": "Max tokens", message: "Message" };

function fieldError(id, text) {
  const box = $(`${id}-error`);
  box.textContent = text ? `${LABELS[id]}: ${text}` : "";
  box.hidden = !text;
  if (text) $(id).setAttribute("aria-invalid", "true"); else $(id).removeAttribute("aria-invalid");
}

function clearFieldErrors() {
  for (const id of Object.keys(LABELS)) fieldError(id, "");
}

function fieldOf(param) {
  const hit = FIELDS.find(([prefix]) => param === prefix || (param || "").startsWith(`${prefix}.`) ||
    (param || "").startsWith(`${prefix}[`));
  return hit ? hit[1] : null;
}

// the settings, checked here before anything is sent: {temperature, maxTokens, schema} or null (the errors shown
// beside their fields)
function readSettings() {
  let ok = true;
  const temperature = Number($("temperature").value);
  if ($("temperature").value.trim() === "" || !(temperature >= 0 && temperature <= 2)) {
    fieldError("temperature", "a number from 0 (greedy) to 2.");
    ok = false;
  }
  const maxTokens = Number($("max-tokens").value);
  if (!Number.isInteger(maxTokens) || maxTokens < 1) {
    fieldError("max-tokens", "a whole number of tokens, 1 or more.");
    ok = false;
  }
  let schema = null;
  const schemaText = $("schema").value.trim();
  if (schemaText) {
    try {
      schema = JSON.parse(schemaText);
      if (schema === null || typeof schema !== "object" || Array.isArray(schema)) {
        throw new Error("it must be a JSON object, such as {\"type\": \"object\", ...}");
      }
    } catch (err) {
      fieldError("schema", `not a valid JSON schema (${err.message}). Fix it, or clear it to chat freely; ` +
        "your message was not sent.");
      ok = false;
    }
  }
  return ok ? { temperature, maxTokens, schema } : null;
}

function turn(role, text) {
  const div = document.createElement("div");
  div.className = `turn ${role}`;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.append(body);
  $("conversation").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function meta(div, text, cls) {
  const span = document.createElement("span");
  span.className = "meta" + (cls ? ` ${cls}` : "");
  span.textContent = text;
  div.append(span);
  const conversation = $("conversation");
  conversation.scrollTop = conversation.scrollHeight;  // the newest line in sight
  return span;
}

function requestBody(settings) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history);
  const body = { model, messages, stream: true, stream_options: { include_usage: true },
    temperature: settings.temperature, max_tokens: settings.maxTokens };
  if (settings.schema) {
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: settings.schema } };
  }
  return body;
}

// the SSE events of a streamed answer, as parsed JSON objects
async function* events(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

// "Reading the prompt (5,321 tokens) · 3.2 s" under the answer until its first token: the prompt's size from
// /tokenize, asked beside the request
function promptProgress(answer, messages, signal) {
  const line = meta(answer, "Sending…", "progress");
  const started = performance.now();
  let size = "";
  fetch("/tokenize", { method: "POST", signal, body: JSON.stringify({ model, messages }),
    headers: headers({ "Content-Type": "application/json" }) })
    .then((r) => (r.ok ? r.json() : null)).then((t) => { if (t) size = ` (${num(t.count)} tokens)`; })
    .catch(() => {});
  const tick = () => {
    line.textContent = `Reading the prompt${size} · ${((performance.now() - started) / 1000).toFixed(1)} s`;
  };
  const timer = setInterval(tick, 200);
  return () => { clearInterval(timer); line.remove(); };
}

const FINISH = { stop: "finished", length: "cut at max tokens", tool_calls: "tool calls",
  stopped: "stopped by you", error: "error" };

async function send(text) {
  clearFieldErrors();
  if (!model) {
    showError("The model is not known yet: is the daemon up?");
    return false;
  }
  const settings = readSettings();
  if (!settings) return false;  // the message stays in its box, the errors beside their fields
  history.push({ role: "user", content: text });
  const body = requestBody(settings);
  const asked = turn("user", text);
  const answer = turn("assistant", "");
  const out = answer.querySelector(".text");
  const controller = new AbortController();
  inFlight = controller;
  const endProgress = promptProgress(answer, body.messages, controller.signal);
  const sent = performance.now();
  let first = null, usage = null, route = "", content = "", finish = null, failure = "";
  try {
    const resp = await fetch("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
      headers: headers({ "Content-Type": "application/json" }), signal: controller.signal });
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({}));
      const e = err.error || {};
      const field = fieldOf(e.param);
      if (field) {  // a setting or the message is at fault: say so beside it, and let the user fix and resend
        endProgress();
        asked.remove();
        answer.remove();
        history.pop();
        fieldError(field, e.message || `HTTP ${resp.status}`);
        return false;
      }
      throw new Error(e.message || `HTTP ${resp.status}`);
    }
    route = resp.headers.get("X-Syshax-Route") || "";
    for await (const chunk of events(resp)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      if (chunk.syshax && chunk.syshax.route) route = chunk.syshax.route;
      for (const choice of chunk.choices || []) {
        const piece = choice.delta && choice.delta.content;
        if (piece || choice.finish_reason) {
          if (first === null) { first = performance.now(); endProgress(); }
        }
        if (piece) {
          content += piece;
          out.textContent = content;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
  } catch (err) {
    if (err.name === "AbortError") finish = "stopped";
    else { finish = "error"; failure = err.message; }
  } finally {
    inFlight = null;
    endProgress();
  }
  const end = performance.now();
  if (finish === "error" && !content) {
    answer.classList.add("error");
    history.pop();
    meta(answer, `Failed: ${failure}`, "finish finish-error");
    return false;  // nothing came back: the message goes back into its box
  }
  history.push({ role: "assistant", content });
  if (!content) out.textContent = finish === "stopped" ? "" : "(an empty answer)";
  const tokens = usage ? usage.completion_tokens : null;
  const rate = first !== null && end > first && tokens > 1 ? num((tokens - 1) / ((end - first) / 1000)) : "-";
  const cached = usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
  const parts = [`route ${route || "?"}`, `TTFT ${first === null ? "-" : `${num(Math.round(first - sent))} ms`}`,
    `${rate} tok/s`];
  if (tokens !== null) parts.push(`${num(tokens)} ${tokens === 1 ? "token" : "tokens"}`, `${num(cached)} cached prompt tokens`);
  meta(answer, parts.join(" · "));
  const word = FINISH[finish] || (finish ? `finished: ${finish}` : "ended without a finish reason");
  meta(answer, failure ? `${word}: ${failure}` : word, `finish finish-${finish || "none"}`);
  if (settings.schema && finish !== "stopped") {
    try {
      JSON.parse(content);
      meta(answer, "valid JSON", "valid");
    } catch (err) {
      meta(answer, `not valid JSON: ${err.message}`, "invalid");
    }
  }
  return true;
}

function start() {
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    apiKey = $("key").value;
    $("key").value = "";
    poll();
  });
  $("chat-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const box = $("message");
    const text = box.value.trim();
    if (!text || inFlight) return;
    $("send").disabled = true;
    $("stop").hidden = false;
    const kept = box.value;
    box.value = "";
    try {
      const outcome = await send(text);
      if (!outcome && !box.value) box.value = kept;  // not part of the conversation: never lose what was typed
    } finally {
      $("send").disabled = false;
      $("stop").hidden = true;
    }
  });
  $("stop").addEventListener("click", () => { if (inFlight) inFlight.abort(); });
  $("message").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("chat-form").requestSubmit(); }
  });
  for (const id of ["temperature", "max-tokens", "schema", "message"]) {
    $(id).addEventListener("input", () => fieldError(id, ""));
  }
  $("clear").addEventListener("click", () => {
    if (inFlight) inFlight.abort();
    history.length = 0;
    $("conversation").replaceChildren();
  });
  poll();
  setInterval(poll, POLL_MS);
}

document.addEventListener("DOMContentLoaded", start);
