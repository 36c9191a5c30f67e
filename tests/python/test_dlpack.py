"""DLPack in and out (one process, one-rank groups, host backend): epd.DLView's protocol
(__dlpack__ with and without numpy 2's keywords, __dlpack_device__) accepted by
torch.utils.dlpack.from_dlpack, torch.from_dlpack and numpy.from_dlpack over the same
memory; numpy inputs and outputs (bf16 as uint16 bits); capsules as inputs, read and not
consumed; tensors that require grad; views outliving their endpoint."""

import time

import numpy as np
import pytest
import torch
import torch.utils.dlpack

import epd

pytestmark = pytest.mark.host_only(
    reason="views of host memory (numpy arrays, __array_interface__, DLView on kDLCPU)")


def one_rank_spec(name, **kw):
    fields = dict(num_ranks=1, hidden=128, num_topk=2, num_experts=4, max_tokens_per_rank=8,
                  max_dispatch_tokens_per_rank=4, use_fp8=False)
    fields.update(kw)
    return epd.GroupSpec("%s_%d" % (name, time.monotonic_ns()), **fields)


@pytest.fixture
def ep(client):
    e = client.join(one_rank_spec("dlpack"), 0)
    yield e
    e.close()


def test_dlview_protocol(ep):
    view = ep.low_latency_combine_input(kind="dlpack")
    assert isinstance(view, epd.DLView)
    assert view is ep.low_latency_combine_input(kind="dlpack")
    assert view.shape == (4, 4, 128) and view.dtype == "bfloat16"
    assert view.__dlpack_device__() == (1, 0)
    assert "bfloat16" in repr(view)
    # numpy 2 passes keywords; they are accepted and a legacy capsule comes back.
    cap = view.__dlpack__(stream=None, max_version=(1, 0), dl_device=(1, 0), copy=False)
    assert type(cap).__name__ == "PyCapsule"
    del cap  # an unconsumed capsule frees its export
    a = torch.utils.dlpack.from_dlpack(view)
    b = torch.from_dlpack(view)
    assert a.dtype == torch.bfloat16 and a.shape == (4, 4, 128)
    assert a.data_ptr() == b.data_ptr() == view.data_ptr
    a.fill_(2.0)
    assert float(b.float().sum()) == 2.0 * b.numel()
    # numpy sees bfloat16 as its bits (uint16): 2.0 is 0x4000.
    n = ep.low_latency_combine_input(kind="numpy")
    assert n.dtype == np.uint16 and n.shape == (4, 4, 128)
    assert (n == 0x4000).all()
    n[0, 0, 0] = 0x3F80  # 1.0
    assert float(a[0, 0, 0]) == 1.0


def test_numpy_inputs_and_outputs(ep):
    idx = np.array([[0, 1], [2, -1], [3, 3]], dtype=np.int64)
    per_rank, per_expert, in_rank = ep.get_dispatch_layout(idx)
    assert isinstance(per_rank, np.ndarray)
    assert per_rank.tolist() == [3] and per_expert.tolist() == [1, 1, 1, 1]
    assert in_rank.dtype == np.uint8 and in_rank.tolist() == [[1], [1], [1]]
    # bf16 x as uint16 bits.
    x = torch.randn(3, 128).to(torch.bfloat16)
    bits = x.view(torch.int16).numpy().view(np.uint16)
    r = ep.dispatch(bits, topk_idx=idx)
    assert isinstance(r.recv_x, np.ndarray) and r.recv_x.dtype == np.uint16
    assert (r.recv_x == bits).all()
    assert r.num_recv_tokens == 3 and r.recv_count.tolist() == [3]
    c = ep.combine(r.recv_x, r.handle)
    # One rank: every token comes back once, unchanged.
    assert (c.combined_x == bits).all()
    with pytest.raises(epd.InvalidArgumentError, match="x has dtype float32"):
        ep.dispatch(bits.astype(np.float32), topk_idx=idx)


def test_capsule_inputs_not_consumed(ep):
    idx = torch.tensor([[0, 1], [2, 3]], dtype=torch.int64)
    cap = torch.utils.dlpack.to_dlpack(idx)
    per_rank, per_expert, _ = ep.get_dispatch_layout(cap)
    assert per_expert.tolist() == [1, 1, 1, 1]
    # Still the caller's to consume.
    back = torch.utils.dlpack.from_dlpack(cap)
    assert torch.equal(back, idx)
    with pytest.raises(epd.InvalidArgumentError, match="capsule named 'used_dltensor'"):
        ep.get_dispatch_layout(cap)


def test_requires_grad_and_views_outlive_endpoint(client):
    e = client.join(one_rank_spec("outlive"), 0)
    x = torch.randn(2, 128, requires_grad=True)
    xb = x.to(torch.bfloat16)  # requires grad too
    idx = torch.tensor([[1, 2], [3, -1]], dtype=torch.int64)
    r = e.dispatch(xb, topk_idx=idx)
    assert torch.equal(r.recv_x, xb.detach())
    kept = r.recv_x
    e.close()
    del r
    assert torch.equal(kept, xb.detach())  # still mapped while the view lives


def test_ll_dispatch_input_region(ep):
    region = ep.low_latency_dispatch_input()
    assert region.shape == (4, 128) and region.dtype == torch.bfloat16
    assert region is ep.low_latency_dispatch_input()
    region.copy_(torch.randn(4, 128).to(torch.bfloat16))
    idx = torch.tensor([[0, 1], [1, 2], [2, 3]], dtype=torch.int64)
    r = ep.low_latency_dispatch(region[:3], idx)
    assert r.recv_count.tolist() == [1, 2, 2, 1]
    assert torch.equal(r.recv_x[1, :2], region[:2])
    with pytest.raises(epd.InvalidArgumentError, match="kind"):
        ep.low_latency_dispatch_input(kind="cupy")
    ep.low_latency_combine(r.recv_x, idx, torch.ones(3, 2), r.handle)


def test_join_does_not_import_torch(daemon):
    """A join imports no torch (seconds of a first join); numpy ops neither. Once the caller
    imports torch, its tensors get torch results, and a region of kind None is torch's."""
    import subprocess
    import sys

    code = """
import sys, time
import numpy as np, epd
c = epd.Client.connect(sys.argv[1])
ep = c.join(epd.GroupSpec("lazytorch_%d" % time.monotonic_ns(), 1, 128, 2, 4, 8, 4), 0)
assert "torch" not in sys.modules, "join imported torch"
idx = np.array([[0, 1], [2, 3]], dtype=np.int64)
r = ep.get_dispatch_layout(idx)
assert isinstance(r.num_tokens_per_expert, np.ndarray), r
assert "torch" not in sys.modules, "a numpy op imported torch"
import torch
r = ep.get_dispatch_layout(torch.from_numpy(idx))
assert isinstance(r.num_tokens_per_expert, torch.Tensor), type(r.num_tokens_per_expert)
assert r.num_tokens_per_expert.tolist() == [1, 1, 1, 1]
x = torch.full((2, 128), 1.0, dtype=torch.bfloat16)
d = ep.low_latency_dispatch(x, torch.from_numpy(idx))
assert isinstance(d.recv_x, torch.Tensor) and d.recv_x.dtype == torch.bfloat16, d.recv_x
assert isinstance(ep.low_latency_combine_input(), torch.Tensor)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code, daemon.socket], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_without_torch(daemon):
    """A process where torch cannot be imported gets numpy arrays (bf16 as uint16 bits),
    a writable combine input region included."""
    import subprocess
    import sys

    code = """
import sys, time
sys.modules["torch"] = None  # import torch raises ImportError
import numpy as np, epd
c = epd.Client.connect(sys.argv[1])
ep = c.join(epd.GroupSpec("notorch_%d" % time.monotonic_ns(), 1, 128, 2, 4, 8, 4), 0)
idx = np.array([[0, 1], [2, 3]], dtype=np.int64)
x = np.full((2, 128), 0x3F80, dtype=np.uint16)
r = ep.low_latency_dispatch(x, idx)
assert isinstance(r.recv_x, np.ndarray) and r.recv_x.dtype == np.uint16, r.recv_x
assert r.recv_count.tolist() == [1, 1, 1, 1]
ci = ep.low_latency_combine_input()
assert ci.dtype == np.uint16 and ci.flags.writeable
ci[:] = 0x3F80
out = ep.low_latency_combine(ci, idx, np.full((2, 2), 0.5, dtype=np.float32), r.handle).combined_x
assert (out == 0x3F80).all(), out  # 0.5 * 1.0 + 0.5 * 1.0
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code, daemon.socket], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
