// tools.mjs - tool calling through the official openai package: tools, tool_choice and
// parallel_tool_calls; replies parsed into message.tool_calls, whole and streamed (the SDK's
// ChatCompletionStream assembles the deltas and checks them), for the hermes (Qwen3's template),
// mistral (Mistral Nemo's template) and llama3_json formats; a whole round trip with the SDK's
// runTools; assistant tool_calls and tool results rendered back into the template; the errors.
//
// The models (tests/server/make_tool_model.py) are tiny fixtures whose reply is fixed by how the
// chat template ends the prompt: after Qwen's "<|im_start|>assistant\n" a get_weather call in
// <tool_call> tags, after "</think>\n\n" (enable_thinking false) the text "It is sunny in
// Paris.", after Mistral's [/INST] a [TOOL_CALLS] call and after its [/TOOL_RESULTS] that text,
// after Llama's "<|end_header_id|>\n\n" a {"name", "parameters"} call.
//
// tool_choice "required" and a named function run through constrained decoding (the
// function's parameter schema).
// Env: KILN_URL_HERMES, KILN_URL_MISTRAL, KILN_URL_LLAMA, KILN_URL_PLAIN (kiln-tiny: its template
// renders no tools), KILN_URL_NOPARSE (the hermes model with [server] tool_parser = none),
// KILN_NPM_DIR.
import { assert, client, env, post, run, sse, test } from './common.mjs';

const HERMES = env('KILN_URL_HERMES');
const MISTRAL = env('KILN_URL_MISTRAL');
const LLAMA = env('KILN_URL_LLAMA');
const PLAIN = env('KILN_URL_PLAIN');
const NOPARSE = env('KILN_URL_NOPARSE');

const WEATHER = {
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'The weather in a city.',
    parameters: {
      type: 'object',
      properties: { city: { type: 'string', enum: ['Paris', 'Rome'] } },
      required: ['city'],
      additionalProperties: false,
    },
  },
};
const TIME = { type: 'function', function: { name: 'get_time', description: 'The time now.' } };
const ASK = [{ role: 'user', content: 'What is the weather in Paris?' }];

const chat = (url, body) =>
  client(url).chat.completions.create({ model: modelOf(url), temperature: 0, ...body });
function modelOf(url) {
  return { [HERMES]: 'hermes', [MISTRAL]: 'mistral', [LLAMA]: 'llama3', [NOPARSE]: 'hermes' }[url];
}

/* The one get_weather(city=Paris) call a fixture makes; its id as OpenAI's or Mistral's. */
function checkCall(tc, { mistral = false } = {}) {
  assert.equal(tc.type, 'function');
  assert.match(tc.id, mistral ? /^[A-Za-z0-9]{9}$/ : /^call_[A-Za-z0-9]{24}$/, `id ${tc.id}`);
  assert.equal(tc.function.name, 'get_weather');
  assert.equal(typeof tc.function.arguments, 'string', 'arguments is a JSON string');
  assert.deepEqual(JSON.parse(tc.function.arguments), { city: 'Paris' });
}

function checkCallMessage(res, opts) {
  assert.equal(res.choices.length, 1);
  const c = res.choices[0];
  assert.equal(c.finish_reason, 'tool_calls');
  assert.equal(c.message.role, 'assistant');
  assert.equal(c.message.content, null, 'a reply of only a call has no content');
  assert.equal(c.message.tool_calls.length, 1);
  checkCall(c.message.tool_calls[0], opts);
  return c.message;
}

/* The SDK's streaming helper on a call: the assembled message, the raw chunks' deltas as OpenAI
 * sends them, and the helper's arguments.done event. */
async function streamedCall(url, body, opts) {
  const stream = client(url).chat.completions.stream({
    model: modelOf(url),
    temperature: 0,
    ...body,
    stream: true,
  });
  const chunks = [];
  const done = [];
  stream.on('chunk', (c) => chunks.push(c));
  stream.on('tool_calls.function.arguments.done', (e) => done.push(e));
  const final = await stream.finalChatCompletion();
  const msg = checkCallMessage(final, opts);
  const deltas = chunks.flatMap((c) => c.choices.flatMap((ch) => ch.delta.tool_calls ?? []));
  assert.ok(deltas.length >= 2, 'a header delta, then the arguments');
  const [head, ...rest] = deltas;
  assert.equal(head.index, 0);
  assert.equal(head.id, msg.tool_calls[0].id);
  assert.equal(head.type, 'function');
  assert.equal(head.function.name, 'get_weather');
  assert.equal(head.function.arguments, '');
  for (const d of rest) {
    assert.equal(d.index, 0);
    assert.equal(d.id, undefined, 'only the first delta names the call');
    assert.equal(d.function.name, undefined);
  }
  assert.equal(rest.map((d) => d.function.arguments).join(''), msg.tool_calls[0].function.arguments);
  assert.equal(chunks.at(-1).choices[0].finish_reason, 'tool_calls');
  assert.equal(done.length, 1);
  assert.equal(done[0].name, 'get_weather');
  assert.deepEqual(done[0].parsed_arguments ?? JSON.parse(done[0].arguments), { city: 'Paris' });
  return msg;
}

/* The prompt a request renders to (/tokenize, then /detokenize). */
async function rendered(url, body) {
  const t = await post(url, '/tokenize', body);
  assert.equal(t.status, 200, t.text);
  const d = await post(url, '/detokenize', { tokens: t.json.tokens });
  assert.equal(d.status, 200, d.text);
  return d.json.prompt;
}

/* A 400 whose error names param and matches what. */
async function refused(url, body, param, what) {
  let err;
  try {
    await client(url).chat.completions.create({ model: modelOf(url) ?? 'kiln-tiny', ...body });
  } catch (e) {
    err = e;
  }
  assert.ok(err, 'the request was accepted');
  assert.equal(err.status, 400, String(err));
  assert.equal(err.param, param, String(err));
  assert.match(err.message, what);
  return err;
}

/* tool_choice required / named: the request, constrained by the function's parameter schema
 * (the engine's constrained decoding). */
async function constrained(body) {
  return chat(HERMES, body);
}

// Guided decoding picks among the tokens the schema allows; the fixture model has no preference
// among them, so whitespace (which JSON allows anywhere) is kept out with logit_bias.
const NO_WS = { 9: -100, 10: -100, 13: -100, 32: -100 };

// ---- hermes (Qwen3's template) ---------------------------------------------------------------

test('hermes: the call comes back as message.tool_calls', async () => {
  checkCallMessage(await chat(HERMES, { messages: ASK, tools: [WEATHER, TIME] }));
});

test('hermes: tool_choice auto, stated, is the default', async () => {
  checkCallMessage(await chat(HERMES, { messages: ASK, tools: [WEATHER], tool_choice: 'auto' }));
});

test('hermes: streamed, the deltas assemble into the call', async () => {
  await streamedCall(HERMES, { messages: ASK, tools: [WEATHER, TIME] });
});

test('hermes: n = 2, each choice its own call and id', async () => {
  const res = await chat(HERMES, { messages: ASK, tools: [WEATHER], n: 2, temperature: 1, seed: 5 });
  assert.equal(res.choices.length, 2);
  for (const c of res.choices) {
    assert.equal(c.finish_reason, 'tool_calls');
    checkCall(c.message.tool_calls[0]);
  }
  assert.notEqual(res.choices[0].message.tool_calls[0].id, res.choices[1].message.tool_calls[0].id);
});

test('hermes: a reply without a call is plain content', async () => {
  const res = await chat(HERMES, {
    messages: ASK,
    tools: [WEATHER],
    chat_template_kwargs: { enable_thinking: false },
  });
  const c = res.choices[0];
  assert.equal(c.finish_reason, 'stop');
  assert.equal(c.message.content, 'It is sunny in Paris.');
  assert.equal(c.message.tool_calls, undefined);
});

test('hermes: tool_choice none shows the tools but does not parse', async () => {
  const res = await chat(HERMES, { messages: ASK, tools: [WEATHER], tool_choice: 'none' });
  const c = res.choices[0];
  assert.equal(c.finish_reason, 'stop');
  assert.equal(c.message.tool_calls, undefined);
  assert.match(c.message.content, /^<tool_call>\n\{"name": "get_weather"/);
  const p = await rendered(HERMES, { messages: ASK, tools: [WEATHER] });
  assert.match(p, /<tools>\n\{"type": "function", "function": \{"name": "get_weather"/);
});

test('hermes: a cut-short call stays text, finish_reason length', async () => {
  const res = await chat(HERMES, { messages: ASK, tools: [WEATHER], max_tokens: 3 });
  const c = res.choices[0];
  assert.equal(c.finish_reason, 'length');
  assert.equal(c.message.tool_calls, undefined);
  assert.equal(c.message.content, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}');
});

test('hermes: round trip, the call and its result go back into the template', async () => {
  const first = checkCallMessage(await chat(HERMES, { messages: ASK, tools: [WEATHER] }));
  const call = first.tool_calls[0];
  const messages = [
    ...ASK,
    first, // as the SDK returned it: content null, arguments a JSON string
    { role: 'tool', tool_call_id: call.id, content: '{"sky": "sunny", "temp": 21}' },
  ];
  const res = await chat(HERMES, {
    messages,
    tools: [WEATHER],
    chat_template_kwargs: { enable_thinking: false },
  });
  assert.equal(res.choices[0].message.content, 'It is sunny in Paris.');
  assert.equal(res.choices[0].finish_reason, 'stop');
  // the prompt held the call with its arguments as an object (not a doubly encoded string), and
  // the result as Qwen's template writes a tool turn
  const p = await rendered(HERMES, { messages, tools: [WEATHER] });
  assert.ok(
    p.includes(
      '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' +
        '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{"sky": "sunny", "temp": 21}\n' +
        '</tool_response><|im_end|>\n<|im_start|>assistant\n',
    ),
    p,
  );
});

test('hermes: tool_choice required (constrained)', async () => {
  const res = await constrained({
    messages: ASK,
    tools: [WEATHER, TIME],
    tool_choice: 'required',
    parallel_tool_calls: false,
    logit_bias: NO_WS,
    max_tokens: 64,
  });
  const c = res.choices[0];
  assert.equal(c.finish_reason, 'tool_calls', JSON.stringify(c));
  assert.equal(c.message.tool_calls.length, 1, 'parallel_tool_calls false: one call');
  const tc = c.message.tool_calls[0];
  assert.ok(['get_weather', 'get_time'].includes(tc.function.name));
  const args = JSON.parse(tc.function.arguments);
  if (tc.function.name === 'get_weather') {
    assert.deepEqual(Object.keys(args), ['city']);
    assert.ok(['Paris', 'Rome'].includes(args.city), tc.function.arguments);
  }
});

test('hermes: tool_choice a named function (constrained)', async () => {
  const body = {
    messages: ASK,
    tools: [WEATHER, TIME],
    tool_choice: { type: 'function', function: { name: 'get_weather' } },
    logit_bias: NO_WS,
    max_tokens: 64,
  };
  const res = await constrained(body);
  const tc = res.choices[0].message.tool_calls[0];
  assert.equal(res.choices[0].message.tool_calls.length, 1);
  assert.equal(tc.function.name, 'get_weather');
  const args = JSON.parse(tc.function.arguments);
  assert.deepEqual(Object.keys(args), ['city']);
  assert.ok(['Paris', 'Rome'].includes(args.city), tc.function.arguments);
  // streamed: the header first, then the arguments as they are generated
  const stream = client(HERMES).chat.completions.stream({ model: 'hermes', temperature: 0, ...body });
  const final = await stream.finalChatCompletion();
  const stc = final.choices[0].message.tool_calls[0];
  assert.equal(stc.function.name, 'get_weather');
  assert.deepEqual(JSON.parse(stc.function.arguments), args);
});

test('hermes: bad tools and tool_choice are refused, naming the field', async () => {
  await refused(HERMES, { messages: ASK, tools: [{ type: 'function' }] }, 'tools', /tools\[0\]\.function/);
  await refused(
    HERMES,
    { messages: ASK, tools: [{ type: 'function', function: { ...WEATHER.function, strict: true } }] },
    'tools',
    /strict/,
  );
  await refused(
    HERMES,
    { messages: ASK, tools: [WEATHER], tool_choice: { type: 'function', function: { name: 'nope' } } },
    'tool_choice',
    /'nope' is not in tools/,
  );
  await refused(HERMES, { messages: ASK, tool_choice: 'required' }, 'tool_choice', /needs tools/);
  await refused(HERMES, { messages: ASK, tools: [WEATHER], tool_choice: 'maybe' }, 'tool_choice', /maybe/);
  const history = [
    ...ASK,
    {
      role: 'assistant',
      content: null,
      tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '{"city": ' } }],
    },
    { role: 'tool', tool_call_id: 'call_1', content: 'sunny' },
  ];
  await refused(HERMES, { messages: history, tools: [WEATHER] }, 'messages', /tool_calls\[0\]\.function\.arguments/);
});

test('hermes: with [server] tool_parser = none, tools need tool_choice none', async () => {
  await refused(NOPARSE, { messages: ASK, tools: [WEATHER] }, 'tools', /tool_parser = none/);
  const res = await chat(NOPARSE, { messages: ASK, tools: [WEATHER], tool_choice: 'none' });
  assert.equal(res.choices[0].message.tool_calls, undefined);
});

test('a template that renders no tools: tools get a 400 saying so', async () => {
  await refused(PLAIN, { messages: ASK, tools: [WEATHER] }, 'tools', /does not render tools/);
  await refused(PLAIN, { messages: ASK, tools: [WEATHER], tool_choice: 'none' }, 'tools', /does not render tools/);
  const t = await post(PLAIN, '/tokenize', { messages: ASK, tools: [WEATHER] });
  assert.equal(t.status, 400, t.text);
  assert.equal(t.json.error.param, 'tools');
  // no tools, or an empty list: a plain chat
  const res = await client(PLAIN).chat.completions.create({ model: 'kiln-tiny', messages: ASK, tools: [], max_tokens: 2 });
  assert.equal(res.choices[0].message.tool_calls, undefined);
});

// ---- mistral (Mistral Nemo's template) --------------------------------------------------------

test('mistral: [TOOL_CALLS] parsed, ids of 9 letters and digits', async () => {
  checkCallMessage(await chat(MISTRAL, { messages: ASK, tools: [WEATHER] }), { mistral: true });
  await streamedCall(MISTRAL, { messages: ASK, tools: [WEATHER] }, { mistral: true });
});

for (const stream of [false, true]) {
  test(`mistral: a whole round trip with the SDK's runTools${stream ? ', streamed' : ''}`, async () => {
    const calls = [];
    const runner = client(MISTRAL).chat.completions.runTools({
      model: 'mistral',
      temperature: 0,
      stream,
      messages: ASK,
      tools: [
        {
          type: 'function',
          function: {
            name: 'get_weather',
            description: WEATHER.function.description,
            parameters: WEATHER.function.parameters,
            parse: JSON.parse,
            function: (args) => {
              calls.push(args);
              return { sky: 'sunny', temp: 21 };
            },
          },
        },
      ],
    });
    const content = await runner.finalContent();
    assert.equal(content, 'It is sunny in Paris.');
    assert.deepEqual(calls, [{ city: 'Paris' }], 'the tool ran once, with the parsed arguments');
    const msgs = runner.messages;
    const a = msgs.find((m) => m.role === 'assistant' && m.tool_calls);
    const t = msgs.find((m) => m.role === 'tool');
    assert.ok(a && t, JSON.stringify(msgs));
    checkCall(a.tool_calls[0], { mistral: true });
    assert.equal(t.tool_call_id, a.tool_calls[0].id);
    // the template (which refuses ids that are not 9 characters) wrote the call and the result
    const p = await rendered(MISTRAL, { messages: msgs.slice(0, -1), tools: [WEATHER] });
    assert.ok(
      p.endsWith(
        `[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "${a.tool_calls[0].id}"}]</s>` +
          `[TOOL_RESULTS]{"content": {"sky":"sunny","temp":21}, "call_id": "${a.tool_calls[0].id}"}[/TOOL_RESULTS]`,
      ),
      p,
    );
  });
}

// ---- llama3_json -------------------------------------------------------------------------------

test('llama3_json: the JSON reply parsed, whole and streamed', async () => {
  checkCallMessage(await chat(LLAMA, { messages: ASK, tools: [WEATHER] }));
  await streamedCall(LLAMA, { messages: ASK, tools: [WEATHER] });
  // the call goes back into the template as {"name", "parameters": object}
  const first = checkCallMessage(await chat(LLAMA, { messages: ASK, tools: [WEATHER] }));
  const p = await rendered(LLAMA, {
    messages: [...ASK, first, { role: 'tool', tool_call_id: first.tool_calls[0].id, content: 'sunny' }],
    tools: [WEATHER],
  });
  assert.ok(
    p.includes(
      '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}' +
        '<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|>',
    ),
    p,
  );
});

test('raw stream: role first, one delta per event, finish alone and last', async () => {
  const r = await sse(HERMES, '/v1/chat/completions', {
    model: 'hermes',
    messages: ASK,
    tools: [WEATHER],
    stream: true,
    stream_options: { include_usage: true },
  });
  assert.equal(r.status, 200);
  assert.ok(r.done);
  const ch = r.events.filter((e) => e.choices.length);
  assert.equal(ch[0].choices[0].delta.role, 'assistant');
  const withCalls = ch.filter((e) => e.choices[0].delta.tool_calls);
  assert.equal(withCalls.length, 2);
  for (const e of withCalls) assert.equal(e.choices[0].delta.tool_calls.length, 1);
  const last = ch.at(-1).choices[0];
  assert.equal(last.finish_reason, 'tool_calls');
  assert.deepEqual(last.delta, {});
  assert.equal(r.events.at(-1).usage.completion_tokens, 5);
});

await run('tools');
