// Prometheus' text format, read just enough for the dashboard: samples with their labels.

const SAMPLE = /^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
const LABEL = /([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"/g;

/** [{name, labels: {...}, value}] for every sample line. */
export function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = SAMPLE.exec(line);
    if (!m) continue;
    const labels = {};
    for (const [, key, raw] of (m[2] || "").matchAll(LABEL)) {
      labels[key] = raw.replace(/\\n/g, "\n").replace(/\\(["\\])/g, "$1");
    }
    samples.push({ name: m[1], labels, value: Number(m[3]) });
  }
  return samples;
}
