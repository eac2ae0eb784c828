"""LLM: an in-process Kiln engine (libkiln's kiln_engine_t) with vLLM's offline interface."""

import base64
import codecs
import ctypes
import io
import json
import os
import threading
from typing import Any, Dict, List, Optional, Sequence, Union

from . import _errors
from . import _lib
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling import SamplingParams

_lib_ = _lib.lib
_POLL_SLICE_MS = 100  # a blocked poll wakes up this often, so that Ctrl-C gets through
_MAX_IN_FLIGHT = 1024  # generate() keeps at most this many requests in the engine at once


def _option_value(name, v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    if isinstance(v, (int, float, str)) or isinstance(v, os.PathLike):
        return os.fspath(v) if isinstance(v, os.PathLike) else str(v)
    raise TypeError("LLM(): %s must be a str, number, bool or list, got %s" %
                    (name, type(v).__name__))


# Plain names that several sections have but that mean one of them: dtype= was [model] dtype
# before [cache] dtype existed (write cache_dtype= for the KV cache's).
_PREFERRED = {"dtype": "model"}


def _resolve_options(options):
    """Maps LLM(**engine_options) names onto "section.key" (docs in LLM.__init__)."""
    keys = _lib.config_keys()
    by_key = {}
    sections = {}
    for sec, key, _, _ in keys:
        by_key.setdefault(key, []).append(sec)
        sections.setdefault(sec, set()).add(key)
    out = []
    for name, value in options.items():
        target = None
        if "__" in name:
            sec, key = name.split("__", 1)
            if key in sections.get(sec, ()):
                target = sec + "." + key
        elif name in _PREFERRED and _PREFERRED[name] in by_key.get(name, ()):
            target = _PREFERRED[name] + "." + name  # dtype= is [model] dtype; cache_dtype=
        elif name in by_key:
            if len(by_key[name]) > 1:
                raise TypeError(
                    "LLM(): '%s' is a key of several sections (%s): write %s" %
                    (name, ", ".join("[%s]" % s for s in by_key[name]),
                     " or ".join("%s_%s" % (s, name) for s in by_key[name])))
            target = by_key[name][0] + "." + name
        elif name in sections and "name" in sections[name]:
            target = name + ".name"  # backend="cpu"
        else:
            for sec in sections:
                if name.startswith(sec + "_") and name[len(sec) + 1:] in sections[sec]:
                    target = sec + "." + name[len(sec) + 1:]
        if target is None:
            raise TypeError(
                "LLM() got an unexpected keyword argument '%s': engine options are Kiln "
                "configuration keys (kiln --help-config), as key, section_key or section__key"
                % name)
        out.append(target + "=" + _option_value(name, value))
    return out


def _image_bytes(x, where):
    """Encoded image bytes from bytes, a path, a data: URL or a PIL-like image."""
    if isinstance(x, (bytes, bytearray, memoryview)):
        return bytes(x)
    if isinstance(x, os.PathLike):
        x = os.fspath(x)
    if isinstance(x, str):
        if x.startswith("data:"):
            head, sep, data = x.partition(",")
            if not sep or not head.endswith(";base64"):
                raise _errors.InvalidArgumentError(
                    "%s: a data: URL needs ';base64,' before its data" % where, 1)
            try:
                return base64.b64decode(data, validate=True)
            except ValueError as e:
                raise _errors.InvalidArgumentError(
                    "%s: the data URL is not valid base64 (%s)" % (where, e), 1) from None
        if x.startswith("http://") or x.startswith("https://"):
            raise _errors.InvalidArgumentError(
                "%s: kiln does not fetch URLs here: give the image's bytes, a path or a data: URL"
                % where, 1)
        path = x[7:] if x.startswith("file://") else x
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise _errors.KilnIOError("%s: %s: %s" % (where, path, e.strerror), 5) from None
    if hasattr(x, "save"):  # a PIL.Image.Image, without importing PIL
        buf = io.BytesIO()
        x.save(buf, format="PNG")
        return buf.getvalue()
    raise TypeError("%s: an image is bytes, a path, a data: URL or a PIL image, got %s" %
                    (where, type(x).__name__))


def _rewrite_messages(messages):
    """Messages with each image part turned into {"type": "image"} (what chat templates
    take), and the images' bytes in order."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
    out, images = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError("messages[%d] must be a dict, got %s" % (i, type(m).__name__))
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            has_image = any(isinstance(p, dict) and p.get("type") in ("image_url", "image")
                            for p in content)
            for j, p in enumerate(content):
                where = "messages[%d].content[%d]" % (i, j)
                t = p.get("type") if isinstance(p, dict) else None
                if t == "image_url":
                    u = p.get("image_url")
                    url = u if isinstance(u, str) else (u or {}).get("url")
                    if not isinstance(url, str):
                        raise _errors.InvalidArgumentError(
                            "%s: an image part needs a string url (image_url.url)" % where, 1)
                    images.append(_image_bytes(url, where))
                    parts.append({"type": "image"})
                elif t == "image" and "image" in p:
                    images.append(_image_bytes(p["image"], where))
                    parts.append({"type": "image"})
                elif t == "text":
                    if not isinstance(p.get("text"), str):
                        raise _errors.InvalidArgumentError("%s.text: must be a string" % where, 1)
                    parts.append(p)
                else:
                    raise _errors.InvalidArgumentError(
                        "%s: content of type %r is not supported (text, image_url, image)" %
                        (where, t), 1)
            if not has_image:  # text parts only: one string, as the server makes it
                m = dict(m, content="\n".join(p["text"] for p in parts))
                out.append(m)
                continue
            m = dict(m, content=parts)
        out.append(m)
    return out, images


class _Seq:
    __slots__ = ("text", "decoder", "token_ids", "logprobs", "cum", "finish", "stop_reason")

    def __init__(self, want_logprobs):
        self.text = bytearray()
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.token_ids = []
        self.logprobs = [] if want_logprobs else None
        self.cum = 0.0 if want_logprobs else None
        self.finish = None
        self.stop_reason = None


class _Request:
    """One submitted request and what its events have delivered so far."""

    def __init__(self, llm, request_id, prompt, ids, params, priority, images):
        self.llm = llm
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = list(ids)
        self.params = params
        c, keep = params._to_c(priority)
        self.seqs = [_Seq(params.logprobs is not None) for _ in range(c.n)]
        self.prompt_logprobs = None
        self.cached = 0
        self.metrics = None
        self.finished = False
        self.handle = None
        arr = (ctypes.c_int32 * len(ids))(*ids)
        desc = _lib.RequestDescC()
        desc.struct_size = ctypes.sizeof(desc)
        desc.prompt_ids = ctypes.cast(arr, _lib.c_int32_p)
        desc.num_prompt_ids = len(ids)
        desc.params = ctypes.pointer(c)
        if images:
            imgs = (_lib.ImageInputC * len(images))()
            bufs = []
            for k, b in enumerate(images):
                buf = ctypes.create_string_buffer(b, len(b))
                bufs.append(buf)
                imgs[k].data = ctypes.cast(buf, ctypes.c_void_p)
                imgs[k].size = len(b)
            desc.images = imgs
            desc.num_images = len(images)
            keep += [imgs, bufs]
        handle = ctypes.c_void_p()
        _lib.check(_lib_.kiln_engine_submit(llm._eng, ctypes.byref(desc), ctypes.byref(handle)))
        self.handle = handle
        llm._live.add(self)

    def poll(self, timeout_ms):
        """The next event (a pointer the caller frees), or None on timeout / when finished."""
        if self.finished or not self.handle:
            return None
        out = ctypes.POINTER(_lib.OutputC)()
        _lib.check(_lib_.kiln_request_poll(self.handle, timeout_ms, ctypes.byref(out)))
        return out if out else None

    def cancel(self):
        if self.handle:
            _lib_.kiln_request_cancel(self.handle)

    def release(self):
        if self.handle:
            if not self.finished:
                _lib_.kiln_request_cancel(self.handle)
            _lib_.kiln_request_release(self.handle)
            self.handle = None
            self.llm._live.discard(self)

    def _position(self, tok, lp, top_ids, top_lps, base, top_n):
        tt = self.llm._token_text
        d = {}
        rank = None
        for j in range(top_n):
            if top_ids[base + j] == tok:
                rank = j + 1
                break
        d[tok] = Logprob(lp, rank, tt(tok))
        for j in range(top_n):
            t = top_ids[base + j]
            if t not in d:
                d[t] = Logprob(top_lps[base + j], j + 1, tt(t))
        return d

    def apply(self, ev):
        """Takes one event in; returns the CompletionOutput of what it added (a delta)."""
        e = ev.contents
        if e.index < 0 or e.index >= len(self.seqs):
            raise _errors.KilnError("kiln: an event for sequence %d of %d" %
                                    (e.index, len(self.seqs)))
        s = self.seqs[e.index]
        ids = e.token_ids[:e.num_tokens] if e.num_tokens else []
        raw = ctypes.string_at(e.text, e.text_len) if e.text_len else b""
        s.text += raw
        s.token_ids += ids
        delta_lp = None
        if s.logprobs is not None and e.logprobs:
            delta_lp = []
            for t in range(e.num_tokens):
                lp = e.logprobs[t]
                s.cum += lp
                delta_lp.append(self._position(ids[t], lp, e.top_ids, e.top_logprobs,
                                               t * e.top_n, e.top_n if e.top_ids else 0))
            s.logprobs += delta_lp
        if e.num_prompt_logprobs and self.prompt_logprobs is None:
            pl = [None]
            for i in range(e.num_prompt_logprobs):
                tok = self.prompt_ids[i + 1] if i + 1 < len(self.prompt_ids) else -1
                pl.append(self._position(tok, e.prompt_logprobs[i], e.prompt_top_ids,
                                         e.prompt_top_logprobs, i * e.prompt_top_n,
                                         e.prompt_top_n if e.prompt_top_ids else 0))
            self.prompt_logprobs = pl
        if e.finish_reason == _lib.FINISH_ERROR:
            raise _errors.RequestError((e.error or b"the request failed").decode("utf-8",
                                                                                 "replace"))
        if e.finish_reason != _lib.FINISH_NONE:
            s.finish = _lib.FINISH_NAMES.get(e.finish_reason, "stop")
            if e.stop_str:
                s.stop_reason = e.stop_str.decode("utf-8", "replace")
            elif e.stop_token >= 0 and e.stop_token in (self.params.stop_token_ids or ()):
                s.stop_reason = e.stop_token
        self.cached = e.usage.cached_tokens
        self.metrics = {"queue_time": e.queue_time, "first_token_time": e.first_token_time,
                        "time": e.time}
        if e.request_finished:
            self.finished = True
        delta_text = s.decoder.decode(raw, final=s.finish is not None)
        return CompletionOutput(e.index, delta_text, ids, s.cum, delta_lp, s.finish,
                                s.stop_reason)

    def result(self):
        outs = [CompletionOutput(i, bytes(s.text).decode("utf-8", "replace"), s.token_ids, s.cum,
                                 s.logprobs, s.finish, s.stop_reason)
                for i, s in enumerate(self.seqs)]
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, self.prompt_logprobs,
                             outs, self.finished, self.cached, self.metrics)


class Stream:
    """A request's outputs as they come: iterate for RequestOutput items, each holding in
    outputs[0] what one sequence just added (text, token_ids, logprobs: deltas) and its
    finish_reason once it ends; the last item has finished = True. cancel() asks the engine
    to stop (the stream then ends with finish_reason "abort"); close(), leaving a `with`
    block, an exception (Ctrl-C) inside the iteration, or dropping the stream cancel the
    request too."""

    def __init__(self, req):
        self._req = req

    @property
    def request_id(self):
        return self._req.request_id

    @property
    def prompt_token_ids(self):
        return self._req.prompt_ids

    def __iter__(self):
        return self

    def __next__(self):
        r = self._req
        if r.finished or not r.handle:
            self.close()
            raise StopIteration
        try:
            while True:
                ev = r.poll(_POLL_SLICE_MS)
                if ev is None:
                    continue
                try:
                    delta = r.apply(ev)
                finally:
                    _lib_.kiln_output_free(ev)
                item = RequestOutput(r.request_id, r.prompt, r.prompt_ids, r.prompt_logprobs,
                                     [delta], r.finished, r.cached, r.metrics)
                if r.finished:
                    r.release()
                return item
        except BaseException:
            self.close()
            raise

    def result(self):
        """Drains the stream; the whole request's RequestOutput (as LLM.generate gives)."""
        for _ in self:
            pass
        return self._req.result()

    def cancel(self):
        self._req.cancel()

    def close(self):
        if self._req.handle:
            self._req.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


PromptType = Union[str, Dict[str, Any]]


class LLM:
    """An in-process Kiln engine on one model.

        llm = kiln.LLM()                          # the embedded default model (kiln-tiny)
        llm = kiln.LLM("path/to/hf-dir", dtype="bfloat16", max_model_len=4096)
        out = llm.generate(["Once upon a time"], kiln.SamplingParams(max_tokens=32))
        print(out[0].outputs[0].text)

    model: a Hugging Face model directory or a GGUF file (None or "" = the embedded default
    model, or [model] path of the config file).  config: an INI file (None = the built-in
    defaults).  engine_options: any Kiln configuration key (`kiln --help-config`), by its
    name when only one section has it (dtype=, max_model_len=, max_num_seqs=,
    gpu_memory_utilization=, num_blocks=, enable_prefix_caching=, seed=, threads=...), else
    as section_key or section__key (backend_name="cpu", or backend="cpu"); bools, numbers,
    strings and lists (int lists) are accepted. An unknown name raises TypeError; a bad value
    raises InvalidArgumentError with Kiln's message naming the key.
    """

    def __init__(self, model: Optional[str] = None, *, config: Optional[str] = None,
                 **engine_options):
        self._eng = None
        self._live = set()
        self._tok_cache = {}
        self._lock = threading.Lock()
        self._next_id = 0
        ov = []
        if model:
            ov.append("model.path=" + os.fspath(model))
        ov += _resolve_options(engine_options)
        arr = (ctypes.c_char_p * max(1, len(ov)))(*[o.encode("utf-8") for o in ov])
        eng = ctypes.c_void_p()
        _lib.check(_lib_.kiln_engine_create(
            os.fsencode(config) if config is not None else None,
            ctypes.cast(arr, _lib.c_char_p_p), len(ov), ctypes.byref(eng)))
        self._eng = eng
        info = _lib.EngineInfoC()
        _lib_.kiln_engine_get_info_sized(eng, ctypes.byref(info), ctypes.sizeof(info))
        dec = lambda b: b.decode("utf-8", "replace") if b else None  # noqa: E731
        self.info = {
            "model_path": dec(info.model_path), "model_name": dec(info.model_name),
            "backend": dec(info.backend), "device": dec(info.device),
            "vocab_size": info.vocab_size, "max_model_len": info.max_model_len,
            "block_size": info.block_size, "num_blocks": info.num_blocks,
            "max_num_seqs": info.max_num_seqs,
            "max_num_batched_tokens": info.max_num_batched_tokens,
            "has_tokenizer": info.has_tokenizer,
            "kv_cache_dtype": dec(info.kv_cache_dtype),
            "quantization": dec(info.quantization),
            "max_images": _lib_.kiln_engine_max_images(eng),
        }

    # ---- life cycle ----

    def close(self):
        """Cancels what still runs and frees the engine (also done when the LLM is dropped)."""
        if self._eng:
            for r in list(self._live):
                r.release()
            _lib_.kiln_engine_destroy(self._eng)
            self._eng = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _engine(self):
        if not self._eng:
            raise _errors.KilnError("this LLM is closed")
        return self._eng

    # ---- text ----

    def tokenize(self, text: str, add_special_tokens: bool = True) -> List[int]:
        """The model tokenizer's ids for text (add_special_tokens: BOS etc., as a prompt)."""
        b = text.encode("utf-8")
        ids = _lib.c_int32_p()
        n = ctypes.c_int32()
        _lib.check(_lib_.kiln_engine_tokenize(self._engine(), b, len(b), add_special_tokens,
                                              ctypes.byref(ids), ctypes.byref(n)))
        try:
            return ids[:n.value] if n.value else []
        finally:
            _lib.free(ids)

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(t) for t in token_ids]
        arr = (ctypes.c_int32 * max(1, len(ids)))(*ids)
        out = ctypes.c_void_p()
        _lib.check(_lib_.kiln_engine_detokenize(self._engine(), ctypes.cast(arr, _lib.c_int32_p),
                                                len(ids), skip_special_tokens, ctypes.byref(out)))
        try:
            return ctypes.string_at(out).decode("utf-8", "replace")
        finally:
            _lib.free(out)

    def _token_text(self, tok):
        s = self._tok_cache.get(tok)
        if s is None:
            s = self.detokenize([tok]) if self.info["has_tokenizer"] and tok >= 0 else ""
            self._tok_cache[tok] = s
        return s

    def apply_chat_template(self, messages: List[Dict[str, Any]], *,
                            add_generation_prompt: bool = True, tools: Optional[list] = None,
                            chat_template_kwargs: Optional[Dict[str, Any]] = None) -> str:
        """The prompt the model's chat template makes of messages (as transformers'
        apply_chat_template with tokenize=False). Image parts must already be
        {"type": "image"}; chat() takes image_url parts too."""
        m = json.dumps(messages, ensure_ascii=False).encode("utf-8")
        t = json.dumps(tools, ensure_ascii=False).encode("utf-8") if tools else None
        x = (json.dumps(chat_template_kwargs, ensure_ascii=False).encode("utf-8")
             if chat_template_kwargs else None)
        a = _lib.ChatArgsC(m, len(m), t, len(t) if t else 0, x, len(x) if x else 0,
                           add_generation_prompt)
        out = ctypes.c_void_p()
        n = ctypes.c_size_t()
        _lib.check(_lib_.kiln_engine_apply_chat_template(self._engine(), ctypes.byref(a),
                                                         ctypes.byref(out), ctypes.byref(n)))
        try:
            return ctypes.string_at(out, n.value).decode("utf-8", "replace")
        finally:
            _lib.free(out)

    # ---- requests ----

    def _new_id(self):
        with self._lock:
            self._next_id += 1
            return str(self._next_id)

    def _prepare(self, prompt):
        """(prompt text or None, token ids, images) of one prompt of generate()."""
        images = []
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt), images
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
            if unknown:
                raise TypeError("a prompt dict takes prompt, prompt_token_ids and "
                                "multi_modal_data, not %s" % ", ".join(sorted(unknown)))
            mm = prompt.get("multi_modal_data") or {}
            if set(mm) - {"image"}:
                raise _errors.UnsupportedError(
                    "multi_modal_data: only 'image' is supported, not %s" %
                    ", ".join(sorted(set(mm) - {"image"})), 4)
            im = mm.get("image")
            if im is not None:
                im = im if isinstance(im, (list, tuple)) else [im]
                images = [_image_bytes(x, "multi_modal_data.image[%d]" % i)
                          for i, x in enumerate(im)]
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(
                        isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise TypeError("prompt_token_ids must be a list of ints")
                return prompt.get("prompt"), list(ids), images
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.tokenize(prompt["prompt"]), images
            raise TypeError("a prompt dict needs 'prompt' (a str) or 'prompt_token_ids'")
        raise TypeError("a prompt is a str or a dict with 'prompt' or 'prompt_token_ids', got %s"
                        % type(prompt).__name__)

    @staticmethod
    def _params_list(sampling_params, n):
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        sp = list(sampling_params)
        if len(sp) != n or not all(isinstance(p, SamplingParams) for p in sp):
            raise ValueError("sampling_params: one SamplingParams, or a list of one per prompt "
                             "(%d prompts, got %d)" % (n, len(sp)))
        return sp

    def _run(self, prepared, params, priority):
        """Submits every (prompt, ids, images) with its params, at most _MAX_IN_FLIGHT at a
        time, and waits for all of them; RequestOutputs in input order."""
        self._engine()
        n = len(prepared)
        prio = [0] * n if priority is None else list(priority)
        if len(prio) != n:
            raise ValueError("priority: one int per prompt (%d prompts, got %d)" % (n, len(prio)))
        results = [None] * n
        inflight = []
        nxt = 0
        try:
            while nxt < n or inflight:
                # What is submitted in one go is admitted in one scheduler step (the intake is
                # held meanwhile): the batches, and so the samples, do not depend on timing.
                _lib_.kiln_engine_hold_intake(self._eng, True)
                try:
                    while nxt < n and len(inflight) < _MAX_IN_FLIGHT:
                        text, ids, images = prepared[nxt]
                        try:
                            r = _Request(self, self._new_id(), text, ids, params[nxt],
                                         prio[nxt], images)
                        except _errors.UnavailableError:
                            if not inflight:
                                raise
                            break  # the queue is full: wait for one to finish, then try again
                        inflight.append((nxt, r))
                        nxt += 1
                finally:
                    _lib_.kiln_engine_hold_intake(self._eng, False)
                i, r = inflight[0]
                ev = r.poll(_POLL_SLICE_MS)
                while ev is not None:
                    try:
                        r.apply(ev)
                    finally:
                        _lib_.kiln_output_free(ev)
                    ev = r.poll(0)
                # keep the other queues short
                for _, o in inflight[1:]:
                    ev = o.poll(0)
                    while ev is not None:
                        try:
                            o.apply(ev)
                        finally:
                            _lib_.kiln_output_free(ev)
                        ev = o.poll(0)
                done = [(k, q) for k, q in inflight if q.finished]
                for k, q in done:
                    results[k] = q.result()
                    q.release()
                inflight = [(k, q) for k, q in inflight if not q.finished]
        finally:
            for _, r in inflight:
                r.release()
        return results

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 *, priority: Optional[Sequence[int]] = None) -> List[RequestOutput]:
        """Runs every prompt (a str, {"prompt": str}, {"prompt_token_ids": [...]}, either with
        "multi_modal_data": {"image": bytes | path | [...]}) at once, continuously batched, and
        returns one RequestOutput per prompt, in order. sampling_params: one for all, or one
        per prompt. priority: per prompt, with [scheduler] policy = priority (lower first)."""
        single = isinstance(prompts, (str, dict))
        plist = [prompts] if single else list(prompts)
        params = self._params_list(sampling_params, len(plist))
        prepared = [self._prepare(p) for p in plist]
        return self._run(prepared, params, priority)

    def _chat_prepare(self, messages, add_generation_prompt, tools, chat_template_kwargs):
        msgs, images = _rewrite_messages(messages)
        if images and self.info["max_images"] == 0:
            raise _errors.InvalidArgumentError(
                "the model takes no images (it has no vision tower): give text only", 1)
        prompt = self.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt,
                                          tools=tools, chat_template_kwargs=chat_template_kwargs)
        return prompt, self.tokenize(prompt, add_special_tokens=False), images

    def chat(self, messages, sampling_params: Union[None, SamplingParams,
                                                    Sequence[SamplingParams]] = None, *,
             add_generation_prompt: bool = True, tools: Optional[list] = None,
             chat_template_kwargs: Optional[Dict[str, Any]] = None) -> List[RequestOutput]:
        """Replies to a conversation (a list of {"role", "content"} messages), or to each of
        a list of conversations, rendered with the model's chat template. Content may be a
        list of parts: {"type": "text", "text": ...}, {"type": "image_url", "image_url":
        {"url": "data:...;base64,..." or a path}} or {"type": "image", "image": bytes | path}
        (vision-language models). tools and chat_template_kwargs go to the template."""
        batch = isinstance(messages, (list, tuple)) and messages and isinstance(
            messages[0], (list, tuple))
        convs = list(messages) if batch else [messages]
        params = self._params_list(sampling_params, len(convs))
        prepared = [self._chat_prepare(c, add_generation_prompt, tools, chat_template_kwargs)
                    for c in convs]
        return self._run(prepared, params, None)

    def stream(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None, *,
               priority: int = 0) -> Stream:
        """One prompt's outputs as they are generated (see Stream):

            for out in llm.stream("Once upon a time", SamplingParams(max_tokens=64)):
                print(out.outputs[0].text, end="", flush=True)
        """
        text, ids, images = self._prepare(prompt)
        sp = self._params_list(sampling_params, 1)[0]
        return Stream(_Request(self, self._new_id(), text, ids, sp, priority, images))

    def chat_stream(self, messages, sampling_params: Optional[SamplingParams] = None, *,
                    add_generation_prompt: bool = True, tools: Optional[list] = None,
                    chat_template_kwargs: Optional[Dict[str, Any]] = None) -> Stream:
        """chat() for one conversation, streamed (see Stream)."""
        text, ids, images = self._chat_prepare(messages, add_generation_prompt, tools,
                                               chat_template_kwargs)
        sp = self._params_list(sampling_params, 1)[0]
        return Stream(_Request(self, self._new_id(), text, ids, sp, 0, images))
