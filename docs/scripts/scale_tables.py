#!/usr/bin/python3
"""Sizing on paper for docs/SCALE.md: connections, queue pairs, registered memory and buffer
bytes per node at EP 16, 64, 256 and 2048 for DeepSeek-V3 shapes, for epd (one daemon per node)
and for per-process communicators (DeepEP V1, DeepEP V2, NCCL all-to-all).

  /usr/bin/python3 docs/scripts/scale_tables.py           # prints the tables (Markdown)
  /usr/bin/python3 docs/scripts/scale_tables.py --write   # puts them into docs/SCALE.md
  /usr/bin/python3 docs/scripts/scale_tables.py --check   # checks the epd layout formula against
                                                          # layout.h (compiled) and _sizes.py, and
                                                          # that docs/SCALE.md holds these tables

Standard library only. Every formula is written once below and quoted in docs/SCALE.md.
"""

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ---- the workload: DeepSeek-V3 shapes, 8 GPUs per node ---------------------------------------
H = 7168          # hidden
K = 8             # top-k
M = 4096          # normal-mode tokens per rank (max_tokens_per_rank)
MLL = 128         # low-latency tokens per rank (ll_max_tokens_per_rank)
L = 8             # GPUs (ranks) per node, one NIC per GPU (rail-optimised)
S = -(-H // 128)  # FP8 scale columns per token (128-channel blocks) = 56
C_TCP = 2         # tcp_connections_per_peer default (proto/epd/v1/config.proto field 52)
C_RDMA = 2        # assumed RDMA connections (queue pairs) per peer per rail, same default
EP_SIZES = (16, 64, 256, 2048)


def experts_for(ep):
    """256 routed experts; EP2048 cannot hold 256 experts (E % R == 0), so there we assume 2048
    physical expert slots: the 256 experts each replicated 8 times (redundant experts), one per
    GPU, as DeepEP V2 sizes for (its workspace caps experts at 2048)."""
    return 256 if ep <= 256 else ep


def align(x, a):
    return -(-x // a) * a


GiB = float(1 << 30)
MiB = float(1 << 20)


# ---- epd: EndpointLayout::Compute (kernels/include/epd/kernels/layout.h), per rank -----------
REGION_ALIGNMENT = 256
SYNC_REGION_BYTES = 64 * 1024
LAUNCH_FLAGS_BYTES = 4096  # sizeof(abi::LaunchFlags), static_assert in proto/abi/launch_flags.h
LOW_LATENCY_BUFFERS = 2


def normal_tiles_bytes(R, E, M_):
    """layout.h NormalDispatchTiling::For(M).bytes(R, E): per slot [R] counts, [R] bases, [E]."""
    max_tiles, granule = 64, 256
    slots = min(max_tiles, -(-max(M_, 0) // granule))
    return slots * (2 * R + E) * 4


def epd_endpoint_regions(R, E, H_, K_, M_, Mll, fp8):
    """(name, bytes) of every region, in layout.h's declaration order."""
    Min = max(M_, Mll)
    N = R * M_
    El = E // R
    S_ = -(-H_ // 128)
    f = 1 if fp8 else 0
    ll = 1 if Mll > 0 else 0
    regs = [
        ("in_x", Min * H_ * 2), ("in_scales", f * M_ * S_ * 4), ("in_topk_idx", Min * K_ * 8),
        ("in_topk_weights", Min * K_ * 4), ("in_combine_x", N * H_ * 2),
        ("in_combine_weights", N * K_ * 4), ("in_ll_combine_x", El * R * Mll * H_ * 2),
        ("layout_tokens_per_rank", R * 4), ("layout_tokens_per_expert", E * 4),
        ("layout_is_token_in_rank", M_ * R),
        ("recv_x", N * H_ * 2), ("recv_scales", f * N * S_ * 4), ("recv_topk_idx", N * K_ * 8),
        ("recv_topk_weights", N * K_ * 4), ("recv_tokens_per_expert", El * 4),
        ("recv_src_info", N * 4), ("send_pos", M_ * R * 4), ("rank_prefix", R * 4),
        ("recv_count", 4), ("combined_x", M_ * H_ * 2), ("combined_topk_weights", M_ * K_ * 4),
    ]
    for b in range(LOW_LATENCY_BUFFERS):
        regs += [
            (f"ll_recv_x_{b}", El * R * Mll * H_ * 2),
            (f"ll_recv_scales_{b}", f * El * R * Mll * S_ * 4),
            (f"ll_recv_count_{b}", ll * El * 4), (f"ll_recv_src_info_{b}", El * R * Mll * 4),
            (f"ll_handle_pos_{b}", Mll * K_ * 4), (f"ll_combined_x_{b}", Mll * H_ * 2),
        ]
    regs += [("ll_routing", Mll * K_ * 8), ("normal_tiles", normal_tiles_bytes(R, E, M_)),
             ("sync", SYNC_REGION_BYTES),
             ("launch_flags", LAUNCH_FLAGS_BYTES)]
    return regs


def epd_endpoint_bytes(R, E, H_, K_, M_, Mll, fp8):
    """EndpointLayout::total_bytes: every region rounded up to 256 bytes."""
    regions = epd_endpoint_regions(R, E, H_, K_, M_, Mll, fp8)
    return sum(align(b, REGION_ALIGNMENT) for _, b in regions)


# ---- epd: the cross-node exchange (assumed layout, docs/SCALE.md "Assumptions") ---------------
COUNTS_HEADER = 4096  # per slot: the counts written before the rows, rounded to a page


def dispatch_row_bytes(fp8):
    """One token row of a cross-node dispatch: x (e4m3 or bf16), its f32 scales when FP8,
    topk_idx (int64) and topk_weights (f32) of all K picks, a 4-byte source index; 16 B aligned."""
    x = H if fp8 else 2 * H
    return align(x + (4 * S if fp8 else 0) + 8 * K + 4 * K + 4, 16)


COMBINE_ROW = align(2 * H + 16, 16)  # bf16 row + (source token, source rank, weight) header


def epd_exchange(ep, mode):
    """Per group per daemon: rows one source node may send per op, and the receive bytes.

    normal: dispatch sends each token once per destination node  -> L*M rows per source node;
            combine returns one bf16 row per (token, holding rank) -> L*M*min(K, L) rows,
            so that the source reduces in ascending rank order exactly as within a node.
    ll:     dispatch sends each token once per destination node  -> L*Mll rows;
            combine returns one row per (token, expert on that node) -> L*Mll*min(K, L*El).

    per_source (DESIGN §5 as written): one slot per source node per op parity, each holding
    the larger of that node's dispatch (FP8 or bf16: the group allows both) and combine rows,
    plus a counts header: (nodes-1) * 2 * slot.
    count_addressed (the alternative): dispatch rows land in their final recv_x / ll_recv_x
    row of one destination rank (its offsets are known once counts are exchanged; the
    low-latency layout has a fixed slot per (source rank, token)), so dispatch needs no
    region; combine rows of all peers share one region per parity at offsets taken from the
    counts, bounded by K rows per local token whatever the number of nodes:
    2 * (L*T*min(K, (nodes-1)*L) rows + header)."""
    nodes = ep // L
    E = experts_for(ep)
    El = E // ep
    T = M if mode == "normal" else MLL
    d_rows = L * T
    c_rows = L * T * (min(K, L) if mode == "normal" else min(K, L * El))
    d_bytes = d_rows * max(dispatch_row_bytes(True), dispatch_row_bytes(False))
    c_bytes = c_rows * COMBINE_ROW
    slot = align(max(d_bytes, c_bytes), 4096) + COUNTS_HEADER
    shared_rows = L * T * min(K, (nodes - 1) * L)
    shared = 2 * (align(shared_rows * COMBINE_ROW, 4096) + COUNTS_HEADER * (nodes - 1))
    return {"d_rows": d_rows, "c_rows": c_rows, "slot": slot,
            "recv_region": (nodes - 1) * 2 * slot, "shared_region": shared}


def epd_node(ep, mode):
    nodes = ep // L
    E = experts_for(ep)
    if mode == "normal":
        ep_bytes = epd_endpoint_bytes(ep, E, H, K, M, 0, True)
    else:  # the deep_ep layer joins its low-latency group with M = 1 (client/python/epd/deep_ep)
        ep_bytes = epd_endpoint_bytes(ep, E, H, K, 1, MLL, True)
    x = epd_exchange(ep, mode)
    return {
        "endpoint": ep_bytes,
        "areas": L * ep_bytes,
        "recv_region": x["recv_region"],
        "shared_region": x["shared_region"],
        "slot": x["slot"],
        "tcp": 2 * C_TCP * (nodes - 1),          # C dialled out + C accepted, per peer
        "qps": L * C_RDMA * (nodes - 1),         # one RC QP per rail per connection per peer
        "mrs": L * (1 + L),                      # per NIC: the receive region + 8 endpoint areas
        "registered": x["recv_region"] + L * ep_bytes,
        "registered_shared": x["shared_region"] + L * ep_bytes,
    }


# ---- DeepEP V1 (deep_ep/buffers/legacy.py, csrc/config.hpp, csrc/kernels/configs.cuh) --------
V1_NUM_SMS = 24          # README: Buffer.set_num_sms(24)
V1_QPS_PER_RANK = 24     # legacy.py default num_qps_per_rank
V1_MAX_RDMA_PEERS = 20   # NUM_MAX_RDMA_PEERS: internode normal mode up to 20 nodes (EP160)
V1_SOURCE_META = 8       # internode::get_source_meta_bytes(): SourceMeta {int, int}
V1_TOPK_IDX = 8          # sizeof(topk_idx_t) (int64)
# legacy.py get_dispatch_config / get_combine_config: (nvl_send, nvl_recv, rdma_send, rdma_recv)
V1_CONFIGS = {16: ((36, 288, 20, 128), (4, 288, 12, 128)),
              64: ((32, 288, 8, 128), (1, 288, 8, 128))}


def v1_nvl_bytes(cfg, hidden_bytes, R):
    _, nvl_recv, _, _ = cfg
    ch, nvl, rdma = V1_NUM_SMS // 2, min(R, 8), max(R // 8, 1)
    b = ch * nvl * (2 * rdma + 3) * 4
    b += ch * nvl * nvl_recv * (hidden_bytes + V1_SOURCE_META + 128 * V1_TOPK_IDX
                                + 128 * 4 + 128 * 4)
    return align(b, 128)


def v1_rdma_bytes(cfg, hidden_bytes, R):
    _, _, rdma_send, rdma_recv = cfg
    rdma_recv = align(rdma_recv, rdma_send)
    ch, rdma = V1_NUM_SMS // 2, R // 8
    b = ch * rdma * (8 * 2 + 2) * 2 * 4
    b += ch * rdma * rdma_recv * 2 * (hidden_bytes + V1_SOURCE_META + 128 * V1_TOPK_IDX + 128 * 4
                                      + 128 * 4 + 16)
    return align(b, 128)


def v1_normal(ep):
    """Per process: max over the dispatch and combine configs (README get_buffer), hidden_bytes =
    H * max(elem, 2) as the README computes it. None where V1 refuses the size."""
    nodes = ep // L
    if nodes > V1_MAX_RDMA_PEERS or ep not in V1_CONFIGS:
        return None
    hb = H * 2
    nvl = max(v1_nvl_bytes(c, hb, ep) for c in V1_CONFIGS[ep])
    rdma = max(v1_rdma_bytes(c, hb, ep) for c in V1_CONFIGS[ep])
    return {"nvl": nvl, "rdma": rdma, "qps": V1_QPS_PER_RANK * (nodes - 1)}


def v1_low_latency(ep):
    """get_low_latency_rdma_size_hint(Mll, H, R, E); QPs: num_qps_per_rank = E/R RC QPs to every
    other PE (NVSHMEM_IBGDA_NUM_RC_PER_PE; the low-latency NVSHMEM world is all R ranks)."""
    E = experts_for(ep)
    disp_msg = 16 + max(H * 2, H + S * 4)
    comb_msg = S * 4 + H * 2  # num_scales * sizeof(nv_bfloat162) + hidden * sizeof(bf16)
    send = max(MLL * disp_msg, E * MLL * comb_msg)
    recv = max(E * MLL * disp_msg, E * MLL * comb_msg)
    sig = align(E * 4, 128)
    total = 2 * send + 2 * recv + 2 * sig
    return {"rdma": align(total + 128, 128), "qps": (E // ep) * (ep - 1)}


# ---- DeepEP V2 (csrc/elastic/buffer.hpp calculate_buffer_size, layout.cuh, buffers/elastic.py) -
V2_MAX_CHANNELS = 8 * 160      # kNumMaxChannelsPerSM * kNumMaxSMs
V2_ALIGN = 2 << 20             # symmetric::kNumAlignmentBytes
V2_TMA = 32                    # ptx::kNumTMAAlignBytes
V2_QPS_HYBRID = 65             # elastic.py: 65 with fast RDMA atomics (CX-7 and newer), else 129


def v2_token(hidden_bytes, sf_bytes):
    meta = K * 8 + (1 + K) * 4
    return align(hidden_bytes, V2_TMA) + align(sf_bytes, V2_TMA) + align(meta, V2_TMA)


def v2_workspace():
    R, E, C = 1024, 2048, V2_MAX_CHANNELS  # WorkspaceLayout kNumMaxRanks, kNumMaxExperts
    b = 16 + (R + E) * 8 + R * 8 * 2 + E * 8 * 2 + R * 4 + R * 4 * 2 + E * 4 * 2
    b += R * C * 8 + R * C * 4 + 2 * 2 * 8 + (32 + 1) * R * 4 + R * 4
    return align(b, V2_ALIGN)


def v2_hybrid(ep):
    """Hybrid mode (scale-out = nodes, scale-up = 8 NVLink ranks), FP8 dispatch, multiple
    reduction allowed; the combine token is taken as bf16 hidden + the same metadata."""
    so, su = ep // L, L
    dt = v2_token(H, -(-H // 32) * 4)
    ct = v2_token(2 * H, 0)
    disp = dt * (su * so * M + M + so * (M + V2_MAX_CHANNELS))
    comb = ct * (min(su, K) * so * M + min(so, K) * M + so * (M + V2_MAX_CHANNELS))
    buf = align(max(disp, comb), V2_ALIGN)
    return {"buffer": buf, "workspace": v2_workspace(), "qps": V2_QPS_HYBRID * (so - 1)}


# ---- NCCL all-to-all, one communicator per process (NVIDIA/nccl defaults) --------------------
NCCL_CH_PER_NET_PEER = 2       # NCHANNELS_PER_NET_PEER (src/graph/paths.cc, 2.x default 2)
NCCL_QPS_PER_CONN = 1          # IB_QPS_PER_CONNECTION (src/transport/net_ib.cc)
NCCL_P2P_BUF = (1 << 17) * 8   # P2P_NET_CHUNKSIZE 128 KiB x NCCL_STEPS 8 per connection


def nccl_alltoall(ep):
    remote = ep - L
    conns = remote * NCCL_CH_PER_NET_PEER * 2  # a send and a receive connection per channel
    return {"qps": conns * NCCL_QPS_PER_CONN, "buffers": conns * NCCL_P2P_BUF}


# ---- output ------------------------------------------------------------------------------------
def gib(b):
    return f"{b / GiB:,.2f} GiB" if b >= GiB / 4 else f"{b / MiB:,.1f} MiB"


def max_m_within(budget, ep):
    """Largest max_tokens_per_rank whose normal-group endpoint fits `budget` bytes per rank."""
    E = experts_for(ep)
    lo, hi = 0, 1 << 24
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if epd_endpoint_bytes(ep, E, H, K, mid, 0, True) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def tables():
    """The Markdown tables docs/SCALE.md embeds between its BEGIN/END markers."""
    out = []
    w = out.append
    w(f"Shapes: H={H}, K={K}, M={M} (normal), Mll={MLL} (low-latency), FP8 dispatch (S={S}")
    w(f"scales/token), bf16 combine, {L} GPUs and {L} NICs per node,")
    w(f"tcp_connections_per_peer={C_TCP}, RDMA connections per peer per rail={C_RDMA}.")
    w("")
    for ep in EP_SIZES:
        nodes, E = ep // L, experts_for(ep)
        n, ll = epd_node(ep, "normal"), epd_node(ep, "ll")
        w(f"### EP{ep}: {nodes} nodes, E={E} ({E // ep} per rank)")
        w("")
        w("| per node (one daemon) | normal group (M=4096) | low-latency group (Mll=128) |")
        w("|---|---:|---:|")
        w(f"| endpoint area per rank | {gib(n['endpoint'])} | {gib(ll['endpoint'])} |")
        w(f"| 8 endpoint areas | {gib(n['areas'])} | {gib(ll['areas'])} |")
        w(f"| receive slot per source node per parity | {gib(n['slot'])} | {gib(ll['slot'])} |")
        w(f"| cross-node receive region ({nodes - 1} x 2 slots) | {gib(n['recv_region'])} | "
          f"{gib(ll['recv_region'])} |")
        w(f"| registered with the NICs (RDMA) | {gib(n['registered'])} | {gib(ll['registered'])} |")
        w("| alternative: count-addressed combine region (2 parities) | "
          f"{gib(n['shared_region'])} | "
          f"{gib(ll['shared_region'])} |")
        w(f"| alternative: registered | {gib(n['registered_shared'])} | "
          f"{gib(ll['registered_shared'])} |")
        w(f"| memory regions (8 NICs x (1 + 8)) | {n['mrs']} | {ll['mrs']} |")
        w(f"| TCP sockets ({nodes - 1} peers x {C_TCP} x 2) | {n['tcp']} | {ll['tcp']} |")
        w(f"| RDMA queue pairs ({nodes - 1} peers x 8 rails x {C_RDMA}) | {n['qps']} | "
          f"{ll['qps']} |")
        w("")
    w("### Per node, per-process communicators beside epd (8 processes; QPs are one end each)")
    w("")
    w("| EP | epd QPs (both groups) | DeepEP V1 normal QPs | DeepEP V1 LL QPs "
      "| DeepEP V2 hybrid QPs "
      "| NCCL a2a QPs |")
    w("|---:|---:|---:|---:|---:|---:|")
    for ep in EP_SIZES:
        e = epd_node(ep, "normal")["qps"] + epd_node(ep, "ll")["qps"]
        v1 = v1_normal(ep)
        w(f"| {ep} | {e:,} | {L * v1['qps']:,} |" if v1 else f"| {ep} | {e:,} | n/a (max EP160) |")
        out[-1] += (f" {L * v1_low_latency(ep)['qps']:,} | {L * v2_hybrid(ep)['qps']:,} | "
                    f"{L * nccl_alltoall(ep)['qps']:,} |")
    w("")
    w("| EP | epd registered, both groups (alternative) | DeepEP V1 normal (NVL + RDMA) "
      "| DeepEP V1 LL RDMA "
      "| DeepEP V2 hybrid buffer + workspace | NCCL a2a buffers |")
    w("|---:|---:|---:|---:|---:|---:|")
    for ep in EP_SIZES:
        e = epd_node(ep, "normal")["registered"] + epd_node(ep, "ll")["registered"]
        e2 = epd_node(ep, "normal")["registered_shared"] + epd_node(ep, "ll")["registered_shared"]
        v1 = v1_normal(ep)
        v1s = gib(L * (v1["nvl"] + v1["rdma"])) if v1 else "n/a"
        v2 = v2_hybrid(ep)
        w(f"| {ep} | {gib(e)} ({gib(e2)}) | {v1s} | {gib(L * v1_low_latency(ep)['rdma'])} | "
          f"{gib(L * (v2['buffer'] + v2['workspace']))} | "
          f"{gib(L * nccl_alltoall(ep)['buffers'])} |")
    w("")
    w("### What fills an endpoint area (share of the per-rank bytes)")
    w("")
    w("| EP | normal: recv_x + in_combine_x (2 x R*M*H*2) "
      "| low-latency: in_ll_combine_x + 2 ll_recv_x "
      "(3 x E*Mll*H*2) |")
    w("|---:|---:|---:|")
    for ep in EP_SIZES:
        E = experts_for(ep)
        big_n = dict(epd_endpoint_regions(ep, E, H, K, M, 0, True))
        big_l = dict(epd_endpoint_regions(ep, E, H, K, 1, MLL, True))
        sn = big_n["recv_x"] + big_n["in_combine_x"]
        sl = big_l["in_ll_combine_x"] + big_l["ll_recv_x_0"] + big_l["ll_recv_x_1"]
        w(f"| {ep} | {gib(sn)} = {100 * sn / epd_node(ep, 'normal')['endpoint']:.0f}% | "
          f"{gib(sl)} = {100 * sl / epd_node(ep, 'll')['endpoint']:.0f}% |")
    w("")
    w("### The largest max_tokens_per_rank whose normal-group endpoint fits a per-rank budget")
    w("")
    w("| EP | 8 GiB | 16 GiB | 32 GiB |")
    w("|---:|---:|---:|---:|")
    for ep in EP_SIZES:
        w(f"| {ep} | " + " | ".join(str(max_m_within(b << 30, ep)) for b in (8, 16, 32)) + " |")
    return "\n".join(out) + "\n"


BEGIN = "<!-- BEGIN scale_tables.py output -->\n"
END = "<!-- END scale_tables.py output -->"


# ---- checks ------------------------------------------------------------------------------------
CHECK_SHAPES = [  # (R, E, H, K, M, Mll, fp8)
    (16, 256, 7168, 8, 4096, 0, True), (16, 256, 7168, 8, 1, 128, True),
    (64, 256, 7168, 8, 4096, 0, True), (256, 256, 7168, 8, 1, 128, True),
    (8, 16, 128, 2, 3, 5, False), (3, 9, 200, 3, 7, 0, True), (2048, 2048, 7168, 8, 1, 128, True),
]

CPP = r"""
#include <cstdio>
#include "epd/kernels/layout.h"
int main() {
  int R, E, H, K, M, Mll, fp8;
  while (std::scanf("%d %d %d %d %d %d %d", &R, &E, &H, &K, &M, &Mll, &fp8) == 7) {
    epd::kernels::GroupShape s;
    s.num_ranks = R; s.num_experts = E; s.hidden = H; s.num_topk = K;
    s.max_tokens_per_rank = M; s.ll_max_tokens_per_rank = Mll; s.use_fp8 = fp8 != 0;
    std::printf("%llu\n", (unsigned long long)epd::kernels::EndpointLayout::Compute(s).total_bytes);
  }
}
"""


def check():
    failures = 0
    want = [epd_endpoint_bytes(*s) for s in CHECK_SHAPES]
    # 1. the C++ layout itself, compiled on the fly when a compiler is there
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx:
        with tempfile.TemporaryDirectory() as d:
            src, exe = os.path.join(d, "l.cc"), os.path.join(d, "l")
            with open(src, "w") as f:
                f.write(CPP)
            subprocess.run([cxx, "-std=c++20", "-I", os.path.join(ROOT, "kernels/include"),
                            "-I", ROOT, src, "-o", exe], check=True)
            stdin = "".join(" ".join(str(int(v)) for v in s) + "\n" for s in CHECK_SHAPES)
            run = subprocess.run([exe], input=stdin, capture_output=True, text=True, check=True)
            got = [int(x) for x in run.stdout.split()]
        for s, g, x in zip(CHECK_SHAPES, got, want):
            if g != x:
                print(f"FAIL layout.h {s}: C++ {g} != script {x}")
                failures += 1
        print(f"layout.h ({cxx}): {len(got)} shapes compared")
    else:
        print("FAIL no C++ compiler: layout.h not compared")
        failures += 1
    # 2. the Python twin the deep_ep layer sizes its budgets with
    spec = importlib.util.spec_from_file_location(
        "_sizes", os.path.join(ROOT, "client/python/epd/deep_ep/_sizes.py"))
    sizes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sizes)
    for s, x in zip(CHECK_SHAPES, want):
        R, E, H_, K_, M_, Mll, fp8 = s
        g = sizes.endpoint_bytes(num_ranks=R, num_experts=E, hidden=H_, num_topk=K_,
                                 max_tokens_per_rank=M_, ll_max_tokens_per_rank=Mll, use_fp8=fp8)
        if g != x:
            print(f"FAIL _sizes.py {s}: {g} != script {x}")
            failures += 1
    print(f"_sizes.py: {len(CHECK_SHAPES)} shapes compared")
    # 3. internal consistency of the derived figures
    for ep in EP_SIZES:
        E = experts_for(ep)
        assert E % ep == 0 and ep % L == 0, ep
        n = epd_node(ep, "normal")
        x = epd_exchange(ep, "normal")
        assert n["recv_region"] == (ep // L - 1) * 2 * n["slot"]
        assert x["c_rows"] == K * x["d_rows"]  # min(K, L) == K for K = L = 8
        assert n["registered"] == n["recv_region"] + L * n["endpoint"]
        assert n["shared_region"] <= n["recv_region"] or ep // L - 1 < 1
        assert max_m_within(n["endpoint"], ep) == M  # the budget search inverts the formula
    assert dispatch_row_bytes(True) == 7504 and dispatch_row_bytes(False) == 14448
    assert COMBINE_ROW == 14352  # the row sizes docs/SCALE.md quotes
    assert v1_low_latency(16)["qps"] == 16 * 15
    print("derived figures: consistent")
    # 4. the tables in docs/SCALE.md are this script's output
    with open(os.path.join(ROOT, "docs/SCALE.md")) as f:
        doc = f.read()
    if BEGIN not in doc or END not in doc:
        print("FAIL docs/SCALE.md has no scale_tables.py block")
        failures += 1
    elif doc.split(BEGIN, 1)[1].split(END, 1)[0] != tables():
        print("FAIL docs/SCALE.md tables differ from this script's output: rerun with --write")
        failures += 1
    else:
        print("docs/SCALE.md: tables match")
    print("OK" if failures == 0 else f"{failures} FAILED")
    return 1 if failures else 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true",
                   help="compare with layout.h, _sizes.py and the tables in docs/SCALE.md")
    p.add_argument("--write", action="store_true", help="replace the tables in docs/SCALE.md")
    a = p.parse_args()
    if a.check:
        sys.exit(check())
    if a.write:
        path = os.path.join(ROOT, "docs/SCALE.md")
        with open(path) as f:
            doc = f.read()
        head, rest = doc.split(BEGIN, 1)
        with open(path, "w") as f:
            f.write(head + BEGIN + tables() + END + rest.split(END, 1)[1])
        return
    sys.stdout.write(tables())


if __name__ == "__main__":
    main()
