#!/usr/bin/env python3
"""moe_layer.py: a toy Mixture-of-Experts layer in PyTorch through DeepEP's API on epd, the
Python twin of moe_layer.cc: router (x @ G -> top-k, softmax weights) -> dispatch ->
per-expert FFN (y = W_e x) -> combine, in normal and in low-latency mode, one process per
rank (torch.multiprocessing, a gloo group), each rank checking its combined output against
a dense single-process torch computation of the same layer. Prints a table and exits 0 only
when every rank matched.

    python3 client/examples/moe_layer.py --socket /run/epd/epd.sock --num-ranks 8

Needs the epd package and the deep_ep drop-in (README "Python quick start"); without the
drop-in it uses epd.deep_ep, the same module. The ranks join with the join secret in
EPD_JOIN_SECRET when set. CPU tensors on epd's host backend, CUDA tensors on its CUDA
backend (rank r on GPU r % device_count).
"""

import argparse
import os
import sys
import tempfile
import time
import traceback
import warnings

# torch 1.13 warns about a deprecated alias when torch.distributed is imported.
warnings.filterwarnings("ignore", message="torch.distributed.reduce_op is deprecated")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

try:
    import deep_ep  # the drop-in (client/python/deep_ep_dropin)
except ImportError:
    from epd import deep_ep


def make_model(a, device):
    """Gate [H, E] and experts [E, H, H] (y = W_e x), the same in every process."""
    g = torch.Generator().manual_seed(1234)
    gate = torch.randn((a.hidden, a.num_experts), generator=g)
    experts = torch.randn((a.num_experts, a.hidden, a.hidden), generator=g) / a.hidden ** 0.5
    return gate.to(device), experts.to(device)


def tokens(a, rank, it, device):
    g = torch.Generator().manual_seed(1000003 * (it + 1) + rank)
    return torch.randn((a.tokens, a.hidden), generator=g).to(torch.bfloat16).to(device)


def route(x, gate, k):
    """Top-k experts by x @ G and their softmax weights: ([T, K] int64, [T, K] f32)."""
    scores = x.float() @ gate
    top, idx = scores.topk(k, dim=1)
    return idx, torch.softmax(top, dim=1)


def dense_reference(x, idx, w, experts):
    """The layer in one process, f64: out[t] = sum_k w[t,k] * W_{idx[t,k]} x[t]."""
    xd = x.double()
    out = torch.zeros_like(xd)
    for k in range(idx.shape[1]):
        y = torch.einsum("toh,th->to", experts[idx[:, k]].double(), xd)
        out += w[:, k:k + 1].double() * y
    return out


def fp8_to_float(t):
    """float8_e4m3fn (or its uint8 bits, on a torch without float8) to float32."""
    if t.dtype != torch.uint8:
        return t.float()
    b = t.to(torch.int32)
    exp, mant = (b >> 3) & 0xF, (b & 0x7).float()
    mag = torch.where(exp == 0, mant * 2.0 ** -9, (8 + mant) * torch.pow(2.0, (exp - 10).float()))
    mag = torch.where((exp == 0xF) & (b & 0x7 == 0x7), torch.full_like(mag, float("nan")), mag)
    return torch.where(b & 0x80 != 0, -mag, mag)


def rel_error(ref, got):
    return ((ref - got.double()).abs().max() / max(ref.abs().max().item(), 1e-3)).item()


def run_rank(rank, a, init_file, results):
    try:
        results.put((rank, True, layer(rank, a, init_file)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def layer(rank, a, init_file):
    os.environ["EPD_SOCKET"] = a.socket
    os.environ["EPD_LAUNCH_MODE"] = a.launch_mode
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=a.num_ranks)
    group = dist.new_group(list(range(a.num_ranks)))
    R, E, H, K, T = a.num_ranks, a.num_experts, a.hidden, a.topk, a.tokens
    local = E // R
    device = "cpu"
    if torch.cuda.is_available() and os.environ.get("EPD_EXAMPLE_DEVICE", "auto") != "cpu":
        import epd

        if epd.Client.connect(a.socket).stats_summary()["backend"] == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device = "cuda"
    gate, experts = make_model(a, device)

    # ---- the DeepEP part: a Buffer with room for both modes ----
    num_nvl_bytes = deep_ep.Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(H * 2, R)
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
    buffer = deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=True)

    worst_normal = worst_ll = 0.0
    start = time.monotonic()
    for it in range(a.iters):
        x = tokens(a, rank, it, device)
        idx, w = route(x, gate, K)
        ref = dense_reference(x, idx, w, experts)

        # Normal mode: each rank's experts weight their outputs; combine sums the rows.
        n_rank, _, n_expert, in_rank, _ = buffer.get_dispatch_layout(idx, E)
        recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
            x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=n_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=n_expert)
        y = torch.zeros(recv_x.shape, dtype=torch.float32, device=device)
        for k in range(K):
            sel = recv_idx[:, k] >= 0
            e = recv_idx[sel, k] + rank * local
            y[sel] += recv_w[sel, k:k + 1] * torch.einsum("noh,nh->no", experts[e], recv_x[sel].float())
        combined, _, _ = buffer.combine(y.to(torch.bfloat16), handle)
        worst_normal = max(worst_normal, rel_error(ref, combined))

        # Low-latency mode: per-local-expert blocks [E/R, R*T, H]; combine weights them.
        recv, count, handle, _, _ = buffer.low_latency_dispatch(x, idx, T, E, use_fp8=a.fp8)
        if a.fp8:
            data, scales = recv
            xs = fp8_to_float(data) * scales.repeat_interleave(128, dim=-1)
        else:
            xs = recv.float()
        out = torch.zeros(xs.shape, dtype=torch.bfloat16, device=device)
        for j in range(local):
            n = int(count[j])
            out[j, :n] = (xs[j, :n] @ experts[rank * local + j].t()).to(torch.bfloat16)
        combined, _, _ = buffer.low_latency_combine(out, idx, w, handle)
        worst_ll = max(worst_ll, rel_error(ref, combined))
    ms = (time.monotonic() - start) * 1e3
    dist.barrier(group)
    del buffer
    dist.destroy_process_group()
    return worst_normal, worst_ll, ms


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", default=os.environ.get("EPD_SOCKET") or "/run/epd/epd.sock",
                   help="epd's unix socket (default: $EPD_SOCKET, else /run/epd/epd.sock)")
    p.add_argument("--num-ranks", type=int, default=8, help="ranks (one process each)")
    p.add_argument("--num-experts", type=int, default=32, help="experts (a multiple of --num-ranks)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (a multiple of 128 with FP8)")
    p.add_argument("--topk", type=int, default=4, help="experts per token")
    p.add_argument("--tokens", type=int, default=48, help="tokens per rank per iteration")
    p.add_argument("--iters", type=int, default=3, help="iterations")
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True,
                   help="low-latency dispatch in FP8 (normal mode stays BF16)")
    p.add_argument("--launch-mode", choices=("auto", "daemon", "client"), default="auto",
                   help="who launches the kernels on the CUDA backend")
    p.add_argument("--tolerance", type=float, default=0.0,
                   help="max relative error (0 = the defaults: 2e-2 BF16, 8e-2 with FP8)")
    a = p.parse_args()
    if a.num_ranks < 1 or a.num_experts % a.num_ranks != 0:
        p.error("--num-experts %d must be a multiple of --num-ranks %d" % (a.num_experts, a.num_ranks))
    if a.topk > a.num_experts or (a.fp8 and a.hidden % 128 != 0):
        p.error("--topk must be <= --num-experts, and --hidden a multiple of 128 with --fp8")
    tol_normal = a.tolerance or 2e-2
    tol_ll = a.tolerance or (8e-2 if a.fp8 else 2e-2)

    print("moe_layer.py: %d ranks, E=%d H=%d K=%d T=%d, %d iterations, LL FP8 %s, %s-launched, "
          "through %s via %s" % (a.num_ranks, a.num_experts, a.hidden, a.topk, a.tokens, a.iters,
                                 "on" if a.fp8 else "off", a.launch_mode, deep_ep.__name__, a.socket))
    print("rank  normal rel.err  low-lat rel.err  time (ms)  result")
    sys.stdout.flush()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="moe_layer_py_") as tmp:
        init_file = os.path.join(tmp, "gloo_init")
        procs = [ctx.Process(target=run_rank, args=(r, a, init_file, results), daemon=True)
                 for r in range(a.num_ranks)]
        for pr in procs:
            pr.start()
        failures = 0
        for _ in range(a.num_ranks):
            try:
                rank, ok, payload = results.get(timeout=300)
            except Exception:
                print("moe_layer.py: a rank did not answer within 300 s")
                failures = a.num_ranks
                break
            if not ok:
                print("%4d  FAILED:\n%s" % (rank, payload))
                failures += 1
                continue
            normal, ll, ms = payload
            good = normal <= tol_normal and ll <= tol_ll
            failures += 0 if good else 1
            print("%4d  %14.2e  %15.2e  %9.1f  %s" % (rank, normal, ll, ms, "ok" if good else "MISMATCH"))
            sys.stdout.flush()
        for pr in procs:
            pr.join(timeout=30)
            if pr.is_alive():
                pr.kill()
    print("moe_layer.py: %s (%d of %d ranks failed)"
          % ("FAILED" if failures else "all ranks match the dense torch layer", failures, a.num_ranks))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
