"""deep_ep on epd: DeepEP V1's API re-exported from epd.deep_ep (docs/DEEP_EP.md)."""

from epd.deep_ep import *  # noqa: F401,F403
from epd.deep_ep import __all__  # noqa: F401

from . import utils  # noqa: E402 (deep_ep.utils, not epd.deep_ep.utils, as a submodule)
