"""deep_ep.utils.envs on epd: re-exports epd.deep_ep.utils.envs."""

from epd.deep_ep.utils.envs import *  # noqa: F401,F403
from epd.deep_ep.utils.envs import __all__  # noqa: F401
