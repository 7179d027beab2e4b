// Playground: chat or complete with any RUNNING model, streamed, with the sampling settings a
// person tunes first; per answer the time to first token, decode speed and token usage; a
// reasoning model's reasoning folded above its answer. Rerank: a query and documents through a
// cross-encoder, ranked by score. "View code" shows the same request as curl and as Python.

import { api, apiKey, stream } from "../api.js";
import { curl, python, rerankPython } from "../code.js";
import { h, replace } from "../dom.js";
import { copy, errorBox, showError } from "../widgets.js";

export const title = "Playground";

function numberField(label, attrs) {
  const input = h("input", { type: "number", step: "any", inputmode: "decimal", ...attrs });
  return [h("label", { class: "field" }, label, input), input];
}

export function create() {
  const model = h("select", { "aria-label": "Model", required: true });
  const system = h("textarea", { rows: 3, placeholder: "You are a helpful assistant." });
  const [tempField, temperature] = numberField("Temperature", { min: 0, max: 2, value: 0.7 });
  const [topPField, topP] = numberField("Top p", { min: 0, max: 1, value: 1 });
  const [maxField, maxTokens] = numberField("Max tokens", { min: 1, step: 1, value: 128 });
  const stop = h("textarea", { rows: 2, placeholder: "one per line", spellcheck: "false" });
  const settings = h("form", { class: "settings", "aria-label": "Request settings" },
    h("label", { class: "field" }, "Model", model),
    h("label", { class: "field chat-only" }, "System prompt", system),
    tempField, topPField, maxField,
    h("label", { class: "field" }, "Stop sequences", stop));
  for (const field of [tempField, topPField, maxField, stop.parentNode]) {
    field.classList.add("generate-only");  // sampling: nothing a cross-encoder reads
  }
  settings.addEventListener("submit", (e) => e.preventDefault());

  const error = errorBox();
  const chat = chatPanel();
  const completions = completionsPanel();
  const rerank = rerankPanel();
  const codeBox = h("div", { class: "code-panel", id: "code-panel", hidden: true });
  let kind = "chat";
  let controller = null;
  const panels = { chat, completions, rerank };
  const tabs = [["chat", "Chat", chat], ["completions", "Completions", completions],
    ["rerank", "Rerank", rerank]].map(
    ([id, label, panel]) => {
      panel.root.id = `panel-${id}`;
      panel.root.setAttribute("role", "tabpanel");
      panel.root.setAttribute("aria-labelledby", `tab-${id}`);
      return h("button", {
        role: "tab", id: `tab-${id}`, type: "button", "aria-controls": `panel-${id}`,
        onclick: () => select(id),
      }, label);
    });
  const tablist = h("div", { role: "tablist", "aria-label": "Mode" }, tabs);
  tablist.addEventListener("keydown", (e) => {
    if (e.key !== "ArrowLeft" && e.key !== "ArrowRight") return;
    const ids = Object.keys(panels);
    const step = e.key === "ArrowRight" ? 1 : ids.length - 1;
    const from = ids.indexOf(e.target.id.replace("tab-", ""));  // the focused tab's neighbour
    select(ids[((from < 0 ? ids.indexOf(kind) : from) + step) % ids.length]);
    document.getElementById(`tab-${kind}`).focus();
  });

  function select(id) {
    kind = id;
    for (const tab of tabs) {
      const on = tab.id === `tab-${id}`;
      tab.setAttribute("aria-selected", String(on));
      tab.tabIndex = on ? 0 : -1;
    }
    for (const [name, panel] of Object.entries(panels)) panel.root.hidden = id !== name;
    settings.querySelector(".chat-only").hidden = id !== "chat";
    for (const field of settings.querySelectorAll(".generate-only")) field.hidden = id === "rerank";
    if (!codeBox.hidden) showCode();
  }

  function params() {
    const out = { model: model.value };
    if (temperature.value !== "") out.temperature = Number(temperature.value);
    if (topP.value !== "") out.top_p = Number(topP.value);
    if (maxTokens.value !== "") out.max_tokens = Number(maxTokens.value);
    const stops = stop.value.split("\n").filter((s) => s !== "");
    if (stops.length) out.stop = stops;
    return out;
  }

  function request() {
    if (kind === "rerank") {
      const body = { model: model.value, query: rerank.query.value, documents: rerank.documents() };
      if (rerank.topN.value !== "") body.top_n = Number(rerank.topN.value);
      return { path: "/v1/rerank", body };
    }
    const common = { ...params(), stream: true, stream_options: { include_usage: true } };
    if (kind === "chat") {
      const typed = chat.input.value.trim() ? [{ role: "user", content: chat.input.value }] : [];
      const messages = [...(system.value.trim() ? [{ role: "system", content: system.value }] : []),
        ...chat.messages, ...typed];
      return { path: "/v1/chat/completions", body: { ...common, messages } };
    }
    return { path: "/v1/completions", body: { ...common, prompt: completions.input.value } };
  }

  function showCode() {
    const { path, body } = request();
    const origin = window.location.origin;
    const snippets = [["curl", curl(origin, path, body, Boolean(apiKey()))],
      kind === "rerank" ? ["Python (httpx)", rerankPython(origin, body)]
        : ["Python (openai)", python(origin, kind, body)]];
    replace(codeBox, snippets.map(([label, text]) => h("figure", {},
      h("figcaption", {}, label, h("button", { type: "button", class: "secondary small",
        onclick: () => copy(text) }, `Copy ${label}`)),
      h("pre", { tabindex: "0", "aria-label": `${label} code` }, h("code", {}, text)))));
  }

  async function send(target) {
    if (!model.value) {
      showError(error, { message: "No model is RUNNING yet: deploy one under Models." });
      return;
    }
    showError(error, null);
    const { path, body } = request();
    controller = new AbortController();
    target.busy(true);
    const started = performance.now();
    let first = null;
    let usage = null;
    let finish = null;
    try {
      for await (const chunk of stream(path, body, controller.signal)) {
        for (const c of chunk.choices) {
          const thought = c.delta && c.delta.reasoning_content;
          if (thought && target.reason) {  // a model served with a reasoning parser
            first ??= performance.now();
            target.reason(thought);
          }
          const piece = c.delta ? c.delta.content : c.text;
          if (piece) {
            first ??= performance.now();
            target.append(piece);
          }
          finish = c.finish_reason || finish;
        }
        usage = chunk.usage || usage;
      }
    } catch (err) {
      if (err.name !== "AbortError") {
        showError(error, err);
        target.failed(err);
      } else {
        finish = "stopped";
      }
    } finally {
      controller = null;
      target.busy(false);
    }
    const end = performance.now();
    target.done({
      ttft: first === null ? null : first - started,
      speed: usage && first !== null && usage.completion_tokens > 1 && end > first
        ? (usage.completion_tokens - 1) / ((end - first) / 1000) : null,
      usage, finish,
    });
    if (!codeBox.hidden) showCode();
  }

  /** A rerank is one JSON answer, not a stream: the documents come back best first. */
  async function sendRerank() {
    if (!model.value) {
      showError(error, { message: "No model is RUNNING yet: deploy a cross-encoder under Models." });
      return;
    }
    showError(error, null);
    const { path, body } = request();
    controller = new AbortController();
    rerank.busy(true);
    const started = performance.now();
    try {
      rerank.show(await api("POST", path, body, controller.signal), performance.now() - started);
    } catch (err) {
      if (err.name !== "AbortError") showError(error, err);
    } finally {
      controller = null;
      rerank.busy(false);
    }
    if (!codeBox.hidden) showCode();
  }

  for (const panel of [chat, completions, rerank]) {
    panel.onSend = panel === rerank ? sendRerank : () => send(panel);
    panel.onStop = () => controller?.abort();
    panel.onCode = () => {
      const open = codeBox.hidden;
      codeBox.hidden = !open;
      for (const b of document.querySelectorAll(".view-code")) b.setAttribute("aria-expanded", String(open));
      if (open) showCode();
    };
  }

  async function refresh() {
    let models;
    try {
      models = (await api("GET", "/v1/models")).data.filter((m) => m.has_running_instance);
    } catch (err) {
      showError(error, err);
      return;
    }
    const current = model.value;
    const names = models.map((m) => m.id);
    const shown = [...model.options].map((o) => o.value).filter(Boolean);
    if (model.options.length && names.join("\n") === shown.join("\n")) return;
    replace(model, names.length ? names.map((n) => h("option", { value: n, selected: n === current }, n))
      : h("option", { value: "" }, "no RUNNING model"));
  }

  select("chat");
  const root = h("section", { "aria-labelledby": "playground-h" },
    h("h1", { id: "playground-h", tabindex: "-1" }, "Playground"),
    h("div", { class: "playground" }, settings,
      h("div", { class: "pane" }, tablist, error, chat.root, completions.root, rerank.root,
        codeBox)));
  for (const event of ["input", "change"]) {  // the code shown follows what is typed
    root.addEventListener(event, () => { if (!codeBox.hidden) showCode(); });
  }
  return { root, refresh, interval: 5000 };
}

/** Buttons shared by both panels; the panel's owner sets onSend / onStop / onCode. */
function controls(panel, sendLabel) {
  const sendButton = h("button", { type: "submit", class: "primary" }, sendLabel);
  const stopButton = h("button", { type: "button", class: "secondary", disabled: true,
    onclick: () => panel.onStop() }, "Stop");
  const codeButton = h("button", { type: "button", class: "secondary view-code",
    "aria-expanded": "false", "aria-controls": "code-panel", onclick: () => panel.onCode() },
  "View code");
  panel.busy = (on) => {
    panel.sending = on;
    sendButton.disabled = on;
    stopButton.disabled = !on;
  };
  return [sendButton, stopButton, codeButton];
}

/** Send on Enter (Shift+Enter for a new line); Escape stops the answer. */
function keys(panel, textarea, form) {
  textarea.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      form.requestSubmit();
    } else if (e.key === "Escape") {
      panel.onStop();
    }
  });
}

function chatPanel() {
  const panel = { messages: [] };
  const log = h("ol", { class: "chat-log", role: "log", "aria-live": "polite", "aria-label": "Conversation" });
  panel.input = h("textarea", { rows: 3, "aria-label": "Message", placeholder: "Ask something… (Enter sends, Shift+Enter: new line)" });
  const clear = h("button", { type: "button", class: "secondary", onclick: () => {
    panel.messages = [];
    replace(log);
  } }, "Clear");
  const form = h("form", { class: "compose" }, panel.input,
    h("div", { class: "actions" }, controls(panel, "Send"), clear));
  keys(panel, panel.input, form);
  let answer = null;
  let text = "";
  let thinking = null;
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    if (!panel.input.value.trim() || panel.sending) return;
    const content = panel.input.value;
    panel.messages.push({ role: "user", content });
    panel.input.value = "";
    log.append(h("li", { class: "msg user" }, h("span", { class: "who" }, "You"), h("p", {}, content)));
    text = "";
    thinking = null;
    answer = h("p", { class: "streaming" });
    log.append(h("li", { class: "msg assistant", "aria-busy": "true" },
      h("span", { class: "who" }, "Assistant"), answer));
    panel.onSend();
  });
  // Reasoning, folded above the answer (not sent back in later turns, as OpenAI advises).
  panel.reason = (piece) => {
    if (!thinking) {
      thinking = h("p", { class: "reasoning" });
      answer.before(h("details", { class: "reasoning" }, h("summary", {}, "Reasoning"), thinking));
    }
    thinking.textContent += piece;
    log.scrollTop = log.scrollHeight;
  };
  panel.append = (piece) => {
    text += piece;
    answer.textContent = text;
    log.scrollTop = log.scrollHeight;
  };
  panel.failed = (err) => answer.parentNode.append(h("p", { class: "error" }, err.message));
  panel.done = (stats) => {
    answer.classList.remove("streaming");
    answer.parentNode.removeAttribute("aria-busy");
    answer.parentNode.append(statsLine(stats));
    if (text) panel.messages.push({ role: "assistant", content: text });
  };
  panel.root = h("div", { class: "panel" }, log, form);
  return panel;
}

function completionsPanel() {
  const panel = {};
  panel.input = h("textarea", { rows: 4, "aria-label": "Prompt", placeholder: "Once upon a time" });
  const output = h("pre", { class: "completion", role: "log", "aria-live": "polite", "aria-label": "Completion" });
  const form = h("form", { class: "compose" }, panel.input,
    h("div", { class: "actions" }, controls(panel, "Complete")));
  keys(panel, panel.input, form);
  let stats = null;
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    if (panel.sending) return;
    replace(output, h("span", { class: "prompt" }, panel.input.value));
    stats?.remove();
    panel.onSend();
  });
  panel.append = (piece) => output.append(h("span", { class: "generated" }, piece));
  panel.failed = (err) => output.append(h("span", { class: "error" }, `\n${err.message}`));
  panel.done = (s) => {
    stats = statsLine(s);
    output.after(stats);
  };
  panel.root = h("div", { class: "panel", hidden: true }, output, form);
  return panel;
}

function statsLine({ ttft, speed, usage, finish }) {
  const parts = [
    ttft === null ? null : `TTFT ${Math.round(ttft)} ms`,
    speed === null ? null : `${speed.toFixed(1)} tok/s`,
    usage ? `${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens` : null,
    finish ? `finish: ${finish}` : null,
  ].filter(Boolean);
  return h("p", { class: "stats" }, parts.join(" · "));
}

function rerankPanel() {
  const panel = {};
  panel.query = h("input", { type: "text", "aria-label": "Query", placeholder: "What is the capital of France?" });
  const docs = h("textarea", { rows: 5, "aria-label": "Documents", spellcheck: "false",
    placeholder: "one document per line" });
  panel.documents = () => docs.value.split("\n").filter((d) => d.trim() !== "");
  panel.topN = h("input", { type: "number", min: 1, step: 1, inputmode: "numeric" });
  const results = h("ol", { class: "rerank-results", "aria-live": "polite", "aria-label": "Ranked documents" });
  const form = h("form", { class: "compose" },
    h("label", { class: "field" }, "Query", panel.query),
    h("label", { class: "field" }, "Documents (one per line)", docs),
    h("label", { class: "field" }, "Top n (optional)", panel.topN),
    h("div", { class: "actions" }, controls(panel, "Rerank")));
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    if (!panel.query.value.trim() || !panel.documents().length || panel.sending) return;
    panel.onSend();
  });
  let stats = null;
  panel.show = (answer, ms) => {
    replace(results, answer.results.map((r) => h("li", { class: "ranked", "data-index": String(r.index) },
      h("meter", { min: 0, max: 1, value: Math.max(0, Math.min(1, r.relevance_score)),
        "aria-label": `Score of document ${r.index + 1}` }),
      h("span", { class: "score" }, r.relevance_score.toFixed(4)),
      h("span", { class: "doc" }, `#${r.index + 1} ${r.document ? r.document.text : ""}`))));
    stats?.remove();
    stats = h("p", { class: "stats" },
      `${Math.round(ms)} ms · ${answer.usage.prompt_tokens} prompt tokens`);
    results.after(stats);
  };
  panel.root = h("div", { class: "panel", hidden: true }, form, results);
  return panel;
}
