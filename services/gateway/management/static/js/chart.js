// A sparkline as inline SVG: the last few minutes of one series, with its current value in text
// (the picture only repeats what the text says).

import { h } from "./dom.js";

const SVG = "http://www.w3.org/2000/svg";
const W = 300;
const H = 64;

function svg(tag, attrs) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  return el;
}

/** `points`: [[t, value], ...]; `ceiling`: the least top of the scale (1 for a fraction). */
export function sparkline(label, points, format, ceiling = 1) {
  const values = points.map(([, v]) => v);
  const now = values.length ? values[values.length - 1] : null;
  const max = values.length ? Math.max(...values) : null;
  const top = Math.max(ceiling, max ?? 0);
  const t0 = points.length ? points[0][0] : 0;
  const span = points.length > 1 ? points[points.length - 1][0] - t0 : 1;
  const coords = points.map(([t, v]) => {
    const x = ((t - t0) / span) * W;
    const y = H - 2 - (v / top) * (H - 4);
    return `${x.toFixed(1)},${y.toFixed(1)}`;
  });
  const picture = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", "aria-hidden": "true" });
  if (coords.length > 1) {
    picture.append(svg("polygon", { class: "area", points: `0,${H} ${coords.join(" ")} ${W},${H}` }));
    picture.append(svg("polyline", { class: "line", points: coords.join(" ") }));
  }
  return h("figure", { class: "spark" },
    h("figcaption", {}, h("span", {}, label),
      h("strong", {}, now === null ? "–" : format(now)),
      h("span", { class: "muted" }, `max ${max === null ? "–" : format(max)}`)),
    picture);
}
