// images.mjs - image input in /v1/chat/completions on the tiny Qwen2-VL model (a servable copy of
// tests/fixtures/models/qwen2_vl made by make_vl_model.py): the openai client sends data-URL
// images (PNG, JPEG, WebP; one, two in a message, in two messages) and gets completions whose
// usage counts the image tokens; the same image twice hits the prefix cache and gives the same
// tokens, another image other logprobs; /v1/models says the model takes images. Every bad case is
// a 400 whose message names the message and part: undecodable, truncated and unsupported images,
// a bad data URL or base64, too many images, a remote URL when remote images are off, an image
// to a text-only model; with remote images on (a local HTTP server on 127.0.0.1): a fetched image
// works like its data URL, and a 404, an over-large body, a timeout and another scheme are 400s.
// Env: KILN_URL_VL (max_images_per_prompt 2), KILN_URL_REMOTE (allow_remote_images, 60000
// bytes at most, 5 s timeout), KILN_URL_TEXT (a text-only model), KILN_IMAGES (the fixture's
// images folder), KILN_DATA_IMAGES (tests/data/images), KILN_NPM_DIR.
import fs from 'node:fs';
import http from 'node:http';
import path from 'node:path';

import { APIError, assert, assertError, client, env, get, post, run, test } from './common.mjs';

const VL = env('KILN_URL_VL');
const REMOTE = env('KILN_URL_REMOTE');
const TEXT = env('KILN_URL_TEXT');
const IMAGES = env('KILN_IMAGES');
const DATA = env('KILN_DATA_IMAGES');
const MODEL = 'vl-tiny';
const ai = client(VL);

const file = (dir, name) => fs.readFileSync(path.join(dir, name));
const dataUrl = (bytes, type) => `data:${type};base64,${Buffer.from(bytes).toString('base64')}`;
const PNG = file(IMAGES, 'landscape.png'); // 150 x 90: 6 x 10 patches, 15 tokens
const JPG = file(IMAGES, 'portrait.jpg'); // 70 x 130: 10 x 4 patches, 10 tokens
const WEBP = file(DATA, 'lossy.webp');
const image = (url) => ({ type: 'image_url', image_url: { url } });
const text = (t) => ({ type: 'text', text: t });
const ask = (parts, extra = {}) => ({
  model: MODEL,
  messages: [
    { role: 'system', content: 'You are a helpful assistant.' },
    { role: 'user', content: parts },
  ],
  max_tokens: 6,
  temperature: 0,
  logprobs: true,
  ...extra,
});

/* A 400 naming messages[m].content[p] and saying `what`. */
async function bad(url, body, m, p, what) {
  const r = await post(url, '/v1/chat/completions', body);
  const e = assertError(r, 400, { param: 'messages', type: 'invalid_request_error' });
  assert.ok(e.message.startsWith(`messages[${m}].content[${p}]`), `not named: ${e.message}`);
  assert.match(e.message, what);
  return e;
}

let textOnlyTokens;

test('/v1/models says the model takes images', async () => {
  const vl = (await get(VL, '/v1/models')).json.data[0];
  assert.deepEqual(vl.input_modalities, ['text', 'image']);
  assert.equal(vl.max_images_per_prompt, 2);
  const tx = (await get(TEXT, '/v1/models')).json.data[0];
  assert.deepEqual(tx.input_modalities, ['text']);
  assert.equal(tx.max_images_per_prompt, 0);
});

test('a PNG data URL through the openai client; usage counts the image tokens', async () => {
  const plain = await ai.chat.completions.create(ask([text('Describe this image.')]));
  textOnlyTokens = plain.usage.prompt_tokens;
  const r = await ai.chat.completions.create(
    ask([image(dataUrl(PNG, 'image/png')), text('Describe this image.')]),
  );
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(r.usage.completion_tokens, 6);
  // <|vision_start|>, 15 image tokens, <|vision_end|>
  assert.equal(r.usage.prompt_tokens, textOnlyTokens + 17);
  // the same again: the same tokens, served from the prefix cache past the image
  const again = await ai.chat.completions.create(
    ask([image(dataUrl(PNG, 'image/png')), text('Describe this image.')]),
  );
  assert.deepEqual(
    again.choices[0].logprobs.content.map((t) => t.logprob),
    r.choices[0].logprobs.content.map((t) => t.logprob),
  );
  assert.ok(again.usage.prompt_tokens_details.cached_tokens > 16, JSON.stringify(again.usage));
  // another image (10 tokens): other logprobs
  const flipped = await post(VL, '/v1/chat/completions', ask([image(dataUrl(JPG, 'image/jpeg')), text('Describe this image.')]));
  assert.equal(flipped.status, 200, flipped.text);
  assert.equal(flipped.json.usage.prompt_tokens, textOnlyTokens + 12);
  assert.notDeepEqual(
    flipped.json.choices[0].logprobs.content.map((t) => t.logprob),
    r.choices[0].logprobs.content.map((t) => t.logprob),
  );
});

test('JPEG and WebP, two images in a message, images in two messages, streaming', async () => {
  const two = await ai.chat.completions.create(
    ask([image(dataUrl(JPG, 'image/jpeg')), image(dataUrl(WEBP, 'image/webp')), text('Compare.')]),
  );
  const plain = await ai.chat.completions.create(ask([text('Compare.')]));
  // the JPEG's 10 tokens, at least 4 for the WebP, 2 x 2 vision start/end tokens
  assert.ok(two.usage.prompt_tokens >= plain.usage.prompt_tokens + 10 + 4 + 4, JSON.stringify(two.usage));
  const body = ask([]);
  body.messages = [
    { role: 'user', content: [image(dataUrl(JPG, 'image/jpeg')), text('What is this?')] },
    { role: 'assistant', content: 'A picture.' },
    { role: 'user', content: [text('And this?'), image(dataUrl(PNG, 'image/png'))] },
  ];
  const multi = await ai.chat.completions.create(body);
  assert.equal(multi.usage.completion_tokens, 6);
  const stream = await ai.chat.completions.create({ ...ask([image(dataUrl(PNG, 'image/png'))]), stream: true, stream_options: { include_usage: true } });
  let usage;
  for await (const chunk of stream) if (chunk.usage) usage = chunk.usage;
  assert.ok(usage && usage.prompt_tokens > 17, JSON.stringify(usage));
});

test('bad images are 400s naming the message and part', async () => {
  const q = (url, at = 0) => {
    const parts = [text('Look:'), text('here')];
    parts.splice(at, 0, image(url));
    return ask(parts);
  };
  await bad(VL, q(dataUrl(PNG.subarray(0, 300), 'image/png'), 1), 1, 1, /truncated PNG/);
  await bad(VL, q(dataUrl(Buffer.from('definitely not an image'), 'image/png')), 1, 0, /not a PNG, JPEG or WebP image/);
  const gif = Buffer.concat([Buffer.from('GIF89a'), Buffer.alloc(64)]);
  await bad(VL, q(dataUrl(gif, 'image/png'), 2), 1, 2, /GIF images are not supported \(PNG, JPEG and WebP are\)/);
  await bad(VL, q(dataUrl(gif, 'image/gif')), 1, 0, /unsupported image type 'image\/gif'/);
  await bad(VL, q('data:image/png;base64,iVBO!!!!'), 1, 0, /not valid base64 \(at character 4/);
  await bad(VL, q('data:image/png,rawbytes'), 1, 0, /must be base64/);
  await bad(VL, q('data:image/png;base64'), 1, 0, /needs a ','/);
  await bad(VL, q('ftp://127.0.0.1/x.png'), 1, 0, /must be a data: URL/);
  await bad(VL, q('http://127.0.0.1:9/x.png'), 1, 0, /allow_remote_images is off/);
  const three = ask([image(dataUrl(PNG, 'image/png')), image(dataUrl(PNG, 'image/png')), text('x'), image(dataUrl(PNG, 'image/png'))]);
  await bad(VL, three, 1, 3, /more than 2 images in the request \(\[model\] max_images_per_prompt\)/);
  const shape = ask([{ type: 'image_url', image_url: { href: 'x' } }]);
  await bad(VL, shape, 1, 0, /must be an object with a string "url"/);
  const t = ask([text('hi'), image(dataUrl(PNG, 'image/png'))]);
  t.model = 'kiln-tiny';
  await bad(TEXT, t, 1, 1, /content of type 'image_url' is not supported by this model \(text only\)/);
  // and through the client: an APIError with status 400
  try {
    await ai.chat.completions.create(q(dataUrl(PNG.subarray(0, 100), 'image/png')));
    assert.fail('accepted a truncated image');
  } catch (e) {
    assert.ok(e instanceof APIError, String(e));
    assert.equal(e.status, 400);
    assert.match(e.message, /messages\[1\]\.content\[0\]: truncated PNG/);
  }
  // the server is still fine
  const ok = await ai.chat.completions.create(ask([image(dataUrl(PNG, 'image/png'))]));
  assert.equal(ok.usage.completion_tokens, 6);
});

test('remote images: fetched under the limits', async () => {
  const big = Buffer.alloc(70000, 1);
  const srv = http.createServer((req, res) => {
    if (req.url === '/landscape.png') {
      res.writeHead(200, { 'content-type': 'image/png' });
      res.end(PNG);
    } else if (req.url === '/big.png') {
      res.writeHead(200, { 'content-type': 'image/png' });
      res.end(big);
    } else if (req.url === '/slow.png') {
      setTimeout(() => res.end(PNG), 30000); // past the 5 s timeout; closed in finally
    } else {
      res.writeHead(404);
      res.end('no');
    }
  });
  await new Promise((ok) => srv.listen(0, '127.0.0.1', ok));
  const base = `http://127.0.0.1:${srv.address().port}`;
  try {
    const rc = client(REMOTE);
    const byUrl = await rc.chat.completions.create(ask([image(`${base}/landscape.png`), text('Describe this image.')]));
    const byData = await rc.chat.completions.create(ask([image(dataUrl(PNG, 'image/png')), text('Describe this image.')]));
    assert.equal(byUrl.usage.prompt_tokens, byData.usage.prompt_tokens);
    assert.deepEqual(
      byUrl.choices[0].logprobs.content.map((t) => t.logprob),
      byData.choices[0].logprobs.content.map((t) => t.logprob),
    );
    await bad(REMOTE, ask([text('a'), image(`${base}/missing.png`)]), 1, 1, /fetching the image URL failed: .*404/);
    await bad(REMOTE, ask([image(`${base}/big.png`)]), 1, 0, /over the limit of 60000 bytes \(\[server\] max_image_bytes\)/);
    await bad(REMOTE, ask([image(`${base}/slow.png`)]), 1, 0, /fetching the image URL failed: .*[Tt]imeout|timed out/);
    await bad(REMOTE, ask([image('http://127.0.0.1:9/x.png')]), 1, 0, /fetching the image URL failed/);
  } finally {
    srv.closeAllConnections?.();
    srv.close();
  }
});

await run('images');
