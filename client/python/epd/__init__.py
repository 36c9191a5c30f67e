"""epd: Python client of the expert-parallel MoE dispatch/combine daemon.

    import epd
    client = epd.Client.connect()                # $EPD_SOCKET or /run/epd/epd.sock
    spec = epd.GroupSpec("moe0", num_ranks=8, hidden=7168, num_topk=8, num_experts=256,
                         max_tokens_per_rank=4096, max_dispatch_tokens_per_rank=128)
    with client.join(spec, rank) as ep:
        r = ep.low_latency_dispatch(x, topk_idx)  # zero-copy, cached views
        ...

The full reference is docs/CLIENT_API.md, section "Python".
"""

from . import _C
from ._core import (
    DEFAULT_SOCKET,
    Client,
    Endpoint,
    EndpointInfo,
    GroupSpec,
    NodeSpec,
    RankMask,
    version,
)
from ._errors import *  # noqa: F401,F403 (the exception classes)
from ._errors import __all__ as _error_names

DLView = _C.DLView
Handle = _C.Handle
PendingOp = _C.PendingOp
LayoutResult = _C.LayoutResult
DispatchResult = _C.DispatchResult
CombineResult = _C.CombineResult
LowLatencyDispatchResult = _C.LowLatencyDispatchResult
LowLatencyCombineResult = _C.LowLatencyCombineResult
OpMask = _C.OpMask

__version__ = _C.version()

__all__ = [
    "Client",
    "Endpoint",
    "EndpointInfo",
    "GroupSpec",
    "NodeSpec",
    "RankMask",
    "OpMask",
    "DLView",
    "Handle",
    "PendingOp",
    "LayoutResult",
    "DispatchResult",
    "CombineResult",
    "LowLatencyDispatchResult",
    "LowLatencyCombineResult",
    "DEFAULT_SOCKET",
    "version",
] + list(_error_names)
