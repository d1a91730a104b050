// The dashboard page: polls the read model (api/…) and draws what it returns. Figures arrive as plotly JSON and
// go to Plotly.react unchanged; tables are built with textContent (ids and reasons come from the log).
"use strict";

const POLL_MS = 3000;
const RUNS_POLL_MS = 10000;
const state = { runId: null, position: -1, executionId: null, treeKey: null, runs: [] };

const $ = (id) => document.getElementById(id);

function el(tag, text, attrs = {}) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function fmt(value, digits = 3) {
  if (value === null || value === undefined) return "—";
  if (typeof value === "number") return Number.isInteger(value) ? value.toLocaleString() : value.toFixed(digits);
  return String(value);
}

async function getJSON(path) {
  const response = await fetch(path, { credentials: "same-origin" });
  if (response.status === 204) return null;
  if (!response.ok) {
    let detail = response.statusText;
    try { detail = (await response.json()).detail || detail; } catch (_) { /* not JSON */ }
    throw new Error(`${response.status}: ${detail}`);
  }
  return response.json();
}

function setStatus(text, bad = false) {
  $("status").textContent = text;
  $("status").className = bad ? "bad" : "";
}

function api(...parts) {
  return "api/runs/" + parts.map(encodeURIComponent).join("/");
}

// ---- runs ----

async function loadRuns() {
  const runs = await getJSON("api/runs");
  state.runs = runs;
  const select = $("run-select");
  const chosen = state.runId || new URLSearchParams(location.hash.slice(1)).get("run") || (runs[0] || {}).run_id;
  select.replaceChildren(...runs.map((r) => {
    const option = el("option", `${r.run_id} (${r.events.toLocaleString()} events)`, { value: r.run_id });
    if (r.run_id === chosen) option.selected = true;
    return option;
  }));
  if (!runs.length) setStatus("no runs in the log yet");
  if (chosen && chosen !== state.runId) selectRun(chosen);
}

function selectRun(runId) {
  state.runId = runId;
  state.position = -1;
  state.executionId = null;
  state.treeKey = null;
  $("tree-panel").hidden = true;
  history.replaceState(null, "", "#run=" + encodeURIComponent(runId));
  loadRun();
}

async function loadRun() {
  if (!state.runId) return;
  try {
    const view = await getJSON(api(state.runId) + `?since=${state.position}`);
    $("live").classList.toggle("on", true);
    if (view === null) return;  // nothing new
    state.position = view.position;
    document.body.dataset.position = view.position;
    renderSummary(view.summary);
    Plotly.react("curves", view.curves.data, view.curves.layout, { responsive: true, displaylogo: false });
    Plotly.react("timeline", view.timeline.data, view.timeline.layout, { responsive: true, displaylogo: false });
    renderExecutions(view.executions);
    setStatus(`position ${view.position.toLocaleString()} · ${new Date().toLocaleTimeString()}`);
    if (state.executionId) openExecution(state.executionId, false);
  } catch (err) {
    $("live").classList.toggle("on", false);
    setStatus(String(err.message || err), true);
  }
}

function renderSummary(s) {
  const executions = Object.entries(s.executions).map(([k, v]) => `${v} ${k}`).join(", ") || "none yet";
  const branches = Object.entries(s.branches).map(([k, v]) => `${k} ${v}`).join(", ") || "none";
  const cards = [
    ["steps", s.steps], ["last reward", fmt(s.reward_last)], ["last pass rate", fmt(s.pass_rate_last)],
    ["executions", executions], ["branches", branches], ["dedup", s.dedup_factor ? `×${fmt(s.dedup_factor, 2)}` : "—"],
    ["trajectories (cap)", `${s.trajectories_before_cap} → ${s.trajectories_after_cap}`],
    ["switches", s.switches], ["events", s.events], ["wall (s)", fmt(s.wall_s, 1)],
  ];
  $("summary").replaceChildren(...cards.map(([label, value]) => {
    const card = el("div", null, { class: "card" });
    card.append(el("div", value, { class: "value" }), el("div", label, { class: "label" }));
    return card;
  }));
}

function renderExecutions(rows) {
  $("execution-count").textContent = `(${rows.length})`;
  const body = $("executions").tBodies[0];
  body.replaceChildren(...rows.map((r) => {
    const tr = el("tr", null, { "data-execution": r.execution_id, class: r.status.replace(" ", "-") });
    if (r.execution_id === state.executionId) tr.classList.add("selected");
    const branches = Object.entries(r.branches).map(([k, v]) => `${k} ${v}`).join(", ");
    for (const value of [r.execution_id, r.task_id, r.step, r.status + (r.stop_reason ? ` (${r.stop_reason})` : ""),
                         r.calls, r.prompt_tokens, r.completion_tokens, branches, fmt(r.reward), fmt(r.started_s, 1)]) {
      tr.append(el("td", value));
    }
    tr.addEventListener("click", () => openExecution(r.execution_id, true));
    return tr;
  }));
}

// ---- an execution ----

async function openExecution(executionId, userAction) {
  const runId = state.runId;
  try {
    const [tree, calls] = await Promise.all([
      getJSON(api(runId, "executions", executionId, "tree")),
      getJSON(api(runId, "executions", executionId, "calls")),
    ]);
    if (runId !== state.runId) return;
    state.executionId = executionId;
    for (const tr of $("executions").tBodies[0].rows) {
      tr.classList.toggle("selected", tr.dataset.execution === executionId);
    }
    $("tree-panel").hidden = false;
    const key = `${executionId}@${tree.digest}`;
    if (key === state.treeKey) return;  // unchanged since last drawn
    state.treeKey = key;
    renderTree(tree);
    renderCalls(calls);
    if (userAction) {
      $("call").hidden = true;
      $("tree-panel").scrollIntoView({ behavior: "smooth" });
    }
  } catch (err) {
    setStatus(String(err.message || err), true);
  }
}

function renderTree(tree) {
  const t = tree.stats;
  $("tree-title").textContent = `${tree.execution_id} · ${tree.status} · reward ${fmt(tree.reward)} · `
    + `${t.calls} calls, ${t.nodes} nodes, ${t.unique_tokens.toLocaleString()} unique of `
    + `${t.flat_tokens.toLocaleString()} flat tokens · ${tree.trajectories} trajectories, `
    + `${tree.trajectories_kept} kept by the cap (K = ${tree.cap_k})`;
  $("tree-legend").replaceChildren(
    ...Object.entries(tree.kinds).map(([kind, colour]) => {
      const item = el("span", kind, { class: "kind" });
      item.prepend(el("i", null, { style: `background:${colour}` }));
      return item;
    }),
    (() => { const i = el("span", "not trained (cut by the cap)", { class: "kind" });
      i.prepend(el("i", null, { style: "background:#d9d9d9" })); return i; })(),
  );
  const div = $("tree");
  Plotly.react(div, tree.figure.data, tree.figure.layout, { responsive: true, displaylogo: false });
  div.removeAllListeners && div.removeAllListeners("plotly_click");
  div.on("plotly_click", (event) => {
    const point = event.points && event.points[0];
    if (point && point.id && point.id !== "tree") showNode(tree.nodes[Number(point.id.slice(1))]);
  });
  document.body.dataset.tree = tree.execution_id;
}

function showNode(node) {
  const box = $("node");
  const dl = el("dl");
  for (const [k, v] of [["node", node.node], ["created by", `call ${node.call_index} (${node.kind}, chain ${node.chain})`],
                        ["tokens", node.tokens], ["generated", node.targets], ["starts at depth", node.depth],
                        ["trajectories through it", node.trajectories], ["trains", node.trains ? "yes" : "no"]]) {
    dl.append(el("dt", k), el("dd", v));
  }
  const link = el("a", `recorded call ${node.call_index} →`, { href: "#", id: "node-call-link" });
  link.addEventListener("click", (e) => { e.preventDefault(); openCall(node.call_index); });
  box.replaceChildren(el("h3", `node ${node.node}`), dl, link);
}

function renderCalls(calls) {
  $("calls").tBodies[0].replaceChildren(...calls.map((c) => {
    const tr = el("tr", null, { "data-call": c.call_index });
    for (const value of [c.call_index, c.chain_id, c.branch_hint || "", c.prompt_tokens, c.new_prompt_tokens,
                         c.completion_tokens, c.policy_version, c.cell_id, fmt(c.latency_s), c.finish_reason]) {
      tr.append(el("td", value));
    }
    tr.addEventListener("click", () => openCall(c.call_index));
    return tr;
  }));
}

async function openCall(callIndex) {
  try {
    const call = await getJSON(api(state.runId, "executions", state.executionId, "calls", callIndex));
    for (const tr of $("calls").tBodies[0].rows) tr.classList.toggle("selected", Number(tr.dataset.call) === callIndex);
    const box = $("call");
    const dl = el("dl");
    for (const [k, v] of [["call", `${call.call_index} (${call.call_id})`], ["api", call.api],
                          ["prompt tokens", `${call.prompt_tokens} (${call.new_prompt_tokens} new after `
                            + `${call.parent_prefix_len} of call ${fmt(call.parent_call_index)})`],
                          ["completion tokens", call.completion_tokens], ["policy version", call.policy_version],
                          ["cell", call.cell_id], ["latency", `${fmt(call.latency_s)} s`],
                          ["finish", call.finish_reason], ["record", call.record]]) {
      dl.append(el("dt", k), el("dd", v));
    }
    const parts = [el("h3", `recorded call ${call.call_index}`), dl];
    if (call.completion_text !== undefined) {
      parts.push(el("h4", "new prompt"), el("pre", call.new_prompt_text), el("h4", "completion"),
                 el("pre", call.completion_text));
    } else {
      parts.push(el("h4", "completion token ids"), el("pre", call.completion.join(" ")));
    }
    box.replaceChildren(...parts);
    box.hidden = false;
    box.scrollIntoView({ behavior: "smooth", block: "nearest" });
  } catch (err) {
    setStatus(String(err.message || err), true);
  }
}

$("run-select").addEventListener("change", (e) => selectRun(e.target.value));
loadRuns().catch((err) => setStatus(String(err.message || err), true));
setInterval(loadRun, POLL_MS);
setInterval(() => loadRuns().catch(() => {}), RUNS_POLL_MS);
