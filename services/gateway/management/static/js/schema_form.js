// A form built from a JSON schema (the gateway's OpenAPI document), so the deploy form always has
// every field of ModelCreate with its type, bounds, default and description, and a new field on
// the server appears here without a change to the UI.

import { h, uid } from "./dom.js";

/** The schema behind a property: $ref followed, `X | null` unwrapped. */
export function resolve(schema, components) {
  let nullable = false;
  let s = schema;
  if (s.anyOf) {
    const others = s.anyOf.filter((x) => x.type !== "null");
    nullable = others.length < s.anyOf.length;
    s = { ...others[0], default: s.default, description: s.description, title: s.title };
  }
  if (s.$ref) {
    const target = components[s.$ref.split("/").pop()];
    s = { ...target, ...s, $ref: undefined };
  }
  return { schema: s, nullable };
}

function kindOf(s, nullable) {
  if (s.enum) return "enum";
  if (s.type === "boolean") return nullable ? "tristate" : "checkbox";
  if (s.type === "integer" || s.type === "number") return "number";
  if (s.type === "array") return "list";
  if (s.type === "object" && s.properties) return "object";
  if (s.type === "object") return "map";
  return "text";
}

function humanize(name) {
  const text = name.replace(/_/g, " ");
  return text.charAt(0).toUpperCase() + text.slice(1);
}

export class SchemaForm {
  /** `layout`: [{title, names: [...] | "rest", open}]; `labels`: field name -> label text;
   * `lines`: list and map fields entered one item per line (a textarea), for values that may
   * hold commas (a backend flag's JSON, VLLM_CPU_OMP_THREADS_BIND=0-3,6). */
  constructor(schema, components, { layout, labels = {}, lines = [] }) {
    this.components = components;
    this.labels = labels;
    this.lines = new Set(lines);
    this.fields = [];
    const required = new Set(schema.required || []);
    const names = Object.keys(schema.properties);
    const placed = new Set(layout.flatMap((g) => (g.names === "rest" ? [] : g.names)));
    this.element = h("div", { class: "schema-form" }, layout.map((group) => {
      const own = group.names === "rest" ? names.filter((n) => !placed.has(n))
        : group.names.filter((n) => n in schema.properties);
      const body = own.map((n) => this.field([n], schema.properties[n], required.has(n)));
      if (!body.length) return null;
      if (!group.title) return h("div", { class: "field-grid" }, body);
      return h("details", { class: "group", open: group.open },
        h("summary", {}, group.title), h("div", { class: "field-grid" }, body));
    }));
  }

  field(path, raw, required) {
    const { schema: s, nullable } = resolve(raw, this.components);
    const name = path.join(".");
    const kind = kindOf(s, nullable);
    const label = this.labels[name] || humanize(path[path.length - 1]);
    if (kind === "object") {
      // an optional group (autoscaling: X | null) requires nothing until the user fills it in
      const inner = s.required && !nullable ? new Set(s.required) : new Set();
      return h("fieldset", { class: "nested" }, h("legend", {}, label),
        s.description ? h("p", { class: "hint" }, s.description) : null,
        h("div", { class: "field-grid" }, Object.entries(s.properties).map(
          ([n, p]) => this.field([...path, n], p, inner.has(n)))));
    }
    const id = uid("field");
    const hintId = `${id}-hint`;
    const errorId = `${id}-error`;
    const lines = this.lines.has(name) && (kind === "list" || kind === "map");
    const control = this.control(kind, s, { id, name, required, describedby: `${hintId} ${errorId}`, lines });
    const error = h("span", { class: "field-error", id: errorId });
    this.fields.push({ path, name, kind, schema: s, control, error, lines });
    const each = lines ? "one per line" : "comma separated";
    const hint = [s.description, kind === "map" ? `key=value, ${each}` : null,
      kind === "list" ? each : null].filter(Boolean).join(" · ");
    if (kind === "checkbox") {
      return h("div", { class: "field check" },
        h("label", { for: id }, control, " ", label),
        h("span", { class: "hint", id: hintId }, hint), error);
    }
    return h("div", { class: "field" },
      h("label", { for: id }, label, required ? h("span", { class: "req", "aria-hidden": "true" }, " *") : null),
      control, h("span", { class: "hint", id: hintId }, hint), error);
  }

  control(kind, s, { id, name, required, describedby, lines = false }) {
    const common = { id, name, "aria-describedby": describedby, required };
    if (lines) {
      return h("textarea", { ...common, rows: 3, autocomplete: "off", spellcheck: "false",
        placeholder: kind === "map" ? "KEY=value" : "" });
    }
    if (kind === "enum") {
      // no default (an optional choice, e.g. speculative_config.method): an empty "default"
      // option first, so nothing is sent unless the user picks one
      const unset = s.default === undefined || s.default === null
        ? [h("option", { value: "", selected: true }, "default")] : [];
      return h("select", common, [...unset,
        ...s.enum.map((v) => h("option", { value: v, selected: v === s.default }, v))]);
    }
    if (kind === "tristate") {
      return h("select", common, h("option", { value: "" }, "default"),
        h("option", { value: "true" }, "on"), h("option", { value: "false" }, "off"));
    }
    if (kind === "checkbox") {
      return h("input", { ...common, type: "checkbox", checked: s.default === true });
    }
    if (kind === "number") {
      const integer = s.type === "integer";
      return h("input", {
        ...common, type: "number", inputmode: integer ? "numeric" : "decimal",
        step: integer ? 1 : "any", min: s.minimum ?? (s.exclusiveMinimum !== undefined && integer
          ? s.exclusiveMinimum + 1 : null), max: s.maximum,
        placeholder: s.default ?? "default",
      });
    }
    return h("input", {
      ...common, type: "text", autocomplete: "off", spellcheck: "false",
      placeholder: s.default ?? (kind === "map" ? "zone=a, gpu=big" : ""),
    });
  }

  /** The JSON body: only what the user set (the server fills in its defaults). */
  value() {
    const out = {};
    for (const f of this.fields) {
      const v = this.read(f);
      if (v === undefined) continue;
      let node = out;
      for (const key of f.path.slice(0, -1)) node = node[key] ??= {};
      node[f.path[f.path.length - 1]] = v;
    }
    return out;
  }

  read(f) {
    const c = f.control;
    if (f.kind === "checkbox") return c.checked === (f.schema.default === true) ? undefined : c.checked;
    const text = c.value.trim();
    if (text === "") return undefined;
    switch (f.kind) {
      case "enum": return text === f.schema.default ? undefined : text;
      case "tristate": return text === "true";
      case "number": return Number(text);
      case "list": return text.split(f.lines ? "\n" : ",").map((x) => x.trim()).filter(Boolean);
      case "map": return Object.fromEntries(text.split(f.lines ? "\n" : ",").map((x) => x.trim()).filter(Boolean)
        .map((pair) => {
          const at = pair.indexOf("=");
          if (at < 1) throw Object.assign(new Error(`expected key=value, got "${pair}"`), { param: f.name });
          return [pair.slice(0, at).trim(), pair.slice(at + 1).trim()];
        }));
      default: return text;
    }
  }

  /** Mark the field the server named (param "engine_args.max_num_seqs"); false if none matches. */
  showError(param, message) {
    this.clearErrors();
    const f = this.fields.find((x) => x.name === param);
    if (!f) return false;
    f.control.setAttribute("aria-invalid", "true");
    f.error.textContent = message;
    const group = f.control.closest("details");
    if (group) group.open = true;
    f.control.focus();
    return true;
  }

  clearErrors() {
    for (const f of this.fields) {
      f.control.removeAttribute("aria-invalid");
      f.error.textContent = "";
    }
  }
}
