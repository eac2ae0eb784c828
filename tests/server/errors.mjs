// errors.mjs - bad requests and refusals, each with the right status and an OpenAI-style error
// body {"error": {"message", "type", "param", "code"}} naming the field where there is one, the
// server staying up after each: malformed JSON, wrong types, out-of-range values, prompts past
// the 1024-token context, unknown routes (404), wrong methods (405), unknown models (404); on a
// server with an API key and a 1 KiB body limit: 401 without the right key (/health, /metrics
// stay open), 413 for a larger body (with a Content-Length or chunked); on a server with one
// sequence and a queue of one: 503 with Retry-After under a flood, /health 200 afterwards; on a
// server with a 0.5 s request_timeout: 504 (and an error event in a stream).
// Env: KILN_URL, KILN_URL_AUTH + KILN_AUTH_KEY, KILN_URL_QUEUE, KILN_URL_TIMEOUT, KILN_NPM_DIR.
import {
  APIError,
  assert,
  assertError,
  client,
  collect,
  env,
  get,
  MODEL,
  post,
  rawRequest,
  run,
  sse,
  test,
  waitIdle,
} from './common.mjs';

const URL_ = env('KILN_URL');
const URL_AUTH = env('KILN_URL_AUTH');
const KEY = env('KILN_AUTH_KEY');
const URL_QUEUE = env('KILN_URL_QUEUE');
const URL_TIMEOUT = env('KILN_URL_TIMEOUT');
const ai = client(URL_);
const REF = { model: MODEL, prompt: 'Once upon a time', max_tokens: 16, temperature: 0, ignore_eos: true };
let reference;

/* The server still answers a known request with the known text. */
async function stillUp(url = URL_, headers = {}) {
  const h = await get(url, '/health');
  assert.equal(h.status, 200, `/health: ${h.status} ${h.text}`);
  const r = await post(url, '/v1/completions', REF, { headers });
  assert.equal(r.status, 200, r.text);
  if (reference !== undefined) assert.equal(r.json.choices[0].text, reference);
  return r.json.choices[0].text;
}

/* Expects the SDK call to throw an APIError with this status (and param); returns it. */
async function sdkError(promise, status, param) {
  try {
    await promise;
  } catch (e) {
    assert.ok(e instanceof APIError, `not an APIError: ${e}`);
    assert.equal(e.status, status, `status: ${e.message}`);
    assert.equal(e.error?.code, status);
    if (param !== undefined) assert.equal(e.param, param, `param: ${e.message}`);
    return e;
  }
  assert.fail(`the request succeeded; want ${status}`);
}

/* Sends a body with Transfer-Encoding: chunked (no Content-Length), in pieces. */
function chunked(url, route, text, headers = {}) {
  return new Promise((resolve, reject) => {
    const req = rawRequest(url, route, { headers: { 'content-type': 'application/json', ...headers } });
    req.on('response', (res) => {
      let data = '';
      res.on('data', (d) => (data += d));
      res.on('end', () => {
        let json;
        try {
          json = JSON.parse(data);
        } catch {}
        resolve({ status: res.statusCode, headers: res.headers, text: data, json });
      });
    });
    req.on('error', reject);
    for (let i = 0; i < text.length; i += 300) req.write(text.slice(i, i + 300));
    req.end();
  });
}

test('reference', async () => {
  reference = await stillUp();
});

test('malformed JSON, an empty body, a body that is not an object: 400', async () => {
  for (const route of ['/v1/completions', '/v1/chat/completions', '/tokenize', '/detokenize']) {
    let e = assertError(await post(URL_, route, '{"prompt": "x",'), 400, {
      param: null,
      type: 'invalid_request_error',
    });
    assert.match(e.message, /JSON/);
    assertError(await post(URL_, route, ''), 400, { param: null });
    assertError(await post(URL_, route, '[1, 2]'), 400, { param: null, message: /object/ });
    assertError(await post(URL_, route, '"just a string"'), 400, { param: null });
  }
  await stillUp();
});

test('wrong types and out-of-range values name the field', async () => {
  const C = '/v1/completions';
  const H = '/v1/chat/completions';
  const msgs = [{ role: 'user', content: 'hi' }];
  const cases = [
    [C, {}, 'prompt'],
    [C, { prompt: 5 }, 'prompt'],
    [C, { prompt: '' }, 'prompt'],
    [C, { prompt: [] }, 'prompt'],
    [C, { prompt: [1, 'x'] }, 'prompt'],
    [C, { prompt: [1, 99999] }, 'prompt'],
    [C, { prompt: [{ a: 1 }] }, 'prompt'],
    [C, { prompt: 'x', max_tokens: '10' }, 'max_tokens'],
    [C, { prompt: 'x', max_tokens: 1.5 }, 'max_tokens'],
    [C, { prompt: 'x', max_tokens: 0 }, 'max_tokens'],
    [C, { prompt: 'x', max_tokens: -1 }, 'max_tokens'],
    [C, { prompt: 'x', temperature: 'hot' }, 'temperature'],
    [C, { prompt: 'x', temperature: -0.5 }, 'temperature'],
    [C, { prompt: 'x', top_p: 0 }, 'top_p'],
    [C, { prompt: 'x', top_p: 1.5 }, 'top_p'],
    [C, { prompt: 'x', n: 0 }, 'n'],
    [C, { prompt: 'x', n: 'two' }, 'n'],
    [C, { prompt: 'x', stream: 'yes' }, 'stream'],
    [C, { prompt: 'x', echo: 1 }, 'echo'],
    [C, { prompt: 'x', logprobs: 21 }, 'logprobs'],
    [C, { prompt: 'x', logprobs: true }, 'logprobs'],
    [C, { prompt: 'x', seed: 'abc' }, 'seed'],
    [C, { prompt: 'x', stop: 5 }, 'stop'],
    [C, { prompt: 'x', stop: [''] }, 'stop'],
    [C, { prompt: 'x', presence_penalty: 3 }, 'presence_penalty'],
    [C, { prompt: 'x', logit_bias: { abc: 1 } }, 'logit_bias'],
    [C, { prompt: 'x', logit_bias: { 5: 200 } }, 'logit_bias'],
    [C, { prompt: 'x', stream_options: { include_usage: true } }, 'stream_options'],
    [C, { prompt: 'x', model: 5 }, 'model'],
    [C, { prompt: 'x', best_of: 3 }, 'best_of'],
    [C, { prompt: 'x', beam_width: 2, stream: true }, 'stream'],
    [C, { prompt: 'x', use_beam_search: true, best_of: 2, n: 3 }, 'n'],
    [C, { prompt: 'x', beam_width: 2, logprobs: 1 }, 'logprobs'],
    [C, { prompt: 'x', length_penalty: 2 }, 'length_penalty'],
    [C, { prompt: 'x', beam_width: 2, early_stopping: 'soon' }, 'early_stopping'],
    [H, {}, 'messages'],
    [H, { messages: 'hi' }, 'messages'],
    [H, { messages: [] }, 'messages'],
    [H, { messages: [{ content: 'hi' }] }, 'messages'],
    [H, { messages: [{ role: 'user', content: 5 }] }, 'messages'],
    [
      H,
      { messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'x' } }] }] },
      'messages',
    ],
    [H, { messages: msgs, max_completion_tokens: -3 }, 'max_completion_tokens'],
    [H, { messages: msgs, top_logprobs: 2 }, 'top_logprobs'],
    [H, { messages: msgs, logprobs: 'yes' }, 'logprobs'],
    [H, { messages: msgs, top_logprobs: 50, logprobs: true }, 'top_logprobs'],
    [H, { messages: msgs, echo: true }, 'echo'],
    [H, { messages: msgs, tools: {} }, 'tools'],
    [H, { messages: msgs, response_format: { type: 'json_schema' } }, 'response_format'],
    ['/tokenize', { prompt: 5 }, 'prompt'],
    ['/detokenize', { tokens: 'abc' }, 'tokens'],
    ['/detokenize', { tokens: [1, -2] }, 'tokens'],
    ['/detokenize', { tokens: [99999] }, 'tokens'],
  ];
  for (const [route, body, param] of cases) {
    const r = await post(URL_, route, body);
    const e = assertError(r, 400, { param, type: 'invalid_request_error' });
    assert.ok(
      e.message.includes(param) || param === 'messages' || param === 'prompt',
      `${JSON.stringify(body)}: ${e.message}`,
    );
  }
  await stillUp();
});

test('through the SDK: a negative max_tokens is a BadRequestError naming max_tokens', async () => {
  const e = await sdkError(
    ai.completions.create({ model: MODEL, prompt: 'x', max_tokens: -1 }),
    400,
    'max_tokens',
  );
  assert.equal(e.type, 'invalid_request_error');
  assert.equal(e.constructor.name, 'BadRequestError');
  await sdkError(
    ai.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: 'x' }], max_tokens: -5 }),
    400,
    'max_tokens',
  );
  await sdkError(
    ai.completions.create({ model: MODEL, prompt: 'x', max_tokens: -1, stream: true }),
    400,
    'max_tokens',
  );
});

test('prompts longer than the 1024-token context: 400 naming prompt / messages', async () => {
  const long = Array.from({ length: 1100 }, (_, i) => 100 + (i % 500));
  let e = assertError(await post(URL_, '/v1/completions', { prompt: long, max_tokens: 4 }), 400, {
    param: 'prompt',
  });
  assert.match(e.message, /maximum context length is 1024/);
  // a text prompt past the context
  const text = 'The quick brown fox jumps over the lazy dog. '.repeat(200);
  const tok = await post(URL_, '/tokenize', { prompt: text });
  assert.ok(tok.json.count > 1024, `only ${tok.json.count} tokens`);
  e = assertError(await post(URL_, '/v1/completions', { prompt: text }), 400, {
    param: 'prompt',
    message: /1024/,
  });
  e = assertError(
    await post(URL_, '/v1/chat/completions', { messages: [{ role: 'user', content: text }] }),
    400,
    { param: 'messages', message: /1024/ },
  );
  // a prompt that fits, with max_tokens that does not
  e = assertError(
    await post(URL_, '/v1/completions', { prompt: long.slice(0, 1000), max_tokens: 100 }),
    400,
    { param: 'prompt' },
  );
  assert.match(e.message, /1100 tokens/);
  // one long prompt among short ones refuses the whole request, nothing runs
  assertError(await post(URL_, '/v1/completions', { prompt: ['short', text], max_tokens: 4 }), 400, {
    param: 'prompt',
  });
  // streamed: refused before the stream starts
  const s = await sse(URL_, '/v1/completions', { prompt: long, max_tokens: 4, stream: true });
  assertError({ status: s.status, text: s.text, json: s.json }, 400, { param: 'prompt' });
  await sdkError(ai.completions.create({ model: MODEL, prompt: long, max_tokens: 4 }), 400, 'prompt');
  await waitIdle(URL_, 2000);
  await stillUp();
});

test('unknown routes: 404', async () => {
  for (const [method, route] of [
    ['GET', '/index.htm'],
    ['GET', '/chat.js/x'],
    ['GET', '/v1/nothing'],
    ['POST', '/v1/engines'],
    ['POST', '/v2/completions'],
    ['GET', '/v1/models/kiln-tiny'],
    ['POST', '/v1/completions/x'],
  ]) {
    const r = method === 'GET' ? await get(URL_, route) : await post(URL_, route, { prompt: 'x' });
    assertError(r, 404, { param: null, type: 'not_found_error' });
  }
  await stillUp();
});

test('wrong methods: 405 with Allow', async () => {
  for (const [method, route, allow] of [
    ['GET', '/v1/completions', /POST/],
    ['GET', '/v1/chat/completions', /POST/],
    ['PUT', '/tokenize', /POST/],
    ['DELETE', '/detokenize', /POST/],
    ['POST', '/v1/models', /GET/],
    ['POST', '/health', /GET/],
    ['DELETE', '/metrics', /GET/],
    ['POST', '/', /GET/],
    ['PUT', '/chat.js', /GET/],
  ]) {
    const r =
      method === 'GET' ? await get(URL_, route) : await post(URL_, route, { prompt: 'x' }, { method });
    assertError(r, 405, { param: null });
    assert.match(r.headers.get('allow') || '', allow, `${method} ${route}: Allow ${r.headers.get('allow')}`);
  }
  await stillUp();
});

test('an unknown model: 404 naming model (completions, chat, streamed, SDK)', async () => {
  let e = assertError(await post(URL_, '/v1/completions', { model: 'gpt-4', prompt: 'x' }), 404, {
    param: 'model',
    type: 'not_found_error',
  });
  assert.match(e.message, /gpt-4/);
  assertError(
    await post(URL_, '/v1/chat/completions', { model: 'nope', messages: [{ role: 'user', content: 'x' }] }),
    404,
    { param: 'model' },
  );
  const s = await sse(URL_, '/v1/completions', { model: 'nope', prompt: 'x', stream: true });
  assertError({ status: s.status, text: s.text, json: s.json }, 404, { param: 'model' });
  const err = await sdkError(
    client(URL_).chat.completions.create({ model: 'gpt-4o', messages: [{ role: 'user', content: 'x' }] }),
    404,
    'model',
  );
  assert.equal(err.constructor.name, 'NotFoundError');
  await stillUp();
});

// ---- the server with an API key and a 1 KiB body limit ---------------------------------------

test('API key: missing or wrong gets 401 on /v1 and /tokenize; /health, /metrics, /version stay open', async () => {
  for (const headers of [
    {},
    { authorization: 'Bearer wrong' },
    { authorization: `Basic ${KEY}` },
    { authorization: `Bearer ${KEY}x` },
    { authorization: 'Bearer' },
  ]) {
    for (const route of ['/v1/completions', '/v1/chat/completions', '/tokenize', '/detokenize']) {
      const r = await post(
        URL_AUTH,
        route,
        { prompt: 'x', messages: [{ role: 'user', content: 'x' }], tokens: [1] },
        { headers },
      );
      assertError(r, 401, { param: null, type: 'authentication_error' });
      assert.match(r.headers.get('www-authenticate') || '', /Bearer/);
    }
    assertError(await get(URL_AUTH, '/v1/models', { headers }), 401);
  }
  // the chat page is public too: it asks for the key when the API wants one
  for (const route of ['/health', '/metrics', '/version', '/', '/index.html', '/chat.js', '/chat.css']) {
    const r = await get(URL_AUTH, route);
    assert.equal(r.status, 200, `${route} without a key: ${r.status}`);
  }
  const e = await sdkError(
    client(URL_AUTH, 'wrong-key').completions.create({ model: MODEL, prompt: 'x', max_tokens: 2 }),
    401,
  );
  assert.equal(e.constructor.name, 'AuthenticationError');
  // the right key
  const good = client(URL_AUTH, KEY);
  assert.deepEqual(
    (await good.models.list()).data.map((m) => m.id),
    [MODEL],
  );
  const r = await good.completions.create(REF);
  assert.equal(r.choices[0].text, reference);
  const s = await collect(
    await good.chat.completions.create({
      model: MODEL,
      messages: [{ role: 'user', content: 'hi' }],
      max_tokens: 4,
      stream: true,
    }),
  );
  assert.ok(s.text[0].length > 0);
  const t = await post(
    URL_AUTH,
    '/tokenize',
    { prompt: 'hello' },
    { headers: { authorization: `Bearer ${KEY}` } },
  );
  assert.equal(t.status, 200);
});

test('a body over max_body_bytes (1024): 413, with a Content-Length or chunked', async () => {
  const auth = { authorization: `Bearer ${KEY}` };
  const big = JSON.stringify({ prompt: 'x'.repeat(2000), max_tokens: 2 });
  let r = await post(URL_AUTH, '/v1/completions', big, { headers: auth });
  assertError(r, 413, { param: null });
  r = await chunked(URL_AUTH, '/v1/completions', big, auth);
  assertError(r, 413, { param: null });
  r = await chunked(URL_AUTH, '/tokenize', JSON.stringify({ prompt: 'y'.repeat(5000) }), auth);
  assertError(r, 413, { param: null });
  // just under the limit is fine, chunked or not
  const fits = JSON.stringify({ prompt: 'Once upon a time' + ' '.repeat(900), max_tokens: 2 });
  assert.ok(fits.length < 1024);
  r = await post(URL_AUTH, '/v1/completions', fits, { headers: auth });
  assert.equal(r.status, 200, r.text);
  r = await chunked(URL_AUTH, '/v1/completions', fits, auth);
  assert.equal(r.status, 200, r.text);
  await stillUp(URL_AUTH, auth);
});

// ---- max_queued_requests = 1, max_num_seqs = 1 -----------------------------------------------

test('queue full: 503 with Retry-After under a flood; /health 200 afterwards', async () => {
  const body = { model: MODEL, prompt: 'Flood', max_tokens: 48, ignore_eos: true, temperature: 0 };
  const results = await Promise.all(
    Array.from({ length: 24 }, (_, i) =>
      i % 4 === 3
        ? sse(URL_QUEUE, '/v1/completions', { ...body, stream: true })
        : post(
            URL_QUEUE,
            i % 2 ? '/v1/chat/completions' : '/v1/completions',
            i % 2 ? { ...body, prompt: undefined, messages: [{ role: 'user', content: 'Flood' }] } : body,
          ),
    ),
  );
  let ok = 0;
  let busy = 0;
  for (const r of results) {
    if (r.status === 200) {
      ok++;
      if (r.events) {
        assert.ok(r.done, 'a stream without [DONE]');
        assert.equal(r.events.at(-1).choices[0].finish_reason, 'length');
      } else {
        assert.equal(r.json.usage.completion_tokens, 48);
      }
      continue;
    }
    const res = r.events ? { status: r.status, text: r.text, json: r.json } : r;
    const e = assertError(res, 503, { param: null, type: 'server_busy' });
    assert.match(e.message, /queue is full/);
    assert.ok(Number(r.headers.get('retry-after')) >= 1, `Retry-After: ${r.headers.get('retry-after')}`);
    busy++;
  }
  console.log(`     ${ok} answered, ${busy} refused with 503`);
  assert.ok(busy >= 1, 'no 503 under a flood of 24 with a queue of 1');
  assert.ok(ok >= 1, 'nothing was answered');
  assert.equal(ok + busy, 24);
  // through the SDK (no retries): an InternalServerError with status 503
  const settled = await Promise.allSettled(
    Array.from({ length: 8 }, () => client(URL_QUEUE).completions.create(body)),
  );
  const refused = settled.filter((x) => x.status === 'rejected').map((x) => x.reason);
  assert.ok(refused.length >= 1, 'the SDK flood got no 503');
  for (const e of refused) {
    assert.ok(e instanceof APIError && e.status === 503, `not a 503: ${e}`);
    assert.equal(e.constructor.name, 'InternalServerError');
    assert.equal(e.type, 'server_busy');
    assert.equal(e.headers.get('retry-after'), '1');
  }
  await waitIdle(URL_QUEUE, 5000);
  await stillUp(URL_QUEUE);
  const h = await get(URL_QUEUE, '/health');
  assert.equal(h.status, 200);
  assert.deepEqual(h.json, { status: 'ok' });
});

// ---- request_timeout = 0.5 s -------------------------------------------------------------------

test('request_timeout: 504 (and an error event in a stream); the blocks are freed', async () => {
  // four 1000-token sequences take seconds on a CPU
  const long = { model: MODEL, prompt: ['Once', 'upon', 'a', 'time'], max_tokens: 1000, ignore_eos: true };
  const t0 = Date.now();
  const r = await post(URL_TIMEOUT, '/v1/completions', long);
  const ms = Date.now() - t0;
  assertError(r, 504, { param: null, message: /request_timeout/ });
  assert.ok(ms < 5000, `the 504 came after ${ms} ms`);
  const s = await sse(URL_TIMEOUT, '/v1/completions', { ...long, stream: true });
  assert.equal(s.status, 200);
  assert.ok(s.done, 'the stream did not end with [DONE]');
  const last = s.events.at(-1);
  assert.ok(last && last.error, `no error event at the end: ${JSON.stringify(last)}`);
  assert.equal(last.error.code, 504);
  assert.deepEqual(Object.keys(last.error).sort(), ['code', 'message', 'param', 'type']);
  await sdkError(
    client(URL_TIMEOUT).chat.completions.create({
      model: MODEL,
      messages: [{ role: 'user', content: 'hi' }],
      max_tokens: 1000,
      ignore_eos: true,
      n: 4,
    }),
    504,
  );
  await waitIdle(URL_TIMEOUT, 3000);
  const ok = await post(URL_TIMEOUT, '/v1/completions', { ...REF, max_tokens: 4 });
  assert.equal(ok.status, 200, ok.text);
  assert.equal((await get(URL_TIMEOUT, '/health')).status, 200);
});

test('the main server is still up and idle', async () => {
  await waitIdle(URL_, 2000);
  await stillUp();
});

await run('errors');
