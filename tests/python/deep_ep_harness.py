"""Harness of the epd.deep_ep suites: a host-backend epd daemon for the test session and a
runner of one function on R processes joined by a gloo group (torch.multiprocessing).

The daemon binary is $EPD_BINARY, else $EPD_BUILD_DIR/daemon/epd, else build/daemon/epd
of this repository. $EPD_SOCKET of a running daemon is used instead when
EPD_TEST_USE_RUNNING_DAEMON=1 (e.g. a CUDA daemon on the GPU machine).
"""

import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _daemon_binary():
    if os.environ.get("EPD_BINARY"):
        return os.environ["EPD_BINARY"]
    build = os.environ.get("EPD_BUILD_DIR", os.path.join(_REPO, "build"))
    return os.path.join(build, "daemon", "epd")


@pytest.fixture(scope="session")
def epd_socket():
    """The socket of an epd daemon (host backend) running for the whole session."""
    if os.environ.get("EPD_TEST_USE_RUNNING_DAEMON") == "1":
        yield os.environ["EPD_SOCKET"]
        return
    binary = _daemon_binary()
    if not os.path.exists(binary):
        pytest.fail(f"epd daemon binary not found at {binary} (set EPD_BINARY or EPD_BUILD_DIR)")
    tmp = tempfile.mkdtemp(prefix="epd-deep-ep-")
    sock = os.path.join(tmp, "epd.sock")
    log = open(os.path.join(tmp, "epd.log"), "w")
    proc = subprocess.Popen([binary, "--backend=host", f"--socket={sock}", "--host_threads=1"],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.close()
            pytest.fail("epd did not start: " + open(os.path.join(tmp, "epd.log")).read()[-2000:])
        time.sleep(0.05)
    old = os.environ.get("EPD_SOCKET")
    os.environ["EPD_SOCKET"] = sock
    try:
        yield sock
    finally:
        if old is None:
            os.environ.pop("EPD_SOCKET", None)
        else:
            os.environ["EPD_SOCKET"] = old
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(local_rank, num_ranks, port, fn, args, results):
    try:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        from epd.deep_ep.utils.envs import init_dist
        rank, world, group = init_dist(local_rank, num_ranks)
        fn(rank, world, group, *args)
        dist.barrier()
        dist.destroy_process_group()
        results.put((local_rank, None))
    except BaseException:  # noqa: BLE001 (reported to the parent)
        results.put((local_rank, traceback.format_exc()))
        raise


def run_ranks(fn, num_ranks, *args, timeout=60):
    """Runs fn(rank, num_ranks, group, *args) on num_ranks spawned processes (init_dist
    with gloo); fails with every rank's traceback if any raised or timeout passed."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, num_ranks, port, fn, args, results))
             for r in range(num_ranks)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    errors = {}
    done = 0
    while done < num_ranks and time.monotonic() < deadline:
        if not results.empty():
            rank, err = results.get()
            done += 1
            if err is not None:
                errors[rank] = err
            continue
        if any(p.exitcode not in (None, 0) for p in procs) and results.empty():
            time.sleep(0.5)
            if results.empty():
                break
        time.sleep(0.02)
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        pytest.fail("\n".join(f"rank {r}:\n{e}" for r, e in sorted(errors.items())))
    if done < num_ranks:
        pytest.fail(f"only {done} of {num_ranks} ranks finished within {timeout} s "
                    f"(exit codes {[p.exitcode for p in procs]})")


def expect_error(exc_types, fn, *args, match=None, **kwargs):
    """Calls fn and returns the exception of one of exc_types it raised (fails otherwise);
    `match`: a substring the message must contain."""
    try:
        fn(*args, **kwargs)
    except exc_types as e:
        if match is not None and match not in str(e):
            raise AssertionError(f"error {e!r} lacks {match!r}") from e
        return e
    raise AssertionError(f"{getattr(fn, '__name__', fn)} raised nothing, expected {exc_types}")


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
