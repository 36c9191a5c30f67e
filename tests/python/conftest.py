"""Fixtures of the Python suites: `daemon` (a real epd --backend=host on a temporary socket,
one per session) and `world` (R rank processes joined to one group on it)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import epd_testing  # noqa: E402


@pytest.fixture(scope="session")
def daemon():
    d = epd_testing.Daemon()
    yield d
    d.stop()


@pytest.fixture(scope="session")
def world(daemon):
    w = epd_testing.World(daemon.socket, "pyworld_%d" % os.getpid())
    yield w
    w.close()


@pytest.fixture
def client(daemon):
    import epd

    c = epd.Client.connect(daemon.socket, client_name="pytest")
    yield c
    c.close()
