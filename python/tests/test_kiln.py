"""Kiln's Python package on the embedded default model (kiln-tiny), against the `kiln` command
as the reference: the same prompts through `kiln generate --json`, `kiln template` and
`kiln tokenize` (a separate code path over the same engine) must give the same token ids,
text and logprobs.

    KILN_BIN=build/bin/kiln KILN_LIBRARY=build/lib/libkiln.so PYTHONPATH=python \
        python3 -m unittest discover -s python/tests -v

KILN_BIN defaults to the kiln beside the library (../bin/kiln); KILN_SOURCE_DIR (the tree with
share/models/kiln-tiny and the test fixtures) to the tree this file is in.
"""

import base64
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import unittest

import kiln
from kiln import SamplingParams

KILN_BIN = os.environ.get("KILN_BIN") or os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(kiln.LIBRARY_PATH))), "bin", "kiln")
# the source tree: $KILN_SOURCE_DIR, else the one this file is in (python/tests/..)
SRC = os.environ.get("KILN_SOURCE_DIR") or os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
TINY = os.path.join(SRC, "share", "models", "kiln-tiny")
CPU = ["--set", "backend.name=cpu", "--set", "backend.threads=1"]
OPTS = dict(backend="cpu", threads=1, num_blocks=1024)


def cli(*args, stdin=None):
    r = subprocess.run([KILN_BIN, *args, *CPU], input=stdin, capture_output=True, text=True,
                       timeout=120)
    if r.returncode != 0:
        raise AssertionError("kiln %s failed: %s" % (" ".join(args), r.stderr))
    return r.stdout


def cli_json(*args):
    return json.loads(cli(*args, "--json"))


class KilnTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.llm = kiln.LLM(**OPTS)

    @classmethod
    def tearDownClass(cls):
        cls.llm.close()

    def assertLogprobsMatch(self, got, want, top):
        """got: the package's [{id: Logprob}], want: kiln generate --json's logprobs."""
        self.assertEqual(len(got), len(want))
        for pos, (g, w) in enumerate(zip(got, want)):
            tok = w["token_id"]
            self.assertEqual(next(iter(g)), tok, "position %d: the sampled token first" % pos)
            self.assertAlmostEqual(g[tok].logprob, w["logprob"], places=4)
            self.assertEqual(len(w["top_logprobs"]), top)
            for rank, (tid, lp) in enumerate(w["top_logprobs"], 1):
                self.assertIn(tid, g)
                self.assertAlmostEqual(g[tid].logprob, lp, places=4)
                self.assertEqual(g[tid].rank, rank)
                self.assertEqual(g[tid].decoded_token, self.llm.detokenize([tid]))

    # ---- generate vs kiln generate ----

    def test_greedy_matches_cli(self):
        want = cli_json("generate", "--prompt", "Once upon a time", "--max-tokens", "12",
                        "--temperature", "0", "--logprobs", "3")
        out = self.llm.generate(["Once upon a time"],
                                SamplingParams(max_tokens=12, temperature=0, logprobs=3))
        self.assertEqual(len(out), 1)
        r = out[0]
        self.assertTrue(r.finished)
        self.assertEqual(r.prompt, "Once upon a time")
        self.assertEqual(r.prompt_token_ids, want["prompt_ids"])
        self.assertEqual(len(r.outputs), 1)
        c = r.outputs[0]
        self.assertEqual(c.index, 0)
        self.assertEqual(c.token_ids, want["token_ids"])
        self.assertEqual(c.text, want["text"])
        self.assertEqual(c.finish_reason, want["finish_reason"])
        self.assertLogprobsMatch(c.logprobs, want["logprobs"], 3)
        self.assertAlmostEqual(c.cumulative_logprob, sum(w["logprob"] for w in want["logprobs"]),
                               places=3)

    def test_sampled_matches_cli(self):
        args = ["--prompt", "The old man", "--max-tokens", "16", "--temperature", "0.9",
                "--top-p", "0.9", "--top-k", "50", "--seed", "11", "--n", "3"]
        want = cli_json("generate", *args)
        sp = SamplingParams(n=3, max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=11)
        r = self.llm.generate("The old man", sp)[0]
        self.assertEqual([c.index for c in r.outputs], [0, 1, 2])
        self.assertEqual([c.token_ids for c in r.outputs], want["token_ids"])
        self.assertEqual([c.text for c in r.outputs], want["text"])
        self.assertEqual([c.finish_reason for c in r.outputs], want["finish_reason"])
        self.assertEqual(len({tuple(c.token_ids) for c in r.outputs}), 3, "3 different samples")
        self.assertIsNone(r.outputs[0].logprobs)
        self.assertIsNone(r.outputs[0].cumulative_logprob)

    def test_batch_matches_cli_batch(self):
        """Per-prompt params in one batch against the same lines through kiln generate
        --input (the same batch, so the same tokens), and greedy batch = one by one."""
        prompts = ["Once upon a time", "The cat", {"prompt": "A little girl"},
                   {"prompt_token_ids": [2821, 330, 2113]}, "It was a dark night"]
        params = [SamplingParams(max_tokens=8 + i, temperature=0.7, seed=100 + i)
                  for i in range(len(prompts))]
        lines = []
        for p, sp in zip(prompts, params):
            line = {"max_tokens": sp.max_tokens, "temperature": sp.temperature, "seed": sp.seed}
            if isinstance(p, str):
                line["prompt"] = p
            elif "prompt" in p:
                line["prompt"] = p["prompt"]
            else:
                line["prompt_ids"] = p["prompt_token_ids"]
            lines.append(json.dumps(line))
        want = [json.loads(x) for x in cli("generate", "--input", "-",
                                           stdin="\n".join(lines) + "\n").splitlines()]
        batch = self.llm.generate(prompts, params)
        self.assertEqual(len(batch), len(prompts))
        for b, w in zip(batch, want):
            self.assertEqual(b.outputs[0].token_ids, w["token_ids"])
            self.assertEqual(b.outputs[0].text, w["text"])
            self.assertEqual(b.outputs[0].finish_reason, w["finish_reason"])
        self.assertEqual(batch[3].prompt_token_ids, [2821, 330, 2113])
        self.assertIsNone(batch[3].prompt)
        self.assertEqual(batch[2].prompt, "A little girl")
        self.assertEqual(len({b.request_id for b in batch}), len(batch))
        greedy = SamplingParams(max_tokens=10, temperature=0)
        batch = self.llm.generate(prompts, greedy)
        for p, b in zip(prompts, batch):
            self.assertEqual(b.outputs[0].token_ids,
                             self.llm.generate(p, greedy)[0].outputs[0].token_ids)

    def test_many_prompts(self):
        outs = self.llm.generate(["Hello %d" % i for i in range(200)],
                                 SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        self.assertEqual([len(o.outputs[0].token_ids) for o in outs], [4] * 200)
        self.assertEqual([o.prompt for o in outs], ["Hello %d" % i for i in range(200)])

    def test_lengths_and_eos(self):
        c = self.llm.generate("Once", SamplingParams(max_tokens=5, ignore_eos=True,
                                                      temperature=0))[0].outputs[0]
        self.assertEqual((len(c.token_ids), c.finish_reason), (5, "length"))
        # greedy on the chat prompt ends with the end-of-sequence token (tests below)
        c = self.llm.generate("Once", SamplingParams(max_tokens=None, temperature=0,
                                                      ignore_eos=True))[0].outputs[0]
        self.assertEqual(c.finish_reason, "length")
        self.assertEqual(len(c.token_ids) + 2, self.llm.info["max_model_len"])  # "Once" = 2

    def test_stop_strings_and_tokens(self):
        base = self.llm.generate("Once upon a time", SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True))[0].outputs[0]
        stop = base.text[10:14]
        self.assertEqual(len(stop), 4)
        cut = base.text.index(stop)
        c = self.llm.generate("Once upon a time", SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True, stop=[stop, "zzzzqq"]))[0].outputs[0]
        self.assertEqual(c.text, base.text[:cut])
        self.assertEqual((c.finish_reason, c.stop_reason), ("stop", stop))
        c = self.llm.generate("Once upon a time", SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True, stop=stop,
            include_stop_str_in_output=True))[0].outputs[0]
        self.assertEqual(c.text, base.text[:cut + len(stop)])
        tok = base.token_ids[5]
        first = base.token_ids.index(tok)
        c = self.llm.generate("Once upon a time", SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[tok]))[0].outputs[0]
        self.assertEqual((c.finish_reason, c.stop_reason), ("stop", tok))
        self.assertEqual(c.token_ids[:first], base.token_ids[:first])
        self.assertLessEqual(len(c.token_ids), first + 1)
        # min_tokens: the stop token is ignored before 12 tokens
        c = self.llm.generate("Once upon a time", SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[tok],
            min_tokens=12))[0].outputs[0]
        self.assertGreaterEqual(len(c.token_ids), 12)

    def test_logit_bias_and_penalties(self):
        base = self.llm.generate("Once upon a time", SamplingParams(
            max_tokens=6, temperature=0))[0].outputs[0]
        banned = base.token_ids[0]
        c = self.llm.generate("Once upon a time", SamplingParams(
            max_tokens=6, temperature=0, logit_bias={banned: -100}))[0].outputs[0]
        self.assertNotIn(banned, c.token_ids)
        forced = 1000
        c = self.llm.generate("Once upon a time", SamplingParams(
            max_tokens=3, temperature=0, logit_bias={forced: 100}))[0].outputs[0]
        self.assertEqual(c.token_ids, [forced] * 3)
        c = self.llm.generate("Once upon a time", SamplingParams(
            max_tokens=3, temperature=0, logit_bias={forced: 100},
            repetition_penalty=100.0))[0].outputs[0]
        self.assertEqual(c.token_ids[0], forced)

    def test_prompt_logprobs_match_generation_logprobs(self):
        """The prompt's logprobs at position i (prefill logits) against the logprobs of one
        token generated from the first i prompt tokens (decode logits)."""
        r = self.llm.generate("Once upon a time there was", SamplingParams(
            max_tokens=1, temperature=0, prompt_logprobs=5))[0]
        ids = r.prompt_token_ids
        self.assertEqual(len(r.prompt_logprobs), len(ids))
        self.assertIsNone(r.prompt_logprobs[0])
        for i in range(1, len(ids)):
            pos = r.prompt_logprobs[i]
            self.assertEqual(next(iter(pos)), ids[i])
            g = self.llm.generate({"prompt_token_ids": ids[:i]}, SamplingParams(
                max_tokens=1, temperature=0, logprobs=5))[0].outputs[0].logprobs[0]
            top = {t: lp for t, lp in g.items() if lp.rank is not None}
            self.assertEqual(len(top), 5)
            for t, lp in top.items():
                self.assertAlmostEqual(pos[t].logprob, lp.logprob, places=4)
                self.assertEqual(pos[t].rank, lp.rank)

    def test_guided_decoding(self):
        """Structured output: the engine's answer, or its refusal with its message (the engine
        of this build may not have constrained decoding yet)."""
        G = kiln.GuidedDecodingParams
        cases = [(G(choice=["yes", "no"]), lambda t: t in ("yes", "no")),
                 (G(regex="[0-9]{3}"), lambda t: len(t) == 3 and t.isdigit()),
                 (G(json={"type": "object", "properties": {"a": {"type": "integer"}},
                          "required": ["a"]}),
                  lambda t: isinstance(json.loads(t)["a"], int)),
                 (G(json_object=True), lambda t: isinstance(json.loads(t), dict))]
        for g, ok in cases:
            sp = SamplingParams(max_tokens=32, temperature=0, guided_decoding=g)
            try:
                c = self.llm.generate("Answer:", sp)[0].outputs[0]
            except kiln.UnsupportedError as e:
                self.assertIn("constrained decoding", str(e))
                continue
            self.assertTrue(ok(c.text), "%r does not match %r" % (c.text, g))
        with self.assertRaises(ValueError):
            self.llm.generate("x", SamplingParams(guided_decoding=G(regex="a", choice=["b"])))
        with self.assertRaises(ValueError):
            self.llm.generate("x", SamplingParams(guided_decoding=G()))
        with self.assertRaises(TypeError):
            self.llm.generate("x", SamplingParams(guided_decoding={"regex": "a"}))

    # ---- text ----

    def test_tokenize_matches_cli(self):
        text = "Hello world, it's a test."
        want = json.loads(cli("tokenize", "--tokenizer", TINY, "--json", stdin=text))
        self.assertEqual(self.llm.tokenize(text), want)
        self.assertEqual(self.llm.detokenize(want), text)

    def test_chat_matches_cli(self):
        msgs = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Tell me about the sea."}]
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(msgs, f)
        try:
            prompt = cli("template", "--tokenizer", TINY, "--messages", f.name,
                         "--add-generation-prompt")
            want = cli_json("generate", "--messages", f.name, "--max-tokens", "40",
                            "--temperature", "0")
        finally:
            os.unlink(f.name)
        self.assertEqual(self.llm.apply_chat_template(msgs), prompt)
        r = self.llm.chat(msgs, SamplingParams(max_tokens=40, temperature=0))[0]
        self.assertEqual(r.prompt, prompt)
        self.assertEqual(r.prompt_token_ids, want["prompt_ids"])
        self.assertEqual(r.outputs[0].token_ids, want["token_ids"])
        self.assertEqual(r.outputs[0].text, want["text"])
        self.assertEqual(r.outputs[0].finish_reason, want["finish_reason"])
        # a batch of conversations, and content as parts
        parts = [msgs[0], {"role": "user", "content": [{"type": "text",
                                                         "text": "Tell me about the sea."}]}]
        both = self.llm.chat([msgs, parts], SamplingParams(max_tokens=40, temperature=0))
        self.assertEqual([b.outputs[0].token_ids for b in both], [want["token_ids"]] * 2)
        # no generation prompt
        self.assertFalse(self.llm.apply_chat_template(msgs, add_generation_prompt=False)
                         .endswith("assistant\n"))

    def test_chat_errors(self):
        with self.assertRaises(kiln.InvalidArgumentError) as e:
            self.llm.chat([{"role": "user", "content": [{"type": "image_url",
                                                          "image_url": {"url": 5}}]}])
        self.assertIn("messages[0].content[0]", str(e.exception))
        with self.assertRaises(kiln.InvalidArgumentError) as e:
            self.llm.chat([{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://example.com/x.png"}}]}])
        self.assertIn("does not fetch URLs", str(e.exception))
        with self.assertRaises(kiln.InvalidArgumentError) as e:  # a model without a vision tower
            self.llm.chat([{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                {"type": "text", "text": "What is this?"}]}])
        self.assertIn("no vision tower", str(e.exception))
        with self.assertRaises(kiln.InvalidArgumentError) as e:
            self.llm.chat([{"role": "user", "content": [{"type": "audio", "audio": "x"}]}])
        self.assertIn("content of type 'audio' is not supported", str(e.exception))
        with self.assertRaises(TypeError):
            self.llm.chat("hello")

    # ---- streaming ----

    def test_stream_is_generate_in_pieces(self):
        sp = SamplingParams(n=2, max_tokens=20, temperature=0.8, seed=5, logprobs=1)
        want = self.llm.generate("The little boat", sp)[0]
        text = ["", ""]
        ids = [[], []]
        lps = [[], []]
        finish = [None, None]
        items = list(self.llm.stream("The little boat", sp))
        self.assertGreater(len(items), 10)
        for k, it in enumerate(items):
            self.assertEqual(len(it.outputs), 1)
            c = it.outputs[0]
            self.assertIsNone(finish[c.index], "nothing after a sequence finished")
            text[c.index] += c.text
            ids[c.index] += c.token_ids
            lps[c.index] += c.logprobs or []
            finish[c.index] = c.finish_reason
            self.assertEqual(it.finished, k == len(items) - 1)
            self.assertEqual(it.prompt_token_ids, want.prompt_token_ids)
        for i in range(2):
            self.assertEqual(text[i], want.outputs[i].text)
            self.assertEqual(ids[i], want.outputs[i].token_ids)
            self.assertEqual(finish[i], want.outputs[i].finish_reason)
            self.assertEqual([list(p) for p in lps[i]],
                             [list(p) for p in want.outputs[i].logprobs])
        # result() after a partial read gives the whole request
        s = self.llm.stream("The little boat", sp)
        next(s)
        r = s.result()
        self.assertEqual([c.token_ids for c in r.outputs], [c.token_ids for c in want.outputs])

    def test_chat_stream(self):
        msgs = [{"role": "user", "content": "Hi there"}]
        sp = SamplingParams(max_tokens=30, temperature=0)
        want = self.llm.chat(msgs, sp)[0].outputs[0]
        with self.llm.chat_stream(msgs, sp) as s:
            got = "".join(it.outputs[0].text for it in s)
        self.assertEqual(got, want.text)

    def test_stream_cancel(self):
        sp = SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0)
        s = self.llm.stream("Once upon a time", sp)
        n = 0
        last = None
        for it in s:
            n += len(it.outputs[0].token_ids)
            last = it
            if n >= 3 and n < 100:
                s.cancel()
        self.assertEqual(last.outputs[0].finish_reason, "abort")
        self.assertTrue(last.finished)
        self.assertLess(n, 200)
        # leaving a loop early cancels the request and frees its handle
        s = self.llm.stream("Once upon a time", sp)
        for it in s:
            break
        s.close()
        self.assertEqual(len(self.llm._live), 0)
        with self.assertRaises(KeyboardInterrupt):
            for it in self.llm.stream("Once upon a time", sp):
                raise KeyboardInterrupt
        self.assertEqual(len(self.llm._live), 0)
        self.assertEqual(len(self.llm.generate("Hi", SamplingParams(max_tokens=3,
                                                                     ignore_eos=True))[0]
                             .outputs[0].token_ids), 3)

    def test_ctrl_c_stops_generate(self):
        """SIGINT while generate() waits: KeyboardInterrupt within a poll slice, the requests
        cancelled, the engine usable."""
        sp = SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0)
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        t0 = time.monotonic()
        timer.start()
        returned = []
        try:
            with self.assertRaises(KeyboardInterrupt):
                self.llm.generate(["Once upon a time"] * 8, sp)
                returned.append(time.monotonic() - t0)
                time.sleep(5)
        finally:
            timer.cancel()
        self.assertEqual(returned, [], "generate returned before the signal came")
        self.assertLess(time.monotonic() - t0, 3)
        self.assertEqual(len(self.llm._live), 0)
        out = self.llm.generate("Hi", SamplingParams(max_tokens=2, ignore_eos=True))
        self.assertEqual(len(out[0].outputs[0].token_ids), 2)

    # ---- errors ----

    def test_sampling_errors(self):
        cases = [
            (SamplingParams(temperature=-1), "temperature must be in [0, 100], got -1"),
            (SamplingParams(top_p=0), "top_p must be in (0, 1], got 0"),
            (SamplingParams(n=0), "n must be in [1, "),
            (SamplingParams(max_tokens=0), "max_tokens must be >= 1"),
            (SamplingParams(logprobs=21), "logprobs must be in [0, 20], got 21"),
            (SamplingParams(stop_token_ids=[999999]), "stop_token_ids[0] = 999999 is outside"),
            (SamplingParams(max_tokens=100000), "context"),
            (SamplingParams(stop=[""]), "stop[0] is empty"),
        ]
        for sp, msg in cases:
            with self.assertRaises(kiln.InvalidArgumentError, msg=msg) as e:
                self.llm.generate("Hello", sp)
            self.assertIn(msg, str(e.exception))
            self.assertEqual(e.exception.code, 1)
            self.assertIsInstance(e.exception, ValueError)
            with self.assertRaises(kiln.InvalidArgumentError):
                self.llm.stream("Hello", sp)
        with self.assertRaises(TypeError) as e:
            SamplingParams(temprature=0.5)
        self.assertIn("temprature", str(e.exception))
        with self.assertRaises(TypeError) as e:
            self.llm.generate("Hello", SamplingParams(n="2"))
        self.assertIn("SamplingParams.n", str(e.exception))
        with self.assertRaises(kiln.InvalidArgumentError):
            self.llm.generate("Hello", SamplingParams(n=1 << 40))
        with self.assertRaises(ValueError):
            self.llm.generate(["a", "b"], [SamplingParams()])
        with self.assertRaises(TypeError):
            self.llm.generate(5)
        with self.assertRaises(TypeError):
            self.llm.generate({"prompt_token_ids": ["x"]})
        with self.assertRaises(kiln.InvalidArgumentError) as e:
            self.llm.generate({"prompt_token_ids": [5, 999999]})
        self.assertIn("vocabulary", str(e.exception))
        with self.assertRaises(kiln.InvalidArgumentError):
            self.llm.generate({"prompt_token_ids": []})

    def test_fp8_kv_cache(self):
        with kiln.LLM(None, cache_dtype="fp8_e4m3", num_blocks=64, backend="cpu",
                      threads=1) as llm:
            self.assertEqual(llm.info["kv_cache_dtype"], "fp8_e4m3")
            out = llm.generate("Once upon a time", SamplingParams(max_tokens=8, temperature=0))
            self.assertTrue(1 <= len(out[0].outputs[0].token_ids) <= 8)

    def test_engine_options(self):
        with kiln.LLM(None, max_model_len=256, num_blocks=64, enable_prefix_caching=False,
                      backend_name="cpu", backend__threads=1, seed=3) as llm:
            self.assertEqual(llm.info["max_model_len"], 256)
            self.assertEqual(llm.info["num_blocks"], 64)
            self.assertEqual(llm.info["kv_cache_dtype"], "bf16")  # kiln-tiny's dtype
            self.assertEqual(llm.info["quantization"], "none")
            self.assertEqual(llm.info["backend"], "cpu")
            self.assertTrue(llm.info["model_path"].endswith("kiln-tiny"))
            with self.assertRaises(kiln.InvalidArgumentError) as e:
                llm.generate("Hi", SamplingParams(max_tokens=300))
            self.assertIn("256", str(e.exception))
        with kiln.LLM(TINY, **OPTS) as llm:
            self.assertEqual(llm.info["model_path"], TINY)
        with self.assertRaises(kiln.KilnError):
            llm.generate("Hi")  # closed
        with self.assertRaises(TypeError) as e:
            kiln.LLM(max_num_sequences=4)
        self.assertIn("max_num_sequences", str(e.exception))
        with self.assertRaises(TypeError) as e:
            kiln.LLM(path="x")  # [model] and [backend] have a path
        self.assertIn("model_path", str(e.exception))
        with self.assertRaises(kiln.InvalidArgumentError) as e:
            kiln.LLM(max_num_seqs=0, **OPTS)
        self.assertIn("engine.max_num_seqs", str(e.exception))
        with self.assertRaises(kiln.InvalidArgumentError) as e:
            kiln.LLM(dtype="float8", **OPTS)
        self.assertIn("model.dtype", str(e.exception))
        with self.assertRaises(kiln.InvalidArgumentError) as e:  # [cache] dtype
            kiln.LLM(cache_dtype="fp8", **OPTS)
        self.assertIn("cache.dtype", str(e.exception))
        with self.assertRaises(kiln.KilnError) as e:
            kiln.LLM("/nonexistent/model-dir", **OPTS)
        self.assertIn("/nonexistent/model-dir", str(e.exception))
        with self.assertRaises(kiln.KilnError) as e:
            kiln.LLM(config="/nonexistent.ini")
        self.assertIn("/nonexistent.ini", str(e.exception))
        keys = kiln.config_keys()
        self.assertIn(("engine", "max_num_seqs"), [(s, k) for s, k, _, _ in keys])


class ImageTest(unittest.TestCase):
    """Images on the tiny Qwen2-VL fixture (made servable by tests/server/make_vl_model.py),
    against kiln generate --messages with the same image files."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.model = os.path.join(cls.tmp.name, "vl")
        fixture = os.path.join(SRC, "tests", "fixtures", "models", "qwen2_vl")
        subprocess.run(["python3", os.path.join(SRC, "tests", "server", "make_vl_model.py"),
                        fixture, cls.model], check=True)
        cls.images = os.path.join(fixture, "images")
        cls.llm = kiln.LLM(cls.model, dtype="float32", num_blocks=512, backend="cpu", threads=1)

    @classmethod
    def tearDownClass(cls):
        cls.llm.close()
        cls.tmp.cleanup()

    def test_chat_with_images_matches_cli(self):
        a = os.path.join(self.images, "landscape.png")
        b = os.path.join(self.images, "odd.jpg")
        msgs = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": a}},
            {"type": "text", "text": "Compare"},
            {"type": "image_url", "image_url": {"url": b}}]}]
        path = os.path.join(self.tmp.name, "chat.json")
        with open(path, "w") as f:
            json.dump(msgs, f)
        want = cli_json("generate", "--model", self.model, "--set", "model.dtype=float32",
                        "--messages", path, "--max-tokens", "8", "--temperature", "0")
        self.assertEqual(self.llm.info["max_images"], 8)
        sp = SamplingParams(max_tokens=8, temperature=0)
        with open(a, "rb") as f:
            a_bytes = f.read()
        with open(b, "rb") as f:
            b_url = "data:image/jpeg;base64," + base64.b64encode(f.read()).decode()
        forms = [msgs, [{"role": "user", "content": [
            {"type": "image", "image": a_bytes}, {"type": "text", "text": "Compare"},
            {"type": "image_url", "image_url": {"url": b_url}}]}]]
        for m in forms:
            r = self.llm.chat(m, sp)[0]
            self.assertEqual(r.prompt_token_ids, want["prompt_ids"])
            self.assertEqual(r.outputs[0].token_ids, want["token_ids"])
        # generate() with the rendered prompt and multi_modal_data
        prompt = self.llm.apply_chat_template([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "Compare"}, {"type": "image"}]}])
        r = self.llm.generate({"prompt_token_ids": want["prompt_ids"],
                               "multi_modal_data": {"image": [a, a_bytes]}}, sp)[0]
        self.assertEqual(len(r.outputs[0].token_ids), 8)
        r = self.llm.generate({"prompt_token_ids": self.llm.tokenize(prompt, False),
                               "multi_modal_data": {"image": [a, b]}}, sp)[0]
        self.assertEqual(r.outputs[0].token_ids, want["token_ids"])
        with self.assertRaises(kiln.InvalidArgumentError) as e:  # 2 placeholders, 1 image
            self.llm.generate({"prompt_token_ids": want["prompt_ids"],
                               "multi_modal_data": {"image": a}}, sp)
        self.assertIn("image", str(e.exception))
        with self.assertRaises(kiln.KilnError) as e:
            self.llm.chat([{"role": "user", "content": [
                {"type": "image", "image": b"not an image"}]}], sp)
        self.assertIn("image 0", str(e.exception))


if __name__ == "__main__":
    unittest.main()
