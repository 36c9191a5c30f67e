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


def test_per_token_cast_to_fp8():
    """A round trip on a torch with float8_e4m3fn; TypeError naming float8 without it."""
    if not HAS_FP8:
        with pytest.raises(TypeError, match="float8"):
            dmath.per_token_cast_to_fp8(torch.zeros((2, 128)))
        return
    x = torch.randn(8, 300, dtype=torch.float32) * 3
    x[1] = 0
    x8, s = dmath.per_token_cast_to_fp8(x.to(torch.bfloat16))
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == (8, 300) and s.shape == (8, 3)
    # The cast sees the bf16 input: its block maxima are of the bf16-rounded values.
    xb = x.to(torch.bfloat16).float()
    amax = torch.nn.functional.pad(xb, (0, 84)).view(8, 3, 128).abs().amax(2)
    assert torch.allclose(s, amax.clamp(min=1e-4) / 448)
    back = dmath.per_token_cast_back(x8, s).float()
    assert torch.allclose(back, x.to(torch.bfloat16).float(), rtol=0.07, atol=1e-6)



def _e4m3_bits(values):
    """e4m3 bits (uint8) of values exactly representable in e4m3 (normal numbers, 0)."""
    out = []
    for v in values.flatten().tolist():
        if v == 0:
            out.append(0)
            continue
        sign = 0x80 if v < 0 else 0
        e = int(torch.floor(torch.log2(torch.tensor(abs(v)))))
        man = int(round((abs(v) / 2.0 ** e - 1) * 8))
        out.append(sign | (e + 7) << 3 | man)
    return torch.tensor(out, dtype=torch.uint8).view(values.shape)


@pytest.mark.parametrize("H", [512, 1024], ids=["one-word-a-row", "two-words-a-row"])
def test_per_token_cast_back_deep_ep_layouts(H):
    """The calls DeepEP's test_low_latency.py makes on low-latency results: e4m3 data
    [L, N, H] (uint8 bits here) with f32 scales [L, N, H/128] or packed UE8M0 int32
    [L, N, H/512], both column-major (token stride 1) as dispatch returns them, then
    scales.contiguous(), per_token_cast_back(x.view(-1, H), s.view(-1, H // 128)) and
    per_token_cast_back(x[i], s[i]). H = 512: one int32 a row, a last dim of size 1
    whose stride is N (torch counts such a tensor contiguous)."""
    L, N = 2, 8
    g = torch.Generator().manual_seed(3)
    mant = torch.randint(0, 8, (L, N, H), generator=g).float()
    sign = torch.randint(0, 2, (L, N, H), generator=g).float() * 2 - 1
    expo = torch.randint(-6, 8, (L, N, H), generator=g).float()
    values = sign * (1 + mant / 8) * torch.pow(2.0, expo)
    bits = _e4m3_bits(values)
    log2s = torch.randint(-20, 10, (L, N, H // 128), generator=g)
    f32 = torch.pow(2.0, log2s.float())
    want = (values.view(L, N, H // 128, 128) * f32.unsqueeze(3)).view(L, N, H).to(torch.bfloat16)
    # Column-major storage [L, S, N], presented as [L, N, S] with strides (S*N, 1, N).
    def column_major(t):
        out = torch.empty((L, t.size(2), N), dtype=t.dtype).transpose(1, 2)
        out.copy_(t)
        return out

    f32_cm = column_major(f32)
    exps = (log2s + 127).to(torch.int64).view(L, N, H // 512, 4)
    words = exps[..., 0] | exps[..., 1] << 8 | exps[..., 2] << 16 | exps[..., 3] << 24
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    ue8m0_cm = column_major(words)
    assert ue8m0_cm.stride() == (H // 512 * N, 1, N) and f32_cm.stride() == (H // 128 * N, 1, N)
    for scales in (f32_cm, ue8m0_cm):
        s = scales.contiguous()
        whole = dmath.per_token_cast_back(bits.view(-1, H), s.view(-1, H // 128)).view(bits.shape)
        assert torch.equal(whole, want), scales.dtype
        for i in range(L):
            assert torch.equal(dmath.per_token_cast_back(bits[i], s[i]), want[i])
            # Without contiguous(): the column-major slice itself.
            assert torch.equal(dmath.per_token_cast_back(bits[i], scales[i]), want[i])
    if HAS_FP8:
        assert torch.equal(dmath.per_token_cast_back(bits.view(torch.float8_e4m3fn)[0], f32_cm[0]),
                           want[0])


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


def test_timed_calls_leave_the_prologue_out():
    """bench_kineto's daemon-launched fallback times fn only: a slow prologue before each
    call (the L2 flush, sleep and barrier of barrier_comm_profiling) is not counted."""
    import time
    from epd.deep_ep.utils import testing
    calls = []
    avg = testing._timed_calls(lambda: (calls.append("fn"), time.sleep(0.002)), 5,
                               lambda: (calls.append("pro"), time.sleep(0.03)),
                               timer=testing._wall_timer)
    assert calls == ["pro", "fn"] * 5
    assert 0.002 <= avg < 0.02, avg


def test_bench_kineto_without_matching_kernels(monkeypatch):
    """No kernel of fn matches (epd daemon-launched: they run in the daemon): each name gets
    fn's average end-to-end time, [send + recv, 0] with num_kernels_per_period=2; the
    prologue (here a 30 ms barrier) is outside the timed region. CUDA stood in for by the
    wall clock and a profiler that records nothing."""
    import time
    from epd.deep_ep.utils import testing

    class NoKernels:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def export_chrome_trace(self, path):
            with open(path, "w") as f:
                f.write('{"traceEvents": []}')

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.profiler, "profile", lambda **kw: NoKernels())
    monkeypatch.setattr(testing, "_cuda_timer", testing._wall_timer)
    barriers = []

    def barrier():
        barriers.append(1)
        time.sleep(0.03)

    def fn():
        time.sleep(0.002)

    one = testing.bench_kineto(fn, "dispatch", num_tests=4, flush_l2=False,
                               barrier_comm_profiling=True, barrier=barrier)
    assert 0.002 <= one < 0.02, one
    both = testing.bench_kineto(fn, ("dispatch", "combine"), num_tests=4, flush_l2=False,
                                barrier_comm_profiling=True, barrier=barrier,
                                num_kernels_per_period=2)
    assert isinstance(both, tuple) and len(both) == 2
    for send_recv, zero in both:
        assert 0.002 <= send_recv < 0.02 and zero == 0.0, both
    assert len(barriers) == 2 * (4 + 4)  # profiled calls, then the timed ones


def test_byte_and_alignment_arguments_are_checked_ints():
    """Buffer's byte budgets and dispatch's expert_alignment take anything with __index__
    (numpy integers too) and refuse bool, float and str with InvalidArgumentError naming
    the argument (a raw TypeError or a misleading message before)."""
    import numpy as np

    import epd
    from epd.deep_ep.buffer import _non_negative_int

    assert _non_negative_int("Buffer", "num_nvl_bytes", np.int64(1 << 20)) == 1 << 20
    assert type(_non_negative_int("Buffer", "num_nvl_bytes", np.int64(7))) is int
    for bad in (True, 2.0, "2", None):
        with pytest.raises(epd.InvalidArgumentError, match="expert_alignment"):
            _non_negative_int("dispatch", "expert_alignment", bad)
    with pytest.raises(epd.InvalidArgumentError, match="num_rdma_bytes = -1"):
        _non_negative_int("Buffer", "num_rdma_bytes", -1)
    with pytest.raises(epd.InvalidArgumentError, match="num_nvl_bytes = '2'"):
        deep_ep.Buffer(None, num_nvl_bytes="2")
