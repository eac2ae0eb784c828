"""Kiln from Python: an in-process engine over libkiln (ctypes; no other dependency), with
vLLM's offline interface.

    import kiln
    llm = kiln.LLM()                       # the embedded default model; LLM("dir", dtype=...)
    outs = llm.generate(["Once upon a time"], kiln.SamplingParams(max_tokens=32, seed=1))
    print(outs[0].outputs[0].text)
    print(llm.chat([{"role": "user", "content": "Hello"}])[0].outputs[0].text)
    for out in llm.stream("Once upon a time"):
        print(out.outputs[0].text, end="", flush=True)

libkiln.so is found through $KILN_LIBRARY, else the build tree recorded when the package was
installed, else the source tree's build/lib, else the dynamic linker (an installed Kiln).
Errors from Kiln are KilnError subclasses carrying Kiln's message.
"""

from ._errors import (DeviceError, IncompatibleError, InvalidArgumentError, KilnError,
                      KilnIOError, NotFoundError, OutOfMemoryError, RequestError,
                      UnavailableError, UnsupportedError)
from ._lib import LIBRARY_PATH
from .llm import LLM, Stream
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling import GuidedDecodingParams, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM", "SamplingParams", "GuidedDecodingParams", "RequestOutput", "CompletionOutput",
    "Logprob", "Stream",
    "KilnError", "InvalidArgumentError", "NotFoundError", "OutOfMemoryError", "UnsupportedError",
    "KilnIOError", "IncompatibleError", "DeviceError", "UnavailableError", "RequestError",
    "LIBRARY_PATH", "config_keys",
]


def config_keys():
    """Every configuration key LLM(**engine_options) takes: (section, key, type, help)."""
    from . import _lib
    return _lib.config_keys()
