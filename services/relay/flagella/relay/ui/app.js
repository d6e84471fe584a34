// The flows page: live flows from the relay (Server-Sent Events of
// /api/flows, each one `flagella observe -o json` line), a service map built
// from them and a filterable table. Plain JS and SVG: nothing to build,
// nothing fetched from anywhere but the relay.
"use strict";

const MAX_FLOWS = 1000; // kept, newest first
const MAX_ROWS = 200; // shown in the table
const SVG = "http://www.w3.org/2000/svg";
const SPECIAL = {
  "reserved:world": "world",
  "reserved:host": "host",
  "reserved:remote-node": "remote-node",
  "reserved:health": "health",
  "reserved:kube-apiserver": "kube-apiserver",
  "reserved:unmanaged": "unmanaged",
  "reserved:init": "init",
};
const WORKLOAD_LABELS = /^k8s:(app\.kubernetes\.io\/name|app|k8s-app|name)=(.+)$/;

const state = {
  flows: [], // Hubble flows, newest first
  nodes: new Map(), // map node id -> {id, label, sub, kind, pods:Set}
  edges: new Map(), // "src|dst|class" -> {src, dst, cls, count, reasons: Map}
  source: null,
  drawPending: false,
  relayNodes: new Map(), // cluster node -> state
  received: 0,
};

const $ = (id) => document.getElementById(id);

function el(name, attrs = {}, text = "") {
  const e = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text) e.textContent = text;
  return e;
}

// --- what a flow's ends are on the map ---

function verdictClass(verdict) {
  if (verdict === "FORWARDED") return "forwarded";
  if (verdict === "DROPPED") return "dropped";
  return "other"; // AUDIT, ERROR, ...
}

function endName(ep) {
  if (!ep) return "";
  if (ep.pod_name) return `${ep.namespace || ""}/${ep.pod_name}`;
  for (const l of ep.labels || []) if (SPECIAL[l]) return SPECIAL[l];
  return ep.identity ? `identity ${ep.identity}` : "";
}

function destinationName(flow) {
  const svc = flow.destination_service;
  if (svc && svc.name && !(flow.destination || {}).pod_name) {
    return `${svc.namespace ? `${svc.namespace}/` : ""}${svc.name} (service)`;
  }
  return endName(flow.destination);
}

// A map node: the pod's workload (its app label) or the pod; a reserved
// identity (world, host, remote-node ...); else the bare identity.
function mapNode(ep) {
  const labels = (ep && ep.labels) || [];
  if (ep && ep.pod_name) {
    let workload = "";
    for (const l of labels) {
      const m = WORKLOAD_LABELS.exec(l);
      if (m) { workload = m[2]; break; }
    }
    const ns = ep.namespace || "";
    const name = workload || ep.pod_name;
    return { id: `pod:${ns}/${name}`, label: name, sub: ns, kind: "pod", pod: ep.pod_name };
  }
  for (const l of labels) {
    if (SPECIAL[l]) return { id: `special:${SPECIAL[l]}`, label: SPECIAL[l], sub: "", kind: "special" };
  }
  const ident = (ep && ep.identity) || 0;
  return { id: `identity:${ident}`, label: `identity ${ident}`, sub: "", kind: "special" };
}

function addNode(n) {
  let node = state.nodes.get(n.id);
  if (!node) {
    node = { id: n.id, label: n.label, sub: n.sub, kind: n.kind, pods: new Set(), out: 0, in: 0 };
    state.nodes.set(n.id, node);
  }
  if (n.pod) node.pods.add(n.pod);
  return node;
}

function addEdge(src, dst, flow) {
  const cls = verdictClass(flow.verdict);
  const key = `${src.id}|${dst.id}|${cls}`;
  let edge = state.edges.get(key);
  if (!edge) {
    edge = { src: src.id, dst: dst.id, cls, count: 0, reasons: new Map() };
    state.edges.set(key, edge);
    src.out += 1;
    dst.in += 1;
  }
  edge.count += 1;
  if (cls === "dropped") {
    const reason = flow.drop_reason_desc || `reason ${flow.drop_reason || 0}`;
    edge.reasons.set(reason, (edge.reasons.get(reason) || 0) + 1);
  }
}

function addToMap(flow) {
  const src = addNode(mapNode(flow.source));
  const svc = flow.destination_service;
  if (!svc || !svc.name) {
    addEdge(src, addNode(mapNode(flow.destination)), flow);
    return;
  }
  // Sent to a service: the service is the destination (its address is the
  // frontend's), unless the flow names the pod behind it too.
  const s = addNode({ id: `svc:${svc.namespace || ""}/${svc.name}`, label: svc.name,
    sub: `service ${svc.namespace || ""}`.trim(), kind: "service" });
  addEdge(src, s, flow);
  if (flow.destination && flow.destination.pod_name) {
    addEdge(s, addNode(mapNode(flow.destination)), flow);
  }
}

// --- the map: columns by role (sources left, both middle, destinations
// right), each sorted by kind and name, so a given set of nodes always
// lands in the same place ---

const KIND_ORDER = { pod: 0, service: 1, special: 2 };

function layout(width, height) {
  const columns = [[], [], []];
  for (const n of state.nodes.values()) {
    const col = n.in === 0 ? 0 : n.out === 0 ? 2 : 1;
    columns[col].push(n);
  }
  const pos = new Map();
  columns.forEach((nodes, col) => {
    nodes.sort((a, b) => KIND_ORDER[a.kind] - KIND_ORDER[b.kind] || a.id.localeCompare(b.id));
    const x = 90 + (col * (width - 180)) / 2;
    nodes.forEach((n, i) => pos.set(n.id, { x, y: ((i + 1) * height) / (nodes.length + 1) }));
  });
  return pos;
}

function edgeText(e, nodes) {
  const what = { forwarded: "forwarded", dropped: "dropped", other: "audit / other" }[e.cls];
  const lines = [`${nodes.get(e.src).label} → ${nodes.get(e.dst).label}: ${e.count} ${what}`];
  for (const [reason, n] of [...e.reasons].sort((a, b) => b[1] - a[1])) {
    lines.push(`${reason} × ${n}`);
  }
  return lines.join("\n");
}

function drawMap() {
  state.drawPending = false;
  const svg = $("map");
  const width = svg.clientWidth || 900;
  const height = svg.clientHeight || 420;
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.replaceChildren();
  const defs = el("defs");
  const marker = el("marker", { id: "arrow", viewBox: "0 0 10 10", refX: "10", refY: "5",
    markerWidth: "7", markerHeight: "7", orient: "auto-start-reverse" });
  marker.append(el("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "#57606a" }));
  defs.append(marker);
  svg.append(defs);
  const pos = layout(width, height);
  const bend = { forwarded: 0, dropped: 45, other: -45 };
  const tooltip = $("tooltip");
  for (const e of state.edges.values()) {
    const a = pos.get(e.src), b = pos.get(e.dst);
    const dx = b.x - a.x, dy = b.y - a.y;
    const len = Math.hypot(dx, dy) || 1;
    // Leave the boxes (about 70 x 18 from their centres) at both ends.
    const trim = Math.min(len / 3, Math.abs(dx) > Math.abs(dy) ? 72 : 22);
    const sx = a.x + (dx / len) * trim, sy = a.y + (dy / len) * trim;
    const tx = b.x - (dx / len) * trim, ty = b.y - (dy / len) * trim;
    const k = bend[e.cls] + (a.x === b.x ? 60 : 0);
    const cx = (sx + tx) / 2 - (dy / len) * k, cy = (sy + ty) / 2 + (dx / len) * k;
    const text = edgeText(e, state.nodes);
    const path = el("path", { class: `edge ${e.cls}`, d: `M ${sx} ${sy} Q ${cx} ${cy} ${tx} ${ty}`,
      "data-src": e.src, "data-dst": e.dst, "data-verdict": e.cls, "data-count": e.count,
      "data-reasons": [...e.reasons.keys()].join(",") });
    path.append(el("title", {}, text));
    path.addEventListener("mousemove", (ev) => {
      const box = svg.parentElement.getBoundingClientRect();
      tooltip.textContent = text;
      tooltip.style.left = `${ev.clientX - box.left + 12}px`;
      tooltip.style.top = `${ev.clientY - box.top + 12}px`;
      tooltip.hidden = false;
    });
    path.addEventListener("mouseleave", () => { tooltip.hidden = true; });
    svg.append(path);
  }
  for (const n of state.nodes.values()) {
    const p = pos.get(n.id);
    const g = el("g", { class: `node ${n.kind}`, "data-id": n.id,
      "data-pods": [...n.pods].sort().join(","), transform: `translate(${p.x} ${p.y})` });
    g.append(el("rect", { x: -70, y: -18, width: 140, height: n.sub ? 36 : 26 }));
    g.append(el("text", { y: n.sub ? -5 : -5 + 0 }, n.label));
    if (n.sub) g.append(el("text", { class: "sub", y: 10 }, n.sub));
    const pods = [...n.pods].sort();
    g.append(el("title", {}, pods.length ? `${n.label}: ${pods.join(", ")}` : n.label));
    svg.append(g);
  }
}

function scheduleDraw() {
  if (!state.drawPending) {
    state.drawPending = true;
    setTimeout(() => { drawMap(); drawTable(); }, 250);
  }
}

// --- the table ---

function filters() {
  const f = Object.fromEntries(new FormData($("filters")));
  for (const k of Object.keys(f)) f[k] = f[k].trim();
  return f;
}

function podMatches(spec, ep) {
  if (!ep || !ep.pod_name) return false;
  const slash = spec.lastIndexOf("/");
  if (slash >= 0 && spec.slice(0, slash) !== (ep.namespace || "")) return false;
  return ep.pod_name.startsWith(spec.slice(slash + 1));
}

function protocolOf(flow) {
  return Object.keys(flow.l4 || {})[0] || "";
}

function portsOf(flow) {
  const l4 = Object.values(flow.l4 || {})[0] || {};
  return [l4.source_port, l4.destination_port].filter((p) => p);
}

function matches(flow, f) {
  const ends = [flow.source, flow.destination];
  if (f.verdict && flow.verdict !== f.verdict) return false;
  if (f.pod && !ends.some((ep) => podMatches(f.pod, ep))) return false;
  if (f.namespace && !ends.some((ep) => ep && ep.namespace === f.namespace)) return false;
  if (f.port && !portsOf(flow).includes(Number(f.port))) return false;
  if (f.protocol && protocolOf(flow) !== f.protocol) return false;
  if (f.reason) {
    const want = f.reason.toUpperCase();
    const desc = (flow.drop_reason_desc || "").toUpperCase();
    if (!desc.includes(want) && String(flow.drop_reason || "") !== f.reason) return false;
  }
  return true;
}

function cell(row, text, cls = "") {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
}

function drawTable() {
  const f = filters();
  const shown = [];
  let matching = 0;
  for (const flow of state.flows) {
    if (!matches(flow, f)) continue;
    matching += 1;
    if (shown.length < MAX_ROWS) shown.push(flow);
  }
  const body = $("flows").tBodies[0];
  body.replaceChildren();
  for (const flow of shown) {
    const row = body.insertRow();
    const v = flow.verdict || "";
    row.className = `flow-row ${v === "FORWARDED" || v === "DROPPED" ? v : "other"}`;
    const l4 = Object.values(flow.l4 || {})[0] || {};
    cell(row, (flow.time || "").replace("T", " ").replace(/(\.\d{3})\d*Z$/, "$1"), "time");
    cell(row, v, "verdict");
    cell(row, endName(flow.source), "source");
    cell(row, destinationName(flow), "destination");
    cell(row, l4.destination_port ? String(l4.destination_port) : "", "port");
    cell(row, protocolOf(flow), "protocol");
    cell(row, flow.drop_reason_desc || "", "reason");
    cell(row, flow.node_name || "", "node");
  }
  $("count").textContent = `${matching} of ${state.flows.length} (newest first)`;
}

// --- the live stream ---

function showNodes() {
  const parts = [...state.relayNodes].sort().map(([n, s]) => `${n} ${s}`);
  $("nodes").textContent = parts.length ? `nodes: ${parts.join(", ")}` : "";
}

function addNamespace(ns) {
  const select = $("namespace");
  if (!ns || [...select.options].some((o) => o.value === ns)) return;
  select.append(new Option(ns, ns));
}

function connect() {
  if (state.source) state.source.close();
  state.flows = [];
  state.nodes.clear();
  state.edges.clear();
  scheduleDraw();
  const ns = $("namespace").value;
  const url = ns ? `api/flows?namespace=${encodeURIComponent(ns)}` : "api/flows";
  const source = new EventSource(url);
  state.source = source;
  const status = $("connection");
  source.onopen = () => { status.textContent = "live"; };
  source.onerror = () => { status.textContent = "reconnecting…"; };
  source.addEventListener("flow", (ev) => {
    const line = JSON.parse(ev.data);
    const flow = line.flow;
    state.received += 1;
    document.body.dataset.flowsReceived = String(state.received);
    state.flows.unshift(flow);
    if (state.flows.length > MAX_FLOWS) state.flows.length = MAX_FLOWS;
    addToMap(flow);
    addNamespace((flow.source || {}).namespace);
    addNamespace((flow.destination || {}).namespace);
    scheduleDraw();
  });
  source.addEventListener("node_status", (ev) => {
    const s = JSON.parse(ev.data).node_status;
    for (const n of s.node_names) {
      state.relayNodes.set(n, s.state_change === "NODE_CONNECTED" ? "connected" : "UNAVAILABLE");
    }
    showNodes();
  });
  source.addEventListener("lost_events", (ev) => {
    const line = JSON.parse(ev.data);
    status.textContent = `live; lost ${line.lost_events.num_events_lost} flows of node ${line.node_name}`;
  });
  source.addEventListener("failure", (ev) => {
    status.textContent = `relay: ${JSON.parse(ev.data).message}`;
  });
}

async function loadNamespaces() {
  try {
    const resp = await fetch("api/namespaces");
    const body = await resp.json();
    body.namespaces.forEach(addNamespace);
  } catch (e) {
    // The flows name their namespaces as they come.
  }
}

async function loadNodes() {
  try {
    const body = await (await fetch("api/nodes")).json();
    for (const n of body.nodes) state.relayNodes.set(n.name, n.state.toLowerCase());
    showNodes();
  } catch (e) {
    // Node status events fill it in.
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("namespace").addEventListener("change", connect);
  $("filters").addEventListener("input", drawTable);
  $("filters").addEventListener("change", drawTable);
  $("filters").addEventListener("submit", (ev) => ev.preventDefault());
  loadNamespaces();
  loadNodes();
  connect();
});
