"""Harness of the epd.deep_ep suites: the session's epd daemon (conftest.py) as
$EPD_SOCKET, and a runner of one function on R processes that init_dist joins in a gloo
group, as DeepEP's own tests run (torch.multiprocessing, spawn)."""

import os
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import epd_testing


# The tensors' device: "cpu" (the host backend, CI) or, with EPD_TEST_DEVICE=cuda, "cuda"
# (epd --backend=cuda, the GPU machine). The Buffers' launch mode is $EPD_LAUNCH_MODE
# (auto, daemon or client), which the rank processes inherit.
DEVICE = epd_testing.DEVICE


@pytest.fixture(scope="session")
def epd_socket(request):
    """The session daemon's socket (conftest.py `daemon`: host backend, or with
    EPD_TEST_DEVICE=cuda the CUDA one, started or found on $EPD_TEST_SOCKET), exported as
    $EPD_SOCKET for the rank processes' Buffers."""
    old = os.environ.get("EPD_SOCKET")
    os.environ["EPD_SOCKET"] = request.getfixturevalue("daemon").socket
    try:
        yield os.environ["EPD_SOCKET"]
    finally:
        if old is None:
            os.environ.pop("EPD_SOCKET", None)
        else:
            os.environ["EPD_SOCKET"] = old


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
        if hasattr(torch, "set_default_device"):
            torch.set_default_device(DEVICE)  # CPU tensors for the host backend, also on a GPU machine
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

