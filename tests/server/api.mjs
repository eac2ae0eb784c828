// api.mjs - kiln serve end to end through the official openai package: completions and chat,
// streamed and not, n > 1, stop strings, seeds, logprobs (completions' integer logprobs with and
// without echo; chat's logprobs + top_logprobs), several prompts in one request, token-id
// prompts, usage, finish reasons, /v1/models, /tokenize and /detokenize.
// Env: KILN_URL (the server), KILN_NPM_DIR (where the openai package is installed),
// KILN_WEB_DIR (server/web: the chat page's files, which GET / must serve byte for byte).
import fs from 'node:fs';
import path from 'node:path';
import { assert, client, collect, env, get, MODEL, post, run, test, waitIdle } from './common.mjs';

const URL_ = env('KILN_URL');
const ai = client(URL_);
const PROMPT = 'Once upon a time';
const PROMPT2 = 'The little dog';
const CHAT = [
  { role: 'system', content: 'You are a helpful assistant.' },
  { role: 'user', content: 'Tell me a story about a cat.' },
];

async function tokenize(body) {
  const r = await post(URL_, '/tokenize', body);
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.count, r.json.tokens.length);
  return r.json.tokens;
}

function checkUsage(u, prompt, completion) {
  assert.ok(u, 'no usage');
  if (prompt !== undefined) assert.equal(u.prompt_tokens, prompt, 'usage.prompt_tokens');
  if (completion !== undefined) assert.equal(u.completion_tokens, completion, 'usage.completion_tokens');
  assert.equal(u.total_tokens, u.prompt_tokens + u.completion_tokens, 'usage.total_tokens');
}

const byteLen = (s) => Buffer.byteLength(s, 'utf8');

/* Checks completions' integer logprobs against its text (k alternatives per token). */
function checkCompletionLogprobs(lp, text, ntok, k, { echoTokens = 0 } = {}) {
  assert.ok(lp, 'no logprobs');
  const { tokens, token_logprobs, top_logprobs, text_offset } = lp;
  assert.equal(tokens.length, ntok, 'logprobs.tokens: one per token');
  assert.equal(token_logprobs.length, ntok);
  assert.equal(top_logprobs.length, ntok);
  assert.equal(text_offset.length, ntok);
  assert.equal(tokens.join(''), text, 'the tokens spell the text');
  let off = 0;
  for (let i = 0; i < ntok; i++) {
    assert.equal(text_offset[i], off, `text_offset[${i}]`);
    off += byteLen(tokens[i]);
    if (i === 0 && echoTokens > 0) {
      assert.equal(token_logprobs[0], null, 'the first prompt token has no logprob');
      assert.equal(top_logprobs[0], null);
      continue;
    }
    const lpv = token_logprobs[i];
    assert.ok(typeof lpv === 'number' && lpv <= 0 && Number.isFinite(lpv), `token_logprobs[${i}] = ${lpv}`);
    const top = top_logprobs[i];
    assert.ok(top && typeof top === 'object', `top_logprobs[${i}]`);
    const vals = Object.values(top);
    assert.ok(
      vals.length >= 1 && vals.length <= k,
      `top_logprobs[${i}] has ${vals.length} entries, want 1..${k}`,
    );
    for (const v of vals) assert.ok(v <= 0 && Number.isFinite(v), `top_logprobs[${i}]: ${v}`);
    // greedy: a generated token is the most likely one
    if (i >= echoTokens) assert.ok(Math.abs(Math.max(...vals) - lpv) < 1e-4, `token ${i} is not the argmax`);
  }
}

let greedy; // the reference greedy completion of PROMPT (48 tokens)

test('/v1/models lists the served model', async () => {
  const page = await ai.models.list();
  const ids = page.data.map((m) => m.id);
  assert.deepEqual(ids, [MODEL]);
  assert.equal(page.data[0].object, 'model');
  assert.equal(page.data[0].owned_by, 'kiln');
  assert.equal(page.data[0].max_model_len, 1024);
});

test('/health and /version', async () => {
  const h = await get(URL_, '/health');
  assert.equal(h.status, 200, h.text);
  const v = await get(URL_, '/version');
  assert.equal(v.status, 200);
  assert.equal(typeof v.json.version, 'string');
});

test('the chat page: /, /index.html, /chat.js, /chat.css are server/web byte for byte', async () => {
  const dir = env('KILN_WEB_DIR');
  for (const [route, file, type] of [
    ['/', 'index.html', 'text/html; charset=utf-8'],
    ['/index.html', 'index.html', 'text/html; charset=utf-8'],
    ['/chat.js', 'chat.js', 'text/javascript; charset=utf-8'],
    ['/chat.css', 'chat.css', 'text/css; charset=utf-8'],
  ]) {
    const r = await fetch(URL_ + route);
    assert.equal(r.status, 200, route);
    const want = fs.readFileSync(path.join(dir, file));
    const got = Buffer.from(await r.arrayBuffer());
    assert.ok(got.equals(want), `${route}: ${got.length} bytes, ${file} has ${want.length}`);
    assert.equal(r.headers.get('content-type'), type, route);
    assert.equal(r.headers.get('x-content-type-options'), 'nosniff', route);
    assert.match(r.headers.get('content-security-policy') || '', /default-src 'self'/, route);
    const h = await fetch(URL_ + route, { method: 'HEAD' });
    assert.equal(h.status, 200);
    assert.equal(Number(h.headers.get('content-length')), want.length, `HEAD ${route}`);
    assert.equal((await h.arrayBuffer()).byteLength, 0, `HEAD ${route}: a body`);
  }
  // the page refers to nothing outside this server (no CDN)
  const html = fs.readFileSync(path.join(dir, 'index.html'), 'utf8');
  const js = fs.readFileSync(path.join(dir, 'chat.js'), 'utf8');
  const css = fs.readFileSync(path.join(dir, 'chat.css'), 'utf8');
  for (const [name, text] of [['index.html', html], ['chat.js', js], ['chat.css', css]])
    assert.doesNotMatch(text, /(https?:)?\/\/[a-z0-9.-]+\.[a-z]{2,}\//i, `${name} loads something from elsewhere`);
});

test('/tokenize then /detokenize round-trips (text, Unicode, chat messages)', async () => {
  for (const text of [PROMPT, 'Hello, world! Ünïcödé ✓ 日本語 🙂', '  spaces\tand\nnewlines  ']) {
    const r = await post(URL_, '/tokenize', { model: MODEL, prompt: text });
    assert.equal(r.status, 200, r.text);
    assert.equal(r.json.count, r.json.tokens.length);
    assert.equal(r.json.max_model_len, 1024);
    assert.ok(r.json.tokens.every((t) => Number.isInteger(t) && t >= 0 && t < 4096));
    const d = await post(URL_, '/detokenize', { model: MODEL, tokens: r.json.tokens });
    assert.equal(d.status, 200, d.text);
    assert.equal(d.json.prompt, text);
  }
  const m = await post(URL_, '/tokenize', { messages: CHAT });
  assert.equal(m.status, 200, m.text);
  const d = await post(URL_, '/detokenize', { tokens: m.json.tokens });
  assert.match(d.json.prompt, /<\|im_start\|>user\nTell me a story about a cat\.<\|im_end\|>/);
  assert.ok(d.json.prompt.endsWith('<|im_start|>assistant\n'), d.json.prompt);
});

test('completions: greedy, not streamed; finish_reason "length"; usage', async () => {
  const ids = await tokenize({ prompt: PROMPT });
  const r = await ai.completions.create({
    model: MODEL,
    prompt: PROMPT,
    max_tokens: 48,
    temperature: 0,
    ignore_eos: true,
  });
  assert.equal(r.object, 'text_completion');
  assert.equal(r.model, MODEL);
  assert.match(r.id, /^cmpl-/);
  assert.equal(r.choices.length, 1);
  assert.equal(r.choices[0].index, 0);
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.ok(r.choices[0].text.length > 0);
  checkUsage(r.usage, ids.length, 48);
  greedy = r.choices[0].text;
  // the same again: greedy is deterministic
  const r2 = await ai.completions.create({
    model: MODEL,
    prompt: PROMPT,
    max_tokens: 48,
    temperature: 0,
    ignore_eos: true,
  });
  assert.equal(r2.choices[0].text, greedy);
  // the model field may be left out
  const r3 = await post(URL_, '/v1/completions', {
    prompt: PROMPT,
    max_tokens: 48,
    temperature: 0,
    ignore_eos: true,
  });
  assert.equal(r3.status, 200, r3.text);
  assert.equal(r3.json.choices[0].text, greedy);
});

test('completions: streamed greedy text equals the non-streamed text; usage chunk', async () => {
  const s = await ai.completions.create({
    model: MODEL,
    prompt: PROMPT,
    max_tokens: 48,
    temperature: 0,
    ignore_eos: true,
    stream: true,
    stream_options: { include_usage: true },
  });
  const c = await collect(s);
  assert.equal(c.text[0], greedy);
  assert.equal(c.finish[0], 'length');
  assert.ok(c.chunks >= 3, `only ${c.chunks} chunks`);
  const ids = await tokenize({ prompt: PROMPT });
  checkUsage(c.usage, ids.length, 48);
});

test('completions: the same seed gives the same text, streamed or not', async () => {
  const base = {
    model: MODEL,
    prompt: PROMPT,
    max_tokens: 40,
    temperature: 0.9,
    top_p: 0.95,
    ignore_eos: true,
  };
  const a = await ai.completions.create({ ...base, seed: 1234 });
  const b = await ai.completions.create({ ...base, seed: 1234 });
  assert.equal(b.choices[0].text, a.choices[0].text);
  const s = await collect(await ai.completions.create({ ...base, seed: 1234, stream: true }));
  assert.equal(s.text[0], a.choices[0].text);
  const others = [];
  for (const seed of [1, 2, 3]) others.push((await ai.completions.create({ ...base, seed })).choices[0].text);
  assert.ok(
    others.some((t) => t !== a.choices[0].text),
    'other seeds all gave the same text',
  );
});

test('completions: n > 1 (seeded), streamed per index equals non-streamed', async () => {
  const base = {
    model: MODEL,
    prompt: PROMPT,
    n: 3,
    max_tokens: 24,
    temperature: 1.0,
    seed: 77,
    ignore_eos: true,
  };
  const r = await ai.completions.create(base);
  assert.deepEqual(
    r.choices.map((c) => c.index),
    [0, 1, 2],
  );
  assert.ok(r.choices.every((c) => c.finish_reason === 'length' && c.text.length > 0));
  assert.ok(new Set(r.choices.map((c) => c.text)).size > 1, 'n = 3 samples are all the same');
  const ids = await tokenize({ prompt: PROMPT });
  checkUsage(r.usage, ids.length, 72);
  const s = await collect(
    await ai.completions.create({ ...base, stream: true, stream_options: { include_usage: true } }),
  );
  assert.deepEqual(
    s.text,
    r.choices.map((c) => c.text),
  );
  assert.deepEqual(s.finish, ['length', 'length', 'length']);
  checkUsage(s.usage, ids.length, 72);
});

test('completions: several prompts in one request (x n = 2), text and token-id prompts', async () => {
  const ids1 = await tokenize({ prompt: PROMPT });
  const ids2 = await tokenize({ prompt: PROMPT2 });
  const one = async (prompt) =>
    (await ai.completions.create({ model: MODEL, prompt, max_tokens: 16, temperature: 0, ignore_eos: true }))
      .choices[0].text;
  const g1 = await one(PROMPT);
  const g2 = await one(PROMPT2);
  assert.equal(g1, greedy.slice(0, g1.length));
  for (const prompt of [
    [PROMPT, PROMPT2],
    [ids1, ids2],
  ]) {
    const r = await ai.completions.create({
      model: MODEL,
      prompt,
      n: 2,
      max_tokens: 16,
      temperature: 0,
      ignore_eos: true,
    });
    assert.deepEqual(
      r.choices.map((c) => c.index),
      [0, 1, 2, 3],
    );
    assert.deepEqual(
      r.choices.map((c) => c.text),
      [g1, g1, g2, g2],
    );
    checkUsage(r.usage, ids1.length + ids2.length, 64);
    const s = await collect(
      await ai.completions.create({
        model: MODEL,
        prompt,
        n: 2,
        max_tokens: 16,
        temperature: 0,
        ignore_eos: true,
        stream: true,
        stream_options: { include_usage: true },
      }),
    );
    assert.deepEqual(s.text, [g1, g1, g2, g2]);
    assert.deepEqual(s.finish, ['length', 'length', 'length', 'length']);
    checkUsage(s.usage, ids1.length + ids2.length, 64);
  }
});

test('completions: beam search (use_beam_search + best_of, beam_width), best first', async () => {
  const r = await ai.completions.create({
    model: MODEL,
    prompt: PROMPT,
    max_tokens: 8,
    n: 3,
    best_of: 4,
    use_beam_search: true,
    length_penalty: 1.0,
    early_stopping: 'never',
  });
  assert.deepEqual(
    r.choices.map((c) => c.index),
    [0, 1, 2],
  );
  for (const c of r.choices) {
    assert.ok(c.text.length > 0);
    assert.ok(c.finish_reason === 'stop' || c.finish_reason === 'length');
  }
  // width 1 is greedy search
  const g = await ai.completions.create({
    model: MODEL,
    prompt: PROMPT,
    max_tokens: 48,
    ignore_eos: true,
    beam_width: 1,
  });
  assert.equal(g.choices[0].text, greedy);
});

test('completions: a token-id prompt gives the same text as the text prompt', async () => {
  const ids = await tokenize({ prompt: PROMPT });
  const r = await ai.completions.create({
    model: MODEL,
    prompt: ids,
    max_tokens: 48,
    temperature: 0,
    ignore_eos: true,
  });
  assert.equal(r.choices[0].text, greedy);
  checkUsage(r.usage, ids.length, 48);
  // echo of a token-id prompt gives its text back
  const e = await ai.completions.create({
    model: MODEL,
    prompt: ids,
    max_tokens: 4,
    temperature: 0,
    echo: true,
    ignore_eos: true,
  });
  assert.ok(e.choices[0].text.startsWith(PROMPT), e.choices[0].text);
});

test('completions: stop strings end the text before the match (finish_reason "stop"), streamed too', async () => {
  // a piece from the middle of the greedy text, with a letter in it
  let at = -1;
  for (let i = 8; i + 3 <= greedy.length; i++)
    if (/[a-z]/i.test(greedy.slice(i, i + 3))) {
      at = i;
      break;
    }
  assert.ok(at > 0, `no stop piece in ${JSON.stringify(greedy)}`);
  const piece = greedy.slice(at, at + 3);
  const want = greedy.slice(0, greedy.indexOf(piece));
  const base = { model: MODEL, prompt: PROMPT, max_tokens: 48, temperature: 0, ignore_eos: true };
  const r = await ai.completions.create({ ...base, stop: [piece, 'NEVER-IN-TEXT'] });
  assert.equal(r.choices[0].text, want);
  assert.equal(r.choices[0].finish_reason, 'stop');
  assert.equal(r.choices[0].stop_reason, piece);
  assert.ok(r.usage.completion_tokens < 48, 'generation went on past the stop string');
  const s = await collect(await ai.completions.create({ ...base, stop: piece, stream: true }));
  assert.equal(s.text[0], want);
  assert.equal(s.finish[0], 'stop');
  // include_stop_str_in_output (vLLM) keeps the match
  const inc = await ai.completions.create({ ...base, stop: [piece], include_stop_str_in_output: true });
  assert.equal(inc.choices[0].text, want + piece);
});

test('finish_reason "stop" at end of sequence vs "length" at max_tokens', async () => {
  // greedy chat answers of the embedded model end with <|im_end|> well within 200 tokens
  let found = null;
  for (const topic of ['a cat', 'the sea', 'a dog', 'the moon', 'a tree']) {
    const messages = [{ role: 'user', content: `Tell me a story about ${topic}.` }];
    const r = await ai.chat.completions.create({ model: MODEL, messages, max_tokens: 200, temperature: 0 });
    if (r.choices[0].finish_reason === 'stop') {
      found = { messages, r };
      break;
    }
    assert.equal(r.choices[0].finish_reason, 'length');
    assert.equal(r.usage.completion_tokens, 200);
  }
  assert.ok(found, 'no greedy chat answer ended before 200 tokens');
  const { messages, r } = found;
  const n = r.usage.completion_tokens;
  assert.ok(n >= 2 && n < 200, `completion_tokens ${n}`);
  assert.ok(!r.choices[0].message.content.includes('<|im_end|>'), 'the end token is in the text');
  const s = await collect(
    await ai.chat.completions.create({
      model: MODEL,
      messages,
      max_tokens: 200,
      temperature: 0,
      stream: true,
    }),
  );
  assert.equal(s.text[0], r.choices[0].message.content);
  assert.equal(s.finish[0], 'stop');
  // one token fewer than it needed: cut at max_tokens
  const short = await ai.chat.completions.create({
    model: MODEL,
    messages,
    max_tokens: n - 1,
    temperature: 0,
  });
  assert.equal(short.choices[0].finish_reason, 'length');
  assert.equal(short.usage.completion_tokens, n - 1);
  assert.ok(r.choices[0].message.content.startsWith(short.choices[0].message.content));
  // ignore_eos runs to max_tokens
  const ign = await ai.chat.completions.create({
    model: MODEL,
    messages,
    max_tokens: n + 5,
    temperature: 0,
    ignore_eos: true,
  });
  assert.equal(ign.choices[0].finish_reason, 'length');
  assert.equal(ign.usage.completion_tokens, n + 5);
});

test('completions: integer logprobs, streamed and not', async () => {
  const base = {
    model: MODEL,
    prompt: PROMPT,
    max_tokens: 12,
    temperature: 0,
    ignore_eos: true,
    logprobs: 3,
  };
  const r = await ai.completions.create(base);
  const c = r.choices[0];
  assert.equal(c.text, greedy.slice(0, c.text.length));
  checkCompletionLogprobs(c.logprobs, c.text, 12, 3);
  const s = await collect(await ai.completions.create({ ...base, stream: true }));
  assert.equal(s.text[0], c.text);
  assert.deepEqual(s.lp[0].tokens, c.logprobs.tokens);
  assert.deepEqual(s.lp[0].token_logprobs, c.logprobs.token_logprobs);
  assert.deepEqual(s.lp[0].top_logprobs, c.logprobs.top_logprobs);
  assert.deepEqual(s.lp[0].text_offset, c.logprobs.text_offset);
  // logprobs: 0 gives the sampled token's logprob only
  const z = await ai.completions.create({ ...base, logprobs: 0, max_tokens: 4 });
  assert.equal(z.choices[0].logprobs.token_logprobs.length, 4);
});

test('completions: echo, with and without logprobs, streamed and not', async () => {
  const ids = await tokenize({ prompt: PROMPT });
  const base = { model: MODEL, prompt: PROMPT, max_tokens: 6, temperature: 0, ignore_eos: true, echo: true };
  const plain = await ai.completions.create(base);
  assert.equal(plain.choices[0].text, PROMPT + greedy.slice(0, plain.choices[0].text.length - PROMPT.length));
  assert.ok(plain.choices[0].text.length > PROMPT.length);
  checkUsage(plain.usage, ids.length, 6);
  const r = await ai.completions.create({ ...base, logprobs: 2 });
  const c = r.choices[0];
  assert.equal(c.text, plain.choices[0].text);
  checkCompletionLogprobs(c.logprobs, c.text, ids.length + 6, 2, { echoTokens: ids.length });
  assert.equal(c.logprobs.tokens.slice(0, ids.length).join(''), PROMPT);
  checkUsage(r.usage, ids.length, 6);
  const s = await collect(await ai.completions.create({ ...base, logprobs: 2, stream: true }));
  assert.equal(s.text[0], c.text);
  assert.deepEqual(s.lp[0].tokens, c.logprobs.tokens);
  assert.deepEqual(s.lp[0].token_logprobs, c.logprobs.token_logprobs);
  // two prompts, echo each
  const two = await ai.completions.create({ ...base, prompt: [PROMPT, PROMPT2] });
  assert.ok(two.choices[0].text.startsWith(PROMPT));
  assert.ok(two.choices[1].text.startsWith(PROMPT2));
});

test('chat: greedy and seeded, streamed text equals non-streamed; usage matches /tokenize', async () => {
  const promptIds = await tokenize({ messages: CHAT });
  for (const extra of [{ temperature: 0 }, { temperature: 0.8, seed: 99 }]) {
    const base = { model: MODEL, messages: CHAT, max_tokens: 32, ignore_eos: true, ...extra };
    const r = await ai.chat.completions.create(base);
    assert.equal(r.object, 'chat.completion');
    assert.match(r.id, /^chatcmpl-/);
    assert.equal(r.choices[0].message.role, 'assistant');
    assert.equal(typeof r.choices[0].message.content, 'string');
    assert.equal(r.choices[0].finish_reason, 'length');
    checkUsage(r.usage, promptIds.length, 32);
    const stream = await ai.chat.completions.create({
      ...base,
      stream: true,
      stream_options: { include_usage: true },
    });
    let first = true;
    const chunks = [];
    for await (const ch of stream) {
      chunks.push(ch);
      if (ch.choices.length && first) {
        assert.equal(ch.choices[0].delta.role, 'assistant', 'the first chunk carries the role');
        first = false;
      }
      assert.equal(ch.object, 'chat.completion.chunk');
    }
    const text = chunks.flatMap((ch) => ch.choices.map((c) => c.delta.content ?? '')).join('');
    assert.equal(text, r.choices[0].message.content);
    const last = chunks[chunks.length - 1];
    assert.deepEqual(last.choices, []);
    checkUsage(last.usage, promptIds.length, 32);
    const fin = chunks.filter((ch) => ch.choices.length && ch.choices[0].finish_reason);
    assert.equal(fin.length, 1);
    assert.equal(fin[0].choices[0].finish_reason, 'length');
  }
});

test('chat: n > 1, stop strings, max_completion_tokens', async () => {
  const base = { model: MODEL, messages: CHAT, temperature: 1.0, seed: 5, ignore_eos: true };
  const r = await ai.chat.completions.create({ ...base, n: 2, max_tokens: 16 });
  assert.deepEqual(
    r.choices.map((c) => c.index),
    [0, 1],
  );
  checkUsage(r.usage, undefined, 32);
  const s = await collect(await ai.chat.completions.create({ ...base, n: 2, max_tokens: 16, stream: true }));
  assert.deepEqual(
    s.text,
    r.choices.map((c) => c.message.content),
  );
  const g = await ai.chat.completions.create({
    model: MODEL,
    messages: CHAT,
    temperature: 0,
    max_completion_tokens: 24,
    ignore_eos: true,
  });
  assert.equal(g.usage.completion_tokens, 24);
  const text = g.choices[0].message.content;
  const at = text.slice(1).search(/[a-z]{2}/i) + 1; // a piece after the start
  assert.ok(at > 0, text);
  const piece = text.slice(at, at + 2);
  const st = await ai.chat.completions.create({
    model: MODEL,
    messages: CHAT,
    temperature: 0,
    max_tokens: 24,
    ignore_eos: true,
    stop: [piece],
  });
  assert.equal(st.choices[0].message.content, text.slice(0, text.indexOf(piece)));
  assert.equal(st.choices[0].finish_reason, 'stop');
});

test('chat: logprobs + top_logprobs, streamed and not', async () => {
  const base = {
    model: MODEL,
    messages: CHAT,
    max_tokens: 10,
    temperature: 0,
    ignore_eos: true,
    logprobs: true,
    top_logprobs: 2,
  };
  const r = await ai.chat.completions.create(base);
  const content = r.choices[0].logprobs.content;
  assert.equal(content.length, 10);
  assert.equal(content.map((t) => t.token).join(''), r.choices[0].message.content);
  for (const t of content) {
    assert.ok(t.logprob <= 0 && Number.isFinite(t.logprob));
    assert.deepEqual(t.bytes, [...Buffer.from(t.token, 'utf8')]);
    assert.equal(t.top_logprobs.length, 2);
    assert.ok(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob);
    assert.ok(Math.abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4, 'greedy picks the top token');
    assert.equal(t.top_logprobs[0].token, t.token);
    for (const a of t.top_logprobs) assert.deepEqual(a.bytes, [...Buffer.from(a.token, 'utf8')]);
  }
  const s = await collect(await ai.chat.completions.create({ ...base, stream: true }));
  assert.equal(s.text[0], r.choices[0].message.content);
  assert.deepEqual(s.lp[0].content, content);
  // logprobs without top_logprobs: no alternatives
  const plain = await ai.chat.completions.create({ ...base, top_logprobs: undefined, max_tokens: 3 });
  assert.equal(plain.choices[0].logprobs.content.length, 3);
  assert.ok(plain.choices[0].logprobs.content.every((t) => t.top_logprobs.length === 0));
  // no logprobs asked: null
  const none = await ai.chat.completions.create({ model: MODEL, messages: CHAT, max_tokens: 3 });
  assert.equal(none.choices[0].logprobs, null);
});

test('chat: content given as a list of text parts equals the plain string', async () => {
  const parts = [
    {
      role: 'user',
      content: [
        { type: 'text', text: 'Tell me a story' },
        { type: 'text', text: 'about a cat.' },
      ],
    },
  ];
  const str = [{ role: 'user', content: 'Tell me a story\nabout a cat.' }];
  const a = await ai.chat.completions.create({
    model: MODEL,
    messages: parts,
    max_tokens: 12,
    temperature: 0,
  });
  const b = await ai.chat.completions.create({ model: MODEL, messages: str, max_tokens: 12, temperature: 0 });
  assert.equal(a.choices[0].message.content, b.choices[0].message.content);
  assert.equal(a.usage.prompt_tokens, b.usage.prompt_tokens);
});

test('afterwards the server is idle: no KV block used, no request running', async () => {
  await waitIdle(URL_, 3000);
});

await run('api');
