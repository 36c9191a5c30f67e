"""deep_ep.utils.math on epd: re-exports epd.deep_ep.utils.math."""

from epd.deep_ep.utils.math import *  # noqa: F401,F403
from epd.deep_ep.utils.math import __all__  # noqa: F401
