// Metrics: live charts per engine instance from the gateway's own /metrics (the numbers a
// Prometheus scrape sees): generated tokens/s, running and waiting requests, KV-cache use.

import { list } from "../api.js";
import { sparkline } from "../chart.js";
import { h, replace } from "../dom.js";
import { number, percent } from "../format.js";
import { parseMetrics } from "../prom.js";
import { errorBox, showError } from "../widgets.js";

export const title = "Metrics";
const KEEP_S = 300;

export function create() {
  const error = errorBox();
  const total = h("div", { class: "cards" });
  const grid = h("div", { class: "cards" });
  const root = h("section", { "aria-labelledby": "metrics-h" },
    h("h1", { id: "metrics-h", tabindex: "-1" }, "Metrics"),
    h("p", { class: "muted" }, "Sampled from ", h("a", { href: "/metrics" }, "/metrics"),
      " every 2 s while this page is open; the last 5 minutes."),
    error, total, grid);
  const series = new Map();  // instance id -> {model, points: {tps, running, waiting, kv}}
  const overall = [];
  let last = null;  // {t, tokens: Map(instance -> generation_tokens_total)}
  let names = new Map();
  let namesAt = 0;

  async function sample() {
    const t = Date.now() / 1000;
    let samples;
    try {
      const resp = await fetch("/metrics");
      samples = parseMetrics(await resp.text());
      showError(error, null);
    } catch (err) {
      showError(error, err);
      return;
    }
    const by = (name) => new Map(samples.filter((s) => s.name === name)
      .map((s) => [s.labels.engine, { model: s.labels.model_name, value: s.value }]));
    const running = by("vllm:num_requests_running");
    const waiting = by("vllm:num_requests_waiting");
    const kv = by("vllm:kv_cache_usage_perc");
    const tokens = by("vllm:generation_tokens_total");
    let sum = 0;
    for (const [id, r] of running) {
      const s = series.get(id) ?? { model: r.model, tps: [], running: [], waiting: [], kv: [] };
      series.set(id, s);
      const before = last?.tokens.get(id);
      const now = tokens.get(id)?.value;
      const tps = before !== undefined && now !== undefined ? Math.max(0, (now - before) / (t - last.t)) : 0;
      sum += tps;
      s.tps.push([t, tps]);
      s.running.push([t, r.value]);
      s.waiting.push([t, waiting.get(id)?.value ?? 0]);
      s.kv.push([t, kv.get(id)?.value ?? 0]);
      s.seen = t;
    }
    overall.push([t, sum]);
    last = { t, tokens: new Map([...tokens].map(([id, v]) => [id, v.value])) };
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
        .catch(() => {});  // names are a nicety: /metrics alone is public
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
