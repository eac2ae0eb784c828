// disconnect.mjs - 64 concurrent streaming clients, a third of which go away at random points
// (an aborted SDK stream, a destroyed socket mid-stream, a socket closed before the response or
// in the middle of the request body), then non-streaming clients that go away while they wait:
// every other request completes in full, afterwards every KV block is free and no request runs,
// and the server still answers correctly.
// Env: KILN_URL, KILN_NPM_DIR; KILN_TEST_SEED replays a schedule (printed at the start).
import {
  assert,
  client,
  collect,
  env,
  metrics,
  MODEL,
  post,
  rawRequest,
  rng,
  run,
  sleep,
  test,
  waitIdle,
} from './common.mjs';

const URL_ = env('KILN_URL');
const ai = client(URL_);
const SEED = Number(process.env.KILN_TEST_SEED || Math.floor(Math.random() * 1e9));
console.log(`disconnect: seed ${SEED} (KILN_TEST_SEED=${SEED} replays it)`);
const rand = rng(SEED);
const randInt = (lo, hi) => lo + Math.floor(rand() * (hi - lo + 1));

const REF = { model: MODEL, prompt: 'Once upon a time', max_tokens: 24, temperature: 0, ignore_eos: true };
let reference;

function body(i, spec) {
  const common = {
    model: MODEL,
    max_tokens: spec.max,
    n: spec.n,
    temperature: 0.7,
    seed: i,
    ignore_eos: true,
  };
  return spec.chat
    ? { ...common, messages: [{ role: 'user', content: `Story number ${i}, about a ${spec.word}.` }] }
    : { ...common, prompt: `Story number ${i}: the ${spec.word}` };
}

/* A raw streaming request whose socket is destroyed after `after` data chunks (0: as soon as the
 * response head arrives). Resolves with what happened. */
function destroyMidStream(route, b, after) {
  return new Promise((resolve) => {
    const raw = JSON.stringify({ ...b, stream: true });
    const req = rawRequest(URL_, route, {
      headers: { 'content-type': 'application/json', 'content-length': Buffer.byteLength(raw) },
    });
    let chunks = 0;
    req.on('response', (res) => {
      if (res.statusCode !== 200) {
        resolve({ status: res.statusCode });
        req.destroy();
        return;
      }
      if (after === 0) {
        req.destroy();
        resolve({ status: 200, chunks });
        return;
      }
      res.on('data', () => {
        if (++chunks >= after) {
          res.destroy();
          req.destroy();
          resolve({ status: 200, chunks });
        }
      });
      res.on('end', () => resolve({ status: 200, chunks, ended: true }));
      res.on('error', () => {});
    });
    req.on('error', () => resolve({ status: 0, chunks }));
    req.end(raw);
  });
}

/* Sends the whole request, then closes the socket after `ms` ms, likely before any response. */
function destroyEarly(route, b, ms) {
  return new Promise((resolve) => {
    const raw = JSON.stringify(b);
    const req = rawRequest(URL_, route, {
      headers: { 'content-type': 'application/json', 'content-length': Buffer.byteLength(raw) },
    });
    req.on('error', () => {});
    req.on('response', (res) => res.on('error', () => {}));
    req.end(raw);
    setTimeout(() => {
      req.destroy();
      resolve({ status: 0 });
    }, ms);
  });
}

/* Sends the head and half of the body, then closes the socket. */
function destroyMidBody(route, b) {
  return new Promise((resolve) => {
    const raw = JSON.stringify(b);
    const req = rawRequest(URL_, route, {
      headers: { 'content-type': 'application/json', 'content-length': Buffer.byteLength(raw) },
    });
    req.on('error', () => {});
    req.write(raw.slice(0, raw.length >> 1));
    setTimeout(() => {
      req.destroy();
      resolve({ status: 0 });
    }, 20);
  });
}

/* An SDK stream aborted (AbortController) after `after` chunks. */
async function sdkAbort(spec, b, after) {
  const ac = new AbortController();
  const api = spec.chat ? ai.chat.completions : ai.completions;
  let chunks = 0;
  try {
    const stream = await api.create({ ...b, stream: true }, { signal: ac.signal });
    if (after === 0) ac.abort();
    for await (const _ of stream) {
      if (++chunks >= after) ac.abort();
    }
    return { status: 200, chunks, ended: true };
  } catch (e) {
    if (e.name === 'APIUserAbortError' || e.name === 'AbortError' || ac.signal.aborted)
      return { status: 200, chunks };
    throw e;
  }
}

test('reference greedy completion', async () => {
  reference = (await ai.completions.create(REF)).choices[0].text;
  assert.ok(reference.length > 0);
  await waitIdle(URL_, 3000);
});

test('64 concurrent streams, a third of them disconnecting at random points', async () => {
  const before = await metrics(URL_);
  const modes = ['sdk-abort', 'socket-destroy', 'before-response', 'mid-body'];
  const words = ['cat', 'dog', 'ship', 'tree', 'moon', 'king'];
  const specs = [];
  for (let i = 0; i < 64; i++)
    specs.push({
      chat: i % 2 === 1,
      n: rand() < 0.25 ? 2 : 1,
      max: randInt(24, 96),
      word: words[i % words.length],
      leave: i % 3 === 0 ? modes[(i / 3) % modes.length] : null,
      after: randInt(0, 12),
      ms: randInt(0, 40),
    });
  const leaving = specs.filter((s) => s.leave).length;
  console.log(
    `     ${leaving} of 64 clients disconnect: ` +
      modes.map((m) => `${m} ${specs.filter((s) => s.leave === m).length}`).join(', '),
  );
  const results = await Promise.all(
    specs.map(async (spec, i) => {
      const b = body(i, spec);
      const route = spec.chat ? '/v1/chat/completions' : '/v1/completions';
      switch (spec.leave) {
        case 'sdk-abort':
          return sdkAbort(spec, b, spec.after);
        case 'socket-destroy':
          return destroyMidStream(route, b, spec.after);
        case 'before-response':
          return destroyEarly(route, { ...b, stream: true }, spec.ms);
        case 'mid-body':
          return destroyMidBody(route, { ...b, stream: true });
      }
      const api = spec.chat ? ai.chat.completions : ai.completions;
      const c = await collect(
        await api.create({ ...b, stream: true, stream_options: { include_usage: true } }),
      );
      return { status: 200, full: c };
    }),
  );
  let complete = 0;
  results.forEach((r, i) => {
    const spec = specs[i];
    if (spec.leave) return;
    const c = r.full;
    assert.equal(c.text.length, spec.n, `client ${i}: ${c.text.length} choices, want ${spec.n}`);
    for (let k = 0; k < spec.n; k++) {
      assert.equal(c.finish[k], 'length', `client ${i} choice ${k}: finish_reason ${c.finish[k]}`);
      assert.ok(c.text[k].length > 0, `client ${i} choice ${k}: no text`);
    }
    assert.equal(c.usage.completion_tokens, spec.n * spec.max, `client ${i}: usage`);
    complete++;
  });
  assert.equal(complete, 64 - leaving);
  const m = await waitIdle(URL_, 3000);
  const aborted =
    m['kiln:request_success_total{model_name="kiln-tiny",finished_reason="abort"}'] -
    before['kiln:request_success_total{model_name="kiln-tiny",finished_reason="abort"}'];
  console.log(`     ${aborted} engine requests were aborted`);
  assert.ok(aborted >= 1, 'no request was aborted');
});

test('the server still answers correctly after the disconnects', async () => {
  const r = await ai.completions.create(REF);
  assert.equal(r.choices[0].text, reference);
  const s = await collect(await ai.completions.create({ ...REF, stream: true }));
  assert.equal(s.text[0], reference);
  const h = await fetch(URL_ + '/health');
  assert.equal(h.status, 200);
});

test('non-streaming clients that go away while they wait are cancelled too', async () => {
  const long = { model: MODEL, prompt: 'A very long story', max_tokens: 900, ignore_eos: true };
  const t0 = Date.now();
  const results = await Promise.all([
    ...Array.from({ length: 6 }, (_, i) =>
      destroyEarly('/v1/completions', { ...long, seed: i }, 100 + 50 * i),
    ),
    ...Array.from({ length: 4 }, (_, i) =>
      post(URL_, '/v1/completions', { model: MODEL, prompt: `Short ${i}`, max_tokens: 8, ignore_eos: true }),
    ),
  ]);
  for (const r of results.slice(6)) {
    assert.equal(r.status, 200, r.text);
    assert.equal(r.json.usage.completion_tokens, 8);
  }
  // six 900-token requests would keep the engine busy for seconds; cancelled, they stop at once
  await waitIdle(URL_, 3000);
  console.log(`     idle ${Date.now() - t0} ms after the start`);
  const r = await ai.completions.create(REF);
  assert.equal(r.choices[0].text, reference);
});

await run('disconnect');
