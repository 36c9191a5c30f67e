"""Errors raised by epd.deep_ep itself, as epd's exception classes (status code carried)."""

from .. import _errors as _epd_errors

__all__ = ["BufferTooSmallError", "invalid", "precondition", "unsupported"]


class BufferTooSmallError(_epd_errors.ResourceExhaustedError):
    """An op needs a larger num_nvl_bytes / num_rdma_bytes than the Buffer was given;
    `bytes_needed` is the smallest budget that fits it."""

    def __init__(self, code, code_name, message, bytes_needed=0):
        super().__init__(code, code_name, message)
        self.bytes_needed = bytes_needed

    def __reduce__(self):
        return (type(self), (self.code, self.code_name, self.message, self.bytes_needed))


def invalid(message: str) -> _epd_errors.InvalidArgumentError:
    """INVALID_ARGUMENT (also a ValueError)."""
    return _epd_errors.InvalidArgumentError(3, "INVALID_ARGUMENT", message)


def precondition(message: str) -> _epd_errors.FailedPreconditionError:
    """FAILED_PRECONDITION: a destroyed Buffer, a handle of another Buffer."""
    return _epd_errors.FailedPreconditionError(9, "FAILED_PRECONDITION", message)


def unsupported(option: str, why: str) -> _epd_errors.UnimplementedError:
    """UNIMPLEMENTED (also a NotImplementedError) naming the DeepEP option epd lacks."""
    return _epd_errors.UnimplementedError(
        12, "UNIMPLEMENTED", f"deep_ep on epd: {option} is not supported: {why}")


def too_small(what: str, needed: int, given: int, detail: str) -> BufferTooSmallError:
    """RESOURCE_EXHAUSTED naming the budget argument and the bytes an op needs."""
    return BufferTooSmallError(
        8, "RESOURCE_EXHAUSTED",
        f"{detail} needs {what} >= {needed} bytes ({needed / 2**20:.1f} MiB); the Buffer has "
        f"{what} = {given}", needed)
