// common.mjs - what the kiln serve tests share: the openai package (from the npm cache that
// tests/test_server.sh fills), a small sequential test runner, raw HTTP and SSE helpers, and
// /metrics readers.
import assert from 'node:assert/strict';
import fs from 'node:fs';
import http from 'node:http';
import path from 'node:path';
import { pathToFileURL } from 'node:url';

const npmDir = process.env.KILN_NPM_DIR;
if (!npmDir) {
  console.error('FAIL: KILN_NPM_DIR is not set (run these scripts through tests/test_server.sh)');
  process.exit(2);
}
const entry = path.join(npmDir, 'node_modules', 'openai', 'index.mjs');
if (!fs.existsSync(entry)) {
  console.error(`FAIL: the openai package is not installed in ${npmDir}`);
  process.exit(2);
}
const sdk = await import(pathToFileURL(entry).href);
export const OpenAI = sdk.default ?? sdk.OpenAI;
export const APIError = sdk.APIError;
export { assert };

/* The server under test: KILN_URL (http://127.0.0.1:PORT) and the model name. */
export function env(name, fallback) {
  const v = process.env[name];
  if (v === undefined || v === '') {
    if (fallback !== undefined) return fallback;
    throw new Error(`${name} is not set`);
  }
  return v;
}

export const MODEL = process.env.KILN_MODEL || 'kiln-tiny';

/* An SDK client with no retries (a retried 503 would hide what the server said). */
export function client(url, apiKey = 'unused', opts = {}) {
  return new OpenAI({ baseURL: `${url}/v1`, apiKey, maxRetries: 0, timeout: 120_000, ...opts });
}

// ---- the runner ----------------------------------------------------------------------------

const tests = [];
/* Registers a test; run() runs them in order. */
export function test(name, fn) {
  tests.push({ name, fn });
}

/* Runs every registered test in order, prints ok/FAIL per test, exits 1 on any failure. */
export async function run(suite) {
  const only = process.env.KILN_TEST_ONLY;
  let failed = 0;
  let ran = 0;
  const t0 = Date.now();
  for (const t of tests) {
    if (only && !t.name.includes(only)) continue;
    ran++;
    const s = Date.now();
    try {
      await t.fn();
      console.log(`ok   ${suite}: ${t.name} (${Date.now() - s} ms)`);
    } catch (e) {
      failed++;
      console.log(`FAIL ${suite}: ${t.name}`);
      console.log(indent(e && e.stack ? e.stack : String(e)));
      if (e && e.error) console.log(indent(`server error body: ${JSON.stringify(e.error)}`));
    }
  }
  const secs = ((Date.now() - t0) / 1000).toFixed(1);
  console.log(`${suite}: ${ran - failed}/${ran} passed in ${secs} s`);
  process.exit(failed ? 1 : 0);
}

function indent(s) {
  return String(s)
    .split('\n')
    .map((l) => '     ' + l)
    .join('\n');
}

// ---- raw HTTP ------------------------------------------------------------------------------

/* fetch with a JSON body (or a raw string); returns {status, headers, text, json}. */
export async function post(url, route, body, { headers = {}, method = 'POST' } = {}) {
  const raw = typeof body === 'string' ? body : JSON.stringify(body);
  const r = await fetch(url + route, {
    method,
    headers: { 'content-type': 'application/json', ...headers },
    body: method === 'GET' || method === 'HEAD' ? undefined : raw,
  });
  return finish(r);
}

export async function get(url, route, { headers = {}, method = 'GET' } = {}) {
  return finish(await fetch(url + route, { method, headers }));
}

async function finish(r) {
  const text = await r.text();
  let json;
  try {
    json = JSON.parse(text);
  } catch {
    json = undefined;
  }
  return { status: r.status, headers: r.headers, text, json };
}

/* Asserts an OpenAI-style error body: {"error": {"message", "type", "param", "code"}}, with the
 * given status, and (when given) param and type. Returns the error object. */
export function assertError(res, status, { param, type, message } = {}) {
  const ctx = `${res.status} ${res.text}`;
  assert.equal(res.status, status, `status: ${ctx}`);
  assert.ok(res.json && typeof res.json === 'object', `not JSON: ${ctx}`);
  const e = res.json.error;
  assert.ok(e && typeof e === 'object', `no "error" object: ${ctx}`);
  assert.deepEqual(Object.keys(e).sort(), ['code', 'message', 'param', 'type'], `keys: ${ctx}`);
  assert.equal(typeof e.message, 'string', ctx);
  assert.ok(e.message.length > 0, ctx);
  assert.equal(typeof e.type, 'string', ctx);
  if (param !== undefined) assert.equal(e.param, param, `param: ${ctx}`);
  if (type !== undefined) assert.equal(e.type, type, `type: ${ctx}`);
  if (message !== undefined) assert.match(e.message, message, `message: ${ctx}`);
  assert.ok(e.code === null || e.code === status || e.code === String(status), `code: ${ctx}`);
  return e;
}

/* POSTs a streaming request and reads its Server-Sent Events as they come. onEvent(json, i) is
 * called per data event (return 'stop' to abort the request there). Returns {status, headers,
 * events, done (saw [DONE]), error (a transport error)}. */
export async function sse(url, route, body, { headers = {}, onEvent, signal } = {}) {
  const ac = new AbortController();
  if (signal) signal.addEventListener('abort', () => ac.abort());
  const out = { status: 0, headers: null, events: [], done: false, error: null, text: '' };
  let r;
  try {
    r = await fetch(url + route, {
      method: 'POST',
      headers: { 'content-type': 'application/json', ...headers },
      body: JSON.stringify(body),
      signal: ac.signal,
    });
  } catch (e) {
    out.error = e;
    return out;
  }
  out.status = r.status;
  out.headers = r.headers;
  if (!(r.headers.get('content-type') || '').startsWith('text/event-stream')) {
    out.text = await r.text();
    try {
      out.json = JSON.parse(out.text);
    } catch {}
    return out;
  }
  const dec = new TextDecoder();
  let buf = '';
  try {
    for await (const chunk of r.body) {
      buf += dec.decode(chunk, { stream: true });
      let k;
      while ((k = buf.indexOf('\n\n')) >= 0) {
        const ev = buf.slice(0, k);
        buf = buf.slice(k + 2);
        for (const line of ev.split('\n')) {
          if (!line.startsWith('data: ')) continue;
          const data = line.slice(6);
          if (data === '[DONE]') {
            out.done = true;
            continue;
          }
          assert.ok(!out.done, 'an event after [DONE]');
          const j = JSON.parse(data);
          out.events.push(j);
          if (onEvent && onEvent(j, out.events.length - 1) === 'stop') {
            ac.abort();
            return out;
          }
        }
      }
    }
    assert.equal(buf, '', `a partial event at the end of the stream: ${JSON.stringify(buf)}`);
  } catch (e) {
    out.error = e;
  }
  return out;
}

/* A raw HTTP request over its own socket (node:http, no keep-alive), for the cases fetch hides:
 * a body sent in chunks, a socket destroyed mid-stream. Returns the ClientRequest. */
export function rawRequest(url, route, { method = 'POST', headers = {} } = {}) {
  const u = new URL(url);
  return http.request({
    host: u.hostname,
    port: u.port,
    path: route,
    method,
    headers,
    agent: false,
  });
}

// ---- metrics -------------------------------------------------------------------------------

/* GET /metrics as {name: value} for kiln's unlabelled-by-anything-but-model gauges. */
export async function metrics(url) {
  const r = await fetch(url + '/metrics');
  assert.equal(r.status, 200, 'GET /metrics');
  const text = await r.text();
  const m = {};
  for (const line of text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const mm = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$/.exec(line);
    if (!mm) continue;
    if (!(mm[1] in m)) m[mm[1]] = Number(mm[3]);
    m[mm[1] + (mm[2] || '')] = Number(mm[3]);
  }
  return m;
}

/* Waits (up to ms) until no request runs or waits and no KV block is used; returns the last
 * metrics, or throws with them. */
export async function waitIdle(url, ms = 5000) {
  const end = Date.now() + ms;
  let m;
  for (;;) {
    m = await metrics(url);
    const used = m['kiln:kv_cache_used_blocks'];
    const running = m['kiln:num_requests_running'];
    const waiting = m['kiln:num_requests_waiting'] ?? 0;
    assert.ok(used !== undefined && running !== undefined, 'metrics lack the KV/running gauges');
    if (used === 0 && running === 0 && waiting === 0) return m;
    if (Date.now() > end)
      throw new Error(
        `not idle after ${ms} ms: kv_cache_used_blocks ${used}, num_requests_running ${running}, ` +
          `num_requests_waiting ${waiting}`,
      );
    await sleep(100);
  }
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/* A small seeded PRNG (mulberry32), so a failing random schedule can be replayed. */
export function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/* Collects an SDK stream (completions or chat) into per-index texts, finish reasons, logprobs
 * and the usage chunk. */
export async function collect(stream) {
  const text = [];
  const finish = [];
  const stopReason = [];
  const lp = [];
  let usage = null;
  let chunks = 0;
  let id = null;
  for await (const ch of stream) {
    chunks++;
    if (id === null) id = ch.id;
    assert.equal(ch.id, id, 'every chunk has the same id');
    if (ch.usage) usage = ch.usage;
    for (const c of ch.choices) {
      const i = c.index;
      const piece = c.delta !== undefined ? (c.delta.content ?? '') : c.text;
      text[i] = (text[i] ?? '') + piece;
      assert.ok(finish[i] === undefined || finish[i] === null, `choice ${i}: a chunk after its finish`);
      finish[i] = c.finish_reason;
      if (c.stop_reason !== undefined && c.stop_reason !== null) stopReason[i] = c.stop_reason;
      if (c.logprobs) {
        lp[i] ??=
          c.delta !== undefined
            ? { content: [] }
            : { tokens: [], token_logprobs: [], top_logprobs: [], text_offset: [] };
        if (c.delta !== undefined) lp[i].content.push(...(c.logprobs.content ?? []));
        else for (const k of Object.keys(lp[i])) lp[i][k].push(...c.logprobs[k]);
      }
    }
  }
  return { text, finish, stopReason, lp, usage, chunks, id };
}
