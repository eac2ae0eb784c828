// shutdown.mjs - SIGTERM while requests run. KILN_SHUTDOWN_MODE=drain (a 60 s
// shutdown_timeout): the running streamed and non-streamed requests still complete normally
// (finish_reason "length", the usage chunk, [DONE]), new connections are refused or get 503, and
// the process exits 0 soon after. KILN_SHUTDOWN_MODE=abort (shutdown_timeout = 1): requests far
// longer than that end with finish_reason "abort" about 1 s after the signal, and the exit is 0.
// Env: KILN_URL, KILN_SERVER_PID (the server to signal), KILN_SERVER_RC (a file the driver writes
// the server's exit status to), KILN_SHUTDOWN_MODE, KILN_NPM_DIR.
import fs from 'node:fs';
import http from 'node:http';
import { assert, env, get, MODEL, post, run, sleep, sse, test } from './common.mjs';

const URL_ = env('KILN_URL');
const PID = Number(env('KILN_SERVER_PID'));
const RC = env('KILN_SERVER_RC');
const MODE = env('KILN_SHUTDOWN_MODE');

/* Waits for the server's exit status (the driver writes it); returns {rc, ms since t0}. */
async function exitStatus(t0, limitMs) {
  const end = Date.now() + limitMs;
  while (Date.now() < end) {
    if (fs.existsSync(RC)) {
      const text = fs.readFileSync(RC, 'utf8').trim();
      if (text !== '') return { rc: Number(text), ms: Date.now() - t0 };
    }
    await sleep(50);
  }
  throw new Error(`the server (pid ${PID}) has not exited ${limitMs} ms later`);
}

/* New requests after the signal: the connection is refused, or the answer is 503. */
async function probeRefused(what) {
  const results = [];
  for (const attempt of [
    () => get(URL_, '/health'),
    () => post(URL_, '/v1/completions', { model: MODEL, prompt: 'new', max_tokens: 2 }),
    () =>
      sse(URL_, '/v1/chat/completions', {
        model: MODEL,
        messages: [{ role: 'user', content: 'new' }],
        max_tokens: 2,
        stream: true,
      }),
  ]) {
    try {
      const r = await attempt();
      if (r.error) {
        results.push('refused');
        continue;
      }
      assert.equal(r.status, 503, `${what}: a new request got ${r.status} ${r.text ?? ''}`);
      results.push('503');
    } catch (e) {
      const code = e.cause?.code ?? e.code;
      assert.ok(
        ['ECONNREFUSED', 'ECONNRESET', 'UND_ERR_SOCKET', 'EPIPE'].includes(code),
        `${what}: ${e} (${code})`,
      );
      results.push('refused');
    }
  }
  return results.join(', ');
}

/* A request on a keep-alive agent's socket: {status, json}, or {error} if the socket is gone. */
function agentRequest(agent, method, route, body) {
  return new Promise((resolve) => {
    const u = new URL(URL_);
    const raw = body === undefined ? undefined : JSON.stringify(body);
    const req = http.request(
      {
        host: u.hostname,
        port: u.port,
        path: route,
        method,
        agent,
        headers: raw ? { 'content-type': 'application/json', 'content-length': Buffer.byteLength(raw) } : {},
      },
      (res) => {
        let data = '';
        res.on('data', (d) => (data += d));
        res.on('end', () => {
          let json;
          try {
            json = JSON.parse(data);
          } catch {}
          resolve({ status: res.statusCode, json, text: data, reused: req.reusedSocket });
        });
      },
    );
    req.on('error', (e) => resolve({ error: e, reused: req.reusedSocket }));
    req.end(raw);
  });
}

function checkStream(s, n, reason) {
  assert.equal(s.status, 200, `stream status ${s.status} ${s.text}`);
  assert.equal(s.error, null, `stream transport error: ${s.error}`);
  assert.ok(s.done, 'the stream did not end with [DONE]');
  const finish = [];
  for (const ev of s.events) {
    assert.ok(!ev.error, `an error event: ${JSON.stringify(ev)}`);
    for (const c of ev.choices) if (c.finish_reason) finish[c.index] = c.finish_reason;
  }
  assert.deepEqual(finish, Array(n).fill(reason), `finish reasons ${JSON.stringify(finish)}`);
  const usage = s.events.at(-1).usage;
  assert.ok(usage && s.events.at(-1).choices.length === 0, 'no usage chunk at the end');
  return usage;
}

if (MODE === 'drain') {
  test('SIGTERM with requests in flight: they complete, new connections are refused or 503, exit 0', async () => {
    const M = 200;
    let t0 = 0;
    let signalled;
    const signal = new Promise((r) => (signalled = r));
    // a keep-alive connection, open and idle when the signal comes
    const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
    const first = await agentRequest(agent, 'GET', '/health');
    assert.equal(first.status, 200);
    // a non-streamed request, running when the signal comes
    const plainP = post(URL_, '/v1/chat/completions', {
      model: MODEL,
      messages: [{ role: 'user', content: 'hi' }],
      max_tokens: 400,
      ignore_eos: true,
      n: 2,
    });
    await sleep(100);
    const streamP = sse(
      URL_,
      '/v1/completions',
      {
        model: MODEL,
        prompt: ['Once', 'upon', 'a', 'time'],
        max_tokens: M,
        ignore_eos: true,
        stream: true,
        stream_options: { include_usage: true },
      },
      {
        onEvent: (ev, i) => {
          if (i === 0) {
            t0 = Date.now();
            process.kill(PID, 'SIGTERM');
            signalled();
          }
        },
      },
    );
    await signal;
    await sleep(150);
    // the idle keep-alive connection's next request: 503, or the connection is closed
    const again = await agentRequest(agent, 'POST', '/v1/completions', {
      model: MODEL,
      prompt: 'x',
      max_tokens: 2,
    });
    agent.destroy();
    let keepAlive = 'closed';
    if (!again.error) {
      assert.equal(
        again.status,
        503,
        `a request on a kept-alive connection got ${again.status} ${again.text}`,
      );
      assert.equal(again.json.error.type, 'server_busy');
      assert.match(again.json.error.message, /shutting down/);
      keepAlive = `503 (socket reused: ${again.reused})`;
    }
    const probe = await probeRefused('draining');
    const s = await streamP;
    const ms = Date.now() - t0;
    const usage = checkStream(s, 4, 'length');
    assert.equal(usage.completion_tokens, 4 * M);
    const plain = await plainP;
    assert.equal(plain.status, 200, plain.text);
    assert.deepEqual(
      plain.json.choices.map((c) => c.finish_reason),
      ['length', 'length'],
    );
    assert.equal(plain.json.usage.completion_tokens, 800);
    const { rc, ms: exitMs } = await exitStatus(t0, 60_000);
    console.log(
      `     the stream finished ${ms} ms after SIGTERM; new requests: ${probe}; a kept-alive connection: ${keepAlive}; exit status ${rc} after ${exitMs} ms`,
    );
    assert.equal(rc, 0, 'the exit status');
  });
} else if (MODE === 'abort') {
  test('shutdown_timeout = 1 with long requests: they end with finish_reason "abort", exit 0', async () => {
    let t0 = 0;
    let signalled;
    const signal = new Promise((r) => (signalled = r));
    // the non-streamed request runs alongside
    const plainP = post(URL_, '/v1/chat/completions', {
      model: MODEL,
      messages: [{ role: 'user', content: 'hi' }],
      max_tokens: 1000,
      ignore_eos: true,
      n: 4,
    });
    const streamP = sse(
      URL_,
      '/v1/completions',
      {
        model: MODEL,
        prompt: Array.from({ length: 8 }, (_, i) => `Story ${i}`),
        max_tokens: 1000,
        ignore_eos: true,
        stream: true,
        stream_options: { include_usage: true },
      },
      {
        onEvent: (ev, i) => {
          if (i === 0) {
            t0 = Date.now();
            process.kill(PID, 'SIGTERM');
            signalled();
          }
        },
      },
    );
    await signal;
    await sleep(100);
    const probe = await probeRefused('draining');
    const s = await streamP;
    const ms = Date.now() - t0;
    const usage = checkStream(s, 8, 'abort');
    assert.ok(usage.completion_tokens < 8000, `usage ${JSON.stringify(usage)}`);
    const plain = await plainP;
    assert.equal(plain.status, 200, plain.text);
    assert.deepEqual(
      plain.json.choices.map((c) => c.finish_reason),
      ['abort', 'abort', 'abort', 'abort'],
    );
    assert.ok(plain.json.usage.completion_tokens < 4000);
    const { rc, ms: exitMs } = await exitStatus(t0, 15_000);
    console.log(
      `     the stream ended ${ms} ms after SIGTERM; new requests: ${probe}; exit status ${rc} after ${exitMs} ms`,
    );
    assert.ok(ms >= 900, `the requests ended ${ms} ms after SIGTERM, before shutdown_timeout`);
    assert.equal(rc, 0, 'the exit status');
    assert.ok(exitMs < 8000, `exit ${exitMs} ms after SIGTERM (shutdown_timeout 1 s)`);
  });
} else {
  throw new Error(`KILN_SHUTDOWN_MODE: want drain or abort, got ${MODE}`);
}

await run(`shutdown-${MODE}`);
