"""epd.deep_ep's rank masking on 2 processes (gloo group, host backend): enable_shrink=True
makes the low-latency group a "mask" group; low_latency_update_mask_buffer masks and unmasks
a rank, low_latency_query_mask_buffer fills DeepEP's [num_ranks] int32 status (1 = masked),
low_latency_clean_mask_buffer unmasks every rank; the argument checks; and a Buffer without
enable_shrink refusing the three calls."""

import torch
import torch.distributed as dist

import epd
from deep_ep_harness import epd_socket, expect_error, run_ranks  # noqa: F401 (fixture)

R = 2
H = 128
E = 4
K = 2
MLL = 8


def _status(buf):
    s = torch.full((R,), -1, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(s)
    return s.tolist()


def _mask_body(rank, num_ranks, group):
    import deep_ep
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MLL, H, num_ranks, E)
    plain = deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True,
                           explicitly_destroy=True)
    for call, args in ((plain.low_latency_update_mask_buffer, (1, True)),
                       (plain.low_latency_query_mask_buffer, (torch.zeros(R, dtype=torch.int32),)),
                       (plain.low_latency_clean_mask_buffer, ())):
        expect_error(epd.FailedPreconditionError, call, *args, match="enable_shrink")
    plain.destroy()

    buf = deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True,
                         explicitly_destroy=True, enable_shrink=True)
    assert _status(buf) == [0, 0]  # no low-latency group yet: nothing masked
    expect_error(epd.FailedPreconditionError, buf.low_latency_update_mask_buffer, 1, True,
                 match="first low_latency_dispatch")
    x = torch.ones((4, H), dtype=torch.bfloat16)
    topk_idx = torch.tensor([[0, 2], [1, 3], [2, -1], [3, 0]], dtype=torch.int64)
    buf.low_latency_dispatch(x, topk_idx, MLL, E, use_fp8=False)
    expect_error(ValueError, buf.low_latency_update_mask_buffer, R, True, match="rank_to_mask")
    expect_error(ValueError, buf.low_latency_query_mask_buffer, torch.zeros(R + 1, dtype=torch.int32))
    expect_error(ValueError, buf.low_latency_query_mask_buffer, torch.zeros(R, dtype=torch.int64))

    dist.barrier(group)
    if rank == 0:
        buf.low_latency_update_mask_buffer(1, True)
    dist.barrier(group)
    assert _status(buf) == [0, 1]
    dist.barrier(group)
    if rank == 1:
        buf.low_latency_update_mask_buffer(1, False)
    dist.barrier(group)
    assert _status(buf) == [0, 0]
    dist.barrier(group)
    if rank == 0:
        buf.low_latency_update_mask_buffer(1, True)
    dist.barrier(group)
    if rank == 1:
        buf.low_latency_clean_mask_buffer()
    dist.barrier(group)
    assert _status(buf) == [0, 0]
    dist.barrier(group)  # a rank that leaves first is masked: query before either leaves
    buf.destroy()


def test_mask_buffer(epd_socket):
    run_ranks(_mask_body, R, timeout=90)
