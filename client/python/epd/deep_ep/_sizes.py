"""Bytes of one epd endpoint's data area for a group shape: the Python twin of
kernels/include/epd/kernels/layout.h EndpointLayout::Compute (tests/python compares it with
the daemon's EndpointInfo.data_bytes). Used to map DeepEP's byte budgets onto group specs.
"""

_REGION_ALIGNMENT = 256
_SYNC_REGION_BYTES = 64 * 1024
_LAUNCH_FLAGS_BYTES = 4096
_FP8_BLOCK = 128
_LOW_LATENCY_BUFFERS = 2


def _normal_tiles_bytes(R: int, E: int, M: int) -> int:
    """layout.h NormalDispatchTiling::For(M).bytes(R, E): per slot [R] counts, [R] bases, [E]."""
    max_tiles, granule = 64, 256
    slots = min(max_tiles, -(-max(M, 0) // granule))
    return slots * (2 * R + E) * 4


def endpoint_bytes(*, num_ranks: int, num_experts: int, hidden: int, num_topk: int,
                   max_tokens_per_rank: int, ll_max_tokens_per_rank: int, use_fp8: bool) -> int:
    """Total bytes of an endpoint's regions, each rounded up to 256 bytes."""
    R, E, H, K = num_ranks, num_experts, hidden, num_topk
    M, Mll = max_tokens_per_rank, ll_max_tokens_per_rank
    Min = max(M, Mll)
    N = R * M
    El = E // R
    S = -(-H // _FP8_BLOCK)
    fp8 = 1 if use_fp8 else 0
    ll = 1 if Mll > 0 else 0
    regions = [
        Min * H * 2, fp8 * M * S * 4, Min * K * 8, Min * K * 4, N * H * 2, N * K * 4,
        El * R * Mll * H * 2,
        R * 4, E * 4, M * R,
        N * H * 2, fp8 * N * S * 4, N * K * 8, N * K * 4, El * 4, N * 4, M * R * 4, R * 4, 4,
        M * H * 2, M * K * 4,
    ]
    regions += [El * R * Mll * H * 2, fp8 * El * R * Mll * S * 4, ll * El * 4, El * R * Mll * 4,
                Mll * K * 4, Mll * H * 2] * _LOW_LATENCY_BUFFERS
    regions += [Mll * K * 8, _normal_tiles_bytes(R, E, M), _SYNC_REGION_BYTES,
                _LAUNCH_FLAGS_BYTES]
    align = _REGION_ALIGNMENT
    return sum(-(-b // align) * align for b in regions)


def max_tokens_within(budget: int, **shape) -> int:
    """The largest max_tokens_per_rank M >= 1 whose endpoint_bytes(M, **shape) <= budget, or 0."""
    def fits(m):
        return endpoint_bytes(max_tokens_per_rank=m, **shape) <= budget

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > (1 << 30):
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
