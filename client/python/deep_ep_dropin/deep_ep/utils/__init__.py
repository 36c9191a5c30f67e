"""deep_ep.utils on epd: re-exports epd.deep_ep.utils (envs, math, testing)."""

from . import envs, math, testing

__all__ = ["envs", "math", "testing"]
