"""Strided views (one process, one-rank groups, host backend): the low-latency FP8
recv_scales that the C ABI returns with explicit strides (token index fastest) keep them
in torch (stride()), in numpy (__array_interface__ strides, in bytes) and in DLPack exports;
packed UE8M0 int32 scales (use_ue8m0) against the f32 power-of-two scales of the same
dispatch; use_ue8m0's argument errors; the view cache keyed by strides (two views of one
address and shape with other strides are two objects) and a cached strided view read back
as an input with its strides (epd._C._ViewCacheProbe)."""

import time

import numpy as np
import pytest
import torch

import epd
import epd_testing as T

H, E, K, MLL = 512, 4, 2, 4


def spec(name, hidden=H):
    return epd.GroupSpec("%s_%d" % (name, time.monotonic_ns()), num_ranks=1, hidden=hidden,
                         num_topk=K, num_experts=E, max_tokens_per_rank=8,
                         max_dispatch_tokens_per_rank=MLL, use_fp8=True)


def join(client, s):
    """One rank of `s` (OnDevice with EPD_TEST_DEVICE=cuda: results read as CPU copies,
    which keep the views' strides)."""
    e = client.join(s, 0, launch_mode=T.LAUNCH_MODE)
    return T.OnDevice(e) if T.CUDA else e


@pytest.fixture
def ep(client):
    e = join(client, spec("strided"))
    yield e
    e.close()


def inputs():
    g = torch.Generator().manual_seed(5)
    x = (torch.randn((3, H), generator=g) * torch.tensor([0.01, 1.0, 300.0]).view(3, 1))
    idx = torch.tensor([[0, 1], [1, 3], [2, -1]], dtype=torch.int64)
    return x.to(torch.bfloat16), idx


def ref_scales(x, idx, round_scale):
    """{(expert, row): [H/128] f32 scale} of the one-rank dispatch (rows in token order)."""
    out = {}
    for e in range(E):
        row = 0
        for t in range(x.shape[0]):
            if (idx[t] == e).any():
                amax = x[t].float().view(-1, 128).abs().amax(dim=1).clamp(min=1e-4)
                s = amax / 448.0
                if round_scale:
                    s = torch.exp2(torch.ceil(torch.log2(s)))
                out[(e, row)] = s
                row += 1
    return out


def test_fp8_scales_strided_torch(ep):
    x, idx = inputs()
    r = ep.low_latency_dispatch(x, idx, use_fp8=True)
    s = r.recv_scales
    assert s.shape == (E, MLL, H // 128) and s.dtype == torch.float32
    assert s.stride() == (H // 128 * MLL, 1, MLL)
    assert not s.is_contiguous()
    for (e, row), want in ref_scales(x, idx, False).items():
        assert torch.allclose(s[e, row], want, rtol=1e-6, atol=0), (e, row, s[e, row], want)
    # The storage is [E, H/128, MLL]: its transpose is a compact tensor over the same bytes.
    assert s.transpose(1, 2).is_contiguous()
    # Cached: the same object op after op from the same buffer.
    ep.low_latency_combine(torch.zeros((E, MLL, H), dtype=torch.bfloat16), idx,
                           torch.ones(3, K), r.handle)
    r2 = ep.low_latency_dispatch(x, idx, use_fp8=True)
    ep.low_latency_combine(torch.zeros((E, MLL, H), dtype=torch.bfloat16), idx,
                           torch.ones(3, K), r2.handle)
    r3 = ep.low_latency_dispatch(x, idx, use_fp8=True)
    assert T.raw(r3).recv_scales is T.raw(r).recv_scales
    assert T.raw(r3).recv_scales.stride() == s.stride()


@pytest.mark.host_only("numpy views of host memory")
def test_fp8_scales_strided_numpy(ep):
    x, idx = inputs()
    bits = x.view(torch.int16).numpy().view(np.uint16)
    r = ep.low_latency_dispatch(bits, idx.numpy(), use_fp8=True, round_scale=True)
    s = r.recv_scales
    assert isinstance(s, np.ndarray) and s.dtype == np.float32
    assert s.shape == (E, MLL, H // 128)
    assert s.strides == (4 * H // 128 * MLL, 4, 4 * MLL)
    for (e, row), want in ref_scales(x, idx, True).items():
        assert s[e, row].tolist() == want.tolist(), (e, row)


def test_ue8m0_packed_scales(ep):
    x, idx = inputs()
    f32 = ep.low_latency_dispatch(x, idx, use_fp8=True, round_scale=True)
    want = f32.recv_scales.clone()
    count = f32.recv_count.clone()
    ep.low_latency_combine(torch.zeros((E, MLL, H), dtype=torch.bfloat16), idx,
                           torch.ones(3, K), f32.handle)
    r = ep.low_latency_dispatch(x, idx, use_fp8=True, round_scale=True, use_ue8m0=True)
    s = r.recv_scales
    assert s.dtype == torch.int32 and s.shape == (E, MLL, H // 512)
    assert s.stride() == (H // 512 * MLL, 1, MLL)
    # Byte i of word j: the biased exponent of 128-channel block 4j + i.
    exps = (want.contiguous().view(torch.int32) >> 23) & 0xFF  # [E, MLL, H/128]
    for e in range(E):
        for row in range(int(count[e])):
            words = [int(w) & 0xFFFFFFFF for w in s[e, row].tolist()]
            got = [(w >> (8 * i)) & 0xFF for w in words for i in range(4)]
            assert got == exps[e, row].tolist(), (e, row, got)
    # DeepEP's test reads them through .contiguous().view(-1, H // 128) (four tokens a row)
    # and per_token_cast_back: the flat bytes are token-major after contiguous().
    flat = s.contiguous().view(-1, H // 128).view(torch.uint8).view(E, MLL, H // 128)
    for e in range(E):
        n = int(count[e])
        assert torch.equal(flat[e, :n].to(torch.int32), exps[e, :n])
    ep.low_latency_combine(torch.zeros((E, MLL, H), dtype=torch.bfloat16), idx,
                           torch.ones(3, K), r.handle)


def test_ue8m0_argument_errors(ep, client):
    x, idx = inputs()
    with pytest.raises(epd.InvalidArgumentError, match="use_ue8m0"):
        ep.low_latency_dispatch(x, idx, use_fp8=True, use_ue8m0=True)
    with pytest.raises(epd.InvalidArgumentError, match="use_ue8m0"):
        ep.low_latency_dispatch(x, idx, use_ue8m0=True)
    narrow = join(client, spec("ue8m0_narrow", hidden=256))
    try:
        with pytest.raises(epd.InvalidArgumentError, match="512"):
            narrow.low_latency_dispatch(x[:, :256].contiguous(), idx, use_fp8=True,
                                        round_scale=True, use_ue8m0=True)
    finally:
        narrow.close()
    # Nothing was submitted: the endpoint still works.
    r = ep.low_latency_dispatch(x, idx)
    assert r.recv_count.tolist() == [1, 2, 1, 1]


def test_view_cache_keys_strides():
    probe = epd._C._ViewCacheProbe()
    a = np.arange(16, dtype=np.float32).reshape(4, 4)
    t = a.T  # same address, shape and dtype; other strides
    va, vt = probe.get(a), probe.get(t)
    assert va is not vt and probe.size() == 2
    assert probe.get(a) is va and probe.get(t) is vt
    assert va.strides == (4, 1) and vt.strides == (1, 4)
    assert "strides=(1, 4)" in repr(vt)
    # Exports keep the strides: torch, numpy's DLPack and __array_interface__.
    assert torch.from_dlpack(vt).stride() == (1, 4)
    assert torch.equal(torch.from_dlpack(vt), torch.from_numpy(t.copy()))
    assert np.asarray(vt).strides == (4, 16) and (np.asarray(vt) == t).all()
    assert np.asarray(va).strides == (16, 4)
    if hasattr(np, "from_dlpack"):
        assert (np.from_dlpack(vt) == t).all()
    # Read back as an input: the strides it was cached with (None for a compact one given
    # without strides is allowed; numpy gives strides, so both have them here).
    assert probe.find(vt) == ((4, 4), (1, 4))
    assert probe.find(va)[0] == (4, 4) and probe.find(va)[1] in ((4, 1), None)
    assert probe.find(object()) is None
