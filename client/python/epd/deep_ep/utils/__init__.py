"""deep_ep.utils on epd: envs (init_dist), math (FP8 casts, diffs, hashes), testing (timers)."""

from . import envs, math, testing

__all__ = ["envs", "math", "testing"]
