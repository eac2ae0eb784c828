"""ctypes declarations of libkiln's public C API (include/kiln/kiln.h) and the search for
libkiln.so.

The structures below mirror kiln.h field for field. kiln_sampling_params_t is versioned by
its struct_size: a library with a longer struct (a newer kiln.h that appended fields) takes
this package's shorter one and keeps its defaults for the rest; a library with a shorter one
is older than this package, and _check_layout() refuses it at import.
"""

import ctypes
import os

from . import _errors

c_int32_p = ctypes.POINTER(ctypes.c_int32)
c_float_p = ctypes.POINTER(ctypes.c_float)
c_char_p_p = ctypes.POINTER(ctypes.c_char_p)


class SamplingParamsC(ctypes.Structure):
    """kiln_sampling_params_t"""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("n", ctypes.c_int32),
        ("max_tokens", ctypes.c_int32),
        ("min_tokens", ctypes.c_int32),
        ("temperature", ctypes.c_float),
        ("top_p", ctypes.c_float),
        ("top_k", ctypes.c_int32),
        ("min_p", ctypes.c_float),
        ("repetition_penalty", ctypes.c_float),
        ("presence_penalty", ctypes.c_float),
        ("frequency_penalty", ctypes.c_float),
        ("has_seed", ctypes.c_bool),
        ("seed", ctypes.c_uint64),
        ("ignore_eos", ctypes.c_bool),
        ("skip_special_tokens", ctypes.c_bool),
        ("detokenize", ctypes.c_bool),
        ("stop_token_ids", c_int32_p),
        ("num_stop_token_ids", ctypes.c_int32),
        ("stop", c_char_p_p),
        ("num_stop", ctypes.c_int32),
        ("include_stop_str_in_output", ctypes.c_bool),
        ("logit_bias_ids", c_int32_p),
        ("logit_bias_values", c_float_p),
        ("num_logit_bias", ctypes.c_int32),
        ("logprobs", ctypes.c_int32),
        ("prompt_logprobs", ctypes.c_int32),
        ("priority", ctypes.c_int32),
        ("guide", ctypes.c_int),  # kiln_guide_kind_t
        ("guide_spec", ctypes.c_char_p),
        ("guide_spec_len", ctypes.c_size_t),
    ]


# kiln_guide_kind_t
GUIDE_NONE, GUIDE_JSON_OBJECT, GUIDE_JSON_SCHEMA, GUIDE_REGEX, GUIDE_CHOICE, GUIDE_GRAMMAR = range(6)


class UsageC(ctypes.Structure):
    """kiln_usage_t"""

    _fields_ = [
        ("prompt_tokens", ctypes.c_int32),
        ("completion_tokens", ctypes.c_int32),
        ("cached_tokens", ctypes.c_int32),
    ]


class OutputC(ctypes.Structure):
    """kiln_output_t"""

    _fields_ = [
        ("request", ctypes.c_void_p),
        ("request_seq", ctypes.c_uint64),
        ("user", ctypes.c_void_p),
        ("index", ctypes.c_int32),
        ("token_ids", c_int32_p),
        ("num_tokens", ctypes.c_int32),
        ("text", ctypes.c_void_p),
        ("text_len", ctypes.c_size_t),
        ("logprobs", c_float_p),
        ("top_ids", c_int32_p),
        ("top_logprobs", c_float_p),
        ("top_n", ctypes.c_int32),
        ("prompt_logprobs", c_float_p),
        ("prompt_top_ids", c_int32_p),
        ("prompt_top_logprobs", c_float_p),
        ("num_prompt_logprobs", ctypes.c_int32),
        ("prompt_top_n", ctypes.c_int32),
        ("finish_reason", ctypes.c_int),
        ("stop_str", ctypes.c_char_p),
        ("stop_token", ctypes.c_int32),
        ("request_finished", ctypes.c_bool),
        ("usage", UsageC),
        ("error", ctypes.c_char_p),
        ("queue_time", ctypes.c_double),
        ("first_token_time", ctypes.c_double),
        ("time", ctypes.c_double),
    ]


class ImageInputC(ctypes.Structure):
    """kiln_image_input_t"""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("size", ctypes.c_size_t),
        ("pixel_values", c_float_p),
        ("grid_t", ctypes.c_int32),
        ("grid_h", ctypes.c_int32),
        ("grid_w", ctypes.c_int32),
    ]


class RequestDescC(ctypes.Structure):
    """kiln_request_desc_t"""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("prompt", ctypes.c_char_p),
        ("prompt_ids", c_int32_p),
        ("num_prompt_ids", ctypes.c_int32),
        ("params", ctypes.POINTER(SamplingParamsC)),
        ("on_output", ctypes.c_void_p),
        ("user", ctypes.c_void_p),
        ("on_queued", ctypes.c_void_p),
        ("images", ctypes.POINTER(ImageInputC)),
        ("num_images", ctypes.c_int32),
    ]


class EngineInfoC(ctypes.Structure):
    """kiln_engine_info_t"""

    _fields_ = [
        ("model_path", ctypes.c_char_p),
        ("model_name", ctypes.c_char_p),
        ("backend", ctypes.c_char_p),
        ("device", ctypes.c_char_p),
        ("vocab_size", ctypes.c_int32),
        ("max_model_len", ctypes.c_int64),
        ("block_size", ctypes.c_int32),
        ("num_blocks", ctypes.c_int32),
        ("max_num_seqs", ctypes.c_int32),
        ("max_num_batched_tokens", ctypes.c_int32),
        ("has_tokenizer", ctypes.c_bool),
        ("kv_cache_dtype", ctypes.c_char_p),
        ("quantization", ctypes.c_char_p),
    ]


class ChatArgsC(ctypes.Structure):
    """kiln_chat_args_t"""

    _fields_ = [
        ("messages_json", ctypes.c_char_p),
        ("messages_len", ctypes.c_size_t),
        ("tools_json", ctypes.c_char_p),
        ("tools_len", ctypes.c_size_t),
        ("extra_json", ctypes.c_char_p),
        ("extra_len", ctypes.c_size_t),
        ("add_generation_prompt", ctypes.c_bool),
    ]


# kiln_finish_reason_t
FINISH_NONE, FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR = range(5)
FINISH_NAMES = {FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_ABORT: "abort",
                FINISH_ERROR: "error"}

_status_t = ctypes.c_void_p  # kiln_status_t: NULL = OK

# (name, result type, argument types)
_FUNCS = [
    ("kiln_status_message", ctypes.c_char_p, [_status_t]),
    ("kiln_status_free", None, [_status_t]),
    # Declared in libkiln's base/status.h rather than kiln.h, exported with the kiln_ API;
    # kiln.h documents the codes it returns.
    ("kiln_status_code", ctypes.c_int, [_status_t]),
    ("kiln_sampling_params_init", None, [ctypes.c_void_p]),
    ("kiln_engine_create", _status_t,
     [ctypes.c_char_p, c_char_p_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p)]),
    ("kiln_engine_destroy", None, [ctypes.c_void_p]),
    ("kiln_engine_config_key", ctypes.c_bool,
     [ctypes.c_int32, c_char_p_p, c_char_p_p, c_char_p_p, c_char_p_p]),
    ("kiln_engine_get_info_sized", None,
     [ctypes.c_void_p, ctypes.POINTER(EngineInfoC), ctypes.c_size_t]),
    ("kiln_engine_max_images", ctypes.c_int32, [ctypes.c_void_p]),
    ("kiln_engine_submit", _status_t,
     [ctypes.c_void_p, ctypes.POINTER(RequestDescC), ctypes.POINTER(ctypes.c_void_p)]),
    ("kiln_engine_hold_intake", None, [ctypes.c_void_p, ctypes.c_bool]),
    ("kiln_request_poll", _status_t,
     [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.POINTER(OutputC))]),
    ("kiln_output_free", None, [ctypes.POINTER(OutputC)]),
    ("kiln_request_cancel", None, [ctypes.c_void_p]),
    ("kiln_request_release", None, [ctypes.c_void_p]),
    ("kiln_engine_tokenize", _status_t,
     [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_bool,
      ctypes.POINTER(c_int32_p), c_int32_p]),
    ("kiln_engine_detokenize", _status_t,
     [ctypes.c_void_p, c_int32_p, ctypes.c_size_t, ctypes.c_bool, ctypes.POINTER(ctypes.c_void_p)]),
    ("kiln_engine_apply_chat_template", _status_t,
     [ctypes.c_void_p, ctypes.POINTER(ChatArgsC), ctypes.POINTER(ctypes.c_void_p),
      ctypes.POINTER(ctypes.c_size_t)]),
]


def _candidates():
    """Where libkiln.so is looked for, in order, as (path, where it came from)."""
    env = os.environ.get("KILN_LIBRARY")
    if env:
        yield env, "$KILN_LIBRARY"
        return
    try:
        from . import _install  # written by the build backend at `pip install` time
        if getattr(_install, "LIBRARY", None):
            yield _install.LIBRARY, "the build tree recorded at install time"
    except ImportError:
        pass
    here = os.path.dirname(os.path.abspath(__file__))
    # the source tree: python/kiln -> ../../build/lib
    yield os.path.join(here, "..", "..", "build", "lib", "libkiln.so"), "the source tree's build/"
    yield "libkiln.so.0", "the dynamic linker's search path (an installed libkiln)"


def _load():
    tried = []
    for path, origin in _candidates():
        if os.sep in path and not os.path.exists(path):
            tried.append("%s (%s): not there" % (path, origin))
            continue
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            tried.append("%s (%s): %s" % (path, origin, e))
    raise ImportError(
        "kiln: cannot load libkiln.so; tried:\n  " + "\n  ".join(tried) +
        "\nBuild Kiln (make) and set KILN_LIBRARY=/path/to/build/lib/libkiln.so, or "
        "reinstall the package after building (pip install ./python).")


def _declare(lib):
    for name, res, args in _FUNCS:
        try:
            f = getattr(lib, name)
        except AttributeError:
            raise ImportError("kiln: %s has no %s: it is older than this package" %
                              (LIBRARY_PATH, name)) from None
        f.restype = res
        f.argtypes = args


_INIT_BUF = 4096  # more than any kiln_sampling_params_t


def _check_layout(lib):
    buf = ctypes.create_string_buffer(_INIT_BUF)
    lib.kiln_sampling_params_init(buf)
    size = ctypes.c_uint32.from_buffer(buf).value
    if size < ctypes.sizeof(SamplingParamsC) or size > _INIT_BUF:
        raise ImportError(
            "kiln: %s's kiln_sampling_params_t is %d bytes, this package's is %d: the library "
            "is older than the package (rebuild Kiln, or install the package from its tree)" %
            (LIBRARY_PATH, size, ctypes.sizeof(SamplingParamsC)))


def sampling_params_init():
    """A SamplingParamsC at the library's defaults (initialised in a buffer large enough for
    the library's own struct, then cut to this package's fields)."""
    buf = ctypes.create_string_buffer(_INIT_BUF)
    lib.kiln_sampling_params_init(buf)
    c = SamplingParamsC.from_buffer_copy(buf.raw[:ctypes.sizeof(SamplingParamsC)])
    c.struct_size = ctypes.sizeof(SamplingParamsC)
    return c


lib, LIBRARY_PATH = _load()
_declare(lib)
_check_layout(lib)

# The libc free() for what libkiln malloc()s (tokenize, detokenize, apply_chat_template).
_libc = ctypes.CDLL(None)
free = _libc.free
free.restype = None
free.argtypes = [ctypes.c_void_p]


def check(st):
    """Raises the KilnError of a non-NULL kiln_status_t (and frees it)."""
    if not st:
        return
    try:
        code = lib.kiln_status_code(st)
        msg = lib.kiln_status_message(st).decode("utf-8", "replace")
    finally:
        lib.kiln_status_free(st)
    raise _errors.make(code, msg)


def config_keys():
    """Every (section, key, type, help) kiln_engine_create takes, in --help-config order."""
    out = []
    i = 0
    s, k, t, h = (ctypes.c_char_p() for _ in range(4))
    while lib.kiln_engine_config_key(i, ctypes.byref(s), ctypes.byref(k), ctypes.byref(t),
                                     ctypes.byref(h)):
        out.append((s.value.decode(), k.value.decode(), t.value.decode(), h.value.decode()))
        i += 1
    return out
