// kernels/host's per-node ops (host_node_ops.h) against the whole-group ops (host_ops.h):
// for random groups of 2 and 4 nodes with 1-3 ranks each, mixed T (0 included), all
// tokens to one node, FP8, weights, expert_alignment, cached re-dispatch and low-latency
// FP8 / round_scale / UE8M0, each node's part computed from what the exchange would bring
// it (the other nodes' counts and the rows that go to it) equals, bit for bit, the outputs
// of its ranks in the whole-group op. Outputs start as the same garbage in both runs, so
// rows neither writes must stay equal too. The send staging's helpers (QuantizeRowsFp8,
// PackNodeRows) match their row-by-row definitions.
#include "epd/kernels/host_node_ops.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "epd/kernels/host_ops.h"

namespace epd::kernels::host {
namespace {

constexpr uint8_t kGarbage = 0xA5;

template <typename T>
std::vector<T> Garbage(size_t n) {
  std::vector<T> v(n);
  std::memset(v.data(), kGarbage, n * sizeof(T));
  return v;
}

struct Group {
  std::vector<int32_t> node_ranks;  // ranks per node
  GroupShape shape;
  std::vector<int32_t> tokens;  // [R]
  std::vector<std::vector<bf16_bits>> x;
  std::vector<std::vector<uint8_t>> x_fp8;
  std::vector<std::vector<float>> scales, weights;
  std::vector<std::vector<int64_t>> topk;

  int R() const { return shape.num_ranks; }
  NodeRanks Node(int n) const {
    int first = 0;
    for (int k = 0; k < n; ++k) first += node_ranks[k];
    return {first, node_ranks[n]};
  }
};

Group MakeGroup(std::mt19937& rng, int nodes, bool one_node_only, int hidden) {
  Group g;
  int R = 0;
  for (int n = 0; n < nodes; ++n) {
    g.node_ranks.push_back(1 + static_cast<int>(rng() % 3));
    R += g.node_ranks.back();
  }
  GroupShape& s = g.shape;
  s.num_ranks = R;
  s.num_experts = R * (1 + static_cast<int>(rng() % 3));
  s.num_topk = 1 + static_cast<int>(rng() % 4);
  s.hidden = hidden;
  s.max_tokens_per_rank = 1 + static_cast<int>(rng() % 9);
  s.ll_max_tokens_per_rank = s.max_tokens_per_rank;
  s.use_fp8 = true;
  const int El = s.num_experts / R;
  const int node0_experts = g.node_ranks[0] * El;
  std::uniform_real_distribution<float> val(-3.0f, 3.0f);
  for (int r = 0; r < R; ++r) {
    const int T = static_cast<int>(rng() % (s.max_tokens_per_rank + 1));
    g.tokens.push_back(T);
    std::vector<bf16_bits> x(static_cast<size_t>(s.max_tokens_per_rank) * hidden);
    for (auto& v : x) v = FloatToBf16(val(rng));
    std::vector<uint8_t> x8(static_cast<size_t>(s.max_tokens_per_rank) * hidden);
    for (auto& v : x8) v = static_cast<uint8_t>(rng());
    std::vector<float> sc(static_cast<size_t>(s.max_tokens_per_rank) * s.num_scales());
    for (auto& v : sc) v = val(rng);
    std::vector<float> w(static_cast<size_t>(s.max_tokens_per_rank) * s.num_topk);
    for (auto& v : w) v = val(rng);
    std::vector<int64_t> idx(static_cast<size_t>(s.max_tokens_per_rank) * s.num_topk);
    for (auto& v : idx) {
      const int range = one_node_only ? node0_experts : s.num_experts;
      v = rng() % 5 == 0 ? -1 : static_cast<int64_t>(rng() % range);
    }
    g.x.push_back(std::move(x));
    g.x_fp8.push_back(std::move(x8));
    g.scales.push_back(std::move(sc));
    g.weights.push_back(std::move(w));
    g.topk.push_back(std::move(idx));
  }
  return g;
}

/// One rank's dispatch outputs (garbage-initialized).
struct DispatchOut {
  std::vector<uint8_t> recv_x;
  std::vector<float> recv_scales, recv_w;
  std::vector<int64_t> recv_idx;
  std::vector<int32_t> per_expert, src_info, send_pos, prefix;
  int32_t num_recv = -1;

  DispatchOut(const GroupShape& s) {
    const size_t N = s.max_recv_tokens();
    recv_x = Garbage<uint8_t>(N * s.hidden * 2);
    recv_scales = Garbage<float>(N * s.num_scales());
    recv_w = Garbage<float>(N * s.num_topk);
    recv_idx = Garbage<int64_t>(N * s.num_topk);
    per_expert = Garbage<int32_t>(s.num_local_experts());
    src_info = Garbage<int32_t>(N);
    send_pos = Garbage<int32_t>(static_cast<size_t>(s.max_tokens_per_rank) * s.num_ranks);
    prefix = Garbage<int32_t>(s.num_ranks);
  }
  void Into(DispatchRankArgs& a, const GroupShape& s, bool fp8) {
    a.recv_capacity = s.max_recv_tokens();
    a.recv_x = recv_x.data();
    a.recv_scales = fp8 ? recv_scales.data() : nullptr;
    a.recv_topk_idx = recv_idx.data();
    a.recv_topk_weights = recv_w.data();
    a.recv_tokens_per_expert = per_expert.data();
    a.recv_src_info = src_info.data();
    a.send_pos = send_pos.data();
    a.rank_prefix = prefix.data();
  }
  bool operator==(const DispatchOut& o) const {
    return recv_x == o.recv_x && recv_scales == o.recv_scales &&
           std::memcmp(recv_w.data(), o.recv_w.data(), recv_w.size() * 4) == 0 &&
           recv_idx == o.recv_idx && per_expert == o.per_expert && src_info == o.src_info &&
           send_pos == o.send_pos && prefix == o.prefix && num_recv == o.num_recv;
  }
};

struct DispatchCase {
  bool fp8 = false, weights = false;
  int alignment = 1;
};

/// Runs the whole-group dispatch (and a cached re-dispatch, and the combine) and every
/// node's part; compares.
void CheckNormal(const Group& g, const DispatchCase& c, int nodes) {
  const GroupShape& s = g.shape;
  const int R = g.R(), K = s.num_topk, H = s.hidden;
  DispatchOptions opt;
  opt.fp8 = c.fp8;
  opt.expert_alignment = c.alignment;
  auto source_x = [&](int r) -> const void* {
    return c.fp8 ? static_cast<const void*>(g.x_fp8[r].data()) : g.x[r].data();
  };
  const int64_t xb = c.fp8 ? H : 2 * H;
  // Whole group.
  std::vector<DispatchOut> ref(R, DispatchOut(s));
  std::vector<DispatchRankArgs> args(R);
  for (int r = 0; r < R; ++r) {
    args[r].num_tokens = g.tokens[r];
    args[r].x = source_x(r);
    args[r].x_scales = c.fp8 ? g.scales[r].data() : nullptr;
    args[r].topk_idx = g.topk[r].data();
    args[r].topk_weights = c.weights ? g.weights[r].data() : nullptr;
    ref[r].Into(args[r], s, c.fp8);
  }
  ASSERT_TRUE(Dispatch(s, opt, args, {1}).ok());
  for (int r = 0; r < R; ++r) ref[r].num_recv = args[r].num_recv_tokens;
  std::vector<int32_t> counts(static_cast<size_t>(R) * R);
  for (int r = 0; r < R; ++r) {
    CountDispatchRows(s, g.tokens[r], g.topk[r].data(), nullptr, counts.data() + r * R);
  }
  // Cached re-dispatch of the same routing (whole group).
  std::vector<DispatchOut> ref_cached(R, DispatchOut(s));
  std::vector<std::vector<int32_t>> handle(R);
  for (int r = 0; r < R; ++r) handle[r] = ref[r].send_pos;
  for (int r = 0; r < R; ++r) {
    DispatchRankArgs& a = args[r];
    a = {};
    a.num_tokens = g.tokens[r];
    a.x = source_x(r);
    a.x_scales = c.fp8 ? g.scales[r].data() : nullptr;
    a.cached_send_pos = handle[r].data();
    a.cached_num_recv_tokens = ref[r].num_recv;
    ref_cached[r].Into(a, s, c.fp8);
  }
  ASSERT_TRUE(Dispatch(s, opt, args, {1}).ok());
  for (int r = 0; r < R; ++r) ref_cached[r].num_recv = args[r].num_recv_tokens;
  // Combine of random expert outputs (whole group).
  std::mt19937 rng(7);
  std::vector<std::vector<bf16_bits>> y(R);
  std::vector<std::vector<float>> yw(R);
  for (int r = 0; r < R; ++r) {
    y[r].resize(static_cast<size_t>(std::max(ref[r].num_recv, 1)) * H);
    for (auto& v : y[r])
      v = FloatToBf16(static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 37.0f);
    yw[r].resize(static_cast<size_t>(std::max(ref[r].num_recv, 1)) * K);
    for (auto& v : yw[r]) v = static_cast<float>(rng() % 1000) / 999.0f;
  }
  std::vector<std::vector<bf16_bits>> ref_comb(R, Garbage<bf16_bits>(s.max_tokens_per_rank * H));
  std::vector<std::vector<float>> ref_combw(R, Garbage<float>(s.max_tokens_per_rank * K));
  std::vector<CombineRankArgs> cargs(R);
  for (int r = 0; r < R; ++r) {
    cargs[r].num_tokens = g.tokens[r];
    cargs[r].send_pos = handle[r].data();
    cargs[r].num_recv_tokens = ref[r].num_recv;
    cargs[r].x = y[r].data();
    cargs[r].topk_weights = c.weights ? yw[r].data() : nullptr;
    cargs[r].combined_x = ref_comb[r].data();
    cargs[r].combined_topk_weights = c.weights ? ref_combw[r].data() : nullptr;
  }
  ASSERT_TRUE(Combine(s, cargs, {1}).ok());

  for (int n = 0; n < nodes; ++n) {
    const NodeRanks node = g.Node(n);
    SCOPED_TRACE(::testing::Message()
                 << "node " << n << " ranks " << node.first << "+" << node.count);
    // What the other nodes send this node: the rows of their tokens that go to it.
    std::vector<std::vector<int32_t>> ids(R);
    std::vector<std::vector<int64_t>> idx(R);
    std::vector<std::vector<int32_t>> pos(R);
    std::vector<std::vector<uint8_t>> xs(R);
    std::vector<std::vector<float>> sc(R), w(R);
    std::vector<NodeDispatchSource> src(R), src_cached(R);
    for (int r = 0; r < R; ++r) {
      if (node.Has(r)) {
        src[r] = {g.tokens[r],      nullptr,
                  source_x(r),      c.fp8 ? g.scales[r].data() : nullptr,
                  g.topk[r].data(), c.weights ? g.weights[r].data() : nullptr,
                  nullptr};
        src_cached[r] = src[r];
        src_cached[r].topk_idx = nullptr;
        src_cached[r].topk_weights = nullptr;
        src_cached[r].send_pos = handle[r].data();
        continue;
      }
      for (int t = 0; t < g.tokens[r]; ++t) {
        if (!GoesToNode(s, node, g.topk[r].data() + t * K, nullptr)) continue;
        // A token goes to the node for a cached dispatch exactly when it did before.
        EXPECT_TRUE(GoesToNode(s, node, nullptr, handle[r].data() + t * R));
        ids[r].push_back(t);
        idx[r].insert(idx[r].end(), g.topk[r].begin() + t * K, g.topk[r].begin() + (t + 1) * K);
        pos[r].insert(pos[r].end(), handle[r].begin() + t * R, handle[r].begin() + (t + 1) * R);
        const auto* xr = static_cast<const uint8_t*>(source_x(r)) + t * xb;
        xs[r].insert(xs[r].end(), xr, xr + xb);
        sc[r].insert(sc[r].end(), g.scales[r].begin() + t * s.num_scales(),
                     g.scales[r].begin() + (t + 1) * s.num_scales());
        w[r].insert(w[r].end(), g.weights[r].begin() + t * K, g.weights[r].begin() + (t + 1) * K);
      }
      const int rows = static_cast<int>(ids[r].size());
      src[r] = {rows,          ids[r].data(),
                xs[r].data(),  c.fp8 ? sc[r].data() : nullptr,
                idx[r].data(), c.weights ? w[r].data() : nullptr,
                nullptr};
      src_cached[r] = {rows,    ids[r].data(), xs[r].data(), c.fp8 ? sc[r].data() : nullptr,
                       nullptr, nullptr,       pos[r].data()};
    }
    std::vector<DispatchOut> out(node.count, DispatchOut(s));
    std::vector<DispatchRankArgs> local(node.count);
    for (int i = 0; i < node.count; ++i) {
      local[i].num_tokens = g.tokens[node.first + i];
      out[i].Into(local[i], s, c.fp8);
    }
    ASSERT_TRUE(NodeDispatch(s, opt, c.weights, node, counts, src, local, {2}).ok());
    for (int i = 0; i < node.count; ++i) {
      out[i].num_recv = local[i].num_recv_tokens;
      EXPECT_TRUE(out[i] == ref[node.first + i]) << "dispatch, rank " << node.first + i;
    }
    // Cached.
    std::vector<DispatchOut> outc(node.count, DispatchOut(s));
    std::vector<std::vector<int32_t>> cached_handle(node.count);
    for (int i = 0; i < node.count; ++i) {
      cached_handle[i] = handle[node.first + i];
      local[i] = {};
      local[i].num_tokens = g.tokens[node.first + i];
      local[i].cached_send_pos = cached_handle[i].data();
      local[i].cached_num_recv_tokens = ref[node.first + i].num_recv;
      outc[i].Into(local[i], s, c.fp8);
    }
    ASSERT_TRUE(NodeDispatch(s, opt, false, node, counts, src_cached, local, {1}).ok());
    for (int i = 0; i < node.count; ++i) {
      outc[i].num_recv = local[i].num_recv_tokens;
      EXPECT_TRUE(outc[i] == ref_cached[node.first + i]) << "cached, rank " << node.first + i;
    }
    // Combine: each remote rank's rows of this node's tokens, one block each.
    std::vector<std::vector<bf16_bits>> block(R);
    std::vector<std::vector<float>> block_w(R);
    std::vector<std::vector<bf16_bits>> comb(R, Garbage<bf16_bits>(s.max_tokens_per_rank * H));
    std::vector<std::vector<float>> combw(R, Garbage<float>(s.max_tokens_per_rank * K));
    std::vector<CombineRankArgs> na(R);
    for (int r = 0; r < R; ++r) {
      if (node.Has(r)) {
        na[r] = cargs[r];
        na[r].combined_x = comb[r].data();
        na[r].combined_topk_weights = c.weights ? combw[r].data() : nullptr;
        continue;
      }
      int start = 0, cnt = 0;
      for (int s2 = 0; s2 < node.first; ++s2) start += counts[s2 * R + r];
      for (int s2 = node.first; s2 < node.first + node.count; ++s2) cnt += counts[s2 * R + r];
      EXPECT_EQ(start, ref[r].prefix[node.first]);
      block[r].assign(y[r].begin() + start * H, y[r].begin() + (start + cnt) * H);
      block_w[r].assign(yw[r].begin() + start * K, yw[r].begin() + (start + cnt) * K);
      block[r].resize(block[r].size() + 1);  // Non-null even when empty.
      block_w[r].resize(block_w[r].size() + 1);
      na[r] = {};
      na[r].x = block[r].data();
      na[r].topk_weights = c.weights ? block_w[r].data() : nullptr;
      na[r].x_first_row = start;
      na[r].num_recv_tokens = start + cnt;
    }
    ASSERT_TRUE(Combine(s, na, {2}).ok());
    for (int r = node.first; r < node.first + node.count; ++r) {
      EXPECT_EQ(comb[r], ref_comb[r]) << "combine, rank " << r;
      EXPECT_EQ(0, std::memcmp(combw[r].data(), ref_combw[r].data(), combw[r].size() * 4))
          << "combine weights, rank " << r;
    }
  }
}

struct LlCase {
  bool fp8 = false, round_scale = false, ue8m0 = false;
};

void CheckLowLatency(const Group& g, const LlCase& c, int nodes) {
  const GroupShape& s = g.shape;
  const int R = g.R(), K = s.num_topk, H = s.hidden, E = s.num_experts;
  const int El = s.num_local_experts(), S = s.num_scales();
  const int64_t rpe = s.ll_rows_per_expert();
  LowLatencyDispatchOptions opt{c.fp8, c.round_scale, c.ue8m0};
  struct Out {
    std::vector<uint8_t> x, scales;
    std::vector<int32_t> count, src, handle;
  };
  auto make_out = [&] {
    Out o;
    o.x = Garbage<uint8_t>(El * rpe * H * 2);
    o.scales = Garbage<uint8_t>(El * rpe * S * 4);
    o.count = Garbage<int32_t>(El);
    o.src = Garbage<int32_t>(El * rpe);
    o.handle = Garbage<int32_t>(s.ll_max_tokens_per_rank * K);
    return o;
  };
  auto into = [&](Out& o, LowLatencyDispatchRankArgs& a) {
    a.recv_x = o.x.data();
    a.recv_scales = c.fp8 ? o.scales.data() : nullptr;
    a.recv_count = o.count.data();
    a.recv_src_info = o.src.data();
    a.handle_pos = o.handle.data();
  };
  std::vector<Out> ref(R);
  std::vector<LowLatencyDispatchRankArgs> args(R);
  for (int r = 0; r < R; ++r) {
    ref[r] = make_out();
    args[r].num_tokens = g.tokens[r];
    args[r].x = g.x[r].data();
    args[r].topk_idx = g.topk[r].data();
    into(ref[r], args[r]);
  }
  ASSERT_TRUE(LowLatencyDispatch(s, opt, args, {1}).ok());
  std::vector<int32_t> counts(static_cast<size_t>(R) * E);
  for (int r = 0; r < R; ++r) {
    CountLowLatencyRows(s, g.tokens[r], g.topk[r].data(), counts.data() + r * E);
  }
  // Combine (whole group).
  std::mt19937 rng(11);
  std::vector<std::vector<bf16_bits>> y(R, std::vector<bf16_bits>(El * rpe * H));
  for (auto& v : y) {
    for (auto& b : v)
      b = FloatToBf16(static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 53.0f);
  }
  std::vector<std::vector<bf16_bits>> ref_comb(R, Garbage<bf16_bits>(s.ll_max_tokens_per_rank * H));
  std::vector<LowLatencyCombineRankArgs> cargs(R);
  for (int r = 0; r < R; ++r) {
    cargs[r].num_tokens = g.tokens[r];
    cargs[r].topk_idx = g.topk[r].data();
    cargs[r].topk_weights = g.weights[r].data();
    cargs[r].handle_pos = ref[r].handle.data();
    cargs[r].x = y[r].data();
    cargs[r].combined_x = ref_comb[r].data();
  }
  ASSERT_TRUE(LowLatencyCombine(s, cargs, {1}).ok());

  for (int n = 0; n < nodes; ++n) {
    const NodeRanks node = g.Node(n);
    SCOPED_TRACE(::testing::Message() << "node " << n);
    std::vector<std::vector<int32_t>> ids(R);
    std::vector<std::vector<int64_t>> idx(R);
    std::vector<std::vector<uint8_t>> xs(R);
    std::vector<std::vector<float>> sc(R);
    std::vector<NodeLowLatencySource> src(R);
    for (int r = 0; r < R; ++r) {
      if (node.Has(r) && c.fp8 && n % 2 == 1) {  // A local source quantized at the source.
        xs[r].resize(static_cast<size_t>(g.tokens[r]) * H + 1);
        sc[r].resize(static_cast<size_t>(g.tokens[r]) * S + 1);
        QuantizeRowsFp8(s, g.tokens[r], g.x[r].data(), c.round_scale, xs[r].data(), sc[r].data(),
                        {3});
        src[r] = {g.tokens[r], nullptr, g.topk[r].data(), xs[r].data(), sc[r].data(), true};
        continue;
      }
      if (node.Has(r)) {
        src[r] = {g.tokens[r], nullptr, g.topk[r].data(), g.x[r].data(), nullptr, false};
        continue;
      }
      for (int t = 0; t < g.tokens[r]; ++t) {
        if (!GoesToNode(s, node, g.topk[r].data() + t * K, nullptr)) continue;
        ids[r].push_back(t);
        idx[r].insert(idx[r].end(), g.topk[r].begin() + t * K, g.topk[r].begin() + (t + 1) * K);
        if (c.fp8) {  // The sender quantizes.
          std::vector<e4m3_bits> q(H);
          std::vector<float> qs(S);
          QuantizeRowFp8(g.x[r].data() + t * H, H, c.round_scale, q.data(), qs.data());
          xs[r].insert(xs[r].end(), q.begin(), q.end());
          sc[r].insert(sc[r].end(), qs.begin(), qs.end());
        } else {
          const auto* xr = reinterpret_cast<const uint8_t*>(g.x[r].data() + t * H);
          xs[r].insert(xs[r].end(), xr, xr + 2 * H);
        }
      }
      src[r] = {static_cast<int>(ids[r].size()), ids[r].data(), idx[r].data(), xs[r].data(),
                c.fp8 ? sc[r].data() : nullptr,  c.fp8};
    }
    std::vector<Out> out(node.count);
    std::vector<LowLatencyDispatchRankArgs> local(node.count);
    for (int i = 0; i < node.count; ++i) {
      out[i] = make_out();
      local[i].num_tokens = g.tokens[node.first + i];
      into(out[i], local[i]);
    }
    ASSERT_TRUE(NodeLowLatencyDispatch(s, opt, node, counts, src, local, {2}).ok());
    for (int i = 0; i < node.count; ++i) {
      const Out& a = out[i];
      const Out& b = ref[node.first + i];
      EXPECT_TRUE(a.x == b.x && a.scales == b.scales && a.count == b.count && a.src == b.src &&
                  a.handle == b.handle)
          << "LL dispatch, rank " << node.first + i;
    }
    // Combine: each remote expert's rows of this node's tokens.
    const int64_t block_rows = static_cast<int64_t>(node.count) * s.ll_max_tokens_per_rank;
    std::vector<std::vector<bf16_bits>> blocks(R);
    std::vector<int32_t> first_row(E), num_rows(E);
    std::vector<int64_t> block_start(E);
    std::vector<std::vector<bf16_bits>> comb(R, Garbage<bf16_bits>(s.ll_max_tokens_per_rank * H));
    std::vector<LowLatencyCombineRankArgs> na(R);
    for (int r = 0; r < R; ++r) {
      if (node.Has(r)) {
        na[r] = cargs[r];
        na[r].combined_x = comb[r].data();
        continue;
      }
      blocks[r].assign(El * block_rows * H + 1, 0);
      for (int j = 0; j < El; ++j) {
        const int e = r * El + j;
        int start = 0, cnt = 0;
        for (int s2 = 0; s2 < node.first; ++s2) start += counts[s2 * E + e];
        for (int s2 = node.first; s2 < node.first + node.count; ++s2) cnt += counts[s2 * E + e];
        ASSERT_LE(cnt, block_rows);
        std::copy(y[r].begin() + (j * rpe + start) * H, y[r].begin() + (j * rpe + start + cnt) * H,
                  blocks[r].begin() + j * block_rows * H);
        first_row[e] = start;
        num_rows[e] = cnt;
        block_start[e] = j * block_rows;
      }
      na[r] = {};
      na[r].x = blocks[r].data();
      na[r].x_first_row = first_row.data() + r * El;
      na[r].x_num_rows = num_rows.data() + r * El;
      na[r].x_block_start = block_start.data() + r * El;
    }
    ASSERT_TRUE(LowLatencyCombine(s, na, {2}).ok());
    for (int r = node.first; r < node.first + node.count; ++r) {
      EXPECT_EQ(comb[r], ref_comb[r]) << "LL combine, rank " << r;
    }
  }
}

TEST(HostNodeOps, NormalDispatchCombineMatchTheWholeGroup) {
  std::mt19937 rng(1234);
  for (int iter = 0; iter < 120; ++iter) {
    const int nodes = iter % 2 ? 4 : 2;
    const bool one_node = iter % 5 == 0;
    const Group g = MakeGroup(rng, nodes, one_node, 128 * (1 + static_cast<int>(iter % 2)));
    DispatchCase c;
    c.fp8 = iter % 3 == 1;
    c.weights = iter % 4 != 0;
    c.alignment = 1 + static_cast<int>(rng() % 4);
    SCOPED_TRACE(::testing::Message() << "iter " << iter << " R " << g.R() << " E "
                                      << g.shape.num_experts << " K " << g.shape.num_topk);
    CheckNormal(g, c, nodes);
    if (HasFatalFailure()) return;
  }
}

TEST(HostNodeOps, LowLatencyDispatchCombineMatchTheWholeGroup) {
  std::mt19937 rng(99);
  for (int iter = 0; iter < 120; ++iter) {
    const int nodes = iter % 2 ? 4 : 2;
    LlCase c;
    c.fp8 = iter % 3 != 0;
    c.round_scale = c.fp8 && iter % 2 == 0;
    c.ue8m0 = c.round_scale && iter % 4 == 0;
    const Group g = MakeGroup(rng, nodes, iter % 5 == 0, c.ue8m0 ? 512 : 128 * (1 + iter % 2));
    SCOPED_TRACE(::testing::Message() << "iter " << iter << " R " << g.R());
    CheckLowLatency(g, c, nodes);
    if (HasFatalFailure()) return;
  }
}

TEST(HostNodeOps, QuantizeRowsAndPackNodeRowsMatchTheRowByRowLoop) {
  std::mt19937 rng(7);
  HostWorkerPool pool;
  for (int iter = 0; iter < 60; ++iter) {
    const int nodes = iter % 2 ? 4 : 2;
    // Wide rows (8192) make a staging large enough for PackNodeRows to use the threads.
    const Group g =
        MakeGroup(rng, nodes, iter % 5 == 0, iter % 3 == 0 ? 8192 : 128 * (1 + iter % 2));
    const GroupShape& s = g.shape;
    const int R = g.R(), K = s.num_topk, H = s.hidden, S = s.num_scales();
    const bool cached = iter % 3 == 2, fp8 = iter % 3 == 1, round_scale = iter % 4 == 0;
    const HostExecution exec{1 + iter % 4, iter % 2 ? &pool : nullptr};
    SCOPED_TRACE(::testing::Message() << "iter " << iter << " R " << R);
    // Cached sources route by a send_pos [T, R] (>= 0: a row at that rank).
    std::vector<std::vector<int32_t>> send_pos(R);
    std::vector<NodePackSource> src(R);
    std::vector<std::vector<e4m3_bits>> q(R);
    std::vector<std::vector<float>> qs(R);
    for (int r = 0; r < R; ++r) {
      const int T = g.tokens[r];
      send_pos[r].resize(static_cast<size_t>(s.max_tokens_per_rank) * R);
      for (auto& v : send_pos[r]) v = rng() % 3 == 0 ? static_cast<int32_t>(rng() % 50) : -1;
      q[r] = Garbage<e4m3_bits>(static_cast<size_t>(T) * H + 1);
      qs[r] = Garbage<float>(static_cast<size_t>(T) * S + 1);
      QuantizeRowsFp8(s, T, g.x[r].data(), round_scale, q[r].data(), qs[r].data(), exec);
      for (int t = 0; t < T; ++t) {
        std::vector<e4m3_bits> one(H);
        std::vector<float> one_s(S);
        QuantizeRowFp8(g.x[r].data() + t * H, H, round_scale, one.data(), one_s.data());
        ASSERT_EQ(std::memcmp(one.data(), q[r].data() + t * H, H), 0) << "rank " << r << " t " << t;
        ASSERT_EQ(std::memcmp(one_s.data(), qs[r].data() + t * S, 4 * S), 0) << "rank " << r;
      }
      src[r] = {T,
                cached ? nullptr : g.topk[r].data(),
                cached ? send_pos[r].data() : nullptr,
                fp8 ? static_cast<const void*>(g.x_fp8[r].data()) : g.x[r].data(),
                fp8 ? H : 2 * H,
                fp8 ? g.scales[r].data() : nullptr,
                cached ? nullptr : g.weights[r].data()};
    }
    struct Packed {
      std::vector<int32_t> token, pos;
      std::vector<int64_t> idx;
      std::vector<float> w, sc;
      std::vector<uint8_t> x;
      int32_t rows = -1;
    };
    const size_t M = s.max_tokens_per_rank;
    auto garbage = [&] {
      Packed p;
      p.token = Garbage<int32_t>(M);
      p.pos = Garbage<int32_t>(M * R);
      p.idx = Garbage<int64_t>(M * K);
      p.w = Garbage<float>(M * K);
      p.sc = Garbage<float>(M * S);
      p.x = Garbage<uint8_t>(M * H * 2);
      return p;
    };
    std::vector<Packed> got(static_cast<size_t>(R) * nodes);
    std::vector<NodePackJob> jobs;
    for (int r = 0; r < R; ++r) {
      for (int n = 0; n < nodes; ++n) {
        Packed& p = got[r * nodes + n];
        p = garbage();
        jobs.push_back({&src[r], g.Node(n), p.token.data(), cached ? nullptr : p.idx.data(),
                        cached ? p.pos.data() : nullptr, cached ? nullptr : p.w.data(), p.x.data(),
                        fp8 ? p.sc.data() : nullptr, &p.rows});
      }
    }
    PackNodeRows(s, jobs, exec);
    for (int r = 0; r < R; ++r) {
      for (int n = 0; n < nodes; ++n) {
        Packed want = garbage();
        int m = 0;
        const int64_t xb = fp8 ? H : 2 * H;
        for (int t = 0; t < g.tokens[r]; ++t) {
          const int32_t* pos = send_pos[r].data() + t * R;
          const int64_t* idx = g.topk[r].data() + t * K;
          if (!GoesToNode(s, g.Node(n), cached ? nullptr : idx, cached ? pos : nullptr)) continue;
          want.token[m] = t;
          if (cached) {
            std::copy(pos, pos + R, want.pos.begin() + m * R);
          } else {
            std::copy(idx, idx + K, want.idx.begin() + m * K);
            std::copy(g.weights[r].begin() + t * K, g.weights[r].begin() + (t + 1) * K,
                      want.w.begin() + m * K);
          }
          const auto* x = fp8 ? g.x_fp8[r].data() + t * H
                              : reinterpret_cast<const uint8_t*>(g.x[r].data() + t * H);
          std::copy(x, x + xb, want.x.begin() + m * xb);
          if (fp8) {
            std::copy(g.scales[r].begin() + t * S, g.scales[r].begin() + (t + 1) * S,
                      want.sc.begin() + m * S);
          }
          ++m;
        }
        const Packed& p = got[r * nodes + n];
        EXPECT_EQ(p.rows, m) << "rank " << r << " node " << n;
        EXPECT_TRUE(p.token == want.token && p.pos == want.pos && p.idx == want.idx &&
                    std::memcmp(p.w.data(), want.w.data(), 4 * p.w.size()) == 0 &&
                    std::memcmp(p.sc.data(), want.sc.data(), 4 * p.sc.size()) == 0 && p.x == want.x)
            << "rank " << r << " node " << n;
      }
    }
    // Rows on the backend: with x_sources the rows are recorded, not copied, and GatherRows
    // of the record writes what the copy wrote. The sources point at decoys that the windows
    // map onto the real rows, so a row read without its window is wrong.
    for (int r = 0; r < R; ++r) {
      const int T = g.tokens[r];
      const int64_t xb = fp8 ? H : 2 * H;
      const auto* real_x = static_cast<const uint8_t*>(src[r].x);
      std::vector<uint8_t> decoy_x = Garbage<uint8_t>(static_cast<size_t>(T) * xb + 1);
      std::vector<float> decoy_s = Garbage<float>(static_cast<size_t>(T) * S + 1);
      NodePackSource decoy = src[r];
      decoy.x = decoy_x.data();
      if (fp8) decoy.x_scales = decoy_s.data();
      const GatherWindow windows[] = {
          {decoy_x.data(), decoy_x.size(), real_x},
          {reinterpret_cast<const uint8_t*>(decoy_s.data()), 4 * decoy_s.size(),
           reinterpret_cast<const uint8_t*>(fp8 ? g.scales[r].data() : nullptr)}};
      for (int n = 0; n < nodes; ++n) {
        Packed p = garbage();
        const std::vector<uint8_t> x_before = p.x;
        const std::vector<float> scales_before = p.sc;
        std::vector<RowSource> table(M, RowSource{});
        const NodePackJob job{&decoy,
                              g.Node(n),
                              p.token.data(),
                              cached ? nullptr : p.idx.data(),
                              cached ? p.pos.data() : nullptr,
                              cached ? nullptr : p.w.data(),
                              p.x.data(),
                              fp8 ? p.sc.data() : nullptr,
                              &p.rows,
                              table.data()};
        PackNodeRows(s, {&job, 1}, exec);
        EXPECT_EQ(p.x, x_before) << "x copied although recorded";
        EXPECT_EQ(std::memcmp(p.sc.data(), scales_before.data(), 4 * p.sc.size()), 0)
            << "scales copied although recorded";
        RowGather rg;
        rg.x = p.x.data();
        rg.row_bytes = xb;
        rg.blocks = 1;
        rg.block_rows = static_cast<int64_t>(M);
        rg.counts = &p.rows;
        rg.sources = table.data();
        rg.scales_kind = fp8 ? GatherScales::kRows : GatherScales::kNone;
        rg.scales = p.sc.data();
        GatherRows(s, rg, std::span(windows, fp8 ? 2 : 1));
        const Packed& want = got[r * nodes + n];
        EXPECT_EQ(p.rows, want.rows) << "rank " << r << " node " << n;
        EXPECT_TRUE(p.token == want.token && p.pos == want.pos && p.idx == want.idx &&
                    std::memcmp(p.w.data(), want.w.data(), 4 * p.w.size()) == 0 &&
                    std::memcmp(p.sc.data(), want.sc.data(), 4 * p.sc.size()) == 0 && p.x == want.x)
            << "recorded, then gathered: rank " << r << " node " << n;
      }
    }
  }
}

TEST(HostNodeOps, RowsDisagreeingWithTheirCountsAreRefused) {
  std::mt19937 rng(5);
  Group g = MakeGroup(rng, 2, false, 128);
  const GroupShape& s = g.shape;
  const int R = g.R();
  const NodeRanks node = g.Node(0);
  std::vector<int32_t> counts(static_cast<size_t>(R) * R, 0);
  // A remote source claims one row for a local rank but presents none.
  const int remote = node.first + node.count;
  counts[static_cast<size_t>(remote) * R + node.first] = 1;
  std::vector<NodeDispatchSource> src(R);
  std::vector<int64_t> idx(s.num_topk, -1);
  for (int r = node.first; r < node.first + node.count; ++r) {
    src[r] = {0, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  }
  std::vector<DispatchOut> out(node.count, DispatchOut(s));
  std::vector<DispatchRankArgs> local(node.count);
  for (int i = 0; i < node.count; ++i) out[i].Into(local[i], s, false);
  absl::Status st = NodeDispatch(s, {}, false, node, counts, src, local);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("source rank"), std::string::npos) << st;
  // Counts out of range.
  counts[0] = -5;
  st = NodeDispatch(s, {}, false, node, counts, src, local);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  // Token indices not ascending.
  counts.assign(counts.size(), 0);
  std::vector<int32_t> ids = {1, 1};
  std::vector<uint8_t> x(2 * 2 * s.hidden);
  std::vector<int64_t> idx2(2 * s.num_topk, -1);
  src[remote] = {2, ids.data(), x.data(), nullptr, idx2.data(), nullptr, nullptr};
  st = NodeDispatch(s, {}, false, node, counts, src, local);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  for (int i = 0; i < node.count; ++i) EXPECT_TRUE(out[i] == DispatchOut(s));
}

}  // namespace
}  // namespace epd::kernels::host
