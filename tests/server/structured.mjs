// structured.mjs - structured outputs through the official openai client against kiln serve
// (the embedded kiln-tiny model): every schema of tests/data/schemas/ with response_format
// json_schema, each finished output parsed and validated by ajv (with ajv-formats); a part of the
// corpus again through /v1/completions with guided_json, streamed; n > 1; json_object; regex,
// choice and GBNF grammars checked by independent matchers; logprobs of the masked distribution;
// and the 400s for constraints that cannot be compiled.
import fs from 'node:fs';
import path from 'node:path';
import { pathToFileURL } from 'node:url';
import { APIError, MODEL, assert, client, env, run, test } from './common.mjs';

const npmDir = env('KILN_NPM_DIR');
const load = async (pkg, file) =>
  import(pathToFileURL(path.join(npmDir, 'node_modules', pkg, file)).href);
const Ajv = (await load('ajv', 'dist/2020.js')).default;
const addFormats = (await load('ajv-formats', 'dist/index.js')).default;
const Ajv7 = (await load('ajv', 'dist/ajv.js')).default;
const AjvDraft4 = (await load('ajv-draft-04', 'dist/index.js')).default;

const api = client(env('KILN_URL'));
const schemaDir = env('KILN_SCHEMAS');
const MAX_TOKENS = 600;

/* A validator for a schema: its $schema draft picks the ajv class (2020-12 by default). */
function validator(schema) {
  const s = typeof schema === 'object' && schema ? schema.$schema || '' : '';
  const cls = s.includes('draft-04') ? AjvDraft4 : s.includes('draft-07') ? Ajv7 : Ajv;
  const ajv = new cls({ strict: false, allErrors: true });
  addFormats(ajv);
  return ajv.compile(schema);
}

/* KILN_SCHEMA_STRIDE=k (a sanitizer build, several times slower) takes every k-th schema. */
const stride = Number(process.env.KILN_SCHEMA_STRIDE || 1);
const corpus = fs
  .readdirSync(schemaDir)
  .filter((f) => f.endsWith('.json'))
  .sort()
  .filter((_, i) => i % stride === 0)
  .map((f) => ({ name: f.replace(/\.json$/, ''), schema: JSON.parse(fs.readFileSync(path.join(schemaDir, f), 'utf8')) }));

/* Runs fn over items with at most `width` in flight. */
async function pool(items, width, fn) {
  const out = new Array(items.length);
  let next = 0;
  await Promise.all(
    Array.from({ length: width }, async () => {
      while (next < items.length) {
        const i = next++;
        out[i] = await fn(items[i], i);
      }
    }),
  );
  return out;
}

/* Checks one output: parsed and valid when it finished; returns 'stop' or 'length'. */
function check(name, validate, text, finish) {
  if (finish === 'length') return 'length';
  assert.equal(finish, 'stop', `${name}: finish_reason ${finish}`);
  let value;
  try {
    value = JSON.parse(text);
  } catch (e) {
    assert.fail(`${name}: the output is not JSON (${e.message}): ${JSON.stringify(text)}`);
  }
  if (!validate(value))
    assert.fail(`${name}: ${JSON.stringify(text)} does not validate: ${JSON.stringify(validate.errors)}`);
  return 'stop';
}

function tally(kind, results) {
  const stop = results.filter((r) => r === 'stop').length;
  console.log(`  ${kind}: ${stop} of ${results.length} finished and validated, ${results.length - stop} hit max_tokens (${MAX_TOKENS})`);
  assert.ok(stop >= results.length * 0.9, `${kind}: only ${stop} of ${results.length} finished`);
}

test(`the corpus (${corpus.length} schemas) with response_format json_schema: every output validates`, async () => {
  assert.ok(corpus.length * stride >= 100, `the corpus has ${corpus.length * stride} schemas`);
  const results = await pool(corpus, 8, async ({ name, schema }, i) => {
    const validate = validator(schema);
    const r = await api.chat.completions.create({
      model: MODEL,
      messages: [{ role: 'user', content: `Write the ${name.replace(/_/g, ' ')} as JSON.` }],
      max_tokens: MAX_TOKENS,
      temperature: 0.8,
      seed: 1000 + i,
      response_format: { type: 'json_schema', json_schema: { name, schema, strict: true } },
    });
    return check(name, validate, r.choices[0].message.content, r.choices[0].finish_reason);
  });
  tally('chat', results);
});

test('a third of the corpus through /v1/completions with guided_json, streamed', async () => {
  const part = corpus.filter((_, i) => i % 3 === 0);
  const results = await pool(part, 8, async ({ name, schema }, i) => {
    const validate = validator(schema);
    const stream = await api.completions.create({
      model: MODEL,
      prompt: `${name}: `,
      max_tokens: MAX_TOKENS,
      temperature: 1.0,
      seed: 7 * i,
      stream: true,
      guided_json: schema,
    });
    let text = '';
    let finish = null;
    for await (const c of stream) {
      text += c.choices[0]?.text ?? '';
      finish = c.choices[0]?.finish_reason ?? finish;
    }
    return check(name, validate, text, finish);
  });
  tally('completions (stream)', results);
});

test('n = 4 sequences of one request each validate (structured_outputs.json)', async () => {
  const schema = { type: 'object', properties: { id: { type: 'integer', minimum: 1 }, items: { type: 'array', items: { enum: ['a', 'b'] }, maxItems: 3 } }, required: ['id', 'items'], additionalProperties: false };
  const validate = validator(schema);
  const r = await api.completions.create({
    model: MODEL,
    prompt: 'Order: ',
    max_tokens: MAX_TOKENS,
    temperature: 1.0,
    seed: 5,
    n: 4,
    structured_outputs: { json: schema },
  });
  assert.equal(r.choices.length, 4);
  const texts = new Set();
  for (const c of r.choices) {
    check('order (n=4)', validate, c.text, c.finish_reason);
    texts.add(c.text);
  }
  assert.ok(texts.size > 1, 'the four sequences are not all the same');
});

test('response_format json_object: a JSON object', async () => {
  for (let seed = 0; seed < 4; seed++) {
    const r = await api.chat.completions.create({
      model: MODEL,
      messages: [{ role: 'user', content: 'Describe a dog in JSON.' }],
      max_tokens: MAX_TOKENS,
      seed,
      response_format: { type: 'json_object' },
    });
    const c = r.choices[0];
    if (c.finish_reason === 'length') continue;
    const v = JSON.parse(c.message.content);
    assert.ok(v && typeof v === 'object' && !Array.isArray(v), c.message.content);
  }
});

test('guided_regex: the whole output matches', async () => {
  const cases = ['[A-Z]{2}-\\d{3,5}', '(cat|dog|bird)s?( and (cat|dog|bird)s?)?', '\\w{1,12}@\\w{1,12}\\.(com|org)', '-?(0|[1-9]\\d{0,6})(\\.\\d{1,3})?'];
  for (const re of cases)
    for (let seed = 0; seed < 3; seed++) {
      const r = await api.completions.create({ model: MODEL, prompt: 'x', max_tokens: 64, seed, temperature: 1, guided_regex: re });
      const c = r.choices[0];
      assert.equal(c.finish_reason, 'stop', `${re}: ${JSON.stringify(c.text)}`);
      assert.match(c.text, new RegExp(`^(?:${re})$`), re);
    }
});

test('guided_choice: one of the strings, with logprobs of the masked distribution', async () => {
  const choices = ['positive', 'negative', 'neutral ✓'];
  for (let seed = 0; seed < 5; seed++) {
    const r = await api.chat.completions.create({
      model: MODEL,
      messages: [{ role: 'user', content: 'Sentiment of "great movie"?' }],
      max_tokens: 20,
      seed,
      temperature: 1,
      logprobs: true,
      top_logprobs: 5,
      guided_choice: choices,
    });
    const c = r.choices[0];
    assert.ok(choices.includes(c.message.content), c.message.content);
    assert.equal(c.finish_reason, 'stop');
    // the first token's alternatives: every token the constraint allows there starts one of
    // the choices; the others have no probability left (-9999, JSON has no -inf)
    const first = c.logprobs.content[0];
    let mass = 0;
    for (const t of first.top_logprobs) {
      if (t.logprob <= -9999) continue;
      mass += Math.exp(t.logprob);
      assert.ok(choices.some((s) => s.startsWith(t.token)), `alternative ${JSON.stringify(t.token)} starts no choice`);
    }
    assert.ok(mass > 0.5 && mass <= 1.0001, `the allowed alternatives hold ${mass} of the probability`);
  }
});

test('guided_grammar (GBNF): arithmetic expressions, checked by a parser', async () => {
  const grammar = String.raw`
root   ::= expr
expr   ::= term (("+" | "-") term){0,3}
term   ::= factor (("*" | "/") factor){0,2}
factor ::= [0-9]{1,3} | "(" expr ")"
`;
  const parse = (s) => {
    let i = 0;
    const num = () => {
      const m = /^[0-9]{1,3}/.exec(s.slice(i));
      if (!m) throw new Error(`number expected at ${i}`);
      i += m[0].length;
    };
    const factor = () => {
      if (s[i] === '(') {
        i++;
        expr();
        if (s[i++] !== ')') throw new Error(`')' expected at ${i - 1}`);
      } else num();
    };
    const term = () => {
      factor();
      while (s[i] === '*' || s[i] === '/') i++, factor();
    };
    const expr = () => {
      term();
      while (s[i] === '+' || s[i] === '-') i++, term();
    };
    expr();
    if (i !== s.length) throw new Error(`trailing text at ${i}`);
  };
  let done = 0;
  for (let seed = 0; seed < 6; seed++) {
    const r = await api.completions.create({ model: MODEL, prompt: '1+1=', max_tokens: 200, seed, temperature: 1, guided_grammar: grammar });
    const c = r.choices[0];
    if (c.finish_reason === 'length') continue;
    done++;
    parse(c.text);
  }
  assert.ok(done >= 4, `${done} of 6 finished`);
});

test('stop strings still end a constrained output early (finish_reason stop)', async () => {
  const r = await api.completions.create({ model: MODEL, prompt: 'x', max_tokens: 100, seed: 1, stop: [':'], guided_json: { type: 'object', properties: { name: { type: 'string' } }, required: ['name'] } });
  assert.equal(r.choices[0].finish_reason, 'stop');
  assert.ok(!r.choices[0].text.includes(':'), r.choices[0].text);
});

async function expect400(body, param, needle, route = 'completions') {
  try {
    await (route === 'chat' ? api.chat.completions.create(body) : api.completions.create(body));
  } catch (e) {
    assert.ok(e instanceof APIError, String(e));
    assert.equal(e.status, 400, e.message);
    assert.equal(e.param ?? e.error?.param, param, e.message);
    assert.ok(e.message.includes(needle), `${e.message} lacks ${needle}`);
    return;
  }
  assert.fail(`no error for ${JSON.stringify(body)}`);
}

test('constraints that cannot be compiled are 400s naming the field and the reason', async () => {
  const base = { model: MODEL, prompt: 'x', max_tokens: 4 };
  const rf = (schema) => ({ type: 'json_schema', json_schema: { name: 'x', schema } });
  const chat = { model: MODEL, messages: [{ role: 'user', content: 'hi' }], max_tokens: 4 };
  await expect400({ ...chat, response_format: rf({ type: 'object', properties: { a: { type: 'integer', multipleOf: 3 } } }) },
    'response_format.json_schema.schema', "keyword 'multipleOf' is not supported", 'chat');
  await expect400({ ...chat, response_format: rf({ type: 'strnig' }) }, 'response_format.json_schema.schema', "unknown type 'strnig'", 'chat');
  await expect400({ ...chat, response_format: rf({ $ref: '#/$defs/missing' }) }, 'response_format.json_schema.schema', 'points to nothing', 'chat');
  await expect400({ ...chat, response_format: rf({ type: 'string', format: 'uri' }) }, 'response_format.json_schema.schema', "format 'uri' is not supported", 'chat');
  await expect400({ ...chat, response_format: { type: 'json_schema', json_schema: { name: 'x' } } }, 'response_format', 'schema: is required', 'chat');
  await expect400({ ...chat, response_format: { type: 'structural_tag' } }, 'response_format', "type 'structural_tag' is not supported", 'chat');
  await expect400({ ...base, guided_json: { type: 'string', pattern: '(?=a)b' } }, 'guided_json', 'lookaround assertions are not supported');
  await expect400({ ...base, guided_regex: '(ab' }, 'guided_regex', "'(' without a matching ')'");
  await expect400({ ...base, guided_regex: 'a\\1' }, 'guided_regex', 'backreferences');
  await expect400({ ...base, guided_grammar: 'root ::= undefined-rule' }, 'guided_grammar', "rule 'undefined-rule'");
  await expect400({ ...base, guided_grammar: 'root ::= root "a" | "b"' }, 'guided_grammar', 'left-recursive');
  await expect400({ ...base, guided_grammar: 'root ::= "unterminated' }, 'guided_grammar', 'unterminated literal');
  await expect400({ ...base, guided_choice: [] }, 'guided_choice', 'non-empty list');
  await expect400({ ...base, guided_choice: ['a', 3] }, 'guided_choice', 'guided_choice[1]: must be a string');
  await expect400({ ...base, guided_json: { type: 'object' }, guided_regex: 'a' }, 'guided_regex', 'only one constraint per request');
  await expect400({ ...base, guided_whitespace_pattern: ' *' }, 'guided_whitespace_pattern', 'is not supported');
  await expect400({ ...base, structured_outputs: { whitespace_pattern: ' ' } }, 'structured_outputs.whitespace_pattern', 'is not supported');
  await expect400({ ...base, structured_outputs: { grammar: 'root ::= [' } }, 'structured_outputs.grammar', 'unterminated character class');
});

await run('structured.mjs');
