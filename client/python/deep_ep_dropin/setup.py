"""The `deep_ep` drop-in: a top-level package re-exporting epd.deep_ep, so code written for
DeepEP (`import deep_ep`, `from deep_ep.utils.envs import init_dist`) runs on epd.

Install after the epd package (client/python), with no network:
    pip install --no-build-isolation ./client/python/deep_ep_dropin
"""

from setuptools import setup

setup(
    name="epd-deep-ep",
    version="0.1.0",
    description="DeepEP V1 API (import deep_ep) on epd",
    packages=["deep_ep", "deep_ep.utils"],
    python_requires=">=3.9",
)
