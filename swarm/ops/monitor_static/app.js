// swarm monitor: fetch /api/v1/state every `refresh` seconds and draw it. Text only goes through textContent:
// adapter names and the like come from peers, never trusted as HTML.
"use strict";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function ago(seconds) {
  if (seconds < 60) return `${Math.round(seconds)} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ${Math.round(seconds % 60)} s`;
  return `${Math.floor(seconds / 3600)} h ${Math.floor((seconds % 3600) / 60)} min`;
}

function bar(n, cell) {
  const node = el("div", { class: "bar" });
  node.style.gridTemplateColumns = `repeat(${n}, 1fr)`;
  for (let b = 0; b < n; b++) node.append(cell(b));
  return node;
}

function coverageBar(model) {
  return bar(model.num_blocks, (b) => {
    const online = model.blocks[b].online;
    const kind = online === 0 ? "c0" : online < model.replication ? "low" : "ok";
    return el("div", { class: `cell ${kind}`, title: `block ${b}: ${online} live server(s)` }, String(b));
  });
}

function spanBar(model, peer) {
  const standby = new Set(peer.standby_blocks);
  return bar(model.num_blocks, (b) => {
    const served = b >= peer.start && b < peer.end;
    const kind = served ? "span" : standby.has(b) ? "span standby" : "off";
    const title = served ? `serves block ${b}` : standby.has(b) ? `standby copy of block ${b}` : "";
    return el("div", { class: `cell ${kind}`, title }, String(b));
  });
}

function adaptersText(peer) {
  const parts = [];
  for (const [name, holding] of Object.entries(peer.adapters)) {
    const steps = [...new Set(Object.values(holding.steps))];
    const standby = [...new Set(Object.values(holding.standby))];
    let text = `${name}@${steps.join("/") || "-"}`;
    if (standby.length) text += ` (standby @${standby.join("/")})`;
    parts.push(text);
  }
  return parts.join(", ") || "-";
}

function mib(bytes) {
  return bytes >= 2 ** 30 ? `${(bytes / 2 ** 30).toFixed(1)} GiB` : `${Math.round(bytes / 2 ** 20)} MiB`;
}

function memoryCell(peer) {
  const m = peer.memory;
  if (!m) return el("td", {}, "-");
  const low = m.host_available < 0.1 * m.host_total;
  const title =
    `resident: ${mib(m.rss)} (daemon, DHT process, p2pd); machine: ${mib(m.host_available)} free of ${mib(m.host_total)}\n` +
    `kept span inputs: ${mib(m.kept_inputs)} of ${mib(m.kept_inputs_max)}\n` +
    `forward cache: ${mib(m.activation_cache)} of ${mib(m.activation_cache_max)}\n` +
    `generation sessions: ${mib(m.inference)} of ${mib(m.inference_max)}`;
  return el(
    "td",
    { class: low ? "memory low" : "memory", title },
    `${mib(m.rss)} · inputs ${mib(m.kept_inputs)}/${mib(m.kept_inputs_max)} · cache ${mib(m.activation_cache)}/${mib(m.activation_cache_max)}`,
  );
}

function movesCell(peer) {
  const moves = peer.moves || [];
  if (!moves.length) return el("td", { class: "moves" }, "0");
  const title = moves.map((m) => `${m.start}:${m.end} -> ${m.target_start}:${m.target_end}: ${m.reason}`).join("\n");
  return el("td", { class: "moves", title }, `${moves.length}`);
}

function peerRow(model, peer, now) {
  const state = peer.state + (peer.relayed ? " relayed" : "");
  const since = peer.state === "gone" ? `gone ${ago(now - peer.gone_since)} ago` : peer.up_since ? ago(now - peer.up_since) : "-";
  return el(
    "tr",
    { class: peer.state },
    el("td", {}, el("code", { title: peer.peer }, peer.short)),
    el("td", {}, el("span", { class: `state ${peer.state}` }, state)),
    el("td", { class: "bar-cell" }, spanBar(model, peer)),
    el("td", {}, `${peer.start}:${peer.end}`),
    el("td", {}, `${Math.round(peer.throughput)} tok/s`),
    el("td", {}, peer.weights || "-"),
    memoryCell(peer),
    el("td", {}, adaptersText(peer)),
    el("td", {}, peer.standby_blocks.length ? peer.standby_blocks.join(", ") : "-"),
    movesCell(peer),
    el("td", {}, since),
  );
}

function adapterRow(adapter) {
  const copies = Object.entries(adapter.copies).map(([b, n]) => `${b}:${n}`).join(" ");
  const rate = adapter.steps_per_minute === null ? "-" : adapter.steps_per_minute.toFixed(1);
  return el(
    "tr",
    {},
    el("td", {}, adapter.name),
    el("td", {}, adapter.committed === null ? `- (newest held: ${adapter.newest})` : String(adapter.committed)),
    el("td", {}, rate),
    el("td", {}, adapter.trainer || "-"),
    el("td", {}, copies),
    el("td", {}, recoveriesText(adapter)),
    el("td", {}, String(adapter.steps_lost)),
  );
}

function recoveriesText(adapter) {
  const recent = adapter.recoveries.map(
    (r) => `${r.peer.slice(0, 6)}..${r.peer.slice(-4)} failed during ${r.during} of step ${r.step + 1} (retried in ${r.seconds} s)`,
  );
  return recent.join("; ") || "none";
}

function modelCard(model, now) {
  const head = (...names) => el("tr", {}, names.map((n) => el("th", {}, n)));
  const card = el(
    "section",
    { class: "model", id: `model-${model.model}` },
    el(
      "h2",
      {},
      el("span", {}, `${model.model}: ${model.num_blocks} blocks, target replication ${model.replication}`),
      el("span", { class: `status ${model.status}` }, model.status),
    ),
  );
  if (model.problems.length) card.append(el("ul", { class: "problems" }, model.problems.map((p) => el("li", {}, p))));
  card.append(
    coverageBar(model),
    el("div", { class: "legend" }, "blocks by live servers: green at the target, amber under it, red none"),
    el("h3", {}, "peers"),
    el(
      "table",
      {},
      head("peer", "state", "blocks", "span", "throughput", "weights", "memory", "adapters", "standby copies", "moves (1 h)", "up"),
      model.peers.map((p) => peerRow(model, p, now)),
    ),
  );
  if (model.adapters.length) {
    card.append(
      el("h3", {}, "adapters in training"),
      el(
        "table",
        {},
        head(
          "adapter",
          "committed step",
          "steps / min",
          "trainer",
          "copies per block (block:copies)",
          "recent recoveries",
          "steps lost",
        ),
        model.adapters.map((a) => adapterRow(a)),
      ),
    );
  }
  return card;
}

function draw(state) {
  const now = Date.now() / 1000;
  const error = document.getElementById("error");
  error.hidden = !state.error;
  error.textContent = state.error || "";
  document.getElementById("updated").textContent = state.updated_at
    ? `observed ${ago(Math.max(0, now - state.updated_at))} ago, every ${state.refresh} s`
    : "not observed yet";
  document.getElementById("models").replaceChildren(...state.models.map((m) => modelCard(m, now)));
}

async function tick() {
  let refresh = 3;
  try {
    const reply = await fetch("/api/v1/state", { cache: "no-store" });
    const state = await reply.json();
    refresh = state.refresh;
    draw(state);
  } catch (e) {
    const error = document.getElementById("error");
    error.hidden = false;
    error.textContent = `the monitor does not answer (${e}): is \`swarm monitor\` still running?`;
  }
  setTimeout(tick, refresh * 1000);
}

tick();
