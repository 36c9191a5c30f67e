"""The bookkeeping of epd.deep_ep's low-latency ops submitted without a CPU wait
(epd.deep_ep._pending.PendingOps, what Buffer uses on the CUDA backend): every op waited
exactly once, never after its completion record was reused (an endpoint keeps its latest 64),
errors of ops nobody waited for still raised. Against real epd PendingOps of a one-rank
host-backend group (DeepEP's test_low_latency.py op pattern: ops with and without
return_recv_hook, then destroy), and against counting fakes for the error paths."""

import time

import pytest
import torch

import epd
import epd_testing as T
from epd.deep_ep._pending import RECORD_WINDOW, PendingOps

H, E, K, MLL = 128, 4, 2, 4


@pytest.fixture
def ep(client):
    spec = epd.GroupSpec("pending_%d" % time.monotonic_ns(), num_ranks=1, hidden=H, num_topk=K,
                         num_experts=E, max_tokens_per_rank=4, max_dispatch_tokens_per_rank=MLL)
    e = client.join(spec, 0, launch_mode=T.LAUNCH_MODE)
    yield T.OnDevice(e) if T.CUDA else e
    e.close()


def _submit(ep):
    x = torch.ones((2, H), dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1], [2, 3]], dtype=torch.int64)
    return ep.low_latency_dispatch(x, idx, wait=False)


def test_record_window_is_real(ep):
    """The premise: an op RECORD_WINDOW or more ops old cannot be waited for."""
    first = _submit(ep)
    for _ in range(RECORD_WINDOW):
        _submit(ep).wait()
    # Daemon-launched and host: the completion record holds a newer op's; client-launched:
    # the record was reused by an op enqueued after it.
    window = "only the latest 64|more than 64 ops of this endpoint"
    with pytest.raises(epd.FailedPreconditionError, match=window):
        first.wait()


def test_hook_ops_after_plain_ops_then_destroy(ep):
    """Plain ops (waited only later), then many more ops whose hooks are called, then the
    destroy-time drain: the old plain ops were waited in time, none twice."""
    pending = PendingOps(client_launched=False)
    for _ in range(40):
        assert pending.add(_submit(ep), hook_wanted=False) is None
    for _ in range(3 * RECORD_WINDOW):
        hook = pending.add(_submit(ep), hook_wanted=True)
        hook()
        hook()  # idempotent
    assert len(pending) == 0
    pending.drain()


def test_hooks_never_called(ep):
    pending = PendingOps(client_launched=False)
    hooks = [pending.add(_submit(ep), hook_wanted=True) for _ in range(3 * RECORD_WINDOW)]
    assert 0 < len(pending) <= 32
    for hook in hooks:  # the old ones were waited by add(): no-ops, no stale wait
        hook()
    assert len(pending) == 0
    for _ in range(10):
        pending.add(_submit(ep), hook_wanted=False)
    pending.drain()
    assert len(pending) == 0


class FakeOp:
    """Counts waits; fails like an epd op whose record was reused, or with `error`."""

    clock = [0]

    def __init__(self, error=None):
        FakeOp.clock[0] += 1
        self.seq = FakeOp.clock[0]
        self.error = error
        self.waits = 0

    def wait(self):
        self.waits += 1
        if FakeOp.clock[0] - self.seq >= RECORD_WINDOW:
            raise epd.FailedPreconditionError(9, "FAILED_PRECONDITION", "record reused")
        if self.error is not None:
            raise self.error


def test_errors_of_unwaited_ops_are_raised():
    pending = PendingOps(client_launched=False, check_every=4)
    bad = FakeOp(epd.InternalError(13, "INTERNAL", "op failed"))
    pending.add(bad, hook_wanted=False)
    ops = [FakeOp() for _ in range(3)]
    for op in ops:
        pending.add(op, hook_wanted=False)
    with pytest.raises(epd.InternalError, match="op failed"):
        pending.add(FakeOp(), hook_wanted=False)  # bad is now 4 ops old: waited, raised
    assert bad.waits == 1
    pending.drain()  # the rest are fine
    assert all(op.waits == 1 for op in ops)
    # An error found only at the drain (destroy) is raised there, after every wait.
    late = FakeOp(epd.InternalError(13, "INTERNAL", "late"))
    pending.add(late, hook_wanted=True)
    after = FakeOp()
    pending.add(after, hook_wanted=False)
    with pytest.raises(epd.InternalError, match="late"):
        pending.drain()
    assert late.waits == 1 and after.waits == 1 and len(pending) == 0


def test_client_launched_keeps_the_latest():
    pending = PendingOps(client_launched=True, check_every=8)
    ops = []
    for i in range(3 * RECORD_WINDOW):
        ops.append(FakeOp())
        pending.add(ops[-1], hook_wanted=i % 3 == 0)
        assert len(pending) <= 1
    pending.drain()
    assert all(op.waits <= 1 for op in ops)
    # Every 8th op is waited unless it is a hook op (i = 15), the latest at the drain.
    assert ops[-1].waits == 1
    assert [i for i, op in enumerate(ops) if op.waits][:3] == [7, 23, 31]


def test_check_every_within_window():
    with pytest.raises(ValueError):
        PendingOps(False, check_every=RECORD_WINDOW)
