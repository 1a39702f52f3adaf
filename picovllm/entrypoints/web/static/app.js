// The chat playground and the dashboard of `picovllm serve` (and of `picovllm router`).
// Chat: /v1/chat/completions, streamed (SSE); the conversation and settings in localStorage.
// Dashboard: /stats once a second (a server's, or the router's: one per instance).
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "picovllm.chat";
const SETTINGS = ["system", "temperature", "top_p", "max_tokens", "seed", "stop", "json_schema", "tools", "tool_choice", "api_key"];
let messages = JSON.parse(localStorage.getItem(STORE) || "[]"); // {role, content, stats?, error?}
let controller = null; // the reply being streamed
let model = null;

// ---- errors --------------------------------------------------------------------------------

function showError(text) {
  const box = $("error");
  box.textContent = text;
  box.hidden = !text;
}

async function explain(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body.error && body.error.message) message = body.error.message;
  } catch (_) { /* not JSON */ }
  if (response.status === 401) return `Wrong or missing API key (${message})`;
  if (response.status === 503) return `The server is busy or its engine is down (${message})`;
  return message;
}

function headers() {
  const key = $("api_key").value.trim();
  return { "Content-Type": "application/json", ...(key ? { Authorization: `Bearer ${key}` } : {}) };
}

// ---- Markdown (escaped first: nothing the model writes becomes markup of its own) ----------

function escapeHtml(s) {
  return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
}

function inline(s) {
  return s
    .replace(/`([^`]+)`/g, "<code>$1</code>")
    .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>")
    .replace(/\[([^\]]+)\]\((https?:\/\/[^)\s]+)\)/g, '<a href="$2" target="_blank" rel="noopener">$1</a>');
}

function markdown(text) {
  const out = [];
  const parts = text.split(/```/);
  parts.forEach((part, i) => {
    if (i % 2 === 1) { // a code block: its first line may name the language
      const body = part.replace(/^[^\n]*\n/, (line) => (/^\w*\n$/.test(line) ? "" : line));
      out.push(`<pre><code>${escapeHtml(body.replace(/\n$/, ""))}</code></pre>`);
      return;
    }
    let list = null;
    const close = () => { if (list) { out.push(`</${list}>`); list = null; } };
    let para = [];
    const flush = () => { if (para.length) { out.push(`<p>${para.join("<br>")}</p>`); para = []; } };
    for (const raw of part.split("\n")) {
      const line = inline(escapeHtml(raw));
      const heading = raw.match(/^(#{1,4})\s+(.*)$/);
      const bullet = raw.match(/^\s*[-*]\s+(.*)$/);
      const numbered = raw.match(/^\s*\d+[.)]\s+(.*)$/);
      if (heading) { flush(); close(); out.push(`<h${heading[1].length + 2}>${inline(escapeHtml(heading[2]))}</h${heading[1].length + 2}>`); }
      else if (bullet || numbered) {
        flush();
        const kind = bullet ? "ul" : "ol";
        if (list !== kind) { close(); out.push(`<${kind}>`); list = kind; }
        out.push(`<li>${inline(escapeHtml((bullet || numbered)[1]))}</li>`);
      } else if (!raw.trim()) { flush(); close(); }
      else { close(); para.push(line); }
    }
    flush(); close();
  });
  return out.join("");
}

// ---- chat ----------------------------------------------------------------------------------

function save() {
  localStorage.setItem(STORE, JSON.stringify(messages));
  const settings = {};
  for (const id of SETTINGS) settings[id] = $(id).value;
  localStorage.setItem(STORE + ".settings", JSON.stringify(settings));
}

function statsText(s) {
  const parts = [`TTFT ${s.ttft_ms.toFixed(0)} ms`, `${s.tok_s.toFixed(1)} tok/s`, `${s.tokens} tokens`];
  if (s.cached_tokens) parts.push(`prefix cache: ${s.cached_tokens} of ${s.prompt_tokens} prompt tokens`);
  return parts.join(" · ");
}

function render() {
  const box = $("messages");
  box.innerHTML = "";
  if (!messages.length) box.innerHTML = '<div class="empty">Ask the model something.</div>';
  for (const m of messages) {
    const div = document.createElement("div");
    div.className = `msg ${m.role}${m.error ? " failed" : ""}`;
    if (m.role === "assistant") div.innerHTML = markdown(m.content);
    else div.textContent = m.content;
    for (const call of m.tool_calls || []) {
      const c = document.createElement("div");
      c.className = "tool-call";
      c.textContent = `tool call: ${call.function.name}(${call.function.arguments})`;
      div.appendChild(c);
    }
    if (m.stats || m.error) {
      const s = document.createElement("div");
      s.className = m.error ? "stats error-text" : "stats";
      s.textContent = m.error || statsText(m.stats);
      div.appendChild(s);
    }
    box.appendChild(div);
  }
  box.scrollTop = box.scrollHeight;
}

function requestBody() {
  const body = {
    model, stream: true, stream_options: { include_usage: true },
    messages: [
      ...($("system").value.trim() ? [{ role: "system", content: $("system").value }] : []),
      ...messages.filter((m) => !m.error || m.content).map((m) => (
        m.tool_calls ? { role: m.role, content: m.content, tool_calls: m.tool_calls } : { role: m.role, content: m.content })),
    ],
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    max_tokens: Number($("max_tokens").value),
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  const stop = $("stop").value.split("\n").filter((s) => s);
  if (stop.length) body.stop = stop;
  const schema = parsed("json_schema", "The JSON schema");
  if (schema) body.response_format = { type: "json_schema", json_schema: { name: "answer", schema } };
  const tools = parsed("tools", "The tools");
  if (tools) Object.assign(body, { tools, tool_choice: $("tool_choice").value });
  return body;
}

// A settings box's JSON (null when empty); an Error saying which box when it does not parse.
function parsed(id, what) {
  const text = $(id).value.trim();
  if (!text) return null;
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new Error(`${what} is not JSON: ${e.message}`);
  }
}

// A streamed chat chunk's tool-call deltas, added to the answer's calls (by index, as OpenAI sends them).
function addToolCalls(answer, deltas) {
  answer.tool_calls = answer.tool_calls || [];
  for (const d of deltas) {
    const call = answer.tool_calls[d.index] ||= { id: d.id, type: "function", function: { name: "", arguments: "" } };
    if (d.function && d.function.name) call.function.name = d.function.name;
    if (d.function && d.function.arguments) call.function.arguments += d.function.arguments;
  }
}

async function reply() {
  let body;
  try {
    body = requestBody();
  } catch (e) {
    showError(e.message);
    return;
  }
  const answer = { role: "assistant", content: "" };
  messages.push(answer);
  render();
  busy(true);
  controller = new AbortController();
  const start = performance.now();
  let first = null, usage = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) throw new Error(await explain(response));
    showError("");
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      const events = buffer.split("\n\n");
      buffer = events.pop();
      for (const event of events) {
        const data = event.replace(/^data: /, "");
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || "the server failed");
        if (chunk.usage) usage = chunk.usage;
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta && (delta.content || delta.tool_calls)) {
          if (first === null) first = performance.now();
          answer.content += delta.content || "";
          if (delta.tool_calls) addToolCalls(answer, delta.tool_calls);
          render();
        }
      }
    }
    const end = performance.now();
    const tokens = usage ? usage.completion_tokens : 0;
    answer.stats = {
      ttft_ms: (first ?? end) - start,
      tok_s: tokens > 1 && first !== null && end > first ? (tokens - 1) / ((end - first) / 1000) : 0,
      tokens,
      prompt_tokens: usage ? usage.prompt_tokens : 0,
      cached_tokens: usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0,
    };
  } catch (e) {
    if (e.name === "AbortError") answer.error = "stopped";
    else {
      answer.error = e instanceof TypeError ? "The server does not answer (is it running?)" : e.message;
      showError(answer.error);
    }
  } finally {
    controller = null;
    busy(false);
    save();
    render();
  }
}

function busy(on) {
  $("send").hidden = on;
  $("stop-button").hidden = !on;
  $("regenerate").disabled = on;
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  messages.push({ role: "user", content: text });
  reply();
});
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
$("stop-button").addEventListener("click", () => controller && controller.abort());
$("regenerate").addEventListener("click", () => {
  if (controller) return;
  while (messages.length && messages[messages.length - 1].role === "assistant") messages.pop();
  if (messages.length) reply();
});
$("new-chat").addEventListener("click", () => {
  if (controller) controller.abort();
  messages = [];
  save();
  render();
});
for (const id of SETTINGS) $(id).addEventListener("change", save);

// ---- dashboard -----------------------------------------------------------------------------

const pct = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`);
const num = (x, d = 0) => (x === null || x === undefined ? "–" : Number(x).toFixed(d));

function chart(canvas, points, color) {
  const ctx = canvas.getContext("2d");
  const w = (canvas.width = canvas.clientWidth * devicePixelRatio);
  const h = (canvas.height = canvas.clientHeight * devicePixelRatio);
  ctx.clearRect(0, 0, w, h);
  const ys = points.map((p) => p.y).filter((y) => y !== null);
  if (!ys.length) return;
  const top = Math.max(...ys) || 1;
  const t0 = points[0].t, span = Math.max(points[points.length - 1].t - t0, 1);
  ctx.strokeStyle = color;
  ctx.lineWidth = 2 * devicePixelRatio;
  ctx.beginPath();
  let started = false;
  for (const p of points) {
    if (p.y === null) continue;
    const x = ((p.t - t0) / span) * w, y = h - (p.y / top) * (h - 4) - 2;
    if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
  }
  ctx.stroke();
  ctx.fillStyle = color;
  for (const p of points) { // (a point with no neighbour draws no line)
    if (p.y !== null) ctx.fillRect(((p.t - t0) / span) * w - 2, h - (p.y / top) * (h - 4) - 4, 4, 4);
  }
  ctx.fillStyle = "#6e6e73";
  ctx.font = `${11 * devicePixelRatio}px system-ui`;
  ctx.fillText(num(top, top < 10 ? 2 : 0), 4, 12 * devicePixelRatio);
}

function instanceView(s, title) {
  const div = document.createElement("div");
  div.className = "instance";
  const h = document.createElement("h2");
  h.textContent = title;
  div.appendChild(h);
  if (s.error) {
    const e = document.createElement("div");
    e.className = "stats error-text";
    e.textContent = s.error;
    div.appendChild(e);
    return div;
  }
  const now = s.now, last = s.series.length ? s.series[s.series.length - 1] : null;
  const cards = [
    ["running", "running", num(now.running)],
    ["waiting", "waiting", num(now.waiting)],
    ["kv", "KV cache used", pct(now.kv_usage)],
    ["hit", "prefix-cache hit rate", pct(now.hit_rate)],
    ["host", "host tier used", now.host_usage === null ? "off" : pct(now.host_usage)],
    ["tok_s", "generation tok/s", last ? num(last.tok_s, 1) : "–"],
    ["requests", "requests done", num(now.requests)],
    ["tokens", "tokens generated", num(now.generation_tokens)],
  ];
  const grid = document.createElement("div");
  grid.className = "cards";
  for (const [key, label, value] of cards) {
    const c = document.createElement("div");
    c.className = "card";
    c.dataset.key = key;
    c.innerHTML = `<div class="label"></div><div class="value"></div>`;
    c.firstChild.textContent = label;
    c.lastChild.textContent = value;
    grid.appendChild(c);
  }
  div.appendChild(grid);
  const charts = document.createElement("div");
  charts.className = "charts";
  const series = [
    ["generation tok/s", "tok_s", "#3b5bdb"], ["TTFT ms (mean a second)", "ttft_ms", "#e8590c"],
    ["ITL ms (mean a second)", "itl_ms", "#2b8a3e"], ["running + waiting", null, "#862e9c"],
  ];
  for (const [label, key, color] of series) {
    const c = document.createElement("div");
    c.className = "chart";
    c.innerHTML = `<div class="label"></div><canvas></canvas>`;
    const seconds = s.series.length ? s.series[s.series.length - 1].t - s.series[0].t : 0;
    c.firstChild.textContent = `${label}, last ${seconds < 90 ? `${Math.round(seconds)} s` : `${Math.round(seconds / 60)} min`}`;
    charts.appendChild(c);
    requestAnimationFrame(() => chart(c.lastChild, s.series.map((p) => ({
      t: p.t, y: key ? p[key] : p.running + p.waiting,
    })), color));
  }
  div.appendChild(charts);
  return div;
}

async function refreshDashboard() {
  if ($("view-dashboard").hidden) return;
  try {
    const response = await fetch("/stats");
    if (!response.ok) throw new Error(await explain(response));
    const stats = await response.json();
    const box = $("instances");
    box.innerHTML = "";
    if (stats.instances) {
      for (const i of stats.instances) box.appendChild(instanceView(i, `${i.role || "instance"} · ${i.url}`));
    } else {
      box.appendChild(instanceView(stats, `${stats.model} (${stats.role})`));
    }
    showError("");
  } catch (e) {
    showError(e instanceof TypeError ? "The server does not answer (is it running?)" : e.message);
  }
}

for (const tab of document.querySelectorAll(".tab")) {
  tab.addEventListener("click", () => {
    for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t === tab);
    for (const v of ["chat", "dashboard"]) $(`view-${v}`).hidden = v !== tab.dataset.view;
    refreshDashboard();
  });
}
setInterval(refreshDashboard, 1000);

// ---- start ---------------------------------------------------------------------------------

async function start() {
  if (matchMedia("(max-width: 700px)").matches) document.querySelector("#settings details").open = false; // (a phone)
  const settings = JSON.parse(localStorage.getItem(STORE + ".settings") || "{}");
  for (const id of SETTINGS) if (settings[id] !== undefined) $(id).value = settings[id];
  render();
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (!response.ok) throw new Error(await explain(response));
    model = (await response.json()).data[0].id;
    $("model").textContent = model;
  } catch (e) {
    showError(e instanceof TypeError ? "The server does not answer (is it running?)" : e.message);
  }
}
$("api_key").addEventListener("change", start);
start();
