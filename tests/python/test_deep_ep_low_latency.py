"""epd.deep_ep low-latency mode against torch references, on R processes and a gloo group:
low_latency_dispatch (BF16, FP8, power-of-two scales, packed UE8M0 scales; hook, async
event, cumulative stats), the handle (recv_src_info, recv_layout_range), low_latency_combine
(copy, zero_copy through get_next_low_latency_combine_buffer, out=), clean_low_latency_buffer,
the size hint and the too-small-budget error; bad input raising a clear error with the next
op still working; and the op sequence of DeepEP's test_low_latency.py (its logic rewritten
here, CPU-sized). FP8 data is read back from e4m3 bits where torch has no float8 dtype.
"""

import torch
import torch.distributed as dist

import epd
from deep_ep_harness import DEVICE, epd_socket, expect_error, run_ranks  # noqa: F401 (fixture)

R = 4
H = 512
E = 8
K = 3
MLL = 16
T = 12
OFFSET = 8


def _e4m3_to_float(t: torch.Tensor) -> torch.Tensor:
    """float32 values of e4m3 data: a float8_e4m3fn tensor, or uint8 e4m3 bits."""
    if t.dtype != torch.uint8:
        return t.float()
    b = t.to(torch.int32)
    sign = torch.where(b >= 128, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = (b & 7).float()
    normal = (1 + man / 8) * torch.pow(2.0, (exp - 7).float())
    sub = man / 8 * 2.0 ** -6
    value = torch.where(exp == 0, sub, normal) * sign
    return torch.where((b & 0x7F) == 0x7F, torch.full_like(value, float("nan")), value)


def _ue8m0_to_float(words: torch.Tensor) -> torch.Tensor:
    """float32 scales of packed UE8M0 int32 words (byte j of a word: scale 4w + j, value
    2^(byte - 127)), in element order."""
    b = words.contiguous().reshape(-1).view(torch.uint8).to(torch.float64)
    return torch.pow(2.0, b - 127).to(torch.float32)


def _dequant(x8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[rows, H] f32 from e4m3 x8 [rows, H] and f32 (or packed UE8M0) scales."""
    s = _ue8m0_to_float(scales) if scales.dtype == torch.int32 else scales.float()
    s = s.reshape(x8.size(0), -1, 1)
    return (_e4m3_to_float(x8).view(x8.size(0), -1, 128) * s).view(x8.shape)


def _inputs(rank):
    g = torch.Generator(device="cpu").manual_seed(77 + rank)
    x = torch.full((T, H), float(rank - OFFSET), dtype=torch.float32, device="cpu")
    x[:, -128:] = torch.arange(T, dtype=torch.float32, device="cpu").view(-1, 1)
    x = x.to(torch.bfloat16)
    scores = torch.rand((T, E), generator=g, dtype=torch.float32, device="cpu")
    topk_idx = scores.topk(K, dim=1).indices.to(torch.int64)
    topk_idx[3, :] = -1
    topk_idx[5, 2] = -1
    weights = torch.rand((T, K), generator=g, dtype=torch.float32, device="cpu")
    return x.to(DEVICE), topk_idx.to(DEVICE), weights.to(DEVICE)


def _check_dispatch(rank, num_ranks, recv, count, handle, all_idx, use_fp8, x_ref):
    local = E // num_ranks
    for i in range(local):
        expert = rank * local + i
        n = int(count[i])
        want = [(s, t) for s in range(num_ranks) for t in range(T)
                if expert in all_idx[s][t].tolist()]
        assert n == len(want), (n, len(want))
        src_idx = handle[0][i, :n]
        assert src_idx.dtype == torch.int32
        assert src_idx.tolist() == [t for _, t in want]
        layout = handle[1][i]
        assert layout.dtype == torch.int64
        assert int((layout & 0xFFFFFFFF).sum()) == n
        got = []
        for j in range(num_ranks):
            begin, cnt = int(layout[j]) >> 32, int(layout[j]) & 0xFFFFFFFF
            got += [(j, int(src_idx[r])) for r in range(begin, begin + cnt)]
        assert got == want
        rows = (_dequant(recv[0][i, :n], recv[1][i, :n]) if use_fp8 else recv[i, :n].float())
        want_rows = torch.stack([x_ref[s][t].float() for s, t in want]) if want else rows
        if use_fp8:
            assert torch.allclose(rows, want_rows, rtol=0.07, atol=0)
        else:
            assert torch.equal(rows, want_rows)


def _ll_body(rank, num_ranks, group):
    import deep_ep
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MLL, H, num_ranks, E)
    buf = deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True,
                         num_qps_per_rank=E // num_ranks, explicitly_destroy=True)
    x, topk_idx, weights = _inputs(rank)
    x_ref = [_inputs(s)[0] for s in range(num_ranks)]
    all_idx = torch.empty((num_ranks, T, K), dtype=torch.int64)
    dist.all_gather_into_tensor(all_idx, topk_idx, group=group)  # the gloo shim's [R, T, K]
    assert all(torch.equal(all_idx[s], _inputs(s)[1]) for s in range(num_ranks))
    local = E // num_ranks
    valid_w = weights.masked_fill(topk_idx < 0, 0).sum(dim=1, keepdim=True)
    fp8 = [False, True]
    f32_round_scales = None
    for use_fp8 in fp8:
        for round_scale in ((False, True) if use_fp8 else (False,)):
            for use_ue8m0 in ((False, True) if round_scale else (False,)):
                for hook_mode in (False, True):
                    stats = torch.zeros(local, dtype=torch.int32)
                    recv, count, handle, ev, hook = buf.low_latency_dispatch(
                        x, topk_idx, MLL, E, cumulative_local_expert_recv_stats=stats,
                        use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                        async_finish=not hook_mode, return_recv_hook=hook_mode)
                    hook() if hook_mode else ev.current_stream_wait()
                    assert torch.equal(stats, count)
                    assert count.shape == (local,) and count.dtype == torch.int32
                    assert len(handle) == 5 and tuple(handle)[2:] == (MLL, H, E)
                    if use_fp8:
                        x8, scales = recv
                        assert x8.shape == (local, num_ranks * MLL, H)
                        if use_ue8m0:
                            assert scales.dtype == torch.int32
                            assert scales.shape == (local, num_ranks * MLL, H // 512)
                            # DeepEP's layout: column-major last two dims, epd's view as is.
                            assert scales.stride() == (H // 512 * num_ranks * MLL, 1, num_ranks * MLL)
                            # The same exponents as the float32 power-of-two scales.
                            unpacked = _ue8m0_to_float(scales).view(local, num_ranks * MLL, -1)
                            for i in range(local):
                                n = int(count[i])
                                assert torch.equal(unpacked[i, :n], f32_round_scales[i, :n])
                        else:
                            assert scales.dtype == torch.float32
                            assert scales.shape == (local, num_ranks * MLL, H // 128)
                            assert scales.stride() == (H // 128 * num_ranks * MLL, 1, num_ranks * MLL)
                            if round_scale:
                                for i in range(local):
                                    s = scales[i, :int(count[i])]
                                    assert bool((torch.log2(s) == torch.log2(s).round()).all())
                                f32_round_scales = scales.contiguous().clone()
                    else:
                        assert recv.shape == (local, num_ranks * MLL, H)
                        assert recv.dtype == torch.bfloat16
                    _check_dispatch(rank, num_ranks, recv, count, handle, all_idx, use_fp8, x_ref)

                    # The experts' output: the rows as received (dequantised for FP8).
                    if use_fp8:
                        y = _dequant(recv[0].reshape(-1, H), recv[1].contiguous().reshape(
                            local * num_ranks * MLL, -1)).view(recv[0].shape).to(torch.bfloat16)
                    else:
                        y = recv.clone()
                    for zero_copy in (False, True):
                        if zero_copy:
                            buf.get_next_low_latency_combine_buffer(handle)[:, :, :] = y
                        out = torch.empty((T, H), dtype=torch.bfloat16)
                        combined, ev, hook = buf.low_latency_combine(
                            y, topk_idx, weights, handle, zero_copy=zero_copy,
                            async_finish=not hook_mode, return_recv_hook=hook_mode, out=out)
                        hook() if hook_mode else ev.current_stream_wait()
                        assert combined is out
                        want = x.float() * valid_w
                        if use_fp8:
                            assert torch.allclose(combined.float(), want, rtol=0.15, atol=0.5)
                        else:
                            want_y = torch.zeros((T, H), dtype=torch.float32)
                            for k in range(K):
                                ok = topk_idx[:, k] >= 0
                                want_y[ok] += weights[ok, k:k + 1] * x.float()[ok]
                            assert torch.equal(combined, want_y.to(torch.bfloat16))
    # Without out: a view of epd's buffer, the same values.
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, MLL, E, use_fp8=False)
    combined, ev, _ = buf.low_latency_combine(recv, topk_idx, weights, handle)
    assert ev.event is None
    assert combined.shape == (T, H)
    buf.clean_low_latency_buffer(MLL, H, E)

    # ---- bad input: a clear error on every rank, then the next op works ----
    expect_error(NotImplementedError, buf.low_latency_combine, recv, topk_idx, weights, handle,
                 use_logfmt=True, match="use_logfmt")
    expect_error(NotImplementedError, buf.low_latency_dispatch, x, topk_idx, MLL, E,
                 dispatch_wait_recv_cost_stats=torch.zeros((num_ranks, num_ranks), dtype=torch.int64))
    expect_error(ValueError, buf.low_latency_dispatch, x, topk_idx, MLL * 2, E,
                 match="num_max_dispatch_tokens_per_rank")
    expect_error(ValueError, buf.low_latency_dispatch, x, topk_idx, MLL, E, use_ue8m0=True,
                 match="round_scale")
    expect_error(ValueError, buf.low_latency_combine, recv, topk_idx, weights, (1, 2, 3, 4, 5))
    expect_error(ValueError, buf.clean_low_latency_buffer, MLL, H, E * 2)
    expect_error(epd.FailedPreconditionError, buf.low_latency_query_mask_buffer,
                 torch.zeros(num_ranks, dtype=torch.int32), match="enable_shrink")
    expect_error(ValueError, buf.low_latency_dispatch, x.float(), topk_idx, MLL, E)
    expect_error(ValueError, buf.low_latency_dispatch, torch.zeros((MLL + 1, H), dtype=torch.bfloat16),
                 torch.full((MLL + 1, K), -1, dtype=torch.int64), MLL, E)
    other = deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True,
                           explicitly_destroy=True)
    _, _, other_handle, _, _ = other.low_latency_dispatch(x, topk_idx, MLL, E, use_fp8=False)
    expect_error(epd.FailedPreconditionError, buf.low_latency_combine, recv, topk_idx, weights,
                 other_handle, match="another Buffer")
    other.destroy()
    small = deep_ep.Buffer(group, num_rdma_bytes=hint // 4, low_latency_mode=True)
    e = expect_error(deep_ep.BufferTooSmallError, small.low_latency_dispatch, x, topk_idx, MLL, E,
                     match="num_rdma_bytes")
    assert hint // 4 < e.bytes_needed <= hint
    del small

    recv, count, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, MLL, E, use_fp8=False)
    _check_dispatch(rank, num_ranks, recv, count, handle, all_idx, False, x_ref)
    combined, _, _ = buf.low_latency_combine(recv, topk_idx, weights, handle)
    assert torch.allclose(combined.float(), x.float() * valid_w, rtol=1e-2)
    buf.destroy()


def test_low_latency_mode(epd_socket):
    run_ranks(_ll_body, R, timeout=120)


def _ll_flow_body(rank, num_ranks, group):
    """The op sequence and checks of DeepEP's tests/legacy/test_low_latency.py, CPU-sized
    (bench_kineto, which needs CUDA, left out)."""
    import deep_ep
    from deep_ep.utils.math import calc_diff, hash_tensor, per_token_cast_back
    from deep_ep.utils.testing import bench
    num_tokens, hidden, num_topk, num_experts = 8, 512, 3, 2 * num_ranks
    buf = deep_ep.Buffer(group, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
        num_tokens, hidden, num_ranks, num_experts), low_latency_mode=True,
        num_qps_per_rank=num_experts // num_ranks, explicitly_destroy=True)
    torch.manual_seed(rank)
    local = num_experts // num_ranks
    offset = 128
    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16) * (rank - offset)
    x[:, -128:] = torch.arange(num_tokens).to(torch.bfloat16).view(-1, 1)
    x_list = [x, torch.randn((num_tokens, hidden), dtype=torch.bfloat16) * 0.1]
    scores = torch.randn((num_tokens, num_experts), dtype=torch.float32).abs() + 1
    topk_idx = scores.topk(num_topk, dim=-1, sorted=True).indices.to(deep_ep.topk_idx_t)
    topk_weights = torch.randn((num_tokens, num_topk), dtype=torch.float32).abs()
    topk_idx[torch.randint(0, num_tokens, (1,)).item(), 0] = -1
    all_topk = torch.empty((num_ranks, num_tokens, num_topk), dtype=topk_idx.dtype)
    dist.all_gather_into_tensor(all_topk, topk_idx, group=group)
    hash_value, num_times = 0, 0
    for cur in x_list:
        for hook_mode in (False, True):
            for use_fp8 in (False, True):
                for round_scale in ((False, True) if use_fp8 else (False,)):
                    for use_ue8m0 in ((False, True) if round_scale else (False,)):
                        num_times += 1
                        for _ in range(num_times % 2 + 1):
                            stats = torch.zeros((local,), dtype=torch.int)
                            recv, count, handle, ev, hook = buf.low_latency_dispatch(
                                cur, topk_idx, num_tokens, num_experts,
                                cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
                                round_scale=round_scale, use_ue8m0=use_ue8m0,
                                async_finish=not hook_mode, return_recv_hook=hook_mode)
                            hook() if hook_mode else ev.current_stream_wait()
                        recv = (recv[0], recv[1].contiguous()) if use_fp8 else recv
                        # DeepEP's own calls (e4m3 as uint8 bits where torch has no float8).
                        gemm = (per_token_cast_back(recv[0].view(-1, hidden), recv[1].view(-1, hidden // 128))
                                .view(recv[0].shape) if use_fp8 else recv.clone())
                        for i in range(local):
                            expert = rank * local + i
                            n = int(count[i])
                            layout = handle[1][i]
                            assert int(stats[i]) == n
                            assert n == int((layout & 0xFFFFFFFF).sum())
                            assert n == int((all_topk == expert).sum())
                            if n == 0 or cur is not x:
                                continue
                            rows = (per_token_cast_back(recv[0][i], recv[1][i]).float() if use_fp8
                                    else recv[i].float())[:n]
                            src = handle[0][i, :n]
                            amin = rows[:, :-128].amin(dim=-1)
                            assert torch.equal(amin, rows[:, :-128].amax(dim=-1))
                            if round_scale:
                                assert calc_diff(rows[:, -1], src.view(-1).float()) < 0.007
                            else:
                                assert int((rows[:, -128:] - (src.view(-1, 1) % num_tokens)).abs().sum()) == 0
                            for j in range(num_ranks):
                                begin, cnt = int(layout[j]) >> 32, int(layout[j]) & 0xFFFFFFFF
                                if not round_scale:
                                    assert int((amin == j - offset).sum()) == int((all_topk[j] == expert).sum())
                                    assert int((rows[begin:begin + cnt, :-128] - j + offset).abs().sum()) == 0
                            hash_value ^= hash_tensor(gemm[i, :n])
                        for zero_copy in (False, True):
                            if zero_copy:
                                buf.get_next_low_latency_combine_buffer(handle)[:, :, :] = gemm
                            out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16)
                            combined, ev, hook = buf.low_latency_combine(
                                gemm, topk_idx, topk_weights, handle, async_finish=not hook_mode,
                                zero_copy=zero_copy, return_recv_hook=hook_mode, out=out)
                            hook() if hook_mode else ev.current_stream_wait()
                            diff = calc_diff(cur * topk_weights.masked_fill(topk_idx == -1, 0)
                                             .sum(dim=1).view(-1, 1), combined)
                            assert torch.isnan(combined).sum().item() == 0
                            if not round_scale:
                                assert diff < (9e-4 if use_fp8 else 1e-5), diff
                            hash_value ^= hash_tensor(combined)

    def step():
        r, _, h, _, _ = buf.low_latency_dispatch(x, topk_idx, num_tokens, num_experts,
                                                 use_fp8=True)
        buf.low_latency_combine(gemm, topk_idx, topk_weights, h)

    avg, low, high = bench(step, num_warmups=2, num_tests=4)
    assert 0 < low <= avg <= high
    buf.destroy()


def test_low_latency_flow(epd_socket):
    run_ranks(_ll_flow_body, R, timeout=120)
