// Numbers as a person reads them.

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

export function bytes(n) {
  if (n === null || n === undefined) return "–";
  let i = 0;
  let v = n;
  while (v >= 1024 && i < UNITS.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${v.toFixed(i === 0 ? 0 : 1)} ${UNITS[i]}`;
}

export function percent(fraction, digits = 0) {
  if (fraction === null || fraction === undefined || Number.isNaN(fraction)) return "–";
  return `${(fraction * 100).toFixed(digits)}%`;
}

/** "4 s ago", "3 min ago" from an ISO time. */
export function ago(iso, now = Date.now()) {
  if (!iso) return "never";
  const s = Math.max(0, Math.round((now - Date.parse(iso)) / 1000));
  if (s < 90) return `${s} s ago`;
  if (s < 90 * 60) return `${Math.round(s / 60)} min ago`;
  if (s < 36 * 3600) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}

export function dateTime(iso) {
  return iso ? new Date(iso).toLocaleString() : "–";
}

export function number(v, digits = 1) {
  return v === null || v === undefined || Number.isNaN(v) ? "–" : v.toFixed(digits);
}

/** The progress the engine reports while preparing: "preparing model files: convert 42%". */
export function progressOf(message) {
  const m = /(\d{1,3})%/.exec(message || "");
  return m ? Math.min(100, Number(m[1])) / 100 : null;
}
