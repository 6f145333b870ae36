// syshax's status page and chat playground. It reads what the daemon serves (/v1/syshax/status, /v1/models,
// /v1/chat/completions) and only shows it: no status logic lives here. The API key, when the daemon needs one,
// is kept in this page's memory alone: never stored, never put in a URL.
"use strict";

const POLL_MS = 2000;
let apiKey = "";
let model = "";
const history = [];  // the chat so far: {role, content}

const $ = (id) => document.getElementById(id);

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

function render(st) {
  $("mode").textContent = `mode ${st.mode}`;
  const ready = $("ready");
  ready.textContent = st.draining ? "draining" : st.ready ? "ready" : "not ready";
  ready.className = "pill " + (st.draining ? "warn" : st.ready ? "ok" : "bad");
  renderWorkers(st.workers);
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
    fill($("prefix"), [["blocks", `${p.blocks} of ${p.capacity_blocks} (${p.block_tokens} tokens each)`],
      ["hit rate", p.queries ? `${(100 * p.hits / p.queries).toFixed(1)}% of ${p.queries} prompt tokens` : "no lookups yet"],
      ["stored", p.stored], ["evictions", p.evictions]]);
  } else {
    fill($("prefix"), [["prefix cache", "off"]]);
  }
  const points = st.recent.points;
  const t0 = points[0].t, t1 = points[points.length - 1].t;
  chart($("chart-throughput"), t0, t1, [["throughput", points.map((q) => [q.t, q.tokens_per_s])]]);
  chart($("chart-latency"), t0, t1, [["ttft", points.map((q) => [q.t, q.ttft_ms])],
    ["tpot", points.map((q) => [q.t, q.tpot_ms])]]);
  $("load").textContent = `${st.in_flight} in flight`;
}

const SVG = "http://www.w3.org/2000/svg";

function svg(name, attrs, text) {
  const el = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

// lines of [t, value] (value null: no sample there, the line breaks), over t0..t1, scaled to the largest value
function chart(el, t0, t1, lines) {
  const W = 400, H = 120, L = 34, B = 14;
  const values = lines.flatMap(([, pts]) => pts.map(([, v]) => v)).filter((v) => v !== null);
  const top = Math.max(1, ...values) * 1.1;
  const x = (t) => L + (W - L) * (t - t0) / Math.max(1, t1 - t0);
  const y = (v) => (H - B) - (H - B - 4) * v / top;
  el.replaceChildren(svg("line", { class: "axis", x1: L, y1: H - B, x2: W, y2: H - B }),
    svg("line", { class: "axis", x1: L, y1: 4, x2: L, y2: H - B }),
    svg("text", { x: 2, y: 12 }, top >= 10 ? top.toFixed(0) : top.toFixed(1)),
    svg("text", { x: 2, y: H - B }, "0"),
    svg("text", { x: L, y: H - 2 }, `-${Math.round((t1 - t0) / 60)} min`),
    svg("text", { x: W - 20, y: H - 2 }, "now"));
  for (const [cls, pts] of lines) {
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
}

async function poll() {
  try {
    if (!model) {
      const models = await getJSON("/v1/models");
      model = models.data[0].id;
      $("model").textContent = model;
    }
    render(await getJSON("/v1/syshax/status"));
    showError("");
  } catch (err) {
    showError(err.message);
  }
}

// --- chat ----------------------------------------------------------------------------------------------------

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
}

function requestBody(schemaText) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history);
  const body = { model, messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value) };
  if (schemaText) {
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse(schemaText) } };
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

async function send(text) {
  const schemaText = $("schema").value.trim();
  let body;
  try {
    if (!model) throw new Error("the model is not known yet: is the daemon up?");
    history.push({ role: "user", content: text });
    body = requestBody(schemaText);
  } catch (err) {
    history.pop();
    turn("assistant error", `Not sent: ${err.message}`);
    return;
  }
  turn("user", text);
  const answer = turn("assistant", "");
  const out = answer.querySelector(".text");
  const sent = performance.now();
  let first = null, usage = null, route = "", content = "";
  try {
    const resp = await fetch("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
      headers: headers({ "Content-Type": "application/json" }) });
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({}));
      throw new Error(err.error ? err.error.message : `HTTP ${resp.status}`);
    }
    route = resp.headers.get("X-Syshax-Route") || "";
    for await (const chunk of events(resp)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      if (chunk.syshax && chunk.syshax.route) route = chunk.syshax.route;
      for (const choice of chunk.choices || []) {
        const piece = choice.delta && choice.delta.content;
        if (piece) {
          if (first === null) first = performance.now();
          content += piece;
          out.textContent = content;
        }
      }
    }
  } catch (err) {
    answer.classList.add("error");
    meta(answer, `Failed: ${err.message}`);
    history.pop();
    return;
  }
  const end = performance.now();
  history.push({ role: "assistant", content });
  const tokens = usage ? usage.completion_tokens : 0;
  const rate = first !== null && end > first && tokens > 1 ? ((tokens - 1) / ((end - first) / 1000)).toFixed(1) : "-";
  const cached = usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
  meta(answer, `route ${route || "?"} · TTFT ${first === null ? "-" : Math.round(first - sent)} ms · ` +
    `${rate} tok/s · ${tokens} tokens · ${cached} cached prompt tokens`);
  if (schemaText) {
    try {
      JSON.parse(content);
      meta(answer, "valid JSON", "valid");
    } catch (err) {
      meta(answer, `not valid JSON: ${err.message}`, "invalid");
    }
  }
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
    const text = $("message").value.trim();
    if (!text) return;
    $("message").value = "";
    $("send").disabled = true;
    try { await send(text); } finally { $("send").disabled = false; }
  });
  $("message").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("chat-form").requestSubmit(); }
  });
  $("clear").addEventListener("click", () => { history.length = 0; $("conversation").replaceChildren(); });
  poll();
  setInterval(poll, POLL_MS);
}

document.addEventListener("DOMContentLoaded", start);
