"""The kept DLPack exports of low-latency op arguments (one process, one-rank groups, host
backend): a torch tensor passed again is read through its kept export only while torch
reports the same data_ptr, shape, strides, dtype and device, so a tensor resized,
re-strided, re-pointed (set_, .data =), relabelled in dtype or moved in place between reads
is read exactly as a new export reads it (epd._C._TorchArgProbe); ops on tensors mutated in
place between ops give the results of the same ops on fresh copies."""

import time

import pytest
import torch

import epd
import epd._core

pytestmark = pytest.mark.host_only(reason="one-rank groups on CPU tensors")


@pytest.fixture(autouse=True)
def torch_registered():
    epd._core._setup_frameworks()  # registers torch.Tensor with epd._C


def fresh(t):
    """What a new export of t reads."""
    return epd._C._TorchArgProbe().read(t)


def check_reads(probe, t, expect_hit):
    before = probe.hits
    assert probe.read(t) == fresh(t)
    assert probe.hits == before + (1 if expect_hit else 0)


def test_unchanged_tensor_reuses_its_export():
    probe = epd._C._TorchArgProbe()
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    check_reads(probe, x, False)
    check_reads(probe, x, True)
    x.add_(1)  # contents are not metadata
    check_reads(probe, x, True)
    y = x.clone()  # another tensor in the same argument
    check_reads(probe, y, False)
    check_reads(probe, y, True)
    check_reads(probe, x, False)


@pytest.mark.parametrize("mutate", [
    "resize_smaller", "resize_larger", "t_", "as_strided_", "transpose_", "unsqueeze_",
    "set_other", "set_offset", "data_dtype", "data_view", "empty",
])
def test_tensor_changed_in_place_is_read_again(mutate):
    probe = epd._C._TorchArgProbe()
    x = torch.arange(16, dtype=torch.bfloat16).reshape(4, 4)
    check_reads(probe, x, False)
    check_reads(probe, x, True)
    if mutate == "resize_smaller":
        x.resize_(2, 4)
    elif mutate == "resize_larger":
        x.resize_(64, 64)  # reallocates
    elif mutate == "t_":
        x.t_()  # same shape, new strides
    elif mutate == "as_strided_":
        x.as_strided_((4, 4), (1, 4))
    elif mutate == "transpose_":
        x.transpose_(0, 1)
    elif mutate == "unsqueeze_":
        x.unsqueeze_(0)
    elif mutate == "set_other":
        x.set_(torch.zeros(4, 4, dtype=torch.bfloat16))  # same shape, other storage
    elif mutate == "set_offset":
        x.set_(x.untyped_storage() if hasattr(x, "untyped_storage") else x.storage(), 2, (4, 3), (4, 1))
    elif mutate == "data_dtype":
        x.data = x.view(torch.int16)  # same memory and shape, another dtype
    elif mutate == "data_view":
        x.data = x[1:]
    elif mutate == "empty":
        x.resize_(0, 4)
    check_reads(probe, x, False)
    check_reads(probe, x, True)


def test_subclass_is_exported_every_time():
    probe = epd._C._TorchArgProbe()
    p = torch.nn.Parameter(torch.ones(2, 2), requires_grad=False)
    check_reads(probe, p, False)
    check_reads(probe, p, False)


def one_rank_spec(name):
    return epd.GroupSpec("%s_%d" % (name, time.monotonic_ns()), num_ranks=1, hidden=128,
                         num_topk=2, num_experts=4, max_tokens_per_rank=8,
                         max_dispatch_tokens_per_rank=4, use_fp8=False)


def routed(t, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 128, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(t)]) if t else \
        torch.zeros(0, 2, dtype=torch.int64)
    w = torch.rand(t, 2, generator=g)
    return x, idx, w


def round_trip(ep, x, idx, w):
    r = ep.low_latency_dispatch(x, idx)
    got = [(int(r.recv_count[e]), r.recv_src_info[e, :int(r.recv_count[e])].tolist(),
            r.recv_x[e, :int(r.recv_count[e])].clone()) for e in range(4)]
    cin = ep.low_latency_combine_input()
    cin.copy_(r.recv_x)
    c = ep.low_latency_combine(cin, idx, w, r.handle)
    return got, c.combined_x.clone()


def same(a, b):
    (ga, ca), (gb, cb) = a, b
    assert len(ga) == len(gb)
    for (na, ia, xa), (nb, ib, xb) in zip(ga, gb):
        assert na == nb and ia == ib and torch.equal(xa, xb)
    assert torch.equal(ca, cb)


def check_ops(ep, x, idx, w):
    """Two ops on (x, idx, w) (the second through the kept exports) give what the same ops
    on fresh copies give."""
    first = round_trip(ep, x, idx, w)
    hits = ep._c._export_hits()
    second = round_trip(ep, x, idx, w)
    assert ep._c._export_hits() > hits
    want = round_trip(ep, x.clone(), idx.clone(), w.clone())
    same(first, want)
    same(second, want)


def restride(ep, x, idx):
    """idx re-strided in place (same shape, column-major) after an op read it row-major:
    refused as not contiguous, then read again once restored."""
    n = idx.shape[0]
    ep.low_latency_dispatch(x, idx)
    idx.as_strided_((n, 2), (1, n))
    with pytest.raises(epd.InvalidArgumentError, match="contiguous"):
        ep.low_latency_dispatch(x, idx)
    idx.as_strided_((n, 2), (2, 1))


def test_ops_read_inputs_changed_in_place(client):
    ep = client.join(one_rank_spec("argcache"), 0)
    try:
        x, idx, w = routed(4, 1)
        check_ops(ep, x, idx, w)
        steps = [
            lambda: (x.resize_(2, 128), idx.resize_(2, 2), w.resize_(2, 2)),
            lambda: (x.set_(routed(3, 2)[0]), idx.set_(routed(3, 2)[1]), w.set_(routed(3, 2)[2])),
            lambda: (x.copy_(routed(3, 3)[0]), idx.copy_(routed(3, 3)[1])),
            lambda: restride(ep, x, idx),
            lambda: (x.resize_(0, 128), idx.resize_(0, 2), w.resize_(0, 2)),
            lambda: (x.set_(routed(4, 4)[0]), idx.set_(routed(4, 4)[1]), w.set_(routed(4, 4)[2])),
        ]
        for step in steps:
            step()
            check_ops(ep, x, idx, w)
        # Pending ops keep their inputs' exports until waited for.
        p = ep.low_latency_dispatch(x, idx, wait=False)
        r = p.wait()
        assert r.handle.num_tokens == x.shape[0]
    finally:
        ep.close()
