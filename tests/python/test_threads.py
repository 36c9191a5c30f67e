"""Endpoints and threads (one process; host backend, or CUDA with EPD_TEST_DEVICE=cuda):
Endpoint.close() and Client.close() from another thread while an op runs (the op completes
or raises FailedPreconditionError / UnavailableError, never a crash: close_race.py in a
subprocess), a call on an endpoint while another thread's call runs (FailedPreconditionError
"endpoint used from two threads at once", no mixed-up results), close() while a peer-waiting
op runs (the op finishes, then the endpoint leaves)."""

import functools
import os
import subprocess
import sys
import threading
import time

import pytest

import epd

import epd_testing as T

DEV = "cuda" if T.CUDA else "cpu"

# Mll 8: the low-latency ops take small_inputs()' 8 tokens.
spec = functools.partial(T.unique_spec, max_dispatch_tokens_per_rank=8)
inputs = T.small_inputs


@pytest.mark.parametrize("mode", ["endpoint", "client"])
def test_close_while_op_runs_on_another_thread(daemon, mode):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "close_race.py")
    p = subprocess.run([sys.executable, script, daemon.socket, mode, "150", DEV],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, "rc %d (negative: killed by that signal)\n%s\n%s" % (
        p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert p.stdout.startswith("OK"), p.stdout


def wait_until_busy(ep):
    """Returns once another thread's call on `ep` is running: a call with a bad argument
    raises InvalidArgumentError while the endpoint is free (nothing submitted), and
    FailedPreconditionError naming the two threads while it is busy."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            ep.get_dispatch_layout("not a tensor")
        except epd.InvalidArgumentError:
            time.sleep(0.001)
            continue
        except epd.FailedPreconditionError as e:
            assert "endpoint used from two threads at once: get_dispatch_layout" in str(e)
            return
    raise AssertionError("the other thread's call never started")


def test_two_threads_on_one_endpoint(client):
    x, idx = inputs()
    s = spec("twothreads", num_ranks=2)
    ep0, ep1 = client.join(s, 0), client.join(s, 1)
    out = {}
    # Rank 0's dispatch waits for rank 1 on a thread of its own.
    thread = threading.Thread(target=lambda: out.update(r=ep0.dispatch(x, topk_idx=idx)))
    thread.start()
    wait_until_busy(ep0)
    for call in (lambda: ep0.low_latency_dispatch(x, idx),
                 lambda: ep0.dispatch(x, topk_idx=idx, wait=False),
                 lambda: ep0.combine(x, None),
                 lambda: ep0.leave() or ep0.get_dispatch_layout(idx)):
        with pytest.raises(epd.FailedPreconditionError, match="two threads at once"):
            call()
    ep1.dispatch(x, topk_idx=idx)  # rank 1 arrives: rank 0's dispatch completes
    thread.join(timeout=30)
    assert type(out["r"]).__name__ == "DispatchResult", out
    assert out["r"].num_recv_tokens == T.expected_recv(idx, 0, 2)
    # The leave() asked for while the call ran happened when it returned.
    with pytest.raises(epd.FailedPreconditionError, match="left"):
        ep0.get_dispatch_layout(idx)
    ep0.close()
    ep1.close()


def test_pending_wait_from_two_threads(client):
    x, idx = inputs()
    s = spec("twowaits", num_ranks=2)
    ep0, ep1 = client.join(s, 0), client.join(s, 1)
    op = ep0.dispatch(x, topk_idx=idx, wait=False)
    out = {}
    thread = threading.Thread(target=lambda: out.update(r=op.wait()))
    thread.start()
    wait_until_busy(ep0)
    with pytest.raises(epd.FailedPreconditionError, match="two threads at once: wait"):
        op.wait()
    ep1.dispatch(x, topk_idx=idx)
    thread.join(timeout=30)
    assert out["r"].num_recv_tokens == T.expected_recv(idx, 0, 2)
    # Free again: the endpoint runs ops from this thread.
    ep0.get_dispatch_layout(idx, wait=False)
    ep1.get_dispatch_layout(idx)
    ep0.close()
    ep1.close()


@pytest.mark.parametrize("closer", ["endpoint", "client"])
def test_close_while_op_waits_for_peer(daemon, closer):
    x, idx = inputs()
    s = spec("closewait", num_ranks=2)
    client = epd.Client.connect(daemon.socket)
    peer = epd.Client.connect(daemon.socket)
    ep0, ep1 = client.join(s, 0), peer.join(s, 1)
    out = {}

    def rank0():
        try:
            out["r"] = ep0.dispatch(x, topk_idx=idx)
        except epd.EpdError as e:
            out["e"] = e

    thread = threading.Thread(target=rank0)
    thread.start()
    wait_until_busy(ep0)
    (client.close if closer == "client" else ep0.close)()  # returns at once
    assert ep0.closed
    with pytest.raises(epd.FailedPreconditionError, match="closed"):
        ep0.dispatch(x, topk_idx=idx)
    ep1.dispatch(x, topk_idx=idx)  # the peer arrives: the op completes
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert isinstance(out.get("e"), epd.FailedPreconditionError), out
    assert "closed" in str(out["e"])
    # The endpoint left once the call returned: rank 0 can be joined again.
    deadline = time.monotonic() + 10
    while True:
        try:
            peer.join(s, 0).close()
            break
        except epd.AlreadyExistsError:
            assert time.monotonic() < deadline, "rank 0 was never left"
            time.sleep(0.01)
    peer.close()
