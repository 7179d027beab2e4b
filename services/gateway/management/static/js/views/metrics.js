// Metrics: live charts per engine instance from the load each engine publishes a few times a
// second (GET /api/v1/loads: what the gateway routes by): generated tokens/s, running and
// waiting requests, KV-cache use. Prometheus scrapes the same figures from each engine's own
// /metrics (docs/observability.md); the browser can reach only the gateway.

import { list } from "../api.js";
import { sparkline } from "../chart.js";
import { h, replace } from "../dom.js";
import { number, percent } from "../format.js";
import { errorBox, showError } from "../widgets.js";

export const title = "Metrics";
const KEEP_S = 300;

export function create() {
  const error = errorBox();
  const total = h("div", { class: "cards" });
  const grid = h("div", { class: "cards" });
  const root = h("section", { "aria-labelledby": "metrics-h" },
    h("h1", { id: "metrics-h", tabindex: "-1" }, "Metrics"),
    h("p", { class: "muted" }, "Each engine's load, sampled every 2 s while this page is open; "
      + "the last 5 minutes. Prometheus and Grafana: see ", h("code", {}, "/metrics/targets"), "."),
    error, total, grid);
  const series = new Map();  // instance id -> {model, seen, tps, running, waiting, kv}
  const overall = [];
  let last = null;  // {t, tokens: Map(instance id -> generation_tokens)}
  let names = new Map();
  let namesAt = 0;

  async function sample() {
    const t = Date.now() / 1000;
    let loads;
    try {
      loads = await list("/api/v1/loads");
      showError(error, null);
    } catch (err) {
      showError(error, err);
      return;
    }
    let sum = 0;
    for (const load of loads) {
      const id = load.instance_id;
      const s = series.get(id) ?? { model: load.model_name, tps: [], running: [], waiting: [], kv: [] };
      series.set(id, s);
      const before = last?.tokens.get(id);
      const tps = before === undefined ? 0 : Math.max(0, (load.generation_tokens - before) / (t - last.t));
      sum += tps;
      s.tps.push([t, tps]);
      s.running.push([t, load.num_running]);
      s.waiting.push([t, load.num_waiting]);
      s.kv.push([t, load.kv_cache_usage]);
      s.seen = t;
    }
    overall.push([t, sum]);
    last = { t, tokens: new Map(loads.map((l) => [l.instance_id, l.generation_tokens])) };
    for (const [id, s] of series) {
      for (const key of ["tps", "running", "waiting", "kv"]) {
        while (s[key].length && s[key][0][0] < t - KEEP_S) s[key].shift();
      }
      if (s.seen < t - KEEP_S) series.delete(id);
    }
    while (overall.length && overall[0][0] < t - KEEP_S) overall.shift();
    if (t - namesAt > 10) {
      namesAt = t;
      list("/api/v1/instances").then((items) => { names = new Map(items.map((i) => [i.id, i.name])); })
        .catch(() => {});  // names are a nicety
    }
  }

  function render() {
    replace(total, h("article", { class: "card metric" },
      h("h2", {}, "All instances"),
      sparkline("Generated tokens/s", overall, (v) => number(v))));
    const live = [...series.entries()].filter(([, s]) => s.seen >= (overall.at(-1)?.[0] ?? 0));
    replace(grid, live.length ? live.map(([id, s]) => h("article", { class: "card metric", "data-engine": id },
      h("h2", {}, s.model, h("span", { class: "muted" }, ` · ${names.get(id) || id}`)),
      sparkline("Tokens/s", s.tps, (v) => number(v)),
      sparkline("Running requests", s.running, (v) => number(v, 0)),
      sparkline("Waiting requests", s.waiting, (v) => number(v, 0)),
      sparkline("KV cache", s.kv, (v) => percent(v, 1), 1)))
      : h("p", { class: "empty" }, "No engine instance is reporting. Deploy a model under Models."));
  }

  async function refresh() {
    await sample();
    if (!root.hidden) render();
  }

  return { root, refresh, interval: 2000, background: true };
}
