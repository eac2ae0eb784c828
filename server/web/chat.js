// chat.js - the chat page `kiln serve` serves at / (no framework, no CDN: the files are
// embedded in the binary). It talks to the server's own API: GET /health (loading, ready,
// shutting down), GET /v1/models (the model's name and whether it takes images) and
// POST /v1/chat/completions with stream: true (Server-Sent Events). Stop aborts the fetch;
// the server sees the connection close and cancels the request.
'use strict';

const $ = (id) => document.getElementById(id);
const state = {
  model: null,
  maxImages: 0,
  history: [], // the conversation sent with each request: {role, content}
  images: [], // data: URLs attached to the next message
  controller: null, // the AbortController of the reply streaming now
};

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function apiKey() {
  return $('apikey').value.trim() || localStorage.getItem('kiln.apikey') || '';
}

function headers() {
  const h = { 'Content-Type': 'application/json' };
  const k = apiKey();
  if (k) h.Authorization = 'Bearer ' + k;
  return h;
}

function setStatus(text) {
  $('status').textContent = text;
}

function banner(text, kind) {
  const b = $('banner');
  b.className = 'banner' + (kind ? ' ' + kind : '');
  b.textContent = text || '';
  b.hidden = !text;
}

function scrollDown() {
  const m = $('messages');
  m.scrollTop = m.scrollHeight;
}

// A message bubble: {el, text} where text is the node that holds its text.
function addMessage(role, text, images) {
  const el = document.createElement('div');
  el.className = 'msg ' + role;
  for (const url of images || []) {
    const img = document.createElement('img');
    img.src = url;
    img.alt = 'attached image';
    el.appendChild(img);
  }
  const t = document.createElement('span');
  t.className = 'content';
  t.textContent = text;
  el.appendChild(t);
  $('messages').appendChild(el);
  scrollDown();
  return { el, text: t };
}

function addNote(msg, text) {
  const n = document.createElement('span');
  n.className = 'note';
  n.textContent = text;
  msg.el.appendChild(n);
}

// ---- the server's state ------------------------------------------------------------------

let readyPromise = null;

// Waits until /health says ok, showing why not meanwhile, then reads the model.
function waitReady() {
  if (!readyPromise) {
    readyPromise = (async () => {
      $('send').disabled = true;
      for (;;) {
        let r = null;
        let body = {};
        try {
          r = await fetch('/health', { cache: 'no-store' });
          body = await r.json().catch(() => ({}));
        } catch (e) {
          banner('Cannot reach the server (' + e.message + '); retrying…', 'error');
          setStatus('offline');
          await sleep(2000);
          continue;
        }
        if (r.ok) break;
        if (body.status === 'loading') {
          banner('The server is loading the model. The page is ready as soon as it is.');
          setStatus('loading the model…');
        } else if (body.status === 'shutting_down') {
          banner('The server is shutting down.', 'error');
          setStatus('shutting down');
        } else {
          banner('The server is not ready (HTTP ' + r.status + ').', 'error');
          setStatus('not ready');
        }
        await sleep(1000);
      }
      banner(null);
      await loadModel();
      readyPromise = null;
    })();
  }
  return readyPromise;
}

async function loadModel() {
  const r = await fetch('/v1/models', { headers: headers(), cache: 'no-store' });
  if (r.status === 401) {
    banner('This server needs an API key: enter it under Settings, then send again.', 'error');
    $('settings').hidden = false;
    $('settings-toggle').setAttribute('aria-expanded', 'true');
    setStatus('API key needed');
    $('send').disabled = false;
    return;
  }
  const j = await r.json();
  const m = j.data[0];
  state.model = m.id;
  $('model').textContent = m.id;
  $('model').title = 'context: ' + m.max_model_len + ' tokens';
  document.title = 'Kiln chat: ' + m.id;
  const images = (m.input_modalities || []).includes('image');
  state.maxImages = images ? m.max_images_per_prompt || 1 : 0;
  $('image-label').hidden = !images;
  setStatus('ready');
  $('send').disabled = false;
}

// ---- sending -----------------------------------------------------------------------------

function numberField(id, integer) {
  const v = $(id).value.trim();
  if (v === '') return undefined;
  const x = integer ? parseInt(v, 10) : parseFloat(v);
  return Number.isFinite(x) ? x : undefined;
}

function requestBody() {
  const messages = [];
  const system = $('system').value.trim();
  if (system) messages.push({ role: 'system', content: system });
  messages.push(...state.history);
  const body = { model: state.model || undefined, messages, stream: true };
  const fields = [
    ['temperature', false],
    ['top_p', false],
    ['top_k', true],
    ['max_tokens', true],
    ['seed', true],
  ];
  for (const [f, integer] of fields) {
    const v = numberField(f, integer);
    if (v !== undefined && !(f === 'top_k' && v === 0)) body[f] = v;
  }
  const extra = $('extra').value.trim();
  if (extra) {
    let x;
    try {
      x = JSON.parse(extra);
    } catch (e) {
      throw new ServerError(0, 'Extra request fields: not valid JSON (' + e.message + ')');
    }
    if (!x || typeof x !== 'object' || Array.isArray(x))
      throw new ServerError(0, 'Extra request fields: want a JSON object, like {"seed": 1}');
    Object.assign(body, x, { messages, stream: true });
  }
  return body;
}

// An error to show: a server's answer (status, message, type) or a bad setting (status 0).
class ServerError extends Error {
  constructor(status, message, type) {
    super(message);
    this.status = status;
    this.type = type;
  }
}

async function errorOf(r) {
  let msg = 'HTTP ' + r.status;
  let type = null;
  try {
    const j = await r.json();
    if (j.error) {
      msg = j.error.message || msg;
      type = j.error.type || null;
    }
  } catch (e) {
    /* not JSON */
  }
  return new ServerError(r.status, msg, type);
}

function setBusy(busy) {
  $('send').hidden = busy;
  $('stop').hidden = !busy;
  $('input').disabled = false;
}

async function send() {
  if (state.controller) return;
  const text = $('input').value;
  if (!text.trim() && !state.images.length) return;
  if ($('apikey').value.trim()) localStorage.setItem('kiln.apikey', $('apikey').value.trim());
  const images = state.images.slice();
  const content = images.length
    ? [...images.map((url) => ({ type: 'image_url', image_url: { url } })), { type: 'text', text }]
    : text;
  addMessage('user', text, images);
  state.history.push({ role: 'user', content });
  $('input').value = '';
  clearAttachments();
  const reply = addMessage('assistant', '');
  reply.el.classList.add('streaming');
  const ctl = new AbortController();
  state.controller = ctl;
  setBusy(true);
  setStatus('replying…');
  let out = '';
  let finish = null;
  let stopped = false;
  let error = null;
  try {
    const r = await fetch('/v1/chat/completions', {
      method: 'POST',
      headers: headers(),
      body: JSON.stringify(requestBody()),
      signal: ctl.signal,
    });
    if (!r.ok) throw await errorOf(r);
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf('\n\n')) >= 0) {
        const event = buf.slice(0, i);
        buf = buf.slice(i + 2);
        for (const line of event.split('\n')) {
          if (!line.startsWith('data:')) continue;
          const data = line.slice(5).trim();
          if (data === '[DONE]') continue;
          const j = JSON.parse(data);
          if (j.error) throw new ServerError(500, j.error.message, j.error.type);
          const ch = j.choices && j.choices[0];
          if (!ch) continue;
          if (ch.delta && ch.delta.content) {
            out += ch.delta.content;
            reply.text.textContent = out;
            scrollDown();
          }
          if (ch.finish_reason) finish = ch.finish_reason;
        }
      }
    }
  } catch (e) {
    if (e.name === 'AbortError') stopped = true;
    else error = e;
  }
  state.controller = null;
  setBusy(false);
  reply.el.classList.remove('streaming');
  if (stopped) addNote(reply, '[stopped]');
  else if (finish === 'length') addNote(reply, '[cut at the token limit]');
  else if (finish === 'abort') addNote(reply, '[stopped by the server]');
  if (error) {
    // the request was not answered: it leaves the history, its text goes back to the input
    state.history.pop();
    reply.el.classList.add('error');
    reply.text.textContent = error.message;
    if (!$('input').value) $('input').value = text;
    if (error.status === 503) {
      const loading = /loading/.test(error.message);
      banner(
        loading
          ? 'The server is loading the model; try again in a moment.'
          : 'The server is busy: ' + error.message + '. Try again in a moment.',
        loading ? '' : 'error'
      );
      setStatus(loading ? 'loading the model…' : 'busy');
      if (loading) waitReady();
    } else if (error.status === 401) {
      banner('This server needs an API key: enter it under Settings, then send again.', 'error');
      $('settings').hidden = false;
      setStatus('API key needed');
    } else {
      setStatus('error');
    }
    return;
  }
  state.history.push({ role: 'assistant', content: out });
  banner(null);
  setStatus('ready');
}

function stop() {
  if (state.controller) state.controller.abort();
}

function reset() {
  stop();
  state.history = [];
  $('messages').replaceChildren();
  clearAttachments();
  banner(null);
  $('input').focus();
}

// ---- images ------------------------------------------------------------------------------

function clearAttachments() {
  state.images = [];
  $('attachments').replaceChildren();
  $('image').value = '';
}

function renderAttachments() {
  const box = $('attachments');
  box.replaceChildren();
  state.images.forEach((url, k) => {
    const f = document.createElement('figure');
    const img = document.createElement('img');
    img.src = url;
    img.alt = 'image ' + (k + 1);
    const x = document.createElement('button');
    x.type = 'button';
    x.textContent = '×';
    x.title = 'remove';
    x.addEventListener('click', () => {
      state.images.splice(k, 1);
      renderAttachments();
    });
    f.append(img, x);
    box.appendChild(f);
  });
}

function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const fr = new FileReader();
    fr.onload = () => resolve(fr.result);
    fr.onerror = () => reject(fr.error);
    fr.readAsDataURL(file);
  });
}

async function addImages(files) {
  for (const file of files) {
    if (state.images.length >= state.maxImages) {
      banner('The model takes at most ' + state.maxImages + ' images per message.', 'error');
      break;
    }
    state.images.push(await readAsDataURL(file));
  }
  renderAttachments();
}

// ---- wiring ------------------------------------------------------------------------------

window.addEventListener('DOMContentLoaded', () => {
  $('apikey').value = localStorage.getItem('kiln.apikey') || '';
  $('composer').addEventListener('submit', (e) => {
    e.preventDefault();
    send();
  });
  $('input').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $('stop').addEventListener('click', stop);
  $('reset').addEventListener('click', reset);
  $('image').addEventListener('change', (e) => addImages(e.target.files));
  $('settings-toggle').addEventListener('click', () => {
    const s = $('settings');
    s.hidden = !s.hidden;
    $('settings-toggle').setAttribute('aria-expanded', String(!s.hidden));
  });
  $('apikey').addEventListener('change', () => {
    localStorage.setItem('kiln.apikey', $('apikey').value.trim());
    waitReady();
  });
  waitReady();
});
