"""deep_ep.utils.testing on epd: re-exports epd.deep_ep.utils.testing."""

from epd.deep_ep.utils.testing import *  # noqa: F401,F403
from epd.deep_ep.utils.testing import __all__  # noqa: F401
