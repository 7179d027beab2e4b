// Tiny DOM helpers. Text always goes in as text nodes, so nothing the API returns is ever parsed
// as HTML.

/** h("button", {class: "primary", onclick: fn}, "Deploy") -> HTMLButtonElement */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") {
      el.addEventListener(name.slice(2), value);
    } else if (name === "class") {
      el.className = value;
    } else if (name === "text") {
      el.textContent = value;
    } else if (name === "value") {
      el.value = value;
    } else if (name === "checked" || name === "disabled" || name === "hidden") {
      el[name] = Boolean(value);
    } else {
      el.setAttribute(name, value === true ? "" : String(value));
    }
  }
  append(el, children);
  return el;
}

export function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

/** Replace every child of `el` with `children`. */
export function replace(el, ...children) {
  el.replaceChildren();
  return append(el, children);
}

let nextId = 0;
/** A unique id for label/for and aria-describedby pairs. */
export function uid(prefix = "f") {
  nextId += 1;
  return `${prefix}-${nextId}`;
}
