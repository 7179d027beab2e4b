// The dashboard's shell: one view per section (#/cluster, #/models, ...), each built once and
// kept, so a half-typed form or a conversation survives switching sections. A visible view
// refreshes on its interval; the metrics view samples in the background too.

import { apiKey, setApiKey } from "./api.js";
import { h, replace } from "./dom.js";
import * as cluster from "./views/cluster.js";
import * as keys from "./views/keys.js";
import * as metrics from "./views/metrics.js";
import * as models from "./views/models.js";
import * as playground from "./views/playground.js";

const VIEWS = { cluster, models, playground, keys, metrics };
const built = new Map();
const timers = new Map();
let current = null;

function view(name) {
  if (!built.has(name)) {
    const v = VIEWS[name].create();
    v.root.hidden = true;
    document.getElementById("main").append(v.root);
    built.set(name, v);
  }
  return built.get(name);
}

function schedule(name) {
  const v = view(name);
  clearInterval(timers.get(name));
  timers.set(name, setInterval(() => {
    if (!document.hidden && (name === current || v.background)) v.refresh();
  }, v.interval));
}

function show(name, focus) {
  if (!(name in VIEWS)) name = "cluster";
  for (const [n, v] of built) v.root.hidden = n !== name;
  const v = view(name);
  v.root.hidden = false;
  current = name;
  document.title = `${VIEWS[name].title} · Shoal`;
  for (const link of document.querySelectorAll("nav.sections a[data-view]")) {
    if (link.dataset.view === name) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  v.refresh();
  schedule(name);
  if (focus) v.root.querySelector("h1").focus();
}

function route(focus) {
  show(window.location.hash.replace(/^#\/?/, "") || "cluster", focus);
}

// ---------------------------------------------------------------- the API key
function keyStatus() {
  const box = document.getElementById("key-status");
  const key = apiKey();
  replace(box,
    h("span", { class: "muted" }, key ? `Key ${key.slice(0, 12)}…` : "No API key"),
    h("button", { type: "button", class: "secondary small", onclick: () => askForKey("") },
      key ? "Change key" : "Set key"),
    key ? h("button", { type: "button", class: "secondary small", onclick: () => setApiKey("", false) },
      "Forget") : null);
}

function askForKey(reason) {
  const dialog = document.getElementById("key-dialog");
  if (dialog.open) return;
  dialog.querySelector(".reason").textContent = reason;
  dialog.querySelector("input[name=key]").value = "";
  dialog.showModal();
}

function setUpKeyDialog() {
  const dialog = document.getElementById("key-dialog");
  const form = dialog.querySelector("form");
  dialog.querySelector("[data-close]").addEventListener("click", () => dialog.close());
  form.addEventListener("submit", (event) => {
    const key = form.elements.key.value.trim();
    if (!key) {
      event.preventDefault();
      return;
    }
    setApiKey(key, form.elements.remember.checked);
  });
  window.addEventListener("shoal:unauthorized", (event) => askForKey(event.detail.message));
  window.addEventListener("shoal:key-changed", () => {
    keyStatus();
    if (current) view(current).refresh();
  });
}

setUpKeyDialog();
keyStatus();
window.addEventListener("hashchange", () => route(true));
document.addEventListener("visibilitychange", () => {
  if (!document.hidden && current) view(current).refresh();
});
view("metrics");
schedule("metrics");
route(false);
