"""epd.deep_ep normal mode against torch references, on R processes and a gloo group:
get_dispatch_layout (before and after the epd group exists), dispatch with and without
top-k, cached dispatch, num_worst_tokens, expert_alignment, combine (weights, bias) with a
fresh and a stale handle, rank_prefix_matrix, FP8 dispatch where torch has float8; bad
input (dtype, shape, foreign handle, unsupported options, too small a budget) raising a
clear error with the next op still working; and the op sequence of DeepEP's
test_intranode.py (its logic rewritten here, CPU-sized).
"""

import torch
import torch.distributed as dist

import epd
from deep_ep_harness import DEVICE, epd_socket, expect_error, run_ranks  # noqa: F401 (fixture)

R = 4
H = 256
E = 16
K = 3


def _inputs(rank, num_experts=E, num_topk=K, hidden=H):
    """Rank `rank`'s tokens, the same on every process (seeded by rank)."""
    g = torch.Generator(device="cpu").manual_seed(1000 + rank)
    t = 20 + 3 * rank
    x = torch.randn((t, hidden), generator=g, dtype=torch.float32, device="cpu").to(torch.bfloat16)
    scores = torch.rand((t, num_experts), generator=g, dtype=torch.float32, device="cpu")
    topk_idx = scores.topk(num_topk, dim=1).indices.to(torch.int64)
    topk_idx[0, :] = -1  # a token sent nowhere
    topk_idx[1, 1] = -1
    topk_weights = torch.rand((t, num_topk), generator=g, dtype=torch.float32, device="cpu")
    return x.to(DEVICE), topk_idx.to(DEVICE), topk_weights.to(DEVICE)


def _fp8_inputs(rank, num_tokens):
    """e4m3 bits (uint8, NaN codes left out) and f32 scales of rank `rank`: dispatch moves
    FP8 data as bytes, so torch needs no float8 dtype for these."""
    g = torch.Generator(device="cpu").manual_seed(2000 + rank)
    bits = torch.randint(0, 0x7E, (num_tokens, H), generator=g, dtype=torch.uint8, device="cpu")
    scales = torch.rand((num_tokens, H // 128), generator=g, dtype=torch.float32, device="cpu")
    return bits.to(DEVICE), scales.to(DEVICE)


def _ref_layout(topk_idx, num_experts, num_ranks):
    t = topk_idx.size(0)
    per_expert = torch.zeros(num_experts, dtype=torch.int32)
    in_rank = torch.zeros((t, num_ranks), dtype=torch.bool)
    for i in range(t):
        for e in set(topk_idx[i].tolist()) - {-1}:
            per_expert[e] += 1
            in_rank[i, e // (num_experts // num_ranks)] = True
    return in_rank.sum(0, dtype=torch.int32), per_expert, in_rank


def _ref_recv(rank, num_ranks, num_experts=E):
    """Rows rank receives: (source rank, token) in order, with x, local top-k ids, weights."""
    local = num_experts // num_ranks
    rows = []
    for s in range(num_ranks):
        x, idx, w = _inputs(s, num_experts)
        for t in range(x.size(0)):
            ids = idx[t].tolist()
            if any(e >= 0 and e // local == rank for e in ids):
                lid = [e - rank * local if e >= 0 and e // local == rank else -1 for e in ids]
                lw = [w[t, k].item() if lid[k] >= 0 else 0.0 for k in range(len(ids))]
                rows.append((s, t, x[t], lid, lw))
    return rows


def _normal_body(rank, num_ranks, group):
    import deep_ep
    buf = deep_ep.Buffer(group, num_nvl_bytes=64 << 20, explicitly_destroy=True)
    x, topk_idx, topk_weights = _inputs(rank)
    ref_rank, ref_expert, ref_in_rank = _ref_layout(topk_idx, E, num_ranks)

    # Layout before any epd group (computed by torch) and the references.
    n_rank, n_rdma, n_expert, in_rank, ev = buf.get_dispatch_layout(topk_idx, E)
    assert n_rdma is None and ev.event is None
    assert torch.equal(n_rank, ref_rank) and torch.equal(n_expert, ref_expert)
    assert in_rank.dtype == torch.bool and torch.equal(in_rank, ref_in_rank)

    # Dispatch with top-k.
    ref = _ref_recv(rank, num_ranks)
    recv_x, recv_idx, recv_w, per_expert, handle, ev = buf.dispatch(
        x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=n_expert, topk_idx=topk_idx, topk_weights=topk_weights)
    assert recv_x.shape == (len(ref), H)
    assert torch.equal(recv_x, torch.stack([r[2] for r in ref]))
    assert recv_idx.tolist() == [r[3] for r in ref]
    assert torch.allclose(recv_w, torch.tensor([r[4] for r in ref], dtype=torch.float32))
    local = E // num_ranks
    want = [sum(1 for r in ref if i in r[3]) for i in range(local)]
    assert per_expert == want, (per_expert, want)
    prefix = handle[0]
    assert prefix.shape == (num_ranks, num_ranks) and prefix.dtype == torch.int32
    counts = [sum(1 for r in ref if r[0] == s) for s in range(num_ranks)]
    assert prefix[:, rank].tolist() == torch.tensor(counts).cumsum(0).tolist()
    assert handle[3].tolist() == [r[1] for r in ref]
    assert torch.equal(handle[4], in_rank)
    recv_x_first = recv_x

    # Owned outputs: a later dispatch does not change them.
    snapshot = recv_x.clone()

    # Layout again, now by epd, same answers.
    n_rank2, _, n_expert2, in_rank2, ev = buf.get_dispatch_layout(topk_idx, E, async_finish=True)
    ev.current_stream_wait()
    assert torch.equal(n_rank2, ref_rank) and torch.equal(n_expert2, ref_expert)
    assert torch.equal(in_rank2, ref_in_rank)

    # num_worst_tokens: padded rows, empty list; then combine with the first (stale) handle.
    worst = sum(20 + 3 * s for s in range(num_ranks))
    wx, widx, ww, empty, _, _ = buf.dispatch(
        x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
        topk_idx=topk_idx, topk_weights=topk_weights, num_worst_tokens=worst)
    n = len(ref)
    assert empty == [] and wx.shape == (worst, H) and widx.shape == (worst, K)
    assert torch.equal(wx[:n], recv_x) and torch.equal(widx[:n], recv_idx)
    assert torch.equal(ww[:n], recv_w)
    assert bool((widx[n:] == -1).all()) and bool((ww[n:] == 0).all())
    assert torch.equal(recv_x_first, snapshot)

    # Combine (stale handle: re-dispatched once), with weights and a bias pair.
    y = recv_x.float() * 2
    b0 = torch.full((x.size(0), H), 0.5).to(torch.bfloat16)
    b1 = torch.full((x.size(0), H), 0.25).to(torch.bfloat16)
    comb, comb_w, ev = buf.combine(y.to(torch.bfloat16), handle, topk_weights=recv_w,
                                   bias=(b0, b1), async_finish=True)
    ev.current_stream_wait()
    fanout = in_rank.sum(1, keepdim=True).float()
    want_x = (x.float() * 2 * fanout).to(torch.bfloat16).float() + 0.75
    assert torch.equal(comb, want_x.to(torch.bfloat16))
    masked = topk_weights.masked_fill(topk_idx < 0, 0)
    assert torch.allclose(comb_w, masked), (comb_w, masked)

    # Without top-k (routing from is_token_in_rank): same rows, DeepEP's expert counts.
    rx, ridx, rw, per_expert2, handle2, _ = buf.dispatch(
        x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
        expert_alignment=4)
    assert ridx is None and rw is None
    assert torch.equal(rx, recv_x)
    total = n_expert.clone().long()
    dist.all_reduce(total, group=group)
    mine = total.view(num_ranks, -1)[rank]
    assert per_expert2 == ((mine + 3) // 4 * 4).tolist()

    # Cached dispatch with the top-k-less handle, then combine without weights.
    cx, cidx, cw, clist, chandle, _ = buf.dispatch(x * 3, handle=handle2)
    assert (cidx, cw, clist, chandle) == (None, None, None, None)
    assert torch.equal(cx, torch.stack([_inputs(r[0])[0][r[1]] * 3 for r in ref]))
    comb2, comb_w2, _ = buf.combine(cx, handle2)
    assert comb_w2 is None
    want2 = ((x * 3).float() * fanout).to(torch.bfloat16)
    assert torch.equal(comb2, want2)

    # The first handle still serves (restored again: a dispatch came in between).
    comb3, _, _ = buf.combine(recv_x, handle)
    assert torch.equal(comb3, (x.float() * fanout).to(torch.bfloat16))

    # FP8 (as e4m3 bits; column-major scales as DeepEP's tests pass them), then cached
    # re-dispatches in the other dtype with the FP8 handle and with a stale BF16 handle.
    bits, scales = _fp8_inputs(rank, x.size(0))
    (rb, rs), _, _, _, h8, _ = buf.dispatch(
        (bits, scales.T.contiguous().T), num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=n_expert, topk_idx=topk_idx, topk_weights=topk_weights)
    want_bits = torch.stack([_fp8_inputs(r[0], 20 + 3 * r[0])[0][r[1]] for r in ref])
    want_scales = torch.stack([_fp8_inputs(r[0], 20 + 3 * r[0])[1][r[1]] for r in ref])
    assert torch.equal(rb.view(torch.uint8), want_bits) and torch.equal(rs, want_scales)
    bx, _, _, _, _, _ = buf.dispatch(x, handle=h8)
    assert torch.equal(bx, recv_x)
    (cb, cs), _, _, _, _, _ = buf.dispatch((bits, scales), handle=handle2)
    assert torch.equal(cb.view(torch.uint8), want_bits) and torch.equal(cs, want_scales)

    # ---- bad input: a clear error on every rank, then the next op works ----
    expect_error(ValueError, buf.dispatch, x.float(), num_tokens_per_rank=n_rank,
                 is_token_in_rank=in_rank, num_tokens_per_expert=n_expert, topk_idx=topk_idx)
    expect_error(ValueError, buf.dispatch, x, num_tokens_per_rank=n_rank,
                 is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
                 topk_idx=topk_idx.int(), match="int64")
    expect_error(ValueError, buf.dispatch, x[:, :H // 2].contiguous(), num_tokens_per_rank=n_rank,
                 is_token_in_rank=in_rank[:, :].contiguous(), num_tokens_per_expert=n_expert,
                 topk_idx=topk_idx, match="hidden")
    expect_error(ValueError, buf.dispatch, x, handle=handle, topk_idx=topk_idx)
    expect_error(ValueError, buf.dispatch, x, num_tokens_per_rank=n_rank)
    expect_error(ValueError, buf.combine, recv_x, handle, bias=b0[:1])
    expect_error(ValueError, buf.combine, recv_x, "not a handle")
    expect_error(NotImplementedError, buf.dispatch, x, num_tokens_per_rank=n_rank,
                 num_tokens_per_rdma_rank=n_rank, is_token_in_rank=in_rank,
                 num_tokens_per_expert=n_expert, match="num_tokens_per_rdma_rank")
    expect_error(NotImplementedError, buf.get_local_buffer_tensor, torch.bfloat16)
    expect_error(ValueError, buf.low_latency_dispatch, x, topk_idx, 32, E,
                 match="low_latency_mode")
    expect_error(ValueError, buf.get_dispatch_layout, topk_idx, E + 1)
    other = deep_ep.Buffer(group, num_nvl_bytes=64 << 20)
    _, _, _, _, other_handle, _ = other.dispatch(
        x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
        topk_idx=topk_idx)
    e = expect_error(epd.FailedPreconditionError, buf.combine, recv_x, other_handle,
                     match="another Buffer")
    assert e.code_name == "FAILED_PRECONDITION"
    expect_error(epd.FailedPreconditionError, other.destroy, match="explicitly_destroy")
    del other
    # A dispatch of more tokens than the budget's M: the bytes it needs.
    big = deep_ep.Buffer(group, num_nvl_bytes=1 << 20, explicitly_destroy=True)
    too_many = torch.zeros((4096, H), dtype=torch.bfloat16)
    e = expect_error(deep_ep.BufferTooSmallError, big.dispatch, too_many,
                     num_tokens_per_rank=n_rank, num_tokens_per_expert=n_expert,
                     is_token_in_rank=torch.zeros((4096, num_ranks), dtype=torch.bool),
                     topk_idx=torch.full((4096, K), -1, dtype=torch.int64), match="num_nvl_bytes")
    assert e.bytes_needed > (1 << 20)
    big.destroy()

    # The group goes on after every error above.
    rx3, _, _, _, handle3, _ = buf.dispatch(
        x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
        topk_idx=topk_idx, topk_weights=topk_weights)
    assert torch.equal(rx3, recv_x)
    comb4, _, _ = buf.combine(rx3, handle3)
    assert torch.equal(comb4, (x.float() * fanout).to(torch.bfloat16))

    buf.destroy()
    expect_error(epd.FailedPreconditionError, buf.get_dispatch_layout, topk_idx, E,
                 match="destroyed")


def test_normal_mode(epd_socket):
    run_ranks(_normal_body, R, timeout=120)


def _options_body(rank, num_ranks, group):
    import deep_ep
    for kwargs, option in ((dict(allow_mnnvl=True), "allow_mnnvl"),
                           (dict(allow_nvlink_for_low_latency_mode=False), "allow_nvlink")):
        e = expect_error(NotImplementedError, deep_ep.Buffer, group, 1 << 20, **kwargs)
        assert isinstance(e, epd.UnimplementedError) and option in str(e)
    expect_error(ValueError, deep_ep.Buffer, group, -1)
    expect_error(ValueError, deep_ep.Buffer.set_num_sms, 23)
    deep_ep.Buffer.set_num_sms(24)
    assert deep_ep.Buffer.get_dispatch_config(num_ranks).num_sms == 24
    assert deep_ep.Buffer.get_combine_config(num_ranks).num_sms == 24
    cfg = deep_ep.Config(24, 8, 256)
    assert cfg.get_nvl_buffer_size_hint(H * 2, num_ranks) > 0
    assert cfg.get_rdma_buffer_size_hint(H * 2, num_ranks) == 0
    assert not deep_ep.Buffer.is_sm90_compiled() or torch.cuda.is_available()
    assert deep_ep.topk_idx_t is torch.int64
    with deep_ep.Buffer.capture() as ev:
        pass
    ev.current_stream_wait()


def test_options_and_statics(epd_socket):
    run_ranks(_options_body, 2)


def _intranode_flow_body(rank, num_ranks, group):
    """The op sequence and checks of DeepEP's tests/legacy/test_intranode.py (BF16 part;
    FP8 where torch has float8), written for CPU sizes."""
    import deep_ep
    from deep_ep.utils.math import calc_diff, inplace_unique, per_token_cast_back, per_token_cast_to_fp8
    from deep_ep.utils.testing import bench
    num_tokens, hidden, num_topk, num_experts = 64, 256, 4, 4 * num_ranks
    torch.manual_seed(rank)
    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16) * rank
    x_rand = torch.randn((num_tokens, hidden), dtype=torch.bfloat16)
    fp8 = deep_ep.Buffer.is_sm90_compiled() and hasattr(torch, "float8_e4m3fn")
    x_e4m3 = per_token_cast_to_fp8(x) if fp8 else None
    x_e4m3 = (x_e4m3[0], x_e4m3[1].T.contiguous().T) if fp8 else None
    scores = torch.randn((num_tokens, num_experts), dtype=torch.float32).abs() + 1
    topk_idx = scores.topk(num_topk, dim=-1, sorted=False).indices.to(deep_ep.topk_idx_t)
    weights = torch.ones((num_tokens, num_topk), dtype=torch.float32) * rank
    weights_rand = torch.randn((num_tokens, num_topk), dtype=torch.float32)
    rank_idx = topk_idx // (num_experts // num_ranks)
    rank_idx.masked_fill_(topk_idx == -1, -1)
    inplace_unique(rank_idx, num_ranks)
    per_expert = torch.stack([(topk_idx == i).sum() for i in range(num_experts)]).int()
    gbl_per_expert = per_expert.clone()
    dist.all_reduce(gbl_per_expert, group=group)
    per_rank = torch.stack([(rank_idx == i).sum() for i in range(num_ranks)]).int()
    in_rank = torch.stack([(rank_idx == i).any(dim=1) for i in range(num_ranks)], dim=1)
    gbl_per_rank = per_rank.clone()
    dist.all_reduce(gbl_per_rank, group=group)

    buf = deep_ep.Buffer(group, int(64e6), 0, explicitly_destroy=True)
    l_rank, _, l_expert, l_in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
    assert torch.equal(l_rank, per_rank) and torch.equal(l_expert, per_expert)
    assert torch.equal(l_in_rank, in_rank)
    bench(lambda: buf.get_dispatch_layout(topk_idx, num_experts), num_warmups=2, num_tests=3)
    group.barrier()
    config = deep_ep.Config(24, 8, 256)

    def check_rows(rows, prefix):
        assert torch.equal(rows.amin(dim=1), rows.amax(dim=1))
        begin = 0
        for i in range(num_ranks):
            end = prefix[i][rank].item()
            assert int((rows[begin:end].int() - i).abs().sum()) == 0
            begin = end

    for previous in (False, True):
        for async_mode in (False, True):
            for cur in [c for c in (x_rand, x, x_e4m3) if c is not None]:
                for with_topk in (False, True):
                    args = dict(x=cur, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, config=config,
                                async_finish=async_mode)
                    if with_topk:
                        args.update(topk_idx=topk_idx,
                                    topk_weights=weights_rand if cur is x_rand else weights)
                    if previous:
                        args.update(previous_event=buf.capture())
                    rx, ridx, rw, counts, handle, ev = buf.dispatch(**args)
                    if async_mode:
                        ev.current_stream_wait()
                    rx = per_token_cast_back(*rx) if isinstance(rx, tuple) else rx
                    prefix = handle[0]
                    assert gbl_per_rank[rank].item() == rx.size(0)
                    assert gbl_per_expert.view(num_ranks, -1)[rank].tolist() == counts
                    if cur is not x_rand:
                        check_rows(rx, prefix)
                    rw_clone = None
                    if with_topk:
                        local = num_experts // num_ranks
                        assert bool(((ridx == -1) | ((ridx >= 0) & (ridx < local))).all())
                        for i, c in enumerate(counts):
                            assert int((ridx == i).sum()) == c
                        rw_clone = rw.clone()
                        if cur is not x_rand:
                            rw[ridx == -1] = rw.amax(dim=1, keepdim=True).expand_as(rw)[ridx == -1]
                            check_rows(rw, prefix)
                        worst = num_tokens * num_ranks
                        args.update(num_worst_tokens=worst)
                        wx, widx, ww, empty, _, ev = buf.dispatch(**args)
                        if async_mode:
                            ev.current_stream_wait()
                        wx = per_token_cast_back(*wx) if isinstance(wx, tuple) else wx
                        assert empty == [] and wx.size(0) == widx.size(0) == ww.size(0) == worst
                        assert torch.equal(rx, wx[:rx.size(0)])
                        assert torch.equal(ridx, widx[:rx.size(0)])
                        assert torch.equal(rw_clone, ww[:rx.size(0)])
                        assert bool((widx[rx.size(0):] == -1).all())
                    else:
                        cargs = dict(x=cur, handle=handle, config=config, async_finish=async_mode)
                        if previous:
                            cargs.update(previous_event=buf.capture())
                        rx, _, _, _, _, ev = buf.dispatch(**cargs)
                        if async_mode:
                            ev.current_stream_wait()
                        rx = per_token_cast_back(*rx) if isinstance(rx, tuple) else rx
                        if cur is not x_rand:
                            check_rows(rx, prefix)
                    cargs = dict(x=rx, handle=handle, config=config, async_finish=async_mode)
                    if with_topk:
                        cargs.update(topk_weights=rw)
                    if previous:
                        cargs.update(previous_event=buf.capture())
                    cx, cw, ev = buf.combine(**cargs)
                    if async_mode:
                        ev.current_stream_wait()
                    fan = in_rank.sum(dim=1).unsqueeze(1)
                    ref = x_rand if cur is x_rand else x
                    assert calc_diff(cx.float() / fan, ref) < 5e-6
                    if with_topk:
                        got = cw if cur is x_rand else cw / fan
                        want = weights_rand if cur is x_rand else weights
                        assert calc_diff(got, want) < 1e-9
    # The tuning part's calls: cached dispatches and combines with default configs.
    deep_ep.Buffer.set_num_sms(24)
    for cfg in (deep_ep.Config(24, 4, 256), deep_ep.Buffer.get_dispatch_config(num_ranks)):
        bench(lambda: buf.dispatch(x=x, handle=handle, config=cfg), num_warmups=1, num_tests=2)
    rx, _, _, _, handle, _ = buf.dispatch(x=x, num_tokens_per_rank=per_rank,
                                          is_token_in_rank=in_rank,
                                          num_tokens_per_expert=per_expert, config=config)
    for cfg in (deep_ep.Config(24, 1, 256), deep_ep.Buffer.get_combine_config(num_ranks)):
        bench(lambda: buf.combine(x=rx, handle=handle, config=cfg), num_warmups=1, num_tests=2)
    buf.destroy()


def test_intranode_flow(epd_socket):
    run_ranks(_intranode_flow_body, R, timeout=120)
