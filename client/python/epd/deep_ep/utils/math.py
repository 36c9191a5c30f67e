"""Numeric helpers of DeepEP's test suite, written for epd: FP8 casts, diffs, hashes.

Every function works on CPU and CUDA tensors. per_token_cast_to_fp8 needs a torch with
torch.float8_e4m3fn (2.1 or later; on an older torch it raises TypeError);
per_token_cast_back also reads e4m3 data as uint8 bits (what epd returns on such a torch).
"""

from typing import Tuple

import torch

__all__ = [
    "align",
    "calc_diff",
    "ceil_div",
    "count_bytes",
    "create_grouped_scores",
    "hash_tensor",
    "hash_tensors",
    "inplace_unique",
    "per_token_cast_back",
    "per_token_cast_to_fp8",
    "safe_div",
]

# Channels per FP8 scale and the largest finite e4m3 value.
_BLOCK = 128
_E4M3_MAX = 448.0
# Floor of a block's amax before the division, as DeepEP and epd's dispatch use.
_AMAX_FLOOR = 1e-4


def ceil_div(x: int, y: int) -> int:
    """ceil(x / y) for positive integers."""
    return -(-x // y)


def align(x: int, y: int) -> int:
    """x rounded up to a multiple of y."""
    return ceil_div(x, y) * y


def safe_div(a, b):
    """a / b, with 0 / 0 = 0 (any other division by zero raises ZeroDivisionError)."""
    if b == 0 and a == 0:
        return 0
    return a / b


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - cosine-like similarity of x + 1 and y + 1 in float64: 0 for equal tensors."""
    a = x.double() + 1
    b = y.double() + 1
    return float(1 - 2 * (a * b).sum() / (a * a + b * b).sum())


def _fp8_dtype() -> torch.dtype:
    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:
        raise TypeError(f"torch {torch.__version__} has no float8_e4m3fn (FP8 needs torch >= 2.1)")
    return dtype


def _padded_float(x: torch.Tensor, padded: int) -> torch.Tensor:
    """x [m, n] as float32 [m, padded], zero columns past n (no copy beyond the cast when
    n == padded)."""
    if x.size(1) == padded:
        return x.float()
    xf = torch.zeros((x.size(0), padded), dtype=torch.float32, device=x.device)
    xf[:, :x.size(1)] = x.float()
    return xf


def per_token_cast_to_fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantises x [m, n] (any float dtype) to e4m3 with one scale per 128 channels.

    Returns (x_fp8 [m, n] float8_e4m3fn, scales [m, ceil(n/128)] float32) with
    scale = max(amax, 1e-4) / 448 and x_fp8 = e4m3(x / scale); channels past n are
    zero-padded for the last block's amax.
    """
    if x.dim() != 2:
        raise ValueError(f"per_token_cast_to_fp8: x must be 2-D, got shape {tuple(x.shape)}")
    m, n = x.shape
    padded = align(n, _BLOCK)
    xf = _padded_float(x, padded)
    blocks = xf.view(m, padded // _BLOCK, _BLOCK)
    amax = blocks.abs().amax(dim=2).clamp(min=_AMAX_FLOOR)
    q = (blocks * (_E4M3_MAX / amax).unsqueeze(2)).to(_fp8_dtype())
    return q.view(m, padded)[:, :n].contiguous(), amax / _E4M3_MAX


def _scales_as_float(scales: torch.Tensor) -> torch.Tensor:
    """f32 scales as they are, or packed UE8M0 int32 scales (4 exponent bytes per int32,
    little-endian, value 2^(e - 127)) unpacked to f32, in element order."""
    if scales.dtype in (torch.int32, torch.uint8):
        # reshape(-1): a contiguous tensor whose last dim has size 1 may keep any stride
        # there, which a dtype view refuses.
        exponents = scales.contiguous().reshape(-1).view(torch.uint8).to(torch.int32)
        return (exponents << 23).view(torch.float32)
    return scales.float()


def _e4m3_bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    """float32 values of float8_e4m3fn data held as uint8 bits (0x7F / 0xFF are NaN)."""
    b = torch.arange(256, dtype=torch.int32, device=bits.device)
    exp, man = (b >> 3) & 0xF, (b & 7).float()
    normal = (1 + man / 8) * torch.pow(2.0, (exp - 7).float())
    value = torch.where(exp == 0, man / 8 * 2.0 ** -6, normal)
    value = torch.where(b >= 128, -value, value)
    value = torch.where((b & 0x7F) == 0x7F, torch.full_like(value, float("nan")), value)
    return value[bits.long()]


def per_token_cast_back(x_fp8: torch.Tensor, x_scales: torch.Tensor) -> torch.Tensor:
    """Dequantises x_fp8 [m, n] with x_scales to bf16 [m, n].

    x_fp8: float8_e4m3fn, uint8 e4m3 bits, or any float dtype (values as they are).
    x_scales holds ceil(n/128) scales per row in row order (any shape and strides with
    that element order): f32, e.g. [m, ceil(n/128)], or packed UE8M0 int32 with 4 exponent
    bytes each (byte i of word j: block 4j + i), e.g. [m, n/512] or DeepEP's
    scales.contiguous().view(-1, n // 128) (four rows of words per row).
    """
    if x_fp8.dim() != 2:
        raise ValueError(f"per_token_cast_back: x_fp8 must be 2-D, got shape {tuple(x_fp8.shape)}")
    m, n = x_fp8.shape
    if x_fp8.numel() == 0:
        return torch.empty((m, n), dtype=torch.bfloat16, device=x_fp8.device)
    padded = align(n, _BLOCK)
    if x_fp8.dtype == torch.uint8:
        x_fp8 = _e4m3_bits_to_float(x_fp8)
    xf = _padded_float(x_fp8, padded)
    scales = _scales_as_float(x_scales).reshape(m, -1, 1)
    out = xf.view(m, padded // _BLOCK, _BLOCK) * scales
    return out.view(m, padded)[:, :n].to(torch.bfloat16).contiguous()


def inplace_unique(x: torch.Tensor, num_slots: int) -> None:
    """Rewrites each row of x [rows, cols] (values in [-1, num_slots)) in place as its
    distinct non-negative values in descending order, then -1s."""
    if x.dim() != 2:
        raise ValueError(f"inplace_unique: x must be 2-D, got shape {tuple(x.shape)}")
    present = torch.zeros((x.size(0), num_slots + 1), dtype=torch.bool, device=x.device)
    present.scatter_(1, x.masked_fill(x < 0, num_slots).long(), True)
    present = present[:, :num_slots]
    slots = torch.arange(num_slots, device=x.device, dtype=x.dtype).expand_as(present)
    ordered = torch.where(present, slots, torch.full_like(slots, -1))
    ordered = ordered.sort(dim=1, descending=True).values
    width = min(num_slots, x.size(1))
    x.fill_(-1)
    x[:, :width] = ordered[:, :width]


def create_grouped_scores(scores: torch.Tensor, group_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """scores [T, E] with the experts outside each token's selected groups zeroed;
    group_idx [T, G'] names the selected groups of E / num_groups experts each."""
    num_tokens, num_experts = scores.shape
    keep = torch.zeros((num_tokens, num_groups), dtype=torch.bool, device=scores.device)
    keep.scatter_(1, group_idx.long(), True)
    grouped = scores.view(num_tokens, num_groups, -1) * keep.unsqueeze(-1)
    return grouped.view(num_tokens, num_experts)


def hash_tensor(t: torch.Tensor) -> int:
    """A cheap content hash: the sum of t's 4-byte words (4-byte dtypes) or bytes."""
    t = t.contiguous().reshape(-1)
    if t.element_size() == 4:
        return int(t.view(torch.int32).long().sum().item())
    return int(t.view(torch.uint8).long().sum().item())


def hash_tensors(*tensors) -> int:
    """XOR of hash_tensor over tensors (nested tuples and lists walked, None skipped)."""
    value = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            value ^= hash_tensors(*t)
        elif isinstance(t, torch.Tensor):
            value ^= hash_tensor(t)
    return value


def count_bytes(*tensors) -> int:
    """Total bytes of the element data of tensors (nested tuples and lists, None skipped)."""
    total = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            total += count_bytes(*t)
        elif t is not None:
            total += t.numel() * t.element_size()
    return total
