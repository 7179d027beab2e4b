// The gateway's HTTP API as the dashboard uses it: the same endpoints and the same API key as
// any client (nothing here is private to the UI).

const KEY = "shoal.apiKey";

/** The API key the user gave: this tab's (sessionStorage) or a remembered one (localStorage). */
export function apiKey() {
  return sessionStorage.getItem(KEY) || localStorage.getItem(KEY) || "";
}

export function setApiKey(key, remember) {
  sessionStorage.removeItem(KEY);
  localStorage.removeItem(KEY);
  if (key) (remember ? localStorage : sessionStorage).setItem(KEY, key);
  window.dispatchEvent(new CustomEvent("shoal:key-changed"));
}

/** An OpenAI-shaped error: {error: {message, type, param, code}} with its HTTP status. */
export class ApiError extends Error {
  constructor(status, error) {
    super(error?.message || `HTTP ${status}`);
    this.status = status;
    this.type = error?.type || null;
    this.param = error?.param || null;
    this.code = error?.code || null;
  }
}

function headers(json) {
  const out = {};
  if (json) out["Content-Type"] = "application/json";
  const key = apiKey();
  if (key) out.Authorization = `Bearer ${key}`;
  return out;
}

async function failure(resp) {
  let body = null;
  try {
    body = await resp.json();
  } catch {
    // not JSON: a proxy's page; the status says enough
  }
  const err = new ApiError(resp.status, body?.error);
  if (resp.status === 401) {
    window.dispatchEvent(new CustomEvent("shoal:unauthorized", { detail: err }));
  }
  return err;
}

/** One JSON request; throws ApiError on a 4xx/5xx. */
export async function api(method, path, body = undefined, signal = undefined) {
  const resp = await fetch(path, {
    method,
    headers: headers(body !== undefined),
    body: body === undefined ? undefined : JSON.stringify(body),
    signal,
  });
  if (!resp.ok) throw await failure(resp);
  return resp.status === 204 ? null : resp.json();
}

/** POST a streaming OpenAI request and yield each server-sent event's JSON until [DONE]. */
export async function* stream(path, body, signal) {
  const resp = await fetch(path, {
    method: "POST", headers: headers(true), body: JSON.stringify(body), signal,
  });
  if (!resp.ok) throw await failure(resp);
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const parsed = JSON.parse(data);
        if (parsed.error) throw new ApiError(parsed.error.status || 500, parsed.error);
        yield parsed;
      }
    }
  }
}

/** Every row of a management list. */
export async function list(path) {
  return (await api("GET", path)).items;
}
