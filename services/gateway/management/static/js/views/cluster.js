// Cluster: every worker with its devices, state, heartbeat, labels and the instances it hosts.

import { list } from "../api.js";
import { h, replace } from "../dom.js";
import { ago, bytes, percent } from "../format.js";
import { badge, errorBox, meter, showError } from "../widgets.js";

export const title = "Cluster";

export function create() {
  const summary = h("p", { class: "summary", "aria-live": "polite" });
  const grid = h("div", { class: "cards" });
  const error = errorBox();
  const root = h("section", { "aria-labelledby": "cluster-h" },
    h("h1", { id: "cluster-h", tabindex: "-1" }, "Cluster"), summary, error, grid);

  async function refresh() {
    let workers;
    let instances;
    try {
      [workers, instances] = await Promise.all([list("/api/v1/workers"), list("/api/v1/instances")]);
      showError(error, null);
    } catch (err) {
      showError(error, err);
      return;
    }
    const ready = workers.filter((w) => w.state === "READY").length;
    const gpus = workers.reduce((n, w) => n + w.status.gpus.length, 0);
    const running = instances.filter((i) => i.state === "RUNNING").length;
    replace(summary, `${ready} of ${workers.length} workers ready · ${gpus} GPUs · `
      + `${running} of ${instances.length} instances running`);
    if (!workers.length) {
      replace(grid, h("p", { class: "empty" }, "No worker has registered yet. Start one with ",
        h("code", {}, "shoal worker"), "."));
      return;
    }
    replace(grid, workers.map((w) => workerCard(w, instances.filter(
      (i) => i.worker_id === w.id || i.subordinate_workers.some((s) => s.worker_id === w.id)))));
  }

  return { root, refresh, interval: 2000 };
}

function workerCard(w, instances) {
  const s = w.status;
  const labels = Object.entries(w.labels);
  return h("article", { class: "card worker", "data-worker": w.name, "aria-label": `Worker ${w.name}` },
    h("header", {},
      h("h2", {}, w.name),
      badge(w.state),
      w.simulated ? h("span", { class: "badge simulated" }, "simulated") : null),
    h("p", { class: "muted" }, w.hostname, " · heartbeat ",
      h("time", { datetime: w.last_heartbeat_at || "" }, ago(w.last_heartbeat_at))),
    w.state_message ? h("p", { class: "message" }, w.state_message) : null,
    labels.length ? h("ul", { class: "chips", "aria-label": "Labels" },
      labels.map(([k, v]) => h("li", {}, `${k}=${v}`))) : null,
    h("h3", {}, `CPU · ${s.cpu_cores} cores`),
    meter("Memory", s.memory_used, s.memory_total,
      `${bytes(s.memory_used)} of ${bytes(s.memory_total)}`),
    s.gpus.map((g) => h("div", { class: "gpu" },
      h("h3", {}, `GPU ${g.index} · ${g.name}`),
      meter(`GPU ${g.index} memory`, g.memory_used, g.memory_total,
        `${bytes(g.memory_used)} of ${bytes(g.memory_total)}`),
      g.utilization === null ? null : meter(`GPU ${g.index} utilisation`, g.utilization, 100,
        percent(g.utilization / 100)))),
    instances.length ? h("div", {},
      h("h3", {}, "Instances"),
      h("ul", { class: "plain" }, instances.map((i) => h("li", {}, badge(i.state), " ", i.name))))
      : h("p", { class: "muted" }, "No instances."));
}
