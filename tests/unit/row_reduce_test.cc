// The row reduce (epd/kernels/row_reduce.h): Combine and LowLatencyCombine recording their
// terms (CombineRankArgs::reduce) then kernels::host::ReduceRows equal, bit for bit, the
// same combine summing (random groups: ranks, hidden sizes that are not multiples of the
// reduce's channel blocks, top-k, weights or not, rows of a rank only partly present as a
// node holds them, routes to nowhere and masked experts, infinities and NaN). Recording
// writes no output; the terms' order and every term matter (reversing or dropping them
// changes the result), so a reduce that missed a term or summed out of order fails. And
// CombineRowReduce (mirror_spans.h), the reduce a backend runs after a recorded combine.
#include "epd/kernels/row_reduce.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "daemon/dataplane/exchange/mirror_spans.h"
#include "epd/kernels/host_node_ops.h"
#include "epd/kernels/host_ops.h"
#include "epd/kernels/layout.h"
#include "epd/kernels/types.h"
#include "proto/abi/shm_abi.h"

namespace epd::kernels::host {
namespace {

// Outputs start as 0xA5 bytes.
constexpr bf16_bits kGarbageBf16 = 0xA5A5;
const float kGarbageF32 = std::bit_cast<float>(0xA5A5A5A5u);

template <typename T>
bool SameBytes(const std::vector<T>& a, const std::vector<T>& b) {
  // memcmp is never given the null data() of an empty vector.
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

/// bf16 values of mixed magnitudes, an eighth of them +-2^30 (sums that cancel them show
/// the order of the f32 additions: 1 + 2^30 - 2^30 is 0 in f32, 2^30 - 2^30 + 1 is 1), with
/// `specials`: an infinity of each sign and a NaN among them.
std::vector<bf16_bits> Rows(std::mt19937& rng, size_t n, bool specials) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<bf16_bits> v(n);
  for (auto& b : v) {
    const float big = rng() % 2 == 0 ? 0x1p30f : -0x1p30f;
    b = FloatToBf16(
        rng() % 8 == 0 ? big : dist(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 24) - 8));
  }
  if (specials && n > 0) {
    constexpr float kInf = std::numeric_limits<float>::infinity();
    for (const float f : {kInf, -kInf, std::numeric_limits<float>::quiet_NaN()}) {
      v[rng() % n] = FloatToBf16(f);
    }
  }
  return v;
}

/// One rank's table and outputs of a recorded combine.
struct Recorded {
  std::vector<ReduceTerm> terms;
  ReduceTable table;
};

std::vector<Recorded> Tables(const GroupShape& s) {
  std::vector<Recorded> t(s.num_ranks);
  for (Recorded& r : t) {
    r.terms.assign(static_cast<size_t>(ReduceTableRows(s)) * ReduceTermsPerRow(s), ReduceTerm{});
    r.table.terms = r.terms.data();
  }
  return t;
}

/// R ranks of 2 experts each, `hidden`, top-`K`, M and Mll tokens per rank.
GroupShape Shape(int R, int hidden, int K, int M, int Mll) {
  GroupShape s;
  s.num_ranks = R;
  s.num_experts = 2 * R;
  s.hidden = hidden;
  s.num_topk = K;
  s.max_tokens_per_rank = M;
  s.ll_max_tokens_per_rank = Mll;
  return s;
}

/// One rank of a normal combine: its T, N, first row present and routing, its rows.
struct NormalRank {
  int32_t tokens = 0, recv = 0, first_row = 0;
  std::vector<int32_t> send_pos;  // [T, R]
  std::vector<bf16_bits> x;       // [N - first_row, H]
  std::vector<float> weights;     // [N - first_row, K]
};

/// A normal combine of a random group. `partial`: ranks hold only rows from a random first
/// row on (as a node holds another node's rank).
struct NormalCase {
  GroupShape shape;
  std::vector<NormalRank> ranks;
};

NormalCase MakeNormal(std::mt19937& rng, int R, int hidden, int K, bool partial, bool specials) {
  NormalCase c{Shape(R, hidden, K, 9, 4), std::vector<NormalRank>(R)};
  std::uniform_real_distribution<float> w(-2.0f, 2.0f);
  for (NormalRank& a : c.ranks) {
    a.tokens = static_cast<int32_t>(rng() % (c.shape.max_tokens_per_rank + 1));
    a.recv = 1 + static_cast<int32_t>(rng() % c.shape.max_recv_tokens());
    if (partial) a.first_row = static_cast<int32_t>(rng() % a.recv);
    const size_t present = static_cast<size_t>(a.recv - a.first_row);
    a.x = Rows(rng, present * hidden, specials);
    for (size_t i = 0; i < present * K; ++i) a.weights.push_back(w(rng));
  }
  for (NormalRank& src : c.ranks) {
    src.send_pos.assign(static_cast<size_t>(src.tokens) * R, -1);
    for (int t = 0; t < src.tokens; ++t) {
      // At most min(K, R) ranks, a random row of each (some tokens go nowhere).
      std::vector<int> order(R);
      for (int r = 0; r < R; ++r) order[r] = r;
      std::shuffle(order.begin(), order.end(), rng);
      const int n = static_cast<int>(rng() % (std::min(K, R) + 1));
      for (int i = 0; i < n; ++i) {
        const NormalRank& dst = c.ranks[order[i]];
        src.send_pos[static_cast<size_t>(t) * R + order[i]] =
            dst.first_row + static_cast<int32_t>(rng() % (dst.recv - dst.first_row));
      }
    }
  }
  return c;
}

/// Runs the combine with outputs starting as garbage; `tables`: recording into them.
absl::Status RunNormal(NormalCase& c, bool with_weights, std::vector<std::vector<bf16_bits>>* out,
                       std::vector<std::vector<float>>* out_w, std::vector<Recorded>* tables) {
  const GroupShape& s = c.shape;
  std::vector<CombineRankArgs> args(s.num_ranks);
  out->assign(s.num_ranks, {});
  out_w->assign(s.num_ranks, {});
  for (int r = 0; r < s.num_ranks; ++r) {
    (*out)[r].assign(static_cast<size_t>(s.max_tokens_per_rank) * s.hidden, kGarbageBf16);
    (*out_w)[r].assign(static_cast<size_t>(s.max_tokens_per_rank) * s.num_topk, kGarbageF32);
    const NormalRank& in = c.ranks[r];
    CombineRankArgs& a = args[r];
    a.num_tokens = in.tokens;
    a.send_pos = in.send_pos.data();
    a.num_recv_tokens = in.recv;
    a.x = in.x.data();
    a.topk_weights = with_weights ? in.weights.data() : nullptr;
    a.combined_x = (*out)[r].data();
    a.combined_topk_weights = with_weights ? (*out_w)[r].data() : nullptr;
    a.x_first_row = in.first_row;
    a.reduce = tables != nullptr ? &(*tables)[r].table : nullptr;
  }
  return Combine(s, args, {2});
}

/// ReduceRows of every rank's table into outputs starting as garbage.
void ReduceAll(const GroupShape& s, std::vector<Recorded>& tables, bool weighted, bool with_weights,
               std::vector<std::vector<bf16_bits>>* out, std::vector<std::vector<float>>* out_w) {
  const int32_t M = ReduceTableRows(s);
  out->assign(s.num_ranks, std::vector<bf16_bits>(static_cast<size_t>(M) * s.hidden, kGarbageBf16));
  out_w->assign(s.num_ranks, std::vector<float>(static_cast<size_t>(M) * s.num_topk, kGarbageF32));
  for (int r = 0; r < s.num_ranks; ++r) {
    RowReduce rr;
    rr.combined_x = (*out)[r].data();
    rr.combined_topk_weights = with_weights ? (*out_w)[r].data() : nullptr;
    rr.rows = tables[r].table.rows;
    rr.terms_per_row = ReduceTermsPerRow(s);
    rr.terms = tables[r].terms.data();
    rr.weighted = weighted;
    ReduceRows(s, rr);
  }
}

/// The first `rows` rows of `v` ([*, width]).
template <typename T>
std::vector<T> Head(const std::vector<T>& v, int64_t rows, int64_t width) {
  return std::vector<T>(v.begin(), v.begin() + rows * width);
}

TEST(HostRowReduceTest, RecordedNormalCombineReducesToTheCombine) {
  std::mt19937 rng(11);
  int cases = 0;
  for (const int R : {1, 3, 5}) {
    for (const int hidden : {1, 7, 256, 300, 1031}) {
      for (const int K : {1, 2, 4}) {
        for (const bool with_weights : {false, true}) {
          for (const bool partial : {false, true}) {
            SCOPED_TRACE(::testing::Message()
                         << "R " << R << " hidden " << hidden << " K " << K << " weights "
                         << with_weights << " partial " << partial);
            NormalCase c = MakeNormal(rng, R, hidden, K, partial, /*specials=*/hidden > 200);
            std::vector<std::vector<bf16_bits>> want, rec_x, got;
            std::vector<std::vector<float>> want_w, rec_w, got_w;
            ASSERT_TRUE(RunNormal(c, with_weights, &want, &want_w, nullptr).ok());
            std::vector<Recorded> tables = Tables(c.shape);
            ASSERT_TRUE(RunNormal(c, with_weights, &rec_x, &rec_w, &tables).ok());
            ReduceAll(c.shape, tables, /*weighted=*/false, with_weights, &got, &got_w);
            for (int r = 0; r < R; ++r) {
              // Recording writes no output.
              EXPECT_EQ(rec_x[r], std::vector<bf16_bits>(rec_x[r].size(), kGarbageBf16))
                  << "rank " << r;
              const int T = c.ranks[r].tokens;
              EXPECT_EQ(tables[r].table.rows, T);
              EXPECT_TRUE(SameBytes(Head(got[r], T, hidden), Head(want[r], T, hidden)))
                  << "rank " << r;
              if (with_weights) {
                EXPECT_TRUE(SameBytes(Head(got_w[r], T, K), Head(want_w[r], T, K))) << "rank " << r;
              }
              // Nothing past the rows.
              EXPECT_TRUE(std::all_of(got[r].begin() + int64_t{T} * hidden, got[r].end(),
                                      [](bf16_bits b) { return b == kGarbageBf16; }));
            }
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 3 * 5 * 3 * 2 * 2);
}

/// One rank of a low-latency combine: its T and routing, and of its expert j the rows
/// [first[j], first[j] + num[j]) present, at row block_start[j] of x.
struct LowLatencyRank {
  int32_t tokens = 0;
  std::vector<int64_t> topk_idx;  // [T, K]
  std::vector<float> weights;     // [T, K]
  std::vector<int32_t> handle_pos, first, num;
  std::vector<int64_t> block_start;
  std::vector<bf16_bits> x;
};

/// A low-latency combine of a random group; `partial` as for NormalCase.
struct LowLatencyCase {
  GroupShape shape;
  std::vector<LowLatencyRank> ranks;
};

LowLatencyCase MakeLowLatency(std::mt19937& rng, int R, int hidden, int K, bool partial,
                              bool specials) {
  LowLatencyCase c{Shape(R, hidden, K, 3, 7), std::vector<LowLatencyRank>(R)};
  const GroupShape& s = c.shape;
  const int El = s.num_local_experts();
  const int32_t rpe = static_cast<int32_t>(s.ll_rows_per_expert());
  for (LowLatencyRank& a : c.ranks) {
    int64_t rows = 0;
    for (int j = 0; j < El; ++j) {
      const int32_t f = partial ? static_cast<int32_t>(rng() % rpe) : 0;
      const int32_t n = partial ? 1 + static_cast<int32_t>(rng() % (rpe - f)) : rpe;
      a.first.push_back(f);
      a.num.push_back(n);
      a.block_start.push_back(rows);
      rows += partial ? n : rpe;
    }
    a.x = Rows(rng, static_cast<size_t>(rows) * hidden, specials);
  }
  std::uniform_real_distribution<float> w(-2.0f, 2.0f);
  for (LowLatencyRank& src : c.ranks) {
    src.tokens = static_cast<int32_t>(rng() % (s.ll_max_tokens_per_rank + 1));
    for (int64_t i = 0; i < int64_t{src.tokens} * K; ++i) {
      // A quarter masked (-1); the rest any expert (repeats included).
      const int64_t e = rng() % 4 == 0 ? -1 : static_cast<int64_t>(rng() % s.num_experts);
      src.topk_idx.push_back(e);
      src.weights.push_back(w(rng));
      int32_t pos = 0;
      if (e >= 0) {
        const LowLatencyRank& owner = c.ranks[e / El];
        pos = owner.first[e % El] + static_cast<int32_t>(rng() % owner.num[e % El]);
      }
      src.handle_pos.push_back(pos);
    }
  }
  return c;
}

absl::Status RunLowLatency(LowLatencyCase& c, bool partial,
                           std::vector<std::vector<bf16_bits>>* out,
                           std::vector<Recorded>* tables) {
  const GroupShape& s = c.shape;
  std::vector<LowLatencyCombineRankArgs> args(s.num_ranks);
  out->assign(s.num_ranks,
              std::vector<bf16_bits>(static_cast<size_t>(s.ll_max_tokens_per_rank) * s.hidden,
                                     kGarbageBf16));
  for (int r = 0; r < s.num_ranks; ++r) {
    const LowLatencyRank& in = c.ranks[r];
    LowLatencyCombineRankArgs& a = args[r];
    a.num_tokens = in.tokens;
    a.topk_idx = in.topk_idx.data();
    a.topk_weights = in.weights.data();
    a.handle_pos = in.handle_pos.data();
    a.x = in.x.data();
    a.combined_x = (*out)[r].data();
    if (partial) {
      a.x_first_row = in.first.data();
      a.x_num_rows = in.num.data();
      a.x_block_start = in.block_start.data();
    }
    a.reduce = tables != nullptr ? &(*tables)[r].table : nullptr;
  }
  return LowLatencyCombine(s, args, {2});
}

TEST(HostRowReduceTest, RecordedLowLatencyCombineReducesToTheCombine) {
  std::mt19937 rng(12);
  for (const int R : {1, 2, 4}) {
    for (const int hidden : {1, 9, 256, 520}) {
      for (const int K : {1, 3, 8}) {
        for (const bool partial : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "R " << R << " hidden " << hidden << " K " << K
                                            << " partial " << partial);
          LowLatencyCase c = MakeLowLatency(rng, R, hidden, K, partial, /*specials=*/hidden > 200);
          std::vector<std::vector<bf16_bits>> want, rec, got;
          std::vector<std::vector<float>> unused;
          ASSERT_TRUE(RunLowLatency(c, partial, &want, nullptr).ok());
          std::vector<Recorded> tables = Tables(c.shape);
          ASSERT_TRUE(RunLowLatency(c, partial, &rec, &tables).ok());
          ReduceAll(c.shape, tables, /*weighted=*/true, /*with_weights=*/false, &got, &unused);
          for (int r = 0; r < R; ++r) {
            EXPECT_EQ(rec[r], std::vector<bf16_bits>(rec[r].size(), kGarbageBf16)) << "rank " << r;
            const int T = c.ranks[r].tokens;
            EXPECT_EQ(tables[r].table.rows, T);
            EXPECT_TRUE(SameBytes(Head(got[r], T, hidden), Head(want[r], T, hidden)))
                << "rank " << r;
          }
        }
      }
    }
  }
}

// What makes the tests above able to fail: with these inputs, summing a row's terms in
// another order, or without one of them, gives other bytes.
TEST(HostRowReduceTest, TheTermsOrderAndEveryTermShowInTheResult) {
  std::mt19937 rng(13);
  NormalCase c = MakeNormal(rng, 5, 1031, 4, /*partial=*/false, /*specials=*/false);
  std::vector<std::vector<bf16_bits>> want, rec, got;
  std::vector<std::vector<float>> want_w, rec_w, got_w;
  ASSERT_TRUE(RunNormal(c, /*with_weights=*/true, &want, &want_w, nullptr).ok());
  std::vector<Recorded> tables = Tables(c.shape);
  ASSERT_TRUE(RunNormal(c, true, &rec, &rec_w, &tables).ok());
  const int K = c.shape.num_topk, H = c.shape.hidden;
  auto differs = [&](const std::vector<Recorded>& t) {
    std::vector<Recorded> copy = t;
    for (Recorded& r : copy) r.table.terms = r.terms.data();
    ReduceAll(c.shape, copy, false, true, &got, &got_w);
    bool x = false, w = false;
    for (int r = 0; r < 5; ++r) {
      const int T = c.ranks[r].tokens;
      x |= !SameBytes(Head(got[r], T, H), Head(want[r], T, H));
      w |= !SameBytes(Head(got_w[r], T, K), Head(want_w[r], T, K));
    }
    return std::pair<bool, bool>(x, w);
  };
  EXPECT_EQ(differs(tables), std::pair(false, false));
  std::vector<Recorded> reversed = tables, dropped = tables;
  for (int r = 0; r < 5; ++r) {
    for (int t = 0; t < c.ranks[r].tokens; ++t) {
      ReduceTerm* row = reversed[r].terms.data() + static_cast<size_t>(t) * K;
      int n = 0;
      while (n < K && row[n].x != nullptr) ++n;
      std::reverse(row, row + n);
      dropped[r].terms[static_cast<size_t>(t) * K] = ReduceTerm{};
    }
  }
  EXPECT_EQ(differs(reversed), std::pair(true, true));
  EXPECT_EQ(differs(dropped), std::pair(true, true));
}

// A token whose send_pos names more ranks than a table row holds is refused when recording
// (a dispatch never makes one), before anything is written.
TEST(HostRowReduceTest, MoreRanksThanTopkSlotsIsInvalidWhenRecording) {
  std::mt19937 rng(14);
  NormalCase c = MakeNormal(rng, 3, 16, 1, false, false);
  NormalRank& a = c.ranks[0];
  a.tokens = 1;
  a.send_pos = {c.ranks[0].first_row, -1, c.ranks[2].first_row};
  std::vector<std::vector<bf16_bits>> out;
  std::vector<std::vector<float>> out_w;
  ASSERT_TRUE(RunNormal(c, false, &out, &out_w, nullptr).ok());
  std::vector<Recorded> tables = Tables(c.shape);
  const absl::Status st = RunNormal(c, false, &out, &out_w, &tables);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("send_pos of rank 0 at token 0 names 2 ranks"), std::string::npos)
      << st;
  EXPECT_EQ(tables[0].table.rows, 0);
  EXPECT_EQ(out[0], std::vector<bf16_bits>(out[0].size(), kGarbageBf16));
}

// What the backends reduce after a recorded combine (daemon/dataplane/exchange/
// mirror_spans.h): into the op's outputs of the area, the table's rows clamped to the
// table and the outputs, weighted for a low-latency combine; nothing for another op.
TEST(CombineRowReduceTest, TheCombinesOutputsWithTheRowsClamped) {
  const GroupShape s = Shape(4, 64, 3, 6, 5);
  const EndpointLayout L = EndpointLayout::Compute(s);
  std::vector<uint8_t> area(L.total_bytes);
  std::vector<ReduceTerm> terms(static_cast<size_t>(ReduceTableRows(s)) * ReduceTermsPerRow(s));
  ReduceTable table{terms.data(), 4};
  OpPlan plan;
  plan.op = abi::OpKind::kCombine;
  RowReduce r = CombineRowReduce(s, L, plan, area.data(), table);
  EXPECT_EQ(reinterpret_cast<uint8_t*>(r.combined_x), area.data() + L.combined_x.offset);
  EXPECT_EQ(r.combined_topk_weights, nullptr);
  EXPECT_EQ(r.rows, 4);
  EXPECT_EQ(r.terms_per_row, 3);
  EXPECT_EQ(r.terms, terms.data());
  EXPECT_FALSE(r.weighted);
  plan.flags = abi::kFlagCombineWeights;
  r = CombineRowReduce(s, L, plan, area.data(), table);
  EXPECT_EQ(reinterpret_cast<uint8_t*>(r.combined_topk_weights),
            area.data() + L.combined_topk_weights.offset);
  plan = OpPlan{};
  plan.op = abi::OpKind::kLowLatencyCombine;
  plan.ll_out_buffer = 1;
  table.rows = 1 << 30;  // Clamped to the low-latency output's Mll rows.
  r = CombineRowReduce(s, L, plan, area.data(), table);
  EXPECT_EQ(reinterpret_cast<uint8_t*>(r.combined_x), area.data() + L.ll_combined_x[1].offset);
  EXPECT_EQ(r.rows, 5);
  EXPECT_TRUE(r.weighted);
  table.rows = -7;
  EXPECT_EQ(CombineRowReduce(s, L, plan, area.data(), table).rows, 0);
  plan.op = abi::OpKind::kDispatch;
  table.rows = 4;
  EXPECT_EQ(CombineRowReduce(s, L, plan, area.data(), table).rows, 0);
}

}  // namespace
}  // namespace epd::kernels::host
