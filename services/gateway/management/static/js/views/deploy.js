// The deploy form: every ModelCreate field (from the OpenAPI document), a dry-run preview of the
// placement (POST /api/v1/models?dry_run=true: the scheduler's own decision, nothing written),
// then the deployment itself.

import { api } from "../api.js";
import { h, replace } from "../dom.js";
import { bytes } from "../format.js";
import { SchemaForm } from "../schema_form.js";
import { errorBox, showError, toast } from "../widgets.js";

const LAYOUT = [
  { names: ["name", "source", "replicas", "device", "max_model_len"] },
  { title: "Placement", names: ["placement_strategy", "worker_selector", "gpu_selector", "gpu_type",
    "distributed", "tp", "pp"] },
  { title: "Engine", names: ["dtype", "gpu_memory_utilization", "engine_args"] },
  { title: "Backend", names: ["backend", "backend_version", "backend_parameters",
    "backend_command", "backend_health_path", "env", "extended_kv_cache"] },
  { title: "Autoscaling", names: ["autoscaling"] },
  { title: "Other settings", names: "rest" },
];
const LABELS = {
  max_model_len: "Max model length",
  aliases: "Aliases (it answers to these too)",
  tp: "Tensor parallel (tp)",
  pp: "Pipeline parallel (pp)",
  gpu_memory_utilization: "GPU memory utilization",
  gpu_selector: "GPU selector",
  gpu_type: "GPU type",
  engine_args: "Engine settings",
  "engine_args.kv_cache_memory": "KV cache memory (bytes)",
  "engine_args.num_kv_blocks": "KV blocks",
  backend_parameters: "Backend parameters (raw flags)",
  backend_command: "Backend command (custom)",
  backend_health_path: "Health path (custom)",
  env: "Environment",
  autoscaling: "Autoscaling (replicas follow the load)",
  "autoscaling.min_replicas": "Fewest instances (0: scale to zero)",
  "autoscaling.max_replicas": "Most instances",
};

let openapi = null;
function schemas() {
  openapi ??= fetch("/openapi.json").then((r) => r.json()).then((d) => d.components.schemas);
  return openapi;
}

export function deployForm({ onDeployed }) {
  const error = errorBox();
  const preview = h("div", { class: "preview", role: "status", "aria-live": "polite" });
  const previewButton = h("button", { type: "button", class: "secondary" }, "Preview placement");
  const deployButton = h("button", { type: "submit", class: "primary" }, "Deploy");
  const slot = h("div", {}, h("p", { class: "muted" }, "Loading the form…"));
  const form = h("form", { class: "deploy", "aria-label": "Deploy a model", novalidate: true },
    h("h2", {}, "Deploy a model"), slot, error, preview,
    h("div", { class: "actions" }, previewButton, deployButton));
  let fields = null;

  schemas().then((all) => {
    fields = new SchemaForm(all.ModelCreate, all, { layout: LAYOUT, labels: LABELS,
      lines: ["backend_parameters", "env"] });  // a flag's value may hold commas
    replace(slot, fields.element);
  }).catch((err) => showError(error, err));

  function body() {
    fields.clearErrors();
    showError(error, null);
    return fields.value();
  }

  function fail(err) {
    if (err.param) fields.showError(err.param, err.message);
    showError(error, err);
  }

  previewButton.addEventListener("click", async () => {
    if (!fields) return;
    replace(preview, h("p", { class: "muted" }, "Asking the scheduler…"));
    try {
      renderPlan(preview, await api("POST", "/api/v1/models?dry_run=true", body()));
    } catch (err) {
      replace(preview);
      fail(err);
    }
  });

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (!fields) return;
    deployButton.disabled = true;
    try {
      const model = await api("POST", "/api/v1/models", body());
      toast(`Deploying ${model.name}`);
      replace(preview);
      onDeployed(model);
    } catch (err) {
      fail(err);
    } finally {
      deployButton.disabled = false;
    }
  });

  return { root: form, focus: () => form.querySelector("input, select")?.focus() };
}

function renderPlan(box, plan) {
  const p = plan.placement;
  if (!plan.fits) {
    replace(box, h("div", { class: "plan no-fit" },
      h("h3", {}, "It does not fit now"),
      h("p", {}, plan.message),
      h("p", { class: "muted" }, "Deployed anyway, its instance waits PENDING with this reason "
        + "until a worker can take it.")));
    return;
  }
  const claims = [
    ...Object.entries(p.claim.gpu_memory).map(([gpu, b]) => `${bytes(b)} of GPU ${gpu}`),
    p.claim.ram ? `${bytes(p.claim.ram)} of RAM` : null,
  ].filter(Boolean);
  replace(box, h("div", { class: "plan fits" },
    h("h3", {}, `Fits on ${plan.worker_name}`),
    h("dl", { class: "facts" },
      h("dt", {}, "GPUs"), h("dd", {}, p.gpu_indexes.length ? p.gpu_indexes.join(", ") : "none (CPU)"),
      h("dt", {}, "Parallel"), h("dd", {}, `tp ${p.tp} · pp ${p.pp}`),
      h("dt", {}, "Claims"), h("dd", {}, claims.join(", ") || "–"),
      p.subordinate_workers.length ? [h("dt", {}, "Also on"),
        h("dd", {}, p.subordinate_workers.map((s) => s.worker_name).join(", "))] : null),
    h("p", { class: "muted" }, plan.message)));
}
