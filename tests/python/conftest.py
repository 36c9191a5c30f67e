"""Fixtures of the Python suites: `daemon` (a real epd --backend=host on a temporary socket,
one per session) and `world` (R rank processes joined to one group on it)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import epd_testing  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "host_only(reason): runs on the host backend only (host-memory views, "
        "hand-built host tensors); reported as skipped with EPD_TEST_DEVICE=cuda")


def pytest_collection_modifyitems(config, items):
    if not epd_testing.CUDA:
        return
    for item in items:
        mark = item.get_closest_marker("host_only")
        if mark is not None:
            reason = mark.kwargs.get("reason") or (mark.args[0] if mark.args else "host only")
            item.add_marker(pytest.mark.skip(reason="host backend only: " + reason))


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
