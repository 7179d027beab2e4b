// API keys: create (the secret is shown once: only its hash is stored) with a scope, list with
// scopes and limits, revoke. Limits are set with `shoal keys create/update` or PATCH /api/v1/keys.

import { api, list, setApiKey } from "../api.js";
import { h, replace } from "../dom.js";
import { dateTime } from "../format.js";
import { badge, confirmAction, copy, errorBox, showError, toast } from "../widgets.js";

export const title = "API keys";

export function create() {
  const name = h("input", { id: "key-name", required: true, pattern: "[A-Za-z0-9][A-Za-z0-9_.\\-]{0,62}",
    autocomplete: "off", spellcheck: "false" });
  const expires = h("input", { id: "key-expires", type: "datetime-local" });
  const scope = h("select", { id: "key-scope" },
    h("option", { value: "inference" }, "inference (OpenAI API only)"),
    h("option", { value: "admin" }, "admin (also manages the cluster)"));
  const formError = errorBox();
  const secretBox = h("div", { class: "secret", role: "status", "aria-live": "polite", hidden: true });
  const form = h("form", { class: "inline-form", "aria-label": "Create an API key" },
    h("div", { class: "field" }, h("label", { for: "key-name" }, "Name"), name),
    h("div", { class: "field" }, h("label", { for: "key-scope" }, "Scope"), scope),
    h("div", { class: "field" }, h("label", { for: "key-expires" }, "Expires (optional)"), expires),
    h("button", { type: "submit", class: "primary" }, "Create key"));
  const rows = h("tbody", {});
  const listError = errorBox();
  const table = h("div", { class: "table-wrap" }, h("table", {},
    h("caption", { class: "offscreen" }, "API keys"),
    h("thead", {}, h("tr", {}, ["Name", "Key", "Scope", "Limits", "Created", "Expires", "State", ""].map(
      (c) => h("th", { scope: "col" }, c)))),
    rows));
  // GET /api/v1/auth says whether this gateway requires keys; when it does not, say what that
  // means before anyone relies on a key to keep others out
  const openNotice = h("p", { class: "warning", id: "keys-open-notice", role: "note", hidden: true },
    h("strong", {}, "This gateway does not require API keys. "),
    "Requests without a key are still served with full access, the management API included; a key "
      + "that is sent is honoured (its scope, limits and usage). Set ",
    h("code", {}, "SHOAL_REQUIRE_API_KEY=true"), " on the gateway to require keys.");
  const root = h("section", { "aria-labelledby": "keys-h" },
    h("h1", { id: "keys-h", tabindex: "-1" }, "API keys"),
    h("p", { class: "muted" }, "Clients send a key as ", h("code", {}, "Authorization: Bearer <key>"),
      ". Keys are required when the gateway runs with ", h("code", {}, "SHOAL_REQUIRE_API_KEY=true"), "."),
    openNotice, form, formError, secretBox, listError, table);

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    showError(formError, null);
    const body = { name: name.value.trim(), scope: scope.value };
    if (expires.value) body.expires_at = new Date(expires.value).toISOString();
    try {
      const created = await api("POST", "/api/v1/keys", body);
      form.reset();
      showSecret(secretBox, created);
      refresh();
    } catch (err) {
      showError(formError, err);
    }
  });

  let shown = null;
  async function refresh() {
    let keys;
    try {
      const auth = await api("GET", "/api/v1/auth");
      openNotice.hidden = auth.keys_required;
      keys = await list("/api/v1/keys");
      showError(listError, null);
    } catch (err) {
      showError(listError, err);
      return;
    }
    const now = JSON.stringify(keys);
    if (now === shown) return;  // rebuilding the rows would take the focus off a Revoke button
    shown = now;
    replace(rows, keys.length ? keys.map((k) => keyRow(k, refresh, listError))
      : h("tr", {}, h("td", { colspan: 8, class: "muted" }, "No key yet.")));
  }

  return { root, refresh, interval: 10000 };
}

function keyRow(k, refresh, error) {
  const expired = k.expires_at && Date.parse(k.expires_at) <= Date.now();
  const state = k.revoked_at ? "REVOKED" : expired ? "EXPIRED" : "ACTIVE";
  const revoke = state === "REVOKED" ? null : h("button", {
    type: "button", class: "danger small", "aria-label": `Revoke ${k.name}`,
    onclick: async () => {
      const ok = await confirmAction({
        title: `Revoke ${k.name}?`,
        body: "Clients using this key are refused from now on (within the gateway's key cache "
          + "time). A revoked key cannot be restored.",
        confirm: "Revoke",
      });
      if (!ok) return;
      try {
        await api("DELETE", `/api/v1/keys/${k.id}`);
        toast(`Revoked ${k.name}`);
        await refresh();
        document.querySelector(`tr[data-key="${CSS.escape(k.name)}"] th`)?.focus();
      } catch (err) {
        showError(error, err);
      }
    },
  }, "Revoke");
  return h("tr", { "data-key": k.name },
    h("th", { scope: "row", tabindex: "-1" }, k.name),
    h("td", {}, h("code", {}, `${k.prefix}…`)),
    h("td", {}, k.scope),
    h("td", {}, limitsText(k.limits)),
    h("td", {}, dateTime(k.created_at)),
    h("td", {}, k.expires_at ? dateTime(k.expires_at) : "never"),
    h("td", {}, badge(state)),
    h("td", {}, revoke));
}

function limitsText(limits) {
  if (!limits || !limits.length) return "none";
  return limits.map((l) => `${l.model || "all models"}: ` + ["rpm", "tpm", "token_budget"]
    .filter((f) => l[f] != null).map((f) => `${f} ${l[f]}`).join(", ")).join("; ");
}

function showSecret(box, created) {
  box.hidden = false;
  replace(box,
    h("p", {}, h("strong", {}, `Key ${created.name} created.`),
      " Copy its secret now: it is shown only once."),
    h("code", { class: "secret-value", tabindex: "0" }, created.secret),
    h("div", { class: "actions" },
      h("button", { type: "button", class: "secondary", onclick: () => copy(created.secret) }, "Copy"),
      h("button", { type: "button", class: "secondary", onclick: () => {
        setApiKey(created.secret, false);
        toast("The dashboard now uses this key");
      } }, "Use in this dashboard"),
      h("button", { type: "button", class: "secondary", onclick: () => {
        box.hidden = true;
        replace(box);
      } }, "Done")));
}
