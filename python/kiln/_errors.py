"""Kiln's errors as Python exceptions: one class per kiln_status_t code, each a KilnError
carrying Kiln's message unchanged and the code."""


class KilnError(Exception):
    """An error from libkiln: str(e) is Kiln's message; e.code its kiln_status_t code and
    e.code_name the code's name ("INVALID_ARGUMENT", ...)."""

    code = 8
    code_name = "INTERNAL"

    def __init__(self, message, code=None):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message


class InvalidArgumentError(KilnError, ValueError):
    """Bad input: a configuration value, a request parameter, a prompt (code 1)."""
    code, code_name = 1, "INVALID_ARGUMENT"


class NotFoundError(KilnError, LookupError):
    """A file, plugin, key or device that is not there; a model without a chat template (2)."""
    code, code_name = 2, "NOT_FOUND"


class OutOfMemoryError(KilnError, MemoryError):
    """A host or device allocation failed (3)."""
    code, code_name = 3, "OUT_OF_MEMORY"


class UnsupportedError(KilnError):
    """Valid, but not implemented by this build or backend (4)."""
    code, code_name = 4, "UNSUPPORTED"


class KilnIOError(KilnError, OSError):
    """A read, write or mmap failed (5)."""
    code, code_name = 5, "IO"


class IncompatibleError(KilnError):
    """An ABI or format version mismatch (6)."""
    code, code_name = 6, "INCOMPATIBLE"


class DeviceError(KilnError):
    """The device or its driver reported an error (7)."""
    code, code_name = 7, "DEVICE"


class UnavailableError(KilnError):
    """Not now: a full queue, an engine shutting down; try again later (9)."""
    code, code_name = 9, "UNAVAILABLE"


class RequestError(KilnError):
    """A request that was accepted and then failed (finish_reason "error")."""
    code, code_name = 8, "INTERNAL"


_BY_CODE = {c.code: c for c in (InvalidArgumentError, NotFoundError, OutOfMemoryError,
                                UnsupportedError, KilnIOError, IncompatibleError, DeviceError,
                                UnavailableError)}


def make(code, message):
    cls = _BY_CODE.get(code, KilnError)
    e = cls(message, code)
    if cls is KilnError:
        e.code_name = "INTERNAL" if code == 8 else "CODE_%d" % code
    return e
