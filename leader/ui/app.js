// SilentSwarm Ops UI: plain JavaScript over the leader's REST and SSE endpoints.
// The selection lives in the URL hash (#fellow=ID, #job=ID, #leader), so a reload keeps it.
"use strict";

const API = "/api/v1";
const REFRESH_MS = 2000;
const POLL_MS = 3000;
const MAX_LOG_LINES = 1000;

const state = {
  workers: [],
  jobs: [],
  cluster: null,
  loaded: false, // whether the first overview answer came: before it, views show "loading"
  selection: parseHash(),
  detail: null, // { kind, id, stop() } of the open detail view
};

// --- small helpers ---------------------------------------------------------------------------

function authHeaders() {
  const token = sessionStorage.getItem("swarm-token");
  return token ? { authorization: `Bearer ${token}` } : {};
}

async function streamUrl(url, lastId) {
  // EventSource sends no headers, and the operator token never goes in a URL: with a token,
  // ask for a short-lived read ticket (60 s) and pass that. A fresh one for every (re)open.
  const target = new URL(url, window.location.href);
  if (lastId) target.searchParams.set("after", lastId);
  if (sessionStorage.getItem("swarm-token")) {
    try {
      const response = await fetch(`${API}/auth/read-ticket`, { method: "POST", headers: authHeaders() });
      if (response.ok) target.searchParams.set("ticket", (await response.json()).ticket);
    } catch (error) {
      // No ticket: the stream itself then answers (open reads, or a 401 and polling).
    }
  }
  return target.pathname + target.search;
}

async function getJSON(path) {
  const response = await fetch(API + path, { headers: { accept: "application/json", ...authHeaders() } });
  if (!response.ok) {
    const error = new Error(`${path}: HTTP ${response.status}`);
    error.status = response.status;
    throw error;
  }
  return response.json();
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("data-")) node.setAttribute(key, value);
    else node[key] = value;
  }
  for (const child of children) {
    if (child !== null && child !== undefined) node.append(child);
  }
  return node;
}

const svgEl = (tag, attrs = {}) => {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  return node;
};

const gib = (bytes) => (bytes === null || bytes === undefined ? "-" : `${(bytes / 2 ** 30).toFixed(1)} GiB`);
const num = (value, digits = 4) => (value === null || value === undefined ? "-" : Number(value).toFixed(digits));

function rate(bytesPerSecond) {
  let value = bytesPerSecond || 0;
  for (const unit of ["B/s", "KiB/s", "MiB/s", "GiB/s"]) {
    if (value < 1024 || unit === "GiB/s") return `${value.toFixed(unit === "B/s" ? 0 : 1)} ${unit}`;
    value /= 1024;
  }
  return "-";
}

function size(bytes) {
  let value = bytes || 0;
  for (const unit of ["B", "KiB", "MiB", "GiB"]) {
    if (value < 1024 || unit === "GiB") return `${value.toFixed(unit === "B" ? 0 : 1)} ${unit}`;
    value /= 1024;
  }
  return "-";
}

// Labels as settings write them: gpu=a100,zone=eu (sorted); "" for none.
const labelText = (labels) =>
  Object.keys(labels || {})
    .sort()
    .map((k) => `${k}=${labels[k]}`)
    .join(",");

// Where a job may run: its pool (unset: default) and the labels a fellow must carry.
function jobPool(spec) {
  const labels = labelText(spec.labels);
  return `${spec.pool || "default"}${labels ? ` matching ${labels}` : ""}`;
}

function dl(pairs) {
  const list = el("dl");
  for (const [term, value, id] of pairs) {
    list.append(el("dt", {}, term), el("dd", id ? { id } : {}, String(value)));
  }
  return list;
}

// --- selection -------------------------------------------------------------------------------

function parseHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  for (const kind of ["fellow", "job"]) {
    if (params.get(kind)) return { kind, id: params.get(kind) };
  }
  if (params.has("leader")) return { kind: "leader", id: "leader" };
  return null;
}

function select(kind, id) {
  location.hash = kind === "leader" ? "leader" : `${kind}=${encodeURIComponent(id)}`;
}

window.addEventListener("hashchange", () => {
  state.selection = parseHash();
  openDetail();
});

// --- the overview (refreshed every REFRESH_MS) -----------------------------------------------

async function refresh() {
  try {
    const [health, workers, jobs, cluster] = await Promise.all([
      fetch("/health").then((r) => r.json()),
      getJSON("/workers"),
      getJSON("/jobs").catch(() => state.jobs),
      getJSON("/cluster"),
    ]);
    Object.assign(state, { workers, jobs, cluster, loaded: true });
    const status = document.getElementById("leader-status");
    status.textContent = `leader ${health.version} · NATS ${health.nats}`;
    status.className = `pill ${health.nats === "connected" ? "ok" : "bad"}`;
    renderFellows();
    renderJobs();
    renderGraph();
    if (state.detail && state.detail.refresh) state.detail.refresh();
  } catch (error) {
    const status = document.getElementById("leader-status");
    status.textContent = `leader unreachable (${error.message})`;
    status.className = "pill bad";
  }
}

function gpuTotals(worker) {
  const gpus = worker.hardware.gpus || [];
  if (!gpus.length) return "cpu only";
  const used = gpus.reduce((sum, g) => sum + g.memory_used_bytes, 0);
  const free = gpus.reduce((sum, g) => sum + g.memory_free_bytes, 0);
  return `${gib(used)} / ${gib(free)}`;
}

function netBars(worker, max) {
  const hw = worker.hardware;
  const width = (value) => `${Math.max(2, Math.round((48 * (value || 0)) / max))}px`;
  // One line per direction (the legend under the table says what they are).
  const line = (kind, arrow, value) =>
    el("span", { class: "net" }, el("span", { class: `bar ${kind}`, style: `width:${width(value)}` }), ` ${arrow}${rate(value)}`);
  return el(
    "span",
    { title: `host sent ${rate(hw.net_sent_bytes_per_s)}, received ${rate(hw.net_recv_bytes_per_s)}` },
    line("sent", "↑", hw.net_sent_bytes_per_s),
    line("recv", "↓", hw.net_recv_bytes_per_s),
  );
}

function renderFellows() {
  const body = document.querySelector("#fellows tbody");
  const max = Math.max(
    1,
    ...state.workers.map((w) => Math.max(w.hardware.net_sent_bytes_per_s || 0, w.hardware.net_recv_bytes_per_s || 0)),
  );
  body.replaceChildren(
    ...state.workers.map((w) => {
      const row = el(
        "tr",
        { "data-fellow": w.fellow_id, onclick: () => select("fellow", w.fellow_id) },
        el("td", {}, w.fellow_id),
        el("td", {}, w.hostname),
        el(
          "td",
          { class: "pool", title: labelText(w.labels) || "no labels" },
          w.pool || "default",
          labelText(w.labels) ? el("span", { class: "muted labels" }, ` ${labelText(w.labels)}`) : null,
        ),
        el("td", { class: `status-${w.status}` }, w.status),
        el("td", {}, w.job_id || "-"),
        el("td", {}, w.step ?? "-"),
        el("td", {}, num(w.loss)),
        el("td", {}, netBars(w, max)),
        el("td", {}, gpuTotals(w)),
      );
      if (state.selection && state.selection.kind === "fellow" && state.selection.id === w.fellow_id) {
        row.classList.add("selected");
      }
      return row;
    }),
  );
}

function renderJobs() {
  const body = document.querySelector("#jobs tbody");
  body.replaceChildren(
    ...[...state.jobs].reverse().slice(0, 20).map((job) => {
      // The leader computes the pipeline's step and loss (swarm/types/views.py): never here.
      const view = job.view || {};
      const selected = state.selection && state.selection.kind === "job" && state.selection.id === job.job_id;
      return el(
        "tr",
        { "data-job": job.job_id, class: selected ? "selected" : "", onclick: () => select("job", job.job_id) },
        el("td", {}, job.job_id),
        el("td", { class: `state-${job.state}` }, job.state),
        el("td", {}, `${view.step ?? 0}/${view.total_steps ?? job.spec.steps}`),
        el("td", {}, num(view.loss)),
        el("td", {}, (view.fellows || []).join(", ") || "-"),
      );
    }),
  );
}

function activeJob() {
  if (state.selection && state.selection.kind === "job") {
    const job = state.jobs.find((j) => j.job_id === state.selection.id);
    if (job && job.placement) return job;
  }
  return state.jobs.find((j) => j.state === "RUNNING" && j.placement) || null;
}

// Where the graph puts each fellow and which links it draws (pure: the UI test calls it).
// A job of one pipeline: its stages in order on one row, the other fellows after them. A job
// with replicas: one row per replica (its stages left to right, in columns by stage), the
// sync links of each segment's ring (replica r's stage holding it sends to r + 1's, the last
// to the first) drawn between the rows, and the other fellows on a row below.
function graphLayout(job, fellowIds, width) {
  const stages = job ? [...job.placement.stages].sort((a, b) => (a.replica || 0) - (b.replica || 0) || a.stage - b.stage) : [];
  const replicas = Math.max(0, ...stages.map((s) => (s.replica || 0) + 1));
  const inJob = new Set(stages.map((s) => s.fellow_id));
  const others = fellowIds.filter((id) => !inJob.has(id));
  const nodes = {};
  const links = [];
  const at = (r, i) => stages.find((s) => (s.replica || 0) === r && s.stage === i);
  let height = 220;
  if (replicas <= 1) {
    const ids = [...stages.map((s) => s.fellow_id), ...others];
    const gap = width / (ids.length + 1);
    ids.forEach((id, i) => {
      const placed = stages.find((s) => s.fellow_id === id);
      nodes[id] = { x: gap * (i + 1), y: 160, stage: placed ? placed.stage : null, replica: placed ? 0 : null };
    });
  } else {
    const columns = Math.max(...stages.map((s) => s.stage)) + 1;
    const gap = width / (columns + 1);
    const rowY = (r) => 110 + 70 * r;
    for (const s of stages) nodes[s.fellow_id] = { x: gap * (s.stage + 1), y: rowY(s.replica || 0), stage: s.stage, replica: s.replica || 0 };
    const otherGap = width / (others.length + 1);
    others.forEach((id, i) => {
      nodes[id] = { x: otherGap * (i + 1), y: rowY(replicas), stage: null, replica: null };
    });
    height = rowY(replicas) + (others.length ? 40 : -30);
    // One ring per segment of layers: the replicas' splits cut together (silentswarm.rings),
    // over the stages that hold it. Replicas that split alike: one ring per stage.
    const live = [...new Set(stages.map((s) => s.replica || 0))].sort((a, b) => a - b);
    const cuts = [...new Set(stages.flatMap((s) => [s.layer_start, s.layer_end]))].sort((a, b) => a - b);
    const holder = (r, layer) => stages.find((s) => (s.replica || 0) === r && s.layer_start <= layer && layer < s.layer_end);
    const drawn = new Set();
    for (let g = 0; g + 1 < cuts.length && live.length > 1; g++) {
      live.forEach((r, j) => {
        const next = live[(j + 1) % live.length];
        if (live.length === 2 && j === 1) return; // two replicas: both ring links join one pair
        const from = holder(r, cuts[g]);
        const to = holder(next, cuts[g]);
        const key = from && to ? `${from.fellow_id} ${to.fellow_id}` : null;
        if (!key || drawn.has(key)) return; // two segments held by the same pair: one line
        drawn.add(key);
        links.push({ kind: "sync", segment: cuts[g], replica: r, from: from.fellow_id, to: to.fellow_id, wrap: next < r });
      });
    }
  }
  for (let r = 0; r < Math.max(1, replicas); r++) {
    for (let i = 0; at(r, i) && at(r, i + 1); i++) {
      links.push({ kind: "pipeline", boundary: i, replica: r, from: at(r, i).fellow_id, to: at(r, i + 1).fellow_id });
    }
  }
  return { nodes, links, replicas, height };
}

function renderGraph() {
  const svg = document.getElementById("graph");
  const width = svg.clientWidth || 600;
  const fellows = state.workers;
  const job = activeJob();
  const layout = graphLayout(job, fellows.map((f) => f.fellow_id), width);
  const pos = layout.nodes;
  svg.style.height = `${layout.height}px`;
  const leader = { x: width / 2, y: 36 };
  const children = [];
  for (const id of Object.keys(pos)) {
    children.push(svgEl("line", { class: "control", x1: leader.x, y1: leader.y + 14, x2: pos[id].x, y2: pos[id].y - 14 }));
  }
  const running = (state.cluster && state.cluster.running_jobs) || [];
  const boundaries = job ? (running.find((r) => r.job_id === job.job_id) || {}).boundaries || [] : [];
  const progress = Object.fromEntries(((job && job.progress) || []).map((p) => [p.fellow_id, p]));
  for (const link of layout.links) {
    const a = pos[link.from];
    const b = pos[link.to];
    if (link.kind === "sync") {
      // The replicas of a stage keep their weights in sync over this link (never the leader).
      const attrs = { class: "sync", "data-sync": `${link.segment}-${link.replica}` };
      if (link.wrap) {
        const bend = a.x - 80;
        children.push(svgEl("path", { ...attrs, d: `M ${a.x - 60} ${a.y} C ${bend} ${a.y}, ${bend} ${b.y}, ${b.x - 60} ${b.y}`, fill: "none" }));
      } else {
        children.push(svgEl("line", { ...attrs, x1: a.x, y1: a.y + 14, x2: b.x, y2: b.y - 14 }));
      }
      const p = progress[link.from] || {};
      const label = svgEl("text", { x: a.x + 6, y: (a.y + b.y) / 2 + 4, class: "sync-label" });
      label.textContent = `sync ${p.sync_s === null || p.sync_s === undefined ? "-" : `${p.sync_s.toFixed(2)} s`} · ${size(p.sync_bytes_sent || 0)}`;
      if (!link.wrap) children.push(label);
      continue;
    }
    const boundary = boundaries.find((x) => x.boundary === link.boundary && (x.replica || 0) === link.replica) || {};
    const transport = boundary.transport || (job.placement.transport === "tunnel" ? "relay" : "p2p");
    children.push(svgEl("line", { class: `link ${transport}`, "data-boundary": link.boundary, "data-replica": link.replica, x1: a.x + 40, y1: a.y, x2: b.x - 40, y2: b.y }));
    const label = svgEl("text", { x: (a.x + b.x) / 2, y: a.y + (layout.replicas > 1 ? -6 : 32), "text-anchor": "middle" });
    // As its two ends last measured it: round trip and the codecs in use.
    const measured = boundary.link ? ` · ${boundary.link.rtt_ms.toFixed(1)} ms · ${boundary.link.fwd_codec}` : "";
    label.textContent = `${transport === "relay" ? "relayed" : "direct"} ${rate(boundary.bytes_per_s)}${measured}`;
    children.push(label);
  }
  children.push(graphNode("leader", "leader", leader, () => select("leader", "leader")));
  for (const f of fellows) {
    const at = pos[f.fellow_id];
    let caption = f.fellow_id;
    if (at.stage !== null) caption += layout.replicas > 1 ? ` (r${at.replica} stage ${at.stage})` : ` (stage ${at.stage})`;
    children.push(graphNode(`fellow ${f.status}`, caption, at, () => select("fellow", f.fellow_id)));
  }
  svg.replaceChildren(...children);
}

function graphNode(kind, caption, at, onclick) {
  const group = svgEl("g", { class: `node ${kind}`, "data-node": caption });
  group.addEventListener("click", onclick);
  group.append(svgEl("rect", { x: at.x - 60, y: at.y - 14, width: 120, height: 28, rx: 6 }));
  const text = svgEl("text", { x: at.x, y: at.y + 4, "text-anchor": "middle" });
  text.textContent = caption;
  group.append(text);
  return group;
}

// --- detail views ----------------------------------------------------------------------------

function openDetail() {
  if (state.detail) state.detail.stop();
  state.detail = null;
  const pane = document.getElementById("detail");
  const selection = state.selection;
  renderFellows();
  renderJobs();
  if (!selection) {
    pane.replaceChildren(el("p", { class: "muted" }, "Select the leader, a fellow or a job."));
    return;
  }
  const view = { fellow: fellowView, job: jobView, leader: leaderView }[selection.kind](selection.id);
  state.detail = view;
  pane.replaceChildren(view.root);
}

function stream(url, handlers, fallback) {
  // An SSE stream. When the browser gives up on it (a 4xx/5xx, or the leader restarting),
  // poll with ``fallback`` and try the stream again a little later. A stream opened with a
  // read ticket is never left to the browser's own reconnect (its ticket may have expired):
  // it is reopened with a new ticket, from the last event it saw.
  let source = null;
  let timer = null;
  let retry = null;
  let closed = false;
  let delay = 5000;
  let failures = 0;
  let lastId = null;
  const poll = () => Promise.resolve().then(fallback).catch(() => {});
  const open = async () => {
    if (closed || !window.EventSource) return;
    const target = await streamUrl(url, lastId);
    if (closed) return;
    const ticketed = target.includes("ticket=");
    const current = new EventSource(target);
    source = current;
    for (const [event, handler] of Object.entries(handlers)) {
      current.addEventListener(event, (message) => {
        if (message.lastEventId) lastId = message.lastEventId;
        handler(JSON.parse(message.data), message.lastEventId);
      });
    }
    current.onopen = () => {
      delay = 5000;
      failures = 0;
      if (timer) clearInterval(timer);
      timer = null;
    };
    current.onerror = () => {
      if (closed || current !== source) return;
      if (current.readyState !== EventSource.CLOSED && !ticketed) return; // the browser reconnects itself
      current.close();
      if (!timer) timer = setInterval(poll, POLL_MS);
      retry = setTimeout(open, ticketed && failures === 0 ? 1000 : delay);
      failures += 1;
      delay = Math.min(delay * 2, 60000);
    };
  };
  if (window.EventSource) open();
  else timer = setInterval(poll, POLL_MS);
  return () => {
    closed = true;
    if (source) source.close();
    if (timer) clearInterval(timer);
    if (retry) clearTimeout(retry);
  };
}

function fellowView(id) {
  const root = el("div", { "data-view": "fellow" }, el("h2", {}, `Fellow ${id}`));
  const summary = el("div");
  const logs = el("div", { id: "logs", "aria-live": "polite" });
  root.append(summary, el("h2", {}, "Logs"), logs);
  let lastSeq = 0;

  const append = (entries) => {
    for (const entry of entries) {
      if (entry.seq < lastSeq) continue;
      const time = new Date(entry.ts * 1000).toLocaleTimeString();
      logs.append(el("div", { class: `line ${entry.level}` }, `${time} ${entry.level} ${entry.logger}: ${entry.message}`));
    }
    if (entries.length) lastSeq = Math.max(lastSeq, ...entries.map((e) => e.seq + 1));
    while (logs.childElementCount > MAX_LOG_LINES) logs.firstElementChild.remove();
    logs.scrollTop = logs.scrollHeight;
  };
  const poll = () => getJSON(`/workers/${encodeURIComponent(id)}/logs?limit=200`).then((entries) => append(entries.filter((e) => e.seq >= lastSeq)));
  let stopStream = () => {};
  let closed = false;
  getJSON(`/workers/${encodeURIComponent(id)}/logs?limit=200`)
    .then((entries) => {
      if (closed) return; // the view was left before the snapshot came
      append(entries);
      const after = lastSeq > 0 ? `?after=${lastSeq - 1}` : "";
      stopStream = stream(`${API}/workers/${encodeURIComponent(id)}/logs/stream${after}`, { logs: append }, poll);
    })
    .catch((error) => logs.append(el("div", { class: "line ERROR" }, `logs unavailable: ${error.message}`)));

  // What the registry said of this fellow: "loading" until its first answer, then "found"
  // (with its record), "unknown" (a 404: released, or never joined) or "failed".
  let answer = { kind: "loading" };
  let asking = false;
  const lookUp = () => {
    if (asking) return;
    asking = true;
    getJSON(`/workers/${encodeURIComponent(id)}`)
      .then((record) => (answer = { kind: "found", record }))
      .catch((error) => (answer = error.status === 404 ? { kind: "unknown" } : { kind: "failed", message: error.message }))
      .finally(() => {
        asking = false;
        if (!closed) refresh();
      });
  };
  const notice = (kind, message) => summary.replaceChildren(el("p", { class: "muted", "data-state": kind }, message));

  const refresh = () => {
    const listed = state.workers.find((x) => x.fellow_id === id);
    if (listed) answer = { kind: "found", record: listed };
    else if (state.loaded && answer.kind !== "unknown") lookUp(); // not listed: ask about it alone
    if (answer.kind === "loading") return notice("loading", "Loading…");
    if (answer.kind === "unknown") return notice("unknown", "Not in the registry (released?).");
    if (answer.kind === "failed") return notice("failed", `Registry unavailable: ${answer.message}`);
    renderFellow(answer.record);
  };
  const renderFellow = (w) => {
    const hw = w.hardware;
    const job = state.jobs.find((j) => j.job_id === w.job_id && j.placement);
    const placed = job ? job.placement.stages.find((s) => s.fellow_id === id) : null;
    const children = [
      dl([
        ["status", w.status, "fellow-status"],
        ["host", w.hostname],
        ["pool", w.pool || "default", "fellow-pool"],
        ["labels", labelText(w.labels) || "-", "fellow-labels"],
        ["job", w.job_id || "-"],
        ["step / loss", `${w.step ?? "-"} / ${num(w.loss)}`],
        ["CPU", `${hw.cpu_cores} cores${hw.cpu_quota == null ? "" : ` (quota ${num(hw.cpu_quota, 2)})`}, ${num(hw.cpu_load_pct, 0)}% busy`, "fellow-cpu"],
        ["RAM free", `${gib(hw.ram_available_bytes)} of ${gib(hw.ram_total_bytes)}${hw.ram_limit_bytes == null ? "" : " (its limit)"}`, "fellow-ram"],
        ["host network", `sent ${rate(hw.net_sent_bytes_per_s)}, received ${rate(hw.net_recv_bytes_per_s)}`],
        ["VRAM used / free", gpuTotals(w)],
        ["layers", placed ? `[${placed.layer_start}, ${placed.layer_end}) of ${job.job_id}` : "-"],
      ]),
    ];
    if ((hw.gpus || []).length) {
      const slots = placed ? placed.gpu_slots : [];
      children.push(
        el(
          "table",
          {},
          el("thead", {}, el("tr", {}, ...["GPU", "name", "used", "free", "util", "temp", "layers"].map((h) => el("th", {}, h)))),
          el(
            "tbody",
            {},
            ...hw.gpus.map((g) => {
              const slot = slots.find((s) => s.gpu_uuid === g.uuid);
              return el(
                "tr",
                {},
                el("td", {}, g.index),
                el("td", {}, g.name),
                el("td", {}, gib(g.memory_used_bytes)),
                el("td", {}, gib(g.memory_free_bytes)),
                el("td", {}, g.utilization_pct === null ? "-" : `${g.utilization_pct}%`),
                el("td", {}, g.temperature_c === null ? "-" : `${g.temperature_c} °C`),
                el("td", {}, slot ? `[${slot.layer_start}, ${slot.layer_end})` : "-"),
              );
            }),
          ),
        ),
      );
    }
    children.push(linksTable(id));
    summary.replaceChildren(...children);
  };
  refresh();
  if (answer.kind === "loading") lookUp();
  return {
    root,
    refresh,
    stop: () => {
      closed = true;
      stopStream();
    },
  };
}

// The links measured between this fellow and others (by a job's boundary, or probed while
// both were idle), either end: what a "balanced" job is placed along.
function linksOf(id) {
  const rows = [];
  for (const w of state.workers) {
    for (const [peer, link] of Object.entries(w.links || {})) {
      if (w.fellow_id === id) rows.push({ peer, link });
      else if (peer === id) rows.push({ peer: w.fellow_id, link });
    }
  }
  return rows.sort((a, b) => a.peer.localeCompare(b.peer));
}

function linksTable(id) {
  const rows = linksOf(id);
  if (!rows.length) return el("p", { class: "muted", id: "fellow-links" }, "No link measured yet.");
  const when = (at) => (at === null || at === undefined ? "-" : new Date(at * 1000).toLocaleString());
  return el(
    "table",
    { id: "fellow-links" },
    el("thead", {}, el("tr", {}, ...["link to", "Mbit/s", "round trip", "measured"].map((h) => el("th", {}, h)))),
    el(
      "tbody",
      {},
      ...rows.map(({ peer, link }) =>
        el("tr", { "data-peer": peer }, el("td", {}, peer), el("td", {}, num(link.mbit_s, 1)), el("td", {}, `${num(link.rtt_ms, 2)} ms`), el("td", {}, when(link.measured_at))),
      ),
    ),
  );
}

function placementTable(placement) {
  if (!placement) return el("p", { class: "muted" }, "No placement.");
  // A job with replicas: a row per stage per replica, its replica first.
  const replicated = (placement.replica_slots || 0) > 1 || placement.stages.some((s) => s.replica);
  const headers = ["stage", "fellow", "layers", "GPU slots", "memory est. / offered"];
  return el(
    "table",
    { class: "placement" },
    el("thead", {}, el("tr", {}, ...(replicated ? ["replica", ...headers] : headers).map((h) => el("th", {}, h)))),
    el(
      "tbody",
      {},
      ...placement.stages.map((s) =>
        el(
          "tr",
          {},
          replicated ? el("td", {}, s.replica) : null,
          el("td", {}, s.stage),
          el("td", {}, s.fellow_id),
          el("td", {}, `[${s.layer_start}, ${s.layer_end})`),
          el("td", {}, s.gpu_slots.map((g) => `GPU ${g.gpu_index}: [${g.layer_start}, ${g.layer_end})`).join(", ") || "cpu"),
          el("td", {}, `${gib(s.memory_estimate_bytes)} / ${gib(s.memory_offered_bytes)}`),
        ),
      ),
    ),
  );
}

function leaderView() {
  const root = el("div", { "data-view": "leader" }, el("h2", {}, "Leader: cluster performance"));
  const body = el("div");
  root.append(body);
  const refresh = () => {
    const c = state.cluster;
    if (!c) return;
    const job = c.running_jobs[0];
    body.replaceChildren(
      dl([
        ["hosts online", c.hosts],
        ["CPU cores", c.cpu_cores, "cluster-cpu"],
        ["RAM", `${gib(c.ram_available_bytes)} free of ${gib(c.ram_total_bytes)}`, "cluster-ram"],
        ["GPUs", c.gpus],
        ["VRAM", `${gib(c.vram_free_bytes)} free of ${gib(c.vram_total_bytes)}`],
        ["network", `sent ${rate(c.net_sent_bytes_per_s)}, received ${rate(c.net_recv_bytes_per_s)}`],
        ["running jobs", c.running_jobs.length],
        ["step time", job ? `${num(job.step_time_s, 3)} s` : "-"],
        ["steps / minute", job ? num(job.steps_per_min, 0) : "-"],
        ["tokens / s", job ? num(job.tokens_per_s, 0) : "-"],
      ]),
      el("h2", {}, job ? `Placement of ${job.job_id}` : "Placement"),
      placementTable(job ? job.placement : null),
    );
  };
  refresh();
  return { root, refresh, stop: () => {} };
}

// --- the loss chart: inline SVG drawn here (no library: the UI works offline) ----------------

const CHART = { width: 540, height: 270, left: 52, right: 14, top: 32, bottom: 40 };
const MAX_DRAWN = 1500; // training points drawn at most (a long run is thinned evenly)

function niceTicks(lo, hi, count, integers = false) {
  // Round tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi], with the
  // decimals their labels need.
  if (!(hi > lo)) {
    const pad = Math.abs(lo) * 0.05 || 0.5;
    [lo, hi] = [lo - pad, hi + pad];
  }
  const raw = (hi - lo) / count;
  const power = 10 ** Math.floor(Math.log10(raw));
  let step = [1, 2, 5, 10].find((m) => m * power >= raw * (1 - 1e-9)) * power;
  if (integers) step = Math.max(1, Math.round(step));
  const decimals = integers ? 0 : Math.max(0, Math.ceil(-Math.log10(step) - 1e-9));
  const first = Math.floor(lo / step + 1e-9);
  const last = Math.ceil(hi / step - 1e-9);
  const values = [];
  for (let i = first; i <= last; i++) values.push(Number((i * step).toFixed(decimals)));
  return { lo: first * step, hi: last * step, values, decimals };
}

const compact = new Intl.NumberFormat("en", { notation: "compact", maximumFractionDigits: 1 });
const stepLabel = (step) => (step >= 10000 ? compact.format(step) : String(step));

function chartText(attrs, content) {
  const node = svgEl("text", attrs);
  node.textContent = content;
  return node;
}

function lossSummary(train, val) {
  if (!train.length && !val.length) return "Loss chart: no steps yet";
  const parts = [];
  if (train.length) {
    const [step, loss] = train[train.length - 1];
    parts.push(`training loss ${num(loss)} at step ${step}`);
  }
  parts.push(val.length ? `validation loss ${num(val[val.length - 1][1])} at step ${val[val.length - 1][0]}` : "no validation yet");
  return `Loss chart: ${parts.join(", ")}`;
}

function drawLossChart(chart, train, val) {
  // ``train``: [step, loss] of every finished step; ``val``: [step, validation loss].
  const summary = lossSummary(train, val);
  chart.setAttribute("aria-label", summary);
  const title = svgEl("title");
  title.textContent = summary;
  const path = svgEl("path", { class: "train-loss", "data-points": train.length });
  if (!train.length && !val.length) {
    const { width, height } = CHART;
    chart.replaceChildren(title, path, chartText({ class: "empty", x: width / 2, y: height / 2, "text-anchor": "middle" }, "waiting for the first step…"));
    return;
  }
  // Loops, not Math.min(...array): a long run has more points than arguments fit.
  let [x0, x1, y0, y1] = [Infinity, -Infinity, Infinity, -Infinity];
  for (const series of [train, val]) {
    for (const [step, loss] of series) {
      x0 = Math.min(x0, step);
      x1 = Math.max(x1, step);
      y0 = Math.min(y0, loss);
      y1 = Math.max(y1, loss);
    }
  }
  const xs = niceTicks(x0, x1, 6, true);
  const ys = niceTicks(y0, y1, 5);
  const { width, height, left, right, top, bottom } = CHART;
  const [plotW, plotH] = [width - left - right, height - top - bottom];
  const x = (step) => left + (plotW * (step - xs.lo)) / (xs.hi - xs.lo);
  const y = (loss) => top + plotH - (plotH * (loss - ys.lo)) / (ys.hi - ys.lo);

  const axes = svgEl("g", { class: "axes" });
  for (const value of ys.values) {
    const at = y(value).toFixed(1);
    axes.append(
      svgEl("line", { class: "grid", x1: left, x2: width - right, y1: at, y2: at }),
      chartText({ class: "tick-label y-tick", x: left - 6, y: at, dy: "0.32em", "text-anchor": "end" }, value.toFixed(ys.decimals)),
    );
  }
  for (const value of xs.values) {
    const at = x(value).toFixed(1);
    axes.append(
      svgEl("line", { class: "tick", x1: at, x2: at, y1: top + plotH, y2: top + plotH + 4 }),
      chartText({ class: "tick-label x-tick", x: at, y: top + plotH + 16, "text-anchor": "middle" }, stepLabel(value)),
    );
  }
  axes.append(
    svgEl("line", { class: "axis x-axis", x1: left, x2: width - right, y1: top + plotH, y2: top + plotH }),
    svgEl("line", { class: "axis y-axis", x1: left, x2: left, y1: top, y2: top + plotH }),
    chartText({ class: "axis-title", x: left + plotW / 2, y: height - 6, "text-anchor": "middle" }, "step"),
    chartText({ class: "axis-title", x: 14, y: top + plotH / 2, "text-anchor": "middle", transform: `rotate(-90 14 ${top + plotH / 2})` }, "loss"),
  );

  const every = Math.max(1, Math.ceil(train.length / MAX_DRAWN));
  const shown = train.filter((_, i) => i % every === 0 || i === train.length - 1);
  path.setAttribute("d", shown.map(([s, l], i) => `${i ? "L" : "M"}${x(s).toFixed(1)},${y(l).toFixed(1)}`).join(""));

  const points = svgEl("g", { class: "val-points", "data-points": val.length });
  for (const [step, loss] of val) {
    const dot = svgEl("circle", { class: "val-point", cx: x(step).toFixed(1), cy: y(loss).toFixed(1), r: 4 });
    const tip = svgEl("title");
    tip.textContent = `step ${step}: validation loss ${num(loss)}`;
    dot.append(tip);
    points.append(dot);
  }

  const legend = svgEl("g", { class: "legend", transform: `translate(${left + 8} 14)` });
  legend.append(
    svgEl("line", { class: "train-loss", x1: 0, x2: 20, y1: 0, y2: 0 }),
    chartText({ x: 26, y: 0, dy: "0.32em" }, "training loss"),
    svgEl("circle", { class: "val-point", cx: 130, cy: 0, r: 4 }),
    chartText({ x: 140, y: 0, dy: "0.32em" }, "validation loss"),
  );
  chart.replaceChildren(title, axes, path, points, legend);
}

function jobView(id) {
  const root = el("div", { "data-view": "job" }, el("h2", {}, `Job ${id}`));
  const summary = el("div");
  const chart = svgEl("svg", { id: "chart", role: "img", viewBox: `0 0 ${CHART.width} ${CHART.height}` });
  const placement = el("div");
  root.append(summary, el("h2", {}, "Loss"), chart, el("h2", {}, "Placement"), placement);
  const train = []; // [step, loss] of every finished step, in step order
  const val = []; // [step, validation loss]
  let live = null; // the stream's latest metrics: ahead of the job record the overview polls
  let stopStream = () => {};
  let drawing = false;

  const draw = () => {
    // Many points come at once (the history): draw once after them.
    if (drawing) return;
    drawing = true;
    queueMicrotask(() => {
      drawing = false;
      drawLossChart(chart, train, val);
    });
  };
  const add = (step, loss) => {
    if (loss === null || loss === undefined) return;
    if (train.length && step <= train[train.length - 1][0]) return;
    train.push([step, loss]);
    draw();
  };
  const addVal = (step, loss) => {
    // The live stream repeats the latest validation loss with every step, and the final
    // one (from the job record) may come before the history: a point per new value, kept
    // in step order.
    if (loss === null || loss === undefined) return;
    if (val.some(([s, l]) => s === step || l === loss)) return;
    const at = val.findIndex(([s]) => s > step);
    val.splice(at < 0 ? val.length : at, 0, [step, loss]);
    draw();
  };
  const loadHistory = () =>
    getJSON(`/jobs/${encodeURIComponent(id)}/metrics/history`).then((history) => {
      for (const p of history) {
        add(p.step, p.loss);
        addVal(p.step, p.val_loss);
      }
    });
  let closed = false;
  loadHistory()
    .catch(() => {})
    .finally(() => {
      if (closed) return;
      stopStream = stream(
        `${API}/jobs/${encodeURIComponent(id)}/metrics/stream`,
        {
          metrics: (metrics) => {
            // The losses are the last stage's: plotted at its step, as the history has them
            // (the pipeline's step, the slowest stage's, may lag it by one).
            const head = (metrics.fellows || []).reduce((a, b) => (a && a.stage > b.stage ? a : b), null);
            const step = head ? head.step : metrics.step;
            add(step, metrics.loss);
            addVal(step, metrics.val_loss);
            live = metrics;
            refresh();
          },
          end: () => {
            stopStream();
            loadHistory();
          },
        },
        loadHistory,
      );
    });
  drawLossChart(chart, train, val);

  const refresh = () => {
    const job = state.jobs.find((j) => j.job_id === id);
    if (!job) {
      summary.replaceChildren(el("p", { class: "muted", "data-state": state.loaded ? "unknown" : "loading" }, state.loaded ? "Unknown job." : "Loading…"));
      return;
    }
    // While it runs, the live stream's numbers when they are newer (the same rule computes
    // both: swarm/types/views.py).
    const fresh = job.state === "RUNNING" && live && live.attempt === job.attempt && live.step >= (job.view?.step ?? 0);
    const view = fresh ? live : job.view || {};
    // The validation after the last step is in the job's record, not in its step history.
    if (job.final_val_loss !== null && job.final_val_loss !== undefined) {
      addVal(view.total_steps ?? job.spec.steps, job.final_val_loss);
    }
    summary.replaceChildren(
      dl([
        ["state", job.state, "job-state"],
        ["attempt", job.attempt],
        ["owner", job.owner || "operator", "job-owner"],
        ["pool", jobPool(job.spec), "job-pool"],
        ["step", `${view.step ?? 0} of ${view.total_steps ?? job.spec.steps}`, "job-step"],
        ["loss", num(view.loss ?? (train.length ? train[train.length - 1][1] : null)), "job-loss"],
        ["validation loss", num(view.val_loss), "job-val-loss"],
        ["reason", job.reason || "-", "job-reason"],
      ]),
    );
    placement.replaceChildren(placementTable(job.placement));
  };
  refresh();
  return {
    root,
    refresh,
    stop: () => {
      closed = true;
      stopStream();
    },
  };
}

// --- joining ---------------------------------------------------------------------------------

// Which account the token in this tab stands for (any account's token works here; only an
// admin's creates join sessions), shown on the token's label.
async function showSignedIn() {
  const label = document.querySelector('label[for="token"]');
  if (!label) return;
  if (!sessionStorage.getItem("swarm-token")) {
    label.textContent = "API token (kept in this tab only)";
    return;
  }
  try {
    const me = await getJSON("/auth/whoami");
    const who = me.operator ? "the operator token" : `account ${me.name}`;
    label.textContent = `API token: ${who} (${me.role}), kept in this tab only`;
  } catch (error) {
    label.textContent = `API token (not accepted: ${error.message}), kept in this tab only`;
  }
}

function setUpJoin() {
  const token = document.getElementById("token");
  const result = document.getElementById("join-result");
  const list = document.getElementById("join-sessions");
  token.value = sessionStorage.getItem("swarm-token") || "";
  token.addEventListener("change", () => {
    sessionStorage.setItem("swarm-token", token.value);
    showSignedIn();
  });
  showSignedIn();
  document.getElementById("create-join").addEventListener("click", async () => {
    sessionStorage.setItem("swarm-token", token.value);
    const response = await fetch(`${API}/bootstrap/join-sessions`, {
      method: "POST",
      headers: { ...authHeaders(), "content-type": "application/json" },
      body: "{}",
    });
    const body = await response.json().catch(() => ({}));
    result.textContent = response.ok
      ? `Run on the new machine (single use, until ${new Date(body.expires_at * 1000).toLocaleTimeString()}):\n${body.command}`
      : `${response.status}: ${body.message || "refused"}`;
    listSessions();
  });
  const listSessions = () =>
    getJSON("/bootstrap/join-sessions")
      .then((sessions) => {
        list.replaceChildren(
          ...sessions
            .slice(-10)
            .reverse()
            .map((s) =>
              el(
                "li",
                { "data-session": s.session_id, onclick: () => showSessionLog(s.session_id) },
                `${s.session_id} · ${s.status}${s.fellow_name ? ` · ${s.fellow_name}` : ""} · ${s.log_lines} log lines`,
              ),
            ),
        );
      })
      .catch(() => {});
  listSessions();
  setInterval(listSessions, 5000);
}

function showSessionLog(sessionId) {
  const pane = document.getElementById("detail");
  if (state.detail) state.detail.stop();
  const logs = el("div", { id: "logs" });
  pane.replaceChildren(el("div", { "data-view": "join" }, el("h2", {}, `Join session ${sessionId}`), logs));
  const stop = stream(
    `${API}/bootstrap/join-sessions/${encodeURIComponent(sessionId)}/logs/stream`,
    {
      log: (line) => logs.append(el("div", { class: "line" }, line.line)),
      end: (session) => {
        logs.append(el("div", { class: "line" }, `— ${session.status} ${session.reason || ""}`));
        stop();
      },
    },
    () => {},
  );
  state.detail = { stop, refresh: null };
}

setUpJoin();
window.addEventListener("resize", renderGraph);
openDetail();
refresh();
setInterval(refresh, REFRESH_MS);
