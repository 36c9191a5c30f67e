"""epd's exceptions: one class per absl status code, all subclasses of EpdError.

Where a Python builtin means the same thing the class derives from it too, so callers can
catch either: InvalidArgumentError is a ValueError, DeadlineExceededError a TimeoutError,
PermissionDeniedError a PermissionError, NotFoundError a LookupError, UnavailableError a
ConnectionError, UnimplementedError a NotImplementedError. EpdError is a RuntimeError.
"""

__all__ = [
    "EpdError",
    "CancelledError",
    "UnknownError",
    "InvalidArgumentError",
    "DeadlineExceededError",
    "NotFoundError",
    "AlreadyExistsError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "FailedPreconditionError",
    "AbortedError",
    "OutOfRangeError",
    "UnimplementedError",
    "InternalError",
    "UnavailableError",
    "DataLossError",
    "UnauthenticatedError",
]


def _reason_name(number, fallback):
    """The catalog's name of a reason number, from the C ABI (fallback before it loads)."""
    try:
        from . import _C
    except ImportError:
        return fallback
    return _C.reason_name(number)


class EpdError(RuntimeError):
    """An epd call failed. code: the absl status code (int); code_name: its name
    ("INVALID_ARGUMENT"); message: epd's message, naming the field and value at fault;
    reason: the error catalog's code ("EPD-2003", docs/ERRORS.md; `epctl explain` prints its
    cause and next step) and reason_name its name ("CUDA_DRIVER_TOO_OLD"); left out, the
    unclassified reason of the code (9000 + code: "EPD-9003", "INVALID_ARGUMENT")."""

    def __init__(self, code, code_name, message, reason=None, reason_name=None):
        RuntimeError.__init__(self, code, code_name, message)
        self.code = code
        self.code_name = code_name
        self.message = message
        if reason is None:
            reason, reason_name = "EPD-%d" % (9000 + code), _reason_name(9000 + code, code_name)
        self.reason = reason
        self.reason_name = reason_name
        if isinstance(self, OSError):  # errno/strerror of an OSError base mean nothing here
            self.errno = None
            self.strerror = message
            self.filename = None

    def __str__(self):
        if not self.reason or self.reason.startswith("EPD-9"):  # Unclassified: the code says it.
            return "%s: %s" % (self.code_name, self.message)
        return "%s: %s [%s %s]" % (self.code_name, self.message, self.reason, self.reason_name)

    def __reduce__(self):
        return (type(self), (self.code, self.code_name, self.message, self.reason, self.reason_name))


class CancelledError(EpdError):
    """CANCELLED (1)."""


class UnknownError(EpdError):
    """UNKNOWN (2)."""


class InvalidArgumentError(EpdError, ValueError):
    """INVALID_ARGUMENT (3): a bad shape, dtype, device or value; the message names it."""


class DeadlineExceededError(EpdError, TimeoutError):
    """DEADLINE_EXCEEDED (4): a timeout, or a rank that never arrived (named)."""


class NotFoundError(EpdError, LookupError):
    """NOT_FOUND (5), e.g. an unknown GPU."""


class AlreadyExistsError(EpdError):
    """ALREADY_EXISTS (6), e.g. a rank already taken."""


class PermissionDeniedError(EpdError, PermissionError):
    """PERMISSION_DENIED (7): a join secret that is not the group's, another uid's group."""


class ResourceExhaustedError(EpdError):
    """RESOURCE_EXHAUSTED (8): memory, max_groups or a per-uid quota of the daemon."""


class FailedPreconditionError(EpdError):
    """FAILED_PRECONDITION (9): a left or closed endpoint, a stale or foreign handle."""


class AbortedError(EpdError):
    """ABORTED (10)."""


class OutOfRangeError(EpdError):
    """OUT_OF_RANGE (11)."""


class UnimplementedError(EpdError, NotImplementedError):
    """UNIMPLEMENTED (12): not supported by this backend or by epd."""


class InternalError(EpdError):
    """INTERNAL (13): a bug in epd."""


class UnavailableError(EpdError, ConnectionError):
    """UNAVAILABLE (14): the daemon is gone, shutting down, or not listening on the socket."""


class DataLossError(EpdError):
    """DATA_LOSS (15)."""


class UnauthenticatedError(EpdError):
    """UNAUTHENTICATED (16)."""


# Indexed by status code (0, OK, never raised).
ERROR_TYPES = [
    EpdError,
    CancelledError,
    UnknownError,
    InvalidArgumentError,
    DeadlineExceededError,
    NotFoundError,
    AlreadyExistsError,
    PermissionDeniedError,
    ResourceExhaustedError,
    FailedPreconditionError,
    AbortedError,
    OutOfRangeError,
    UnimplementedError,
    InternalError,
    UnavailableError,
    DataLossError,
    UnauthenticatedError,
]

for _cls in ERROR_TYPES:
    _cls.__module__ = "epd"
del _cls
