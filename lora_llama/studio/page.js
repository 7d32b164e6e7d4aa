// The studio's page: the runs, a run's curves and output, the New run form, chat and ship, over the studio's JSON
// API (server.py). Every request is same-origin; the token travels as the cookie the first visit set.
"use strict";
/* exported openChat, chat, ship, act, startRun */  // called from the page's onclick attributes

const $ = (id) => document.getElementById(id);
let openRun = null, form = null, planTimer = null;

async function api(path, body) {
  const r = await fetch(path, body ? {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)} : {});
  return r.json();
}

function show(tab, adapter) {
  for (const t of ["runs", "new", "chat"]) { $(t).hidden = t !== tab; $("tab-" + t).classList.toggle("on", t === tab); }
  if (tab === "runs") refreshRuns();
  if (tab === "new" && !form) loadForm();
  if (tab === "chat") loadChat(adapter ?? $("chat-adapter-path").value);  // the adapters as they are now
}

function cell(text) { const td = document.createElement("td"); td.textContent = text; return td; }

const rowOf = new Map();  // run name -> [its summary as JSON, its row]: a row is redrawn only when it changes

function runRow(r) {
  const tr = document.createElement("tr");
  tr.className = "run"; tr.dataset.name = r.name; tr.onclick = () => openDetail(r.name);
  const status = cell(r.status + (r.failure ? ": " + r.failure : ""));
  status.className = "status-" + r.status;
  tr.append(cell(r.name), status, cell(r.step), cell(r.loss === null ? "" : r.loss.toFixed(4)));
  return tr;
}

async function refreshRuns() {  // only while the Runs tab shows: a page left open costs a run little
  if (document.hidden || $("runs").hidden) return;
  const asked = openRun, both = await api("/api/runs" + (asked ? "?open=" + encodeURIComponent(asked) : ""));
  const runs = both.runs, body = $("run-list").querySelector("tbody");
  const rows = runs.map((r) => {
    const json = JSON.stringify(r), known = rowOf.get(r.name);
    if (known && known[0] === json) return known[1];
    rowOf.set(r.name, [json, runRow(r)]);
    return rowOf.get(r.name)[1];
  });
  const order = (trs) => trs.map((tr) => tr.dataset.name).join("\n");
  if (order(rows) !== order([...body.children])) body.replaceChildren(...rows);
  else rows.forEach((tr, i) => { if (body.children[i] !== tr) body.children[i].replaceWith(tr); });
  if (asked && asked === openRun) openDetail(asked, true, both.open);  // the open run, read in the same request
}

function chart(rows, keys) {
  const points = keys.map((k) => rows.filter((r) => k in r).map((r) => [r.step, r[k]]));
  const all = points.flat();
  if (!all.length) return "";
  const [w, h, pad] = [640, 220, 34];
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  const [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs) || 1, Math.min(...ys), Math.max(...ys)];
  const X = (x) => pad + (w - 2 * pad) * (x - x0) / ((x1 - x0) || 1);
  const Y = (y) => h - pad - (h - 2 * pad) * (y - y0) / ((y1 - y0) || 1);
  const colors = ["#2f6fde", "#d9480f", "#1a7f37", "#7048e8"];
  const lines = points.map((ps, i) => ps.length ? `<polyline fill="none" stroke="${colors[i]}" stroke-width="2" points="${ps.map((p) => X(p[0]) + "," + Y(p[1])).join(" ")}"/>` +
    (ps.length === 1 ? `<circle cx="${X(ps[0][0])}" cy="${Y(ps[0][1])}" r="3" fill="${colors[i]}"/>` : "") +  // one point: no line to draw
    `<text x="${w - pad - 90}" y="${16 + 14 * i}" fill="${colors[i]}" font-size="12">${keys[i]}</text>` : "").join("");
  const yLabels = y1.toFixed(3) !== y0.toFixed(3) ? `<text x="4" y="${Y(y1) + 4}" font-size="11">${y1.toFixed(3)}</text><text x="4" y="${Y(y0)}" font-size="11">${y0.toFixed(3)}</text>`
    : `<text x="4" y="${Y(y0)}" font-size="11">${y0.toFixed(3)}</text>`;
  return `<svg class="chart" data-keys="${keys.join(" ")}" width="${w}" height="${h}">${lines}${yLabels}` +
    (x1 > x0 ? `<text x="${pad}" y="${h - 8}" font-size="11">step ${x0}</text>` : "") +
    `<text x="${X(x1) - 30}" y="${h - 8}" font-size="11">step ${x1}</text></svg>`;
}

function benchmarkTable(benchmarks) {
  const steps = Object.keys(benchmarks).map(Number).sort((a, b) => a - b);
  if (!steps.length) return "";
  const rows = [];
  for (const task of Object.keys(benchmarks[steps[0]])) {
    for (const metric of Object.keys(benchmarks[steps[0]][task])) {
      rows.push(`<tr><td>${escapeHtml(task)}</td><td>${escapeHtml(metric)}</td>${steps.map((s) => `<td>${(benchmarks[s][task] || {})[metric]?.toFixed?.(4) ?? ""}</td>`).join("")}</tr>`);
    }
  }
  return `<table id="benchmarks"><tr><th>task</th><th>metric</th>${steps.map((s) => `<th>${s === 0 ? "base" : "step " + s}</th>`).join("")}</tr>${rows.join("")}</table>`;
}

function escapeHtml(text) {  // for text and attribute values alike
  return String(text).replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"})[c]);
}

function samplesTable(samples) {
  const rows = samples.slice().reverse().flatMap((s) => Object.entries(s.samples || {}).map(([prompt, answer]) =>
    `<tr><td>${s.step}</td><td>${escapeHtml(prompt)}</td><td>${escapeHtml(answer)}</td></tr>`));
  return rows.length ? `<h3>eval.prompts' answers</h3><div class="scroll"><table id="samples"><tr><th>step</th><th>prompt</th><th>answer</th></tr>${rows.join("")}</table></div>` : "";
}

function detailParts(name, r) {  // the run page's parts, each redrawn only when it changes
  // the curves the run's objective draws (its reporting), each where the metrics hold it
  const drawn = (keys) => keys.filter((k) => r.metrics.some((m) => k in m));
  const trainKeys = drawn(r.curves.train).slice(0, 4), evalKeys = drawn(r.curves.held_out).slice(0, 4);  // 4 colours
  const buttons = r.status === "running" ? `<button class="action" id="stop" onclick="act('stop')">Stop</button>` :
    (r.status === "stopped" || r.status === "failed") ? `<button class="action" id="resume" onclick="act('resume')">Resume</button>` : "";
  const chats = r.adapters.map(([label, path]) => `<button class="link" data-adapter="${escapeHtml(path)}" onclick="openChat(this.dataset.adapter)">${label}</button>`).join(" ");
  return {
    head: `<h2>${escapeHtml(name)} <small class="status-${r.status}" id="detail-status">${r.status}${r.failure ? ": " + escapeHtml(r.failure) : ""}</small></h2>
      <p>step <span id="detail-step">${r.step}</span> ${buttons}</p>
      ${chats ? `<p id="detail-chats">chat with ${chats}</p>` : ""}`,
    train: chart(r.metrics, trainKeys), eval: chart(r.metrics, evalKeys),
    benchmarks: benchmarkTable(r.benchmarks), samples: samplesTable(r.samples),
  };
}

const SHIP = `<div class="card" id="ship"><h3>Ship</h3>
  <button class="action" id="merge" onclick="ship('merge')">Merge</button>
  <button class="action" id="export" onclick="ship('export')">Export GGUF</button>
  <input id="repo-id" placeholder="USER/NAME" size="24"> <label><input type="checkbox" id="push-public"> public</label>
  <button class="action" id="push" onclick="ship('push')">Push to the Hub</button>
  <pre id="ship-output"></pre></div>`;

const PARTS = ["head", "train", "eval", "benchmarks", "samples"], drawn = new WeakMap();

async function openDetail(name, quiet, read) {
  openRun = name;
  const r = read || await api("/api/run?name=" + encodeURIComponent(name));
  if (r.error) { $("run-detail").textContent = r.error; return; }
  const key = JSON.stringify([r.status, r.step, r.metrics.length, r.samples.length, Object.keys(r.benchmarks), r.adapters]);
  let shown = $("detail");
  if (quiet && shown && shown.dataset.name === name && shown.dataset.key === key) return;  // unchanged
  const fresh = !quiet || !shown || shown.dataset.name !== name;
  const restarted = fresh || (shown.dataset.status !== r.status && r.status === "running");
  if (fresh) {
    $("run-detail").innerHTML = `<div class="card" id="detail">${PARTS.map((p) => `<div id="detail-${p}"></div>`).join("")}<div id="detail-ship"></div>
      <h3>recipe</h3><pre id="detail-recipe"></pre><h3>output</h3><pre id="detail-log"></pre></div>`;
    shown = $("detail");
  }
  Object.assign(shown.dataset, {name, status: r.status, key});
  const parts = detailParts(name, r);
  for (const part of PARTS) {
    const html = parts[part], el = $("detail-" + part);
    if (drawn.get(el) !== html) { el.innerHTML = html; drawn.set(el, html); }
  }
  if ($("detail-recipe").textContent !== r.recipe) $("detail-recipe").textContent = r.recipe;
  if (r.status === "finished" && !$("ship")) $("detail-ship").innerHTML = SHIP;
  if (restarted) follow("detail-log", `name=${encodeURIComponent(name)}&what=train`, false);
}

const streams = {};

function lastDraw(line) {  // as a terminal shows a line: a progress bar's redraws (carriage returns) leave the last
  const text = line.endsWith("\r") ? line.slice(0, -1) : line;
  return text.slice(text.lastIndexOf("\r") + 1);
}

function follow(target, query, dropCommand) {  // a command's output pushed as it grows (server-sent events)
  if (streams[target]) streams[target].close();
  const pane = $(target), source = new EventSource("/api/follow?" + query);
  const last = document.createTextNode("");  // the line being written, after the whole lines' text nodes
  let skip = dropCommand, open = "";
  streams[target] = source;
  pane.replaceChildren(last); pane.dataset.done = "false";
  source.onmessage = (e) => {
    const atBottom = pane.scrollHeight - pane.scrollTop - pane.clientHeight < 24;
    const lines = (open + JSON.parse(e.data)).split("\n");
    open = lines.pop();
    open = open.slice(open.lastIndexOf("\r", open.length - 2) + 1);  // only the last redraw is kept
    if (skip && lines.length) { lines.shift(); skip = false; }
    if (lines.length) last.before(lines.map((line) => lastDraw(line) + "\n").join(""));  // a node of its own: laid out alone
    last.data = skip ? "" : lastDraw(open);
    if (atBottom) pane.scrollTop = pane.scrollHeight;  // follows the end unless one scrolled up to read
  };
  source.addEventListener("restart", () => { pane.replaceChildren(last); last.data = open = ""; skip = dropCommand; });
  const end = () => { source.close(); pane.dataset.done = "true"; };
  source.addEventListener("end", end);
  source.onerror = end;
}

let chatChoices = null;

async function loadChat(adapter) {
  const model = $("chat-model").value;
  chatChoices = await api("/api/chat");
  const option = (value, label) => { const o = document.createElement("option"); o.value = value; o.textContent = label; return o; };
  $("chat-model").replaceChildren(...chatChoices.models.map((m) => option(m, m)));
  $("chat-adapter-path").replaceChildren(option("", "none: the model alone"), ...chatChoices.adapters.map((a) => option(a.path, a.path)));
  if (chatChoices.models.includes(model)) $("chat-model").value = model;
  if (chatChoices.adapters.some((a) => a.path === adapter)) $("chat-adapter-path").value = adapter;
  adapterChosen();
}

function adapterChosen() {  // an adapter is asked beside its own base model
  const chosen = chatChoices.adapters.find((a) => a.path === $("chat-adapter-path").value);
  if (chosen && chosen.model) $("chat-model").value = chosen.model;
  $("chat-adapter-pane").hidden = !chosen;
  $("chat-adapter-label").textContent = chosen ? "with " + chosen.path : "";
  $("chat").dataset.adapter = chosen ? chosen.path : "";
}

function openChat(adapter) { show("chat", adapter); }

async function chat() {
  const body = {model: $("chat-model").value, adapter: $("chat-adapter-path").value, prompt: $("chat-prompt").value,
    seed: Number($("chat-seed").value), max_new_tokens: Number($("chat-max").value), temperature: Number($("chat-temperature").value)};
  const panes = [$("chat-base"), $("chat-adapter")];
  for (const pane of panes) { pane.textContent = ""; pane.dataset.done = "false"; }  // the last answers go at once
  const r = await api("/api/chat", body);
  $("chat-error").textContent = r.error || "";
  if (r.error) { for (const pane of panes) pane.dataset.done = "true"; return; }
  for (const pane of r.panes) follow(pane, "what=" + pane, true);
}

async function ship(action) {
  $("ship-output").dataset.done = "false";
  const r = await api("/api/ship", {name: openRun, action, repo_id: $("repo-id").value, public: $("push-public").checked});
  if (r.error) { $("ship-output").textContent = r.error; $("ship-output").dataset.done = "true"; return; }
  follow("ship-output", `name=${encodeURIComponent(openRun)}&what=${action}`, false);
}

async function act(what) {
  const r = await api("/api/" + what, {name: openRun});
  if (r.error) alert(r.error);
  setTimeout(refreshRuns, 500);
}

async function loadForm(base) {
  form = await api("/api/form" + (base ? "?base=" + encodeURIComponent(base) : ""));
  $("base").replaceChildren(...form.bases.map((b) => { const o = document.createElement("option"); o.value = o.textContent = b; return o; }));
  if (base) $("base").value = base;
  $("fields").replaceChildren(...form.fields.map((f) => {
    const row = document.createElement("div"); row.className = "field";
    const label = document.createElement("label"); label.textContent = f.path; label.htmlFor = "f-" + f.path;
    let input;
    if (f.kind === "choice") {
      input = document.createElement("select");
      input.append(...f.choices.map((c) => { const o = document.createElement("option"); o.value = o.textContent = c; return o; }));
    } else if (f.kind === "bool") {
      input = document.createElement("select");
      input.append(...["true", "false"].map((c) => { const o = document.createElement("option"); o.value = o.textContent = c; return o; }));
    } else { input = document.createElement("input"); }
    input.id = "f-" + f.path; input.dataset.path = f.path; input.value = form.values[f.path];
    input.oninput = input.onchange = () => { clearTimeout(planTimer); planTimer = setTimeout(preview, 150); };
    const help = document.createElement("small"); help.textContent = `default ${f.default}: ${f.description}`;
    row.append(label, input, help);
    return row;
  }));
  $("fields").dataset.base = $("base").value;
  preview();
}

function formBody() {
  const values = {};
  for (const input of $("fields").querySelectorAll("[data-path]")) values[input.dataset.path] = input.value;
  return {base: $("base").value, name: $("run-name").value, values};
}

async function preview() {
  const r = await api("/api/plan", formBody());
  $("form-error").textContent = r.error || "";
  $("command").textContent = r.command || "";
  $("yaml").textContent = r.yaml || "";
}

async function startRun() {
  const body = formBody();
  const r = await api("/api/start", body);
  $("form-error").textContent = r.error || "";
  if (!r.error) { openRun = body.name; show("runs"); }
}

$("run-name").oninput = () => { clearTimeout(planTimer); planTimer = setTimeout(preview, 150); };
refreshRuns();
setInterval(refreshRuns, 2000);
document.addEventListener("visibilitychange", refreshRuns);
