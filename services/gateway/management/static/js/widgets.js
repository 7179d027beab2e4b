// Small pieces every view uses: state badges, meters, the confirmation dialog, notices.

import { h, replace } from "./dom.js";
import { percent } from "./format.js";

/** A state as a coloured badge; the text carries the meaning, the colour only repeats it. */
export function badge(state, extra = "") {
  return h("span", { class: `badge state-${String(state).toLowerCase()} ${extra}` }, state);
}

/** A labelled bar: used / total. */
export function meter(label, used, total, text) {
  const fraction = total > 0 ? Math.min(1, used / total) : 0;
  return h("div", { class: "meter" },
    h("div", { class: "meter-label" }, h("span", {}, label), h("span", {}, text)),
    h("div", {
      class: `meter-bar${fraction > 0.9 ? " high" : ""}`, role: "meter",
      "aria-label": label, "aria-valuemin": 0, "aria-valuemax": 100,
      "aria-valuenow": Math.round(fraction * 100), "aria-valuetext": text,
    }, h("span", { style: `width: ${percent(fraction, 1)}` })));
}

/** An error (ApiError or other) shown where the action was taken; role=alert reads it out. */
export function showError(box, err) {
  if (!err) {
    replace(box);
    box.hidden = true;
    return;
  }
  box.hidden = false;
  const where = err.param ? ` (${err.param})` : "";
  const hint = err.status === 401 ? " Set an API key (top right)."
    : err.status === 403 ? " This key is not allowed to manage the cluster." : "";
  replace(box, `${err.message}${where}${hint}`);
}

export function errorBox() {
  return h("p", { class: "error", role: "alert", hidden: true });
}

let toastTimer = null;
/** A short notice in the page's polite live region. */
export function toast(text) {
  const el = document.getElementById("toast");
  el.textContent = text;
  el.classList.add("shown");
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => el.classList.remove("shown"), 4000);
}

/** Ask before something that cannot be undone; resolves true when confirmed. Native <dialog>:
 * focus moves into it, Escape cancels, focus returns to the button that opened it. */
export function confirmAction({ title, body, confirm }) {
  const dialog = document.getElementById("confirm-dialog");
  replace(dialog.querySelector("h2"), title);
  replace(dialog.querySelector("p"), body);
  const ok = dialog.querySelector("button[value=confirm]");
  ok.textContent = confirm;
  const opener = document.activeElement;
  dialog.returnValue = "";
  dialog.showModal();
  dialog.querySelector("button[value=cancel]").focus();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      if (opener instanceof HTMLElement && opener.isConnected) opener.focus();
      resolve(dialog.returnValue === "confirm");
    }, { once: true });
  });
}

/** Copy text, with a fallback for pages not served over https or localhost. */
export async function copy(text) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    const area = h("textarea", { class: "offscreen" }, text);
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  toast("Copied");
}
