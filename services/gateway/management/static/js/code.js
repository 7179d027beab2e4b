// "View code": the playground's request as curl and as `openai` Python, ready to paste. The key
// is read from $SHOAL_API_KEY, never written into the snippet.

/** A JSON value as a Python literal. */
export function py(value, indent = "") {
  if (value === null || value === undefined) return "None";
  if (value === true) return "True";
  if (value === false) return "False";
  if (typeof value === "number" || typeof value === "string") return JSON.stringify(value);
  const inner = `${indent}    `;
  if (Array.isArray(value)) {
    if (!value.length) return "[]";
    return `[\n${value.map((v) => inner + py(v, inner)).join(",\n")},\n${indent}]`;
  }
  const entries = Object.entries(value);
  if (!entries.length) return "{}";
  if (entries.every(([, v]) => typeof v !== "object" || v === null)) {
    return `{${entries.map(([k, v]) => `${JSON.stringify(k)}: ${py(v)}`).join(", ")}}`;
  }
  return `{\n${entries.map(([k, v]) => `${inner}${JSON.stringify(k)}: ${py(v, inner)}`).join(",\n")},\n${indent}}`;
}

function shellQuote(text) {
  return `'${text.replace(/'/g, "'\\''")}'`;
}

export function curl(origin, path, body, withKey) {
  return [
    `curl -N ${origin}${path}`,
    `  -H 'Content-Type: application/json'`,
    withKey ? `  -H "Authorization: Bearer $SHOAL_API_KEY"` : null,
    `  -d ${shellQuote(JSON.stringify(body, null, 2))}`,
  ].filter(Boolean).join(" \\\n");
}

/** `kind` is "chat" or "completions"; `body` the request as sent (stream: true). */
export function python(origin, kind, body) {
  const args = Object.entries(body).map(([k, v]) => `    ${k}=${py(v, "    ")},`).join("\n");
  const call = kind === "chat" ? "client.chat.completions.create" : "client.completions.create";
  const piece = kind === "chat" ? "chunk.choices[0].delta.content or \"\"" : "chunk.choices[0].text";
  return `import os

from openai import OpenAI

client = OpenAI(base_url="${origin}/v1", api_key=os.environ.get("SHOAL_API_KEY", "unused"))
stream = ${call}(
${args}
)
for chunk in stream:
    if chunk.choices:
        print(${piece}, end="", flush=True)
    if chunk.usage:
        print("\\n", chunk.usage)
`;
}

/** A rerank body as Python: httpx (the openai SDK's own HTTP client; the SDK has no rerank). */
export function rerankPython(origin, body) {
  return `import os

import httpx

key = os.environ.get("SHOAL_API_KEY", "unused")
answer = httpx.post(
    "${origin}/v1/rerank",
    headers={"Authorization": f"Bearer {key}"},
    json=${py(body)},
    timeout=120,
)
answer.raise_for_status()
for result in answer.json()["results"]:
    print(result["index"], round(result["relevance_score"], 4), result["document"]["text"])
`;
}
