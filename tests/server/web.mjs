// web.mjs - the chat page that kiln serve serves at /, in a real browser: Debian's chromium,
// headless, driven by puppeteer-core (tests/server/package.json). The page's streamed replies
// are checked against the API's own non-streamed answers to the same conversation (the page
// must show exactly what the server says), the stop button against the server's metrics (the
// request is cancelled there), and the loading, busy, API-key and image cases against servers
// set up for them by tests/test_server.sh. Screenshots go to KILN_ARTIFACTS.
// Env: KILN_URL (kiln-tiny), KILN_URL_LOADING (a server whose model's config.json is a FIFO,
// so it stays loading until KILN_LOADING_FEED writes to it), KILN_URL_BUSY (max_num_seqs 1,
// max_queued_requests 1), KILN_URL_AUTH + KILN_AUTH_KEY, KILN_URL_VL (the tiny Qwen2-VL),
// KILN_IMAGES (its test images), KILN_CHROMIUM, KILN_ARTIFACTS, KILN_NPM_DIR.
import { spawn } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { pathToFileURL } from 'node:url';
import { assert, env, metrics, MODEL, post, run, sleep, sse, test, waitIdle } from './common.mjs';

const URL_ = env('KILN_URL');
const URL_LOADING = env('KILN_URL_LOADING');
const URL_BUSY = env('KILN_URL_BUSY');
const URL_AUTH = env('KILN_URL_AUTH');
const KEY = env('KILN_AUTH_KEY');
const URL_VL = env('KILN_URL_VL');
const IMAGES = env('KILN_IMAGES');
const ARTIFACTS = env('KILN_ARTIFACTS');
fs.mkdirSync(ARTIFACTS, { recursive: true });

// puppeteer-core's ES module entry, as its package.json names it
const pkgDir = path.join(env('KILN_NPM_DIR'), 'node_modules', 'puppeteer-core');
const pkg = JSON.parse(fs.readFileSync(path.join(pkgDir, 'package.json'), 'utf8'));
const entry = (pkg.exports && pkg.exports['.'] && pkg.exports['.'].import) || pkg.module || pkg.main;
const pptr = await import(pathToFileURL(path.join(pkgDir, entry)).href);
const puppeteer = pptr.default ?? pptr;
const browser = await puppeteer.launch({
  executablePath: env('KILN_CHROMIUM'),
  headless: true,
  // root in CI containers has no user namespaces for the sandbox; the page is our own
  args: ['--no-sandbox', '--disable-dev-shm-usage', '--disable-gpu'],
});
console.log(`browser: ${await browser.version()}`);

const pageErrors = [];
async function open(url) {
  const page = await browser.newPage();
  await page.setViewport({ width: 1000, height: 720 });
  page.on('pageerror', (e) => pageErrors.push(`${url}: ${e.message}`));
  page.on('console', (m) => {
    if (m.type() === 'error' && !/Failed to load resource/.test(m.text()))
      pageErrors.push(`${url}: console: ${m.text()}`);
  });
  await page.goto(url + '/', { waitUntil: 'load' });
  return page;
}

const text = (page, sel) => page.$eval(sel, (e) => e.textContent);
const visible = (page, sel) => page.$eval(sel, (e) => !e.hidden && e.offsetParent !== null);
async function waitText(page, sel, re, ms = 30000) {
  await page.waitForFunction(
    (s, src) => {
      const e = document.querySelector(s);
      return e && new RegExp(src).test(e.textContent);
    },
    { timeout: ms },
    sel,
    re.source,
  );
}
async function setField(page, sel, value) {
  await page.$eval(
    sel,
    (e, v) => {
      e.value = v;
      e.dispatchEvent(new Event('change'));
    },
    value,
  );
}
// Types a message and presses Enter.
async function say(page, msg) {
  await page.focus('#input');
  await page.keyboard.type(msg);
  await page.keyboard.press('Enter');
}
const lastReply = (page) => text(page, '.msg.assistant:last-of-type .content');
const streaming = (page) => page.$eval('.msg.assistant:last-of-type', (e) => e.classList.contains('streaming'));
async function waitReplyDone(page, ms = 60000) {
  await page.waitForFunction(
    () => {
      const m = document.querySelectorAll('.msg.assistant');
      return m.length && !m[m.length - 1].classList.contains('streaming');
    },
    { timeout: ms },
  );
}
// The API's own answer to a conversation, not streamed.
async function reference(url, messages, extra = {}) {
  const r = await post(url, '/v1/chat/completions', { messages, temperature: 0, ...extra });
  assert.equal(r.status, 200, r.text);
  return r.json.choices[0].message.content;
}

test('the page loads: model name, ready, no image button for a text model', async () => {
  const page = await open(URL_);
  await waitText(page, '#model', new RegExp(`^${MODEL}$`));
  await waitText(page, '#status', /^ready$/);
  assert.equal(await visible(page, '#image-label'), false);
  assert.equal(await page.title(), `Kiln chat: ${MODEL}`);
  assert.equal(await visible(page, '#stop'), false);
  await page.close();
});

test('a conversation: streamed replies equal the API answers; stop cancels on the server', async () => {
  const page = await open(URL_);
  await waitText(page, '#status', /^ready$/);
  await setField(page, '#temperature', '0');
  await setField(page, '#max_tokens', '40');
  // every state the reply's text passes through, as the page shows it
  await page.evaluate(() => {
    window.__seen = [];
    new MutationObserver(() => {
      const m = document.querySelectorAll('.msg.assistant .content');
      if (m.length) window.__seen.push(m[m.length - 1].textContent);
    }).observe(document.getElementById('messages'), { subtree: true, childList: true, characterData: true });
  });
  const q1 = 'Tell me about the sea.';
  await say(page, q1);
  await waitReplyDone(page);
  const r1 = await lastReply(page);
  assert.equal(r1, await reference(URL_, [{ role: 'user', content: q1 }], { max_tokens: 40 }));
  assert.ok(r1.length > 0);
  // the second turn carries the first in its history
  const q2 = 'And the mountains?';
  await say(page, q2);
  await waitReplyDone(page);
  const r2 = await lastReply(page);
  const conv = [
    { role: 'user', content: q1 },
    { role: 'assistant', content: r1 },
    { role: 'user', content: q2 },
  ];
  assert.equal(r2, await reference(URL_, conv, { max_tokens: 40 }));

  // a long reply (ignore_eos through the extra fields), streamed, then stopped
  await setField(page, '#max_tokens', '');
  await setField(page, '#extra', '{"ignore_eos": true}');
  await page.evaluate(() => (window.__seen = []));
  const before = await metrics(URL_);
  await say(page, 'Tell me a long story.');
  await page.waitForFunction(
    () => {
      const m = document.querySelectorAll('.msg.assistant .content');
      return m.length && m[m.length - 1].textContent.length >= 40;
    },
    { timeout: 60000 },
  );
  assert.equal(await streaming(page), true, 'the reply finished before it could be stopped');
  assert.equal(await visible(page, '#stop'), true);
  assert.equal(await visible(page, '#send'), false);
  const seen = await page.evaluate(() => window.__seen.filter((t) => t.length > 0));
  assert.ok(new Set(seen).size >= 3, `the text did not stream in pieces: ${seen.length} states`);
  for (let i = 1; i < seen.length; i++) assert.ok(seen[i].startsWith(seen[i - 1]), 'the text only grows');
  await page.screenshot({ path: path.join(ARTIFACTS, 'chat-page-streaming.png') });
  await page.click('#stop');
  await waitReplyDone(page, 10000);
  const stopped = await lastReply(page);
  await waitText(page, '.msg.assistant:last-of-type .note', /\[stopped\]/, 5000);
  assert.equal(await visible(page, '#send'), true);
  await sleep(300);
  assert.equal(await lastReply(page), stopped, 'the text grew after stop');
  // the server cancelled it (the client went away): idle at once, one more aborted request
  await waitIdle(URL_, 5000);
  const after = await metrics(URL_);
  const aborted = (m) => m['kiln:request_success_total{model_name="kiln-tiny",finished_reason="abort"}'] ?? 0;
  assert.equal(aborted(after) - aborted(before), 1, 'the server did not cancel the stopped request');
  assert.ok(stopped.length < 4000, `${stopped.length} characters: the reply ran to the end`);
  // the conversation goes on with the stopped text in it
  await setField(page, '#extra', '');
  await setField(page, '#max_tokens', '20');
  await say(page, 'Thanks.');
  await waitReplyDone(page);
  const r4 = await lastReply(page);
  const conv4 = [...conv, { role: 'assistant', content: r2 }, { role: 'user', content: 'Tell me a long story.' },
    { role: 'assistant', content: stopped }, { role: 'user', content: 'Thanks.' }];
  assert.equal(r4, await reference(URL_, conv4, { max_tokens: 20 }));
  await page.screenshot({ path: path.join(ARTIFACTS, 'chat-page.png') });
  console.log(`     screenshot: ${path.join(ARTIFACTS, 'chat-page.png')}`);
  // New chat forgets it
  await page.click('#reset');
  assert.equal((await page.$$('.msg')).length, 0);
  await say(page, q1);
  await waitReplyDone(page);
  assert.equal(await lastReply(page), await reference(URL_, [{ role: 'user', content: q1 }], { max_tokens: 20 }));
  // a bad extra field is shown, and nothing is sent
  await setField(page, '#extra', '{not json');
  await say(page, 'Hello');
  await waitText(page, '.msg.error:last-of-type', /Extra request fields: not valid JSON/, 5000);
  await page.close();
});

test('loading: a clear message until the model is in, then ready by itself', async () => {
  const page = await open(URL_LOADING);
  await waitText(page, '#banner', /loading the model/);
  assert.equal(await visible(page, '#banner'), true);
  assert.equal(await page.$eval('#send', (e) => e.disabled), true);
  await page.screenshot({ path: path.join(ARTIFACTS, 'chat-page-loading.png') });
  // let the model load: write its config.json into the FIFO as often as it is read
  // one write per read: back-to-back writers can land in one read (two documents in one
  // config.json), so each write waits for the reader to have seen its end
  const feed = spawn('bash', ['-c', 'for i in $(seq 100); do cat "$1" > "$2" || exit 1; sleep 0.3; done', 'feed',
    env('KILN_LOADING_CONFIG'), env('KILN_LOADING_FIFO')], { detached: true, stdio: 'ignore' });
  try {
    await waitText(page, '#status', /^ready$/, 60000);
  } finally {
    try {
      process.kill(-feed.pid, 'SIGKILL');
    } catch {}
  }
  assert.equal(await visible(page, '#banner'), false);
  await waitText(page, '#model', /\S/);
  await setField(page, '#max_tokens', '8');
  await say(page, 'Hi');
  await waitReplyDone(page);
  assert.ok((await lastReply(page)).length > 0);
  await page.close();
});

test('busy: a full queue is told as such, and the message can be sent again', async () => {
  // one running and one waiting request fill the server (max_num_seqs 1, max_queued_requests 1);
  // the first may finish before the second is queued on a slow machine: then both go again
  const long = { messages: [{ role: 'user', content: 'x' }], max_tokens: 1000, ignore_eos: true, stream: true };
  let ac, running, full = false;
  for (let attempt = 0; attempt < 5 && !full; attempt++) {
    ac = new AbortController();
    running = [sse(URL_BUSY, '/v1/chat/completions', long, { signal: ac.signal }).catch(() => null),
      sse(URL_BUSY, '/v1/chat/completions', long, { signal: ac.signal }).catch(() => null)];
    for (let i = 0; i < 200 && !full; i++) {
      const m = await metrics(URL_BUSY);
      full = m['kiln:num_requests_running'] === 1 && m['kiln:num_requests_waiting'] === 1;
      if (!full) await sleep(20);
    }
    if (!full) {
      ac.abort();
      await Promise.all(running);
      await waitIdle(URL_BUSY, 10000);
    }
  }
  assert.ok(full, 'the busy server did not fill up (5 attempts)');
  const page = await open(URL_BUSY);
  await waitText(page, '#status', /^ready$/);
  await say(page, 'Hello there');
  await waitText(page, '#banner', /busy/, 10000);
  assert.match(await text(page, '.msg.error:last-of-type'), /queue/i);
  assert.equal(await page.$eval('#input', (e) => e.value), 'Hello there', 'the message is not given back');
  await page.screenshot({ path: path.join(ARTIFACTS, 'chat-page-busy.png') });
  ac.abort();
  await Promise.all(running);
  await waitIdle(URL_BUSY, 10000);
  await setField(page, '#max_tokens', '8');
  await page.click('#send');
  await waitReplyDone(page);
  assert.ok((await lastReply(page)).length > 0);
  await page.close();
});

test('an API key: the page asks for it, then works with it', async () => {
  const page = await open(URL_AUTH);
  await waitText(page, '#banner', /API key/);
  assert.equal(await visible(page, '#settings'), true);
  await setField(page, '#apikey', KEY);
  await waitText(page, '#model', new RegExp(`^${MODEL}$`));
  await setField(page, '#max_tokens', '8');
  await setField(page, '#temperature', '0');
  await say(page, 'Hi');
  await waitReplyDone(page);
  const r = await post(URL_AUTH, '/v1/chat/completions',
    { messages: [{ role: 'user', content: 'Hi' }], temperature: 0, max_tokens: 8 },
    { headers: { authorization: `Bearer ${KEY}` } });
  assert.equal(await lastReply(page), r.json.choices[0].message.content);
  await page.close();
});

test('images: the upload button for a vision model; the reply is the API answer with the image', async () => {
  const page = await open(URL_VL);
  await waitText(page, '#status', /^ready$/);
  assert.equal(await visible(page, '#image-label'), true);
  const file = path.join(IMAGES, 'landscape.png');
  const input = await page.$('#image');
  await input.uploadFile(file);
  await page.waitForSelector('#attachments img');
  await setField(page, '#temperature', '0');
  await setField(page, '#max_tokens', '8');
  await say(page, 'What is this?');
  await waitReplyDone(page);
  assert.equal((await page.$$('.msg.user img')).length, 1);
  assert.equal((await page.$$('#attachments img')).length, 0, 'the attachment stays after sending');
  const url = 'data:image/png;base64,' + fs.readFileSync(file).toString('base64');
  const want = await reference(URL_VL, [{ role: 'user', content: [
    { type: 'image_url', image_url: { url } }, { type: 'text', text: 'What is this?' }] }], { max_tokens: 8 });
  assert.equal(await lastReply(page), want);
  await page.screenshot({ path: path.join(ARTIFACTS, 'chat-page-image.png') });
  await page.close();
});

test('no error in any page', async () => {
  assert.deepEqual(pageErrors, []);
});

try {
  await run('web');
} finally {
  await browser.close();
}
