"""deep_ep.utils on epd (one process, no daemon): the math helpers against hand-written
references (FP8 casts, packed UE8M0 scales, diffs, hashes, unique ranks), the CPU timer,
the byte-size model, and the `deep_ep` drop-in's module layout."""

import pytest
import torch

import deep_ep
from deep_ep.utils import math as dmath
from deep_ep.utils.testing import bench
from epd.deep_ep import _sizes

HAS_FP8 = hasattr(torch, "float8_e4m3fn")


def test_dropin_layout():
    import deep_ep.utils.envs
    import deep_ep.utils.math
    import deep_ep.utils.testing
    import epd.deep_ep
    assert deep_ep.Buffer is epd.deep_ep.Buffer and deep_ep.Config is epd.deep_ep.Config
    assert deep_ep.utils.envs.init_dist is epd.deep_ep.utils.envs.init_dist
    assert deep_ep.utils.math.per_token_cast_back is epd.deep_ep.utils.math.per_token_cast_back
    assert deep_ep.utils.testing.bench_kineto is epd.deep_ep.utils.testing.bench_kineto
    assert deep_ep.topk_idx_t is torch.int64
    assert {"Buffer", "Config", "EventOverlap", "EventHandle"} <= set(dir(deep_ep))


def test_calc_diff_align_count_bytes():
    x = torch.randn(64, 32, dtype=torch.float32)
    assert dmath.calc_diff(x, x) == pytest.approx(0, abs=1e-12)
    a, b = x.double() + 1, -x.double() + 1
    want = float(1 - 2 * (a * b).sum() / (a * a + b * b).sum())
    assert dmath.calc_diff(x, -x) == pytest.approx(want, rel=1e-12)
    assert dmath.align(130, 128) == 256 and dmath.ceil_div(7, 2) == 4
    assert dmath.safe_div(0, 0) == 0 and dmath.safe_div(3, 2) == 1.5
    with pytest.raises(ZeroDivisionError):
        dmath.safe_div(1, 0)
    t = torch.zeros((3, 5), dtype=torch.bfloat16)
    assert dmath.count_bytes(t, (t, None), [torch.zeros(4, dtype=torch.int64)]) == 30 + 30 + 32


def test_inplace_unique():
    x = torch.tensor([[3, 1, 3, -1], [2, 2, 2, 2], [-1, -1, -1, -1], [0, 1, 2, 3]])
    dmath.inplace_unique(x, 4)
    assert x.tolist() == [[3, 1, -1, -1], [2, -1, -1, -1], [-1, -1, -1, -1], [3, 2, 1, 0]]
    y = torch.tensor([[5, 4, 5]])
    dmath.inplace_unique(y, 6)
    assert y.tolist() == [[5, 4, -1]]


def test_grouped_scores_and_hash():
    scores = torch.arange(12, dtype=torch.float32).view(2, 6) + 1
    out = dmath.create_grouped_scores(scores, torch.tensor([[0], [2]]), 3)
    assert out.tolist() == [[1, 2, 0, 0, 0, 0], [0, 0, 0, 0, 11, 12]]
    w = torch.tensor([1, 2, 3], dtype=torch.int32)
    assert dmath.hash_tensor(w) == 6
    b = torch.tensor([1, 2], dtype=torch.uint8)
    assert dmath.hash_tensor(b) == 3
    assert dmath.hash_tensor(w.view(3, 1).T) == 6  # any strides
    assert dmath.hash_tensors(w, [b, None]) == 6 ^ 3


def test_per_token_cast_back_scales():
    # Values standing in for decoded e4m3 data (any float tensor works).
    x8 = torch.arange(2 * 512, dtype=torch.float32).view(2, 512) % 7
    scales = torch.tensor([[0.5, 2.0, 0.25, 8.0], [1.0, 4.0, 0.125, 16.0]])
    want = (x8.view(2, 4, 128) * scales.unsqueeze(2)).view(2, 512).to(torch.bfloat16)
    assert torch.equal(dmath.per_token_cast_back(x8, scales), want)
    assert torch.equal(dmath.per_token_cast_back(x8, scales.T.contiguous().T), want)
    # Packed UE8M0: byte j of a word is the biased exponent of scale 4w + j.
    exps = (torch.log2(scales) + 127).to(torch.int64)
    words = exps[:, 0] | exps[:, 1] << 8 | exps[:, 2] << 16 | exps[:, 3] << 24
    packed = words.to(torch.int64).where(words < 2**31, words - 2**32).to(torch.int32).view(2, 1)
    assert torch.equal(dmath.per_token_cast_back(x8, packed), want)
    empty = dmath.per_token_cast_back(torch.zeros((0, 128)), torch.zeros((0, 1)))
    assert empty.shape == (0, 128) and empty.dtype == torch.bfloat16


@pytest.mark.skipif(not HAS_FP8, reason="torch without float8_e4m3fn (FP8 needs torch >= 2.1)")
def test_per_token_cast_to_fp8_roundtrip():
    x = torch.randn(8, 300, dtype=torch.float32) * 3
    x[1] = 0
    x8, s = dmath.per_token_cast_to_fp8(x.to(torch.bfloat16))
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == (8, 300) and s.shape == (8, 3)
    amax = torch.nn.functional.pad(x, (0, 84)).view(8, 3, 128).abs().amax(2)
    assert torch.allclose(s, amax.clamp(min=1e-4) / 448)
    back = dmath.per_token_cast_back(x8, s).float()
    assert torch.allclose(back, x.to(torch.bfloat16).float(), rtol=0.07, atol=1e-6)


@pytest.mark.skipif(HAS_FP8, reason="torch has float8_e4m3fn")
def test_per_token_cast_to_fp8_needs_float8():
    with pytest.raises(TypeError, match="float8"):
        dmath.per_token_cast_to_fp8(torch.zeros((2, 128)))


def test_bench_cpu():
    calls = []
    avg, low, high = bench(lambda: calls.append(1), num_warmups=2, num_tests=5)
    assert len(calls) == 7 and 0 <= low <= avg <= high


def test_size_model():
    shape = dict(num_ranks=8, num_experts=256, hidden=7168, num_topk=8,
                 ll_max_tokens_per_rank=0, use_fp8=True)
    one = _sizes.endpoint_bytes(max_tokens_per_rank=1, **shape)
    two = _sizes.endpoint_bytes(max_tokens_per_rank=2, **shape)
    assert one % 256 == 0 and two > one
    m = _sizes.max_tokens_within(2 * 10**9, **shape)
    assert _sizes.endpoint_bytes(max_tokens_per_rank=m, **shape) <= 2 * 10**9
    assert _sizes.endpoint_bytes(max_tokens_per_rank=m + 1, **shape) > 2 * 10**9
    assert m >= 4096  # DeepEP's intranode test: 4096 tokens within int(2e9)
    assert _sizes.max_tokens_within(one - 1, **shape) == 0
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 288)
    ll = _sizes.endpoint_bytes(num_ranks=8, num_experts=288, hidden=7168, num_topk=8,
                               max_tokens_per_rank=1, ll_max_tokens_per_rank=128, use_fp8=True)
    assert ll <= hint
