"""SamplingParams: per-request generation settings with vLLM's names and defaults, mapped onto
libkiln's kiln_sampling_params_t."""

import ctypes
import dataclasses
import json as _json
import math
from typing import Any, Dict, List, Optional, Union

from . import _errors
from . import _lib

_INT32 = (-(1 << 31), (1 << 31) - 1)


def _int(name, v, lo=_INT32[0], hi=_INT32[1]):
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError("SamplingParams.%s must be an int, got %s" % (name, type(v).__name__))
    if not lo <= v <= hi:
        raise _errors.InvalidArgumentError("%s must be in [%d, %d], got %d" % (name, lo, hi, v), 1)
    return v


def _float(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError("SamplingParams.%s must be a number, got %s" % (name, type(v).__name__))
    v = float(v)
    if math.isfinite(v) and abs(v) > 3.4e38:  # would become inf as a C float
        raise _errors.InvalidArgumentError("%s is out of range, got %g" % (name, v), 1)
    return v


def _bool(name, v):
    if not isinstance(v, bool):
        raise TypeError("SamplingParams.%s must be a bool, got %s" % (name, type(v).__name__))
    return v


@dataclasses.dataclass
class GuidedDecodingParams:
    """Constrained decoding (structured output), as vLLM's GuidedDecodingParams: set exactly
    one of json (a JSON Schema: a dict or its JSON text), regex (the whole output matches it),
    choice (a list of strings: the output is one of them), grammar (GBNF, from "root") or
    json_object=True (any JSON object)."""

    json: Union[None, str, Dict[str, Any]] = None
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    def _kind_spec(self):
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("GuidedDecodingParams: set exactly one of json, regex, choice, "
                             "grammar, json_object (got %s)" % (", ".join(given) or "none"))
        k = given[0]
        if k == "json":
            spec = self.json if isinstance(self.json, str) else _json.dumps(self.json)
            return _lib.GUIDE_JSON_SCHEMA, spec
        if k == "regex":
            if not isinstance(self.regex, str):
                raise TypeError("GuidedDecodingParams.regex must be a str")
            return _lib.GUIDE_REGEX, self.regex
        if k == "choice":
            if not isinstance(self.choice, (list, tuple)) or not all(
                    isinstance(c, str) for c in self.choice):
                raise TypeError("GuidedDecodingParams.choice must be a list of str")
            return _lib.GUIDE_CHOICE, _json.dumps(list(self.choice))
        if k == "grammar":
            if not isinstance(self.grammar, str):
                raise TypeError("GuidedDecodingParams.grammar must be a str")
            return _lib.GUIDE_GRAMMAR, self.grammar
        if self.json_object is not True:
            raise TypeError("GuidedDecodingParams.json_object must be True or None")
        return _lib.GUIDE_JSON_OBJECT, None


@dataclasses.dataclass
class SamplingParams:
    """Generation settings of a request, as vLLM's SamplingParams (the same names, defaults and
    meanings). Values are checked by Kiln when a request is submitted: an out-of-range value
    raises InvalidArgumentError with Kiln's message naming the field; a value of the wrong
    type raises TypeError; an unknown keyword raises TypeError.

    n: sequences sampled per prompt.  max_tokens: new tokens per sequence (None = up to the
    model's context).  min_tokens: stop tokens and strings are ignored before this many.
    temperature (0 = greedy), top_p, top_k (0 or -1 = off), min_p, repetition_penalty,
    presence_penalty, frequency_penalty: as in vLLM / OpenAI.  seed: a per-request seed (the
    same tokens whatever else runs).  stop: a string or list of strings that end a sequence
    (not included in the text unless include_stop_str_in_output).  stop_token_ids: token ids
    that end a sequence.  ignore_eos: keep going past end-of-sequence tokens.  logprobs:
    None, or k >= 0 for the sampled token's logprob and the top k alternatives.
    prompt_logprobs: the same for each prompt token.  logit_bias: {token id: bias} added to
    the logits.  skip_special_tokens, detokenize: as vLLM's.  guided_decoding: a
    GuidedDecodingParams (structured output; an engine without it raises UnsupportedError).
    """

    n: int = 1
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: Union[None, str, List[str]] = None
    stop_token_ids: Optional[List[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    logit_bias: Optional[Dict[int, float]] = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    guided_decoding: Optional[GuidedDecodingParams] = None

    @property
    def stop_list(self) -> List[str]:
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop]
        return list(self.stop)

    def _to_c(self, priority=0):
        """A kiln_sampling_params_t, and the ctypes arrays it points into (keep them alive)."""
        c = _lib.sampling_params_init()
        keep = []
        c.n = _int("n", self.n)
        c.max_tokens = -1 if self.max_tokens is None else _int("max_tokens", self.max_tokens)
        c.min_tokens = _int("min_tokens", self.min_tokens)
        c.temperature = _float("temperature", self.temperature)
        c.top_p = _float("top_p", self.top_p)
        top_k = _int("top_k", self.top_k)
        c.top_k = 0 if top_k == -1 else top_k  # vLLM's -1 = off
        c.min_p = _float("min_p", self.min_p)
        c.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        c.presence_penalty = _float("presence_penalty", self.presence_penalty)
        c.frequency_penalty = _float("frequency_penalty", self.frequency_penalty)
        if self.seed is not None:
            c.has_seed = True
            c.seed = _int("seed", self.seed, 0, (1 << 64) - 1)
        c.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        c.skip_special_tokens = _bool("skip_special_tokens", self.skip_special_tokens)
        c.detokenize = _bool("detokenize", self.detokenize)
        c.include_stop_str_in_output = _bool("include_stop_str_in_output",
                                             self.include_stop_str_in_output)
        if self.stop is not None:
            if not isinstance(self.stop, (str, list, tuple)) or not all(
                    isinstance(s, str) for s in self.stop_list):
                raise TypeError("SamplingParams.stop must be a str or a list of str")
            stops = self.stop_list
            if stops:
                arr = (ctypes.c_char_p * len(stops))(*[s.encode("utf-8") for s in stops])
                keep.append(arr)
                c.stop = ctypes.cast(arr, _lib.c_char_p_p)
                c.num_stop = len(stops)
        if self.stop_token_ids:
            ids = [_int("stop_token_ids[%d]" % i, t) for i, t in enumerate(self.stop_token_ids)]
            arr = (ctypes.c_int32 * len(ids))(*ids)
            keep.append(arr)
            c.stop_token_ids = ctypes.cast(arr, _lib.c_int32_p)
            c.num_stop_token_ids = len(ids)
        if self.logit_bias:
            if not isinstance(self.logit_bias, dict):
                raise TypeError("SamplingParams.logit_bias must be a dict {token id: bias}")
            items = [(_int("logit_bias key", int(k) if isinstance(k, str) and k.isdigit() else k),
                      _float("logit_bias[%s]" % k, v)) for k, v in self.logit_bias.items()]
            ids = (ctypes.c_int32 * len(items))(*[k for k, _ in items])
            vals = (ctypes.c_float * len(items))(*[v for _, v in items])
            keep += [ids, vals]
            c.logit_bias_ids = ctypes.cast(ids, _lib.c_int32_p)
            c.logit_bias_values = ctypes.cast(vals, _lib.c_float_p)
            c.num_logit_bias = len(items)
        c.logprobs = -1 if self.logprobs is None else _int("logprobs", self.logprobs, 0)
        c.prompt_logprobs = (-1 if self.prompt_logprobs is None else
                             _int("prompt_logprobs", self.prompt_logprobs, 0))
        c.priority = _int("priority", priority)
        if self.guided_decoding is not None:
            if not isinstance(self.guided_decoding, GuidedDecodingParams):
                raise TypeError("SamplingParams.guided_decoding must be a GuidedDecodingParams")
            kind, spec = self.guided_decoding._kind_spec()
            c.guide = kind
            if spec is not None:
                b = spec.encode("utf-8")
                buf = ctypes.create_string_buffer(b, len(b))
                keep.append(buf)
                c.guide_spec = ctypes.cast(buf, ctypes.c_char_p)
                c.guide_spec_len = len(b)
        return c, keep
