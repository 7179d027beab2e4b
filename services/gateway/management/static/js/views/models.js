// Models and their instances: state with the scheduler's reason or the engine's log tail,
// placement, progress while the engine prepares; deploy (with a dry run), scale, delete.

import { api, list } from "../api.js";
import { h, replace } from "../dom.js";
import { ago, bytes, dateTime, progressOf } from "../format.js";
import { badge, confirmAction, errorBox, showError, toast } from "../widgets.js";
import { deployForm } from "./deploy.js";

export const title = "Models";
const PREPARING = new Set(["DOWNLOADING", "STARTING"]);

export function create() {
  const error = errorBox();
  const listEl = h("div", { class: "model-list" });
  const cards = new Map();
  const form = deployForm({ onDeployed: () => { toggle(false); refresh(); } });
  form.root.id = "deploy-panel";
  form.root.hidden = true;
  const toggleButton = h("button", {
    class: "primary", "aria-expanded": "false", "aria-controls": "deploy-panel",
    onclick: () => toggle(form.root.hidden),
  }, "Deploy a model");
  const root = h("section", { "aria-labelledby": "models-h" },
    h("div", { class: "title-row" }, h("h1", { id: "models-h", tabindex: "-1" }, "Models"), toggleButton),
    form.root, error, listEl);

  function toggle(open) {
    form.root.hidden = !open;
    toggleButton.setAttribute("aria-expanded", String(open));
    if (open) form.focus();
  }

  async function refresh() {
    let models;
    let instances;
    let workers;
    try {
      [models, instances, workers] = await Promise.all([
        list("/api/v1/models"), list("/api/v1/instances"), list("/api/v1/workers")]);
      showError(error, null);
    } catch (err) {
      showError(error, err);
      return;
    }
    const names = new Map(workers.map((w) => [w.id, w.name]));
    for (const [id, card] of cards) {
      if (!models.some((m) => m.id === id)) {
        card.root.remove();
        cards.delete(id);
      }
    }
    if (!models.length) {
      replace(listEl, h("p", { class: "empty" }, "No model is deployed. Use “Deploy a model”."));
      return;
    }
    listEl.querySelector(".empty")?.remove();
    models.forEach((m, index) => {
      let card = cards.get(m.id);
      if (!card) {
        card = modelCard(refresh);
        cards.set(m.id, card);
      }
      card.update(m, instances.filter((i) => i.model_id === m.id), names);
      // the registry's order (by name); a card is moved only when it must, since moving a
      // node takes the focus away from whatever the user is on inside it
      const here = listEl.children[index];
      if (here !== card.root) listEl.insertBefore(card.root, here ?? null);
    });
  }

  return { root, refresh, interval: 2000 };
}

function modelCard(refresh) {
  let model = null;
  const heading = h("h2", {});
  const counts = h("span", { class: "counts" });
  const facts = h("dl", { class: "facts" });
  const instancesEl = h("ul", { class: "instances", "aria-label": "Instances" });
  const error = errorBox();
  const replicas = h("input", { type: "number", min: 0, max: 1024, step: 1, class: "narrow",
    inputmode: "numeric" });
  const replicasLabel = h("label", {}, "Replicas ", replicas);
  const scale = h("button", { type: "submit", class: "secondary" }, "Scale");
  const remove = h("button", { type: "button", class: "danger" }, "Delete");
  const scaleForm = h("form", { class: "inline" }, replicasLabel, scale);
  const root = h("article", { class: "card model" },
    h("header", {}, heading, counts),
    facts,
    h("div", { class: "actions" }, scaleForm, remove),
    error,
    h("h3", {}, "Instances"),
    instancesEl);

  scaleForm.addEventListener("submit", async (event) => {
    event.preventDefault();
    try {
      await api("PATCH", `/api/v1/models/${model.id}`,
        { version: model.version, replicas: Number(replicas.value) });
      replicas.dataset.dirty = "";
      toast(`${model.name}: ${replicas.value} replicas`);
      showError(error, null);
      refresh();
    } catch (err) {
      showError(error, err.status === 409
        ? { message: "The model changed meanwhile; look again and retry." } : err);
      refresh();
    }
  });
  replicas.addEventListener("input", () => { replicas.dataset.dirty = "1"; });

  remove.addEventListener("click", async () => {
    const ok = await confirmAction({
      title: `Delete ${model.name}?`,
      body: "Its instances stop and the model is removed from the registry. "
        + "Requests in flight are drained first.",
      confirm: "Delete",
    });
    if (!ok) return;
    try {
      await api("DELETE", `/api/v1/models/${model.id}`);
      toast(`Deleted ${model.name}`);
      refresh();
    } catch (err) {
      showError(error, err);
    }
  });

  function update(m, instances, workerNames) {
    model = m;
    root.dataset.model = m.name;
    root.setAttribute("aria-label", `Model ${m.name}`);
    replace(heading, m.name);
    const byState = {};
    for (const i of instances) byState[i.state] = (byState[i.state] || 0) + 1;
    replace(counts, Object.entries(byState).map(
      ([s, n]) => h("span", { class: `badge state-${s.toLowerCase()}` }, `${n} ${s}`)));
    const args = Object.entries(m.engine_args).filter(([, v]) => v !== null);
    replace(facts,
      fact("Source", h("code", {}, m.source)),
      fact("Device", m.device),
      fact("Placement", [m.placement_strategy,
        ...Object.entries(m.worker_selector).map(([k, v]) => `${k}=${v}`),
        m.gpu_type ? `GPU type ${m.gpu_type}` : null].filter(Boolean).join(" · ")),
      fact("Max length", m.max_model_len ?? "model's own"),
      m.backend !== "shoal" ? fact("Backend", [m.backend, m.backend_version,
        ...m.backend_parameters].filter(Boolean).join(" ")) : null,
      args.length ? fact("Engine", args.map(([k, v]) => `${k}=${v}`).join(", ")) : null,
      m.autoscaling ? fact("Autoscaling", autoscaleText(m)) : null);
    if (!replicas.dataset.dirty && document.activeElement !== replicas) replicas.value = m.replicas;
    replicas.setAttribute("aria-label", `Replicas of ${m.name}`);
    remove.setAttribute("aria-label", `Delete ${m.name}`);
    replace(instancesEl, instances.length ? instances.map((i) => instanceItem(i, workerNames))
      : h("li", { class: "muted" }, m.replicas ? "Waiting for the scheduler…" : "Scaled to zero."));
  }

  return { root, update };
}

/** The autoscaling bounds and target, and the scheduler's last decision with its reason. */
function autoscaleText(m) {
  const a = m.autoscaling;
  const target = a.metric === "kv_cache_usage" ? `KV-cache use ${Math.round(a.target * 100)}%`
    : `${a.target} waiting per instance`;
  const last = m.scale_events && m.scale_events.length ? m.scale_events[m.scale_events.length - 1]
    : null;
  return [`${a.min_replicas}–${a.max_replicas} replicas, target ${target}`,
    last ? ` · last: ${last.from_replicas} → ${last.to_replicas} (${last.reason}), `
      + dateTime(last.at) : ""].join("");
}

function fact(term, value) {
  return [h("dt", {}, term), h("dd", {}, value)];
}

function instanceItem(i, workerNames) {
  const claim = [...Object.values(i.claim.gpu_memory).map((b) => bytes(b)),
    i.claim.ram ? `${bytes(i.claim.ram)} RAM` : null].filter(Boolean).join(" + ");
  const placement = i.worker_id ? [
    [workerNames.get(i.worker_id) || i.worker_name || i.worker_id,
      ...i.subordinate_workers.map((s) => s.worker_name)].join(" + "),
    i.gpu_indexes.length ? `GPUs ${i.gpu_indexes.join(", ")}` : "CPU",
    `tp ${i.tp} · pp ${i.pp}`, claim ? `claims ${claim}` : null,
  ] : ["not placed"];
  const details = [...placement, i.restart_count ? `${i.restart_count} restarts` : null,
    `${i.state} ${ago(i.state_changed_at)}`].filter(Boolean).join(" · ");
  const progress = PREPARING.has(i.state) ? progressOf(i.state_message) : null;
  let message = null;
  if (i.state === "ERROR" && i.state_message) {
    message = h("pre", { class: "log", "aria-label": "Engine log tail" }, i.state_message);
  } else if (i.state_message) {
    message = h("p", { class: "message" }, i.state_message);
  }
  return h("li", { class: "instance", "data-instance": i.name, "data-state": i.state },
    h("div", { class: "instance-head" },
      h("strong", {}, i.name), badge(i.state), h("span", { class: "muted" }, details)),
    PREPARING.has(i.state) ? h("progress", {
      max: 1, value: progress ?? undefined, "aria-label": `${i.name} ${i.state.toLowerCase()}`,
    }) : null,
    message,
    i.warnings.map((w) => h("p", { class: "warning" }, w)));
}
