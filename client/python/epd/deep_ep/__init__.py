"""epd.deep_ep: DeepEP V1's `deep_ep` API (Buffer, Config, EventOverlap, utils) on epd.

Code written for DeepEP's deep_ep.Buffer runs on epd unchanged; install
client/python/deep_ep_dropin to import this package as `deep_ep`. docs/DEEP_EP.md maps
every call onto epd and lists what is not supported.
"""

from . import utils
from ._errors import BufferTooSmallError
from .buffer import Buffer, DispatchHandle, LowLatencyHandle, topk_idx_t
from .config import Config
from .event import EventHandle, EventOverlap

__all__ = [
    "Buffer",
    "BufferTooSmallError",
    "Config",
    "DispatchHandle",
    "EventHandle",
    "EventOverlap",
    "LowLatencyHandle",
    "topk_idx_t",
    "utils",
]
