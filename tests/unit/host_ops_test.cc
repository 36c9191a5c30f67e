// kernels/host ops against a second, deliberately naive oracle written here: per-token loops
// straight from the contract in host_ops.h, sharing no code with kernels/host beyond the
// scalar conversions of types.h. Over a seeded covering sweep of group shapes and routings
// (MakeSweep), routed data and reductions are equal bit for bit (the oracle adds in the
// order host_ops.h states for Combine and LowLatencyCombine). Every case runs as a one-off
// caller and on a persistent HostWorkerPool + HostScratch; PersistentScratchAcrossShapes runs
// cases of different shapes on one pool and scratch. Error cases check the status code, that
// the message names the offending value, and that every output is untouched.
#include "epd/kernels/host_ops.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/host/internal.h"

namespace epd::kernels::host {
namespace {

using ::testing::HasSubstr;

// ---- test data ----------------------------------------------------------------------------

enum class Routing { kUniform, kZipf, kOneExpert };
const char* RoutingName(Routing r) {
  switch (r) {
    case Routing::kUniform:
      return "uniform";
    case Routing::kZipf:
      return "zipf";
    case Routing::kOneExpert:
      return "one_expert";
  }
  return "?";
}

/// One point of the sweep.
struct SweepCase {
  int num_ranks = 1;
  int num_experts = 1;
  int num_topk = 1;
  int hidden = 128;
  int num_tokens = 0;  ///< T of every rank (or the largest, when ragged).
  Routing routing = Routing::kUniform;
  int masked_pct = 0;  ///< Percent of top-k entries set to -1 (0, 30, 100).
  bool fp8 = false;
  int alignment = 1;
  bool ragged = false;  ///< Ranks get different T, some of them 0.
  bool round_scale = false;
  bool ue8m0 = false;  ///< Low-latency dispatch: UE8M0-packed scales (fp8, round_scale, H%512).
  int threads = 1;
  int token_slack = 0;  ///< max_tokens_per_rank (and the low-latency M) = T + token_slack.
  uint64_t seed = 1;

  std::string Name() const {
    std::ostringstream o;
    o << "R" << num_ranks << "_E" << num_experts << "_K" << num_topk << "_H" << hidden << "_T"
      << num_tokens << "_" << RoutingName(routing) << "_mask" << masked_pct
      << (fp8 ? "_fp8" : "_bf16") << "_align" << alignment << (ragged ? "_ragged" : "")
      << (round_scale ? "_rs" : "") << (ue8m0 ? "_ue8m0" : "") << (token_slack ? "_slack" : "")
      << "_thr" << threads;
    return o.str();
  }
};

/// gtest prints a case by its name (not as raw bytes).
void PrintTo(const SweepCase& c, std::ostream* os) { *os << c.Name(); }

/// splitmix64: fast deterministic bulk data.
struct Rng {
  uint64_t state;
  explicit Rng(uint64_t seed) : state(seed * 0x9e3779b97f4a7c15ull + 1) {}
  uint64_t Next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, n).
  uint64_t Below(uint64_t n) { return Next() % n; }
  /// Uniform in [0, 1).
  double Unit() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
};

/// Uninitialized buffer (pages a test never touches cost no memory).
template <typename T>
std::unique_ptr<T[]> Uninit(size_t n) {
  return std::make_unique_for_overwrite<T[]>(n == 0 ? 1 : n);
}

/// Random finite bf16 with magnitudes over 2^-8 .. 2^8, both signs.
bf16_bits RandomBf16(Rng& rng) {
  const uint64_t r = rng.Next();
  const uint16_t sign = static_cast<uint16_t>((r & 1) << 15);
  const uint16_t exp = static_cast<uint16_t>(127 - 8 + ((r >> 1) % 17));
  const uint16_t man = static_cast<uint16_t>((r >> 8) & 0x7f);
  return sign | static_cast<uint16_t>(exp << 7) | man;
}

void FillBf16(bf16_bits* p, size_t n, Rng& rng) {
  for (size_t i = 0; i < n; ++i) p[i] = RandomBf16(rng);
}

/// Inputs of one rank.
struct RankInput {
  int32_t num_tokens = 0;
  std::vector<int64_t> topk_idx;    // [T, K]
  std::vector<float> topk_weights;  // [T, K]
  std::vector<bf16_bits> x;         // [T, H]
  std::vector<e4m3_bits> x_fp8;     // [T, H] (normal FP8 dispatch input)
  std::vector<float> x_scales;      // [T, S]
};

std::vector<RankInput> MakeInputs(const SweepCase& c) {
  Rng rng(c.seed);
  const int S = (c.hidden + 127) / 128;
  // Zipf(1.1) over experts in a seeded random order.
  std::vector<double> cdf(c.num_experts);
  std::vector<int> order(c.num_experts);
  for (int e = 0; e < c.num_experts; ++e) order[e] = e;
  for (int e = c.num_experts - 1; e > 0; --e) std::swap(order[e], order[rng.Below(e + 1)]);
  double total = 0;
  for (int i = 0; i < c.num_experts; ++i) cdf[i] = (total += 1.0 / std::pow(i + 1, 1.1));
  const int hot_expert = static_cast<int>(rng.Below(c.num_experts));

  std::vector<RankInput> in(c.num_ranks);
  for (int s = 0; s < c.num_ranks; ++s) {
    RankInput& r = in[s];
    r.num_tokens = c.num_tokens;
    if (c.ragged) {
      // Rank 1 (and every third rank) sends nothing; the others a random T.
      r.num_tokens = (s % 3 == 1) ? 0 : static_cast<int32_t>(rng.Below(c.num_tokens + 1));
      if (s == 0) r.num_tokens = c.num_tokens;
    }
    const size_t tk = static_cast<size_t>(r.num_tokens) * c.num_topk;
    r.topk_idx.resize(tk);
    r.topk_weights.resize(tk);
    for (size_t i = 0; i < tk; ++i) {
      int64_t e = -1;
      switch (c.routing) {
        case Routing::kUniform:
          e = static_cast<int64_t>(rng.Below(c.num_experts));
          break;
        case Routing::kZipf: {
          const double u = rng.Unit() * total;
          const int i_e =
              static_cast<int>(std::lower_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
          e = order[std::min(i_e, c.num_experts - 1)];
          break;
        }
        case Routing::kOneExpert:
          e = hot_expert;
          break;
      }
      if (static_cast<int>(rng.Below(100)) < c.masked_pct) e = -1;
      r.topk_idx[i] = e;
      r.topk_weights[i] = static_cast<float>(rng.Unit());
    }
    const size_t th = static_cast<size_t>(r.num_tokens) * c.hidden;
    r.x.resize(th);
    FillBf16(r.x.data(), th, rng);
    if (c.fp8) {
      r.x_fp8.resize(th);
      for (size_t i = 0; i < th; ++i) r.x_fp8[i] = static_cast<e4m3_bits>(rng.Next());
      r.x_scales.resize(static_cast<size_t>(r.num_tokens) * S);
      for (float& f : r.x_scales) f = static_cast<float>(rng.Unit());
    }
  }
  return in;
}

GroupShape ShapeOf(const SweepCase& c, int32_t max_tokens, int32_t ll_max_tokens) {
  GroupShape g;
  g.num_ranks = c.num_ranks;
  g.num_experts = c.num_experts;
  g.hidden = c.hidden;
  g.num_topk = c.num_topk;
  g.max_tokens_per_rank = max_tokens;
  g.ll_max_tokens_per_rank = ll_max_tokens;
  g.use_fp8 = c.fp8;
  return g;
}

/// First mismatch of two arrays, compared as raw bytes per element.
template <typename T>
::testing::AssertionResult SameArray(const char* what, const T* want, const T* got, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (std::memcmp(&want[i], &got[i], sizeof(T)) != 0) {
      return ::testing::AssertionFailure() << what << " differs at element " << i << " of " << n
                                           << ": want " << +want[i] << ", got " << +got[i];
    }
  }
  return ::testing::AssertionSuccess();
}

/// data() of a vector, never null: an op tells "given but empty" (T = 0 or N = 0) from
/// "not given" by the pointer, as the engine's shm regions always do.
template <typename T>
const T* NonNull(const std::vector<T>& v) {
  static const T kDummy{};
  return v.empty() ? &kDummy : v.data();
}

// ---- the naive oracle ---------------------------------------------------------------------

/// Normal-mode routing from the definition: rank r receives (s, t) for s ascending, t
/// ascending, when some k of the token names an expert of r.
struct NaiveNormalRouting {
  std::vector<std::vector<std::pair<int, int>>> rows;  // [r] → (s, t) per received row
  std::vector<std::vector<int32_t>> send_pos;          // [s] → [T, R]
};

NaiveNormalRouting NaiveRoute(const SweepCase& c, const std::vector<RankInput>& in) {
  const int R = c.num_ranks, K = c.num_topk, El = c.num_experts / c.num_ranks;
  NaiveNormalRouting out;
  out.rows.resize(R);
  out.send_pos.resize(R);
  for (int s = 0; s < R; ++s) out.send_pos[s].assign(static_cast<size_t>(in[s].num_tokens) * R, -1);
  for (int r = 0; r < R; ++r) {
    for (int s = 0; s < R; ++s) {
      for (int t = 0; t < in[s].num_tokens; ++t) {
        bool hit = false;
        for (int k = 0; k < K; ++k) {
          const int64_t e = in[s].topk_idx[static_cast<size_t>(t) * K + k];
          if (e >= 0 && e / El == r) hit = true;
        }
        if (!hit) continue;
        out.send_pos[s][static_cast<size_t>(t) * R + r] = static_cast<int32_t>(out.rows[r].size());
        out.rows[r].push_back({s, t});
      }
    }
  }
  return out;
}

bool TokenHasExpert(const RankInput& in, int K, int t, int64_t e) {
  for (int k = 0; k < K; ++k) {
    if (in.topk_idx[static_cast<size_t>(t) * K + k] == e) return true;
  }
  return false;
}

/// Low-latency routing: for expert e, (s, t) for s ascending, t ascending, when some k of
/// the token names e (once, however many k do).
struct NaiveLowLatencyRouting {
  std::vector<std::vector<std::pair<int, int>>> rows;  // [e] → (s, t)
  std::vector<std::vector<int32_t>> handle_pos;        // [s] → [T, K]
};

NaiveLowLatencyRouting NaiveRouteLowLatency(const SweepCase& c, const std::vector<RankInput>& in) {
  const int R = c.num_ranks, K = c.num_topk, E = c.num_experts;
  NaiveLowLatencyRouting out;
  out.rows.resize(E);
  out.handle_pos.resize(R);
  for (int s = 0; s < R; ++s) {
    out.handle_pos[s].assign(static_cast<size_t>(in[s].num_tokens) * K, -1);
  }
  // Tokens in (s, t) order; each expert of a token's row takes the next row of its block.
  for (int s = 0; s < R; ++s) {
    for (int t = 0; t < in[s].num_tokens; ++t) {
      for (int k = 0; k < K; ++k) {
        const int64_t e = in[s].topk_idx[static_cast<size_t>(t) * K + k];
        if (e < 0) continue;
        int32_t row = -1;
        for (int j = 0; j < k; ++j) {  // an earlier k with the same expert: same row
          if (in[s].topk_idx[static_cast<size_t>(t) * K + j] == e) {
            row = out.handle_pos[s][static_cast<size_t>(t) * K + j];
          }
        }
        if (row < 0) {
          row = static_cast<int32_t>(out.rows[e].size());
          out.rows[e].push_back({s, t});
        }
        out.handle_pos[s][static_cast<size_t>(t) * K + k] = row;
      }
    }
  }
  return out;
}

/// FP8 quantization of one row from the definition: per 128 channels, amax over |x|,
/// scale = max(amax, 1e-4) / 448 (rounded up to a power of two with round_scale), value
/// = nearest e4m3 of x / scale.
void NaiveQuantize(const bf16_bits* x, int H, bool round_scale, std::vector<e4m3_bits>& q,
                   std::vector<float>& scales) {
  q.assign(H, 0);
  scales.assign((H + 127) / 128, 0.0f);
  for (int b = 0; b * 128 < H; ++b) {
    float amax = 0.0f;
    for (int h = b * 128; h < std::min(H, b * 128 + 128); ++h) {
      amax = std::max(amax, std::fabs(Bf16ToFloat(x[h])));
    }
    float scale = std::max(amax, 1e-4f) / 448.0f;
    if (round_scale) {
      int e;
      const float m = std::frexp(scale, &e);
      if (m != 0.5f) scale = std::ldexp(1.0f, e);
    }
    scales[b] = scale;
    for (int h = b * 128; h < std::min(H, b * 128 + 128); ++h) {
      q[h] = FloatToE4m3(Bf16ToFloat(x[h]) / scale);
    }
  }
}

// ---- one sweep case, end to end ----------------------------------------------------------

/// Output buffers of one rank's normal dispatch, sized from the oracle's count plus one
/// guard row that must stay untouched.
struct DispatchOut {
  int64_t capacity = 0;
  std::unique_ptr<uint8_t[]> recv_x;
  std::unique_ptr<float[]> recv_scales;
  std::vector<int64_t> recv_topk_idx;
  std::vector<float> recv_topk_weights;
  std::vector<int32_t> recv_tokens_per_expert;
  std::vector<int32_t> recv_src_info;
  std::vector<int32_t> send_pos;
  std::vector<int32_t> rank_prefix;
};

constexpr uint8_t kGuardByte = 0xA5;

/// How a sweep case runs: as a one-off caller, or on the pool and scratch shared by every
/// case run in this process.
enum class Exec { kOneOff, kPersistent };

HostExecution ExecOf(const SweepCase& c, Exec how) {
  static HostWorkerPool pool;  // Shared by every case run in this process.
  static HostScratch scratch;
  if (how == Exec::kOneOff) return HostExecution{c.threads};
  return HostExecution{c.threads, &pool, &scratch};
}

void RunNormal(const SweepCase& c, const std::vector<RankInput>& in, Exec how) {
  const int R = c.num_ranks, K = c.num_topk, E = c.num_experts, H = c.hidden;
  const int El = E / R, S = (H + 127) / 128;
  const int32_t M = c.num_tokens + c.token_slack;
  const GroupShape shape = ShapeOf(c, M, 0);
  const HostExecution exec = ExecOf(c, how);
  const NaiveNormalRouting naive = NaiveRoute(c, in);

  // GetDispatchLayout, rank by rank.
  for (int s = 0; s < R; ++s) {
    const int T = in[s].num_tokens;
    std::vector<int32_t> per_rank(R, -7), per_expert(E, -7);
    std::vector<uint8_t> in_rank(static_cast<size_t>(T) * R, 7);
    LayoutRankArgs a;
    a.num_tokens = T;
    a.topk_idx = in[s].topk_idx.data();
    a.num_tokens_per_rank = per_rank.data();
    a.num_tokens_per_expert = per_expert.data();
    a.is_token_in_rank = in_rank.data();
    ASSERT_TRUE(GetDispatchLayout(shape, a, exec).ok());
    std::vector<int32_t> want_rank(R, 0), want_expert(E, 0);
    std::vector<uint8_t> want_in(static_cast<size_t>(T) * R, 0);
    for (int t = 0; t < T; ++t) {
      for (int r = 0; r < R; ++r) {
        want_in[static_cast<size_t>(t) * R + r] =
            naive.send_pos[s][static_cast<size_t>(t) * R + r] >= 0;
        want_rank[r] += want_in[static_cast<size_t>(t) * R + r];
      }
      for (int e = 0; e < E; ++e) want_expert[e] += TokenHasExpert(in[s], K, t, e);
    }
    ASSERT_TRUE(SameArray("num_tokens_per_rank", want_rank.data(), per_rank.data(), R))
        << "rank " << s;
    ASSERT_TRUE(SameArray("num_tokens_per_expert", want_expert.data(), per_expert.data(), E))
        << "rank " << s;
    ASSERT_TRUE(SameArray("is_token_in_rank", want_in.data(), in_rank.data(), want_in.size()))
        << "rank " << s;
  }

  // Dispatch.
  const int64_t x_row_bytes = c.fp8 ? H : 2 * H;
  std::vector<DispatchOut> out(R);
  std::vector<DispatchRankArgs> args(R);
  for (int r = 0; r < R; ++r) {
    DispatchOut& o = out[r];
    o.capacity = static_cast<int64_t>(naive.rows[r].size());
    const size_t rows = static_cast<size_t>(o.capacity) + 1;  // + guard row
    o.recv_x = Uninit<uint8_t>(rows * x_row_bytes);
    std::memset(o.recv_x.get() + o.capacity * x_row_bytes, kGuardByte, x_row_bytes);
    if (c.fp8) {
      o.recv_scales = Uninit<float>(rows * S);
      std::fill_n(o.recv_scales.get() + o.capacity * S, S, -3.0f);
    }
    o.recv_topk_idx.assign(rows * K, -9);
    o.recv_topk_weights.assign(rows * K, -9.0f);
    o.recv_tokens_per_expert.assign(El, -9);
    o.recv_src_info.assign(rows, -9);
    o.send_pos.assign(static_cast<size_t>(in[r].num_tokens) * R, -9);
    o.rank_prefix.assign(R, -9);
    DispatchRankArgs& a = args[r];
    a.num_tokens = in[r].num_tokens;
    a.x = c.fp8 ? static_cast<const void*>(in[r].x_fp8.data()) : in[r].x.data();
    a.x_scales = c.fp8 ? in[r].x_scales.data() : nullptr;
    a.topk_idx = in[r].topk_idx.data();
    a.topk_weights = in[r].topk_weights.data();
    a.recv_capacity = o.capacity;
    a.recv_x = o.recv_x.get();
    a.recv_scales = o.recv_scales.get();
    a.recv_topk_idx = o.recv_topk_idx.data();
    a.recv_topk_weights = o.recv_topk_weights.data();
    a.recv_tokens_per_expert = o.recv_tokens_per_expert.data();
    a.recv_src_info = o.recv_src_info.data();
    a.send_pos = o.send_pos.data();
    a.rank_prefix = o.rank_prefix.data();
    a.num_recv_tokens = -9;
  }
  DispatchOptions options;
  options.fp8 = c.fp8;
  options.expert_alignment = c.alignment;
  const absl::Status st = Dispatch(shape, options, args, exec);
  ASSERT_TRUE(st.ok()) << st;

  for (int r = 0; r < R; ++r) {
    const DispatchOut& o = out[r];
    const auto& rows = naive.rows[r];
    ASSERT_EQ(args[r].num_recv_tokens, static_cast<int32_t>(rows.size())) << "rank " << r;
    ASSERT_TRUE(
        SameArray("send_pos", naive.send_pos[r].data(), o.send_pos.data(), o.send_pos.size()))
        << "rank " << r;
    for (int s = 0; s < R; ++s) {
      int32_t before = 0;
      for (const auto& [src, t] : rows) before += src < s;
      ASSERT_EQ(o.rank_prefix[s], before) << "rank_prefix of rank " << r << " source " << s;
    }
    for (int j = 0; j < El; ++j) {
      int32_t n = 0;
      for (const auto& [s, t] : rows)
        n += TokenHasExpert(in[s], K, t, static_cast<int64_t>(r) * El + j);
      while (n % c.alignment != 0) ++n;
      ASSERT_EQ(o.recv_tokens_per_expert[j], n) << "rank " << r << " local expert " << j;
    }
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto [s, t] = rows[i];
      const void* want_x = c.fp8
                               ? static_cast<const void*>(&in[s].x_fp8[static_cast<size_t>(t) * H])
                               : &in[s].x[static_cast<size_t>(t) * H];
      ASSERT_EQ(std::memcmp(o.recv_x.get() + i * x_row_bytes, want_x, x_row_bytes), 0)
          << "recv_x row " << i << " of rank " << r << " (source " << s << " token " << t << ")";
      if (c.fp8) {
        ASSERT_TRUE(SameArray("recv_scales", &in[s].x_scales[static_cast<size_t>(t) * S],
                              o.recv_scales.get() + i * S, S))
            << "row " << i << " rank " << r;
      }
      ASSERT_EQ(o.recv_src_info[i], s * M + t) << "row " << i << " rank " << r;
      for (int k = 0; k < K; ++k) {
        const int64_t e = in[s].topk_idx[static_cast<size_t>(t) * K + k];
        const bool local = e >= 0 && e / El == r;
        ASSERT_EQ(o.recv_topk_idx[i * K + k], local ? e - static_cast<int64_t>(r) * El : -1)
            << "row " << i << " k " << k << " rank " << r;
        const float w = local ? in[s].topk_weights[static_cast<size_t>(t) * K + k] : 0.0f;
        ASSERT_EQ(o.recv_topk_weights[i * K + k], w) << "row " << i << " k " << k << " rank " << r;
      }
    }
    // The guard row past N is untouched.
    for (int64_t b = 0; b < x_row_bytes; ++b) {
      ASSERT_EQ(o.recv_x[o.capacity * x_row_bytes + b], kGuardByte) << "rank " << r;
    }
    ASSERT_EQ(o.recv_src_info[o.capacity], -9) << "rank " << r;
    ASSERT_EQ(o.recv_topk_idx[o.capacity * K], -9) << "rank " << r;
  }

  // Combine: each rank's "expert output" is random bf16 over its received rows.
  Rng rng(c.seed ^ 0xc0b1);
  std::vector<std::unique_ptr<bf16_bits[]>> y(R);
  std::vector<std::vector<float>> y_weights(R);
  std::vector<std::unique_ptr<bf16_bits[]>> combined(R);
  std::vector<std::vector<float>> combined_weights(R);
  std::vector<CombineRankArgs> cargs(R);
  for (int r = 0; r < R; ++r) {
    const size_t n = naive.rows[r].size();
    y[r] = Uninit<bf16_bits>(n * H);
    FillBf16(y[r].get(), n * H, rng);
    y_weights[r].resize(n * K);
    for (float& w : y_weights[r]) w = static_cast<float>(rng.Unit());
    combined[r] = Uninit<bf16_bits>(static_cast<size_t>(in[r].num_tokens) * H);
    combined_weights[r].assign(static_cast<size_t>(in[r].num_tokens) * K, -9.0f);
    CombineRankArgs& a = cargs[r];
    a.num_tokens = in[r].num_tokens;
    a.send_pos = out[r].send_pos.data();
    a.num_recv_tokens = static_cast<int32_t>(n);
    a.x = y[r].get();
    a.topk_weights = NonNull(y_weights[r]);
    a.combined_x = combined[r].get();
    a.combined_topk_weights = combined_weights[r].data();
  }
  const absl::Status cst = Combine(shape, cargs, exec);
  ASSERT_TRUE(cst.ok()) << cst;
  std::vector<float> acc(H);
  std::vector<bf16_bits> want(H);
  for (int s = 0; s < R; ++s) {
    for (int t = 0; t < in[s].num_tokens; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int r = 0; r < R; ++r) {
        const int32_t row = naive.send_pos[s][static_cast<size_t>(t) * R + r];
        if (row < 0) continue;
        for (int h = 0; h < H; ++h) acc[h] += Bf16ToFloat(y[r][static_cast<size_t>(row) * H + h]);
      }
      for (int h = 0; h < H; ++h) want[h] = FloatToBf16(acc[h]);
      ASSERT_TRUE(
          SameArray("combined_x", want.data(), combined[s].get() + static_cast<size_t>(t) * H, H))
          << "rank " << s << " token " << t;
      for (int k = 0; k < K; ++k) {
        float w = 0.0f;
        for (int r = 0; r < R; ++r) {
          const int32_t row = naive.send_pos[s][static_cast<size_t>(t) * R + r];
          if (row >= 0) w += y_weights[r][static_cast<size_t>(row) * K + k];
        }
        ASSERT_EQ(w, combined_weights[s][static_cast<size_t>(t) * K + k])
            << "combined_topk_weights rank " << s << " token " << t << " k " << k;
      }
    }
  }

  // Cached re-dispatch of new data with the handle: same rows, topk outputs untouched.
  std::vector<std::vector<uint8_t>> x2(R);
  std::vector<std::vector<float>> x2_scales(R);
  for (int r = 0; r < R; ++r) {
    DispatchOut& o = out[r];
    x2[r].resize(static_cast<size_t>(in[r].num_tokens) * x_row_bytes);
    for (uint8_t& b : x2[r]) b = static_cast<uint8_t>(rng.Next());
    if (c.fp8) {
      x2_scales[r].resize(static_cast<size_t>(in[r].num_tokens) * S);
      for (float& f : x2_scales[r]) f = static_cast<float>(rng.Unit());
    }
    std::fill(o.recv_topk_idx.begin(), o.recv_topk_idx.end(), -5);
    std::fill(o.recv_tokens_per_expert.begin(), o.recv_tokens_per_expert.end(), -5);
    DispatchRankArgs& a = args[r];
    a.x = x2[r].data();
    a.x_scales = c.fp8 ? x2_scales[r].data() : nullptr;
    a.topk_idx = nullptr;
    a.topk_weights = nullptr;
    a.cached_send_pos = NonNull(naive.send_pos[r]);
    a.cached_num_recv_tokens = static_cast<int32_t>(naive.rows[r].size());
    a.num_recv_tokens = -9;
    std::fill(o.send_pos.begin(), o.send_pos.end(), -9);
  }
  const absl::Status st2 = Dispatch(shape, options, args, exec);
  ASSERT_TRUE(st2.ok()) << st2;
  for (int r = 0; r < R; ++r) {
    const DispatchOut& o = out[r];
    const auto& rows = naive.rows[r];
    ASSERT_EQ(args[r].num_recv_tokens, static_cast<int32_t>(rows.size()));
    ASSERT_TRUE(SameArray("cached send_pos", naive.send_pos[r].data(), o.send_pos.data(),
                          o.send_pos.size()));
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto [s, t] = rows[i];
      ASSERT_EQ(std::memcmp(o.recv_x.get() + i * x_row_bytes,
                            &x2[s][static_cast<size_t>(t) * x_row_bytes], x_row_bytes),
                0)
          << "cached recv_x row " << i << " of rank " << r;
      if (c.fp8) {
        ASSERT_TRUE(SameArray("cached recv_scales", &x2_scales[s][static_cast<size_t>(t) * S],
                              o.recv_scales.get() + i * S, S));
      }
      ASSERT_EQ(o.recv_src_info[i], s * M + t);
    }
    for (int64_t v : o.recv_topk_idx) ASSERT_EQ(v, -5) << "cached dispatch wrote recv_topk_idx";
    for (int32_t v : o.recv_tokens_per_expert) ASSERT_EQ(v, -5);
  }
}

void RunLowLatency(const SweepCase& c, const std::vector<RankInput>& in, Exec how) {
  const int R = c.num_ranks, K = c.num_topk, E = c.num_experts, H = c.hidden;
  const int El = E / R, S = (H + 127) / 128;
  const int32_t Mll = std::max(1, c.num_tokens + c.token_slack);
  const int64_t rows_per_expert = static_cast<int64_t>(R) * Mll;
  const GroupShape shape = ShapeOf(c, c.num_tokens + c.token_slack, Mll);
  const HostExecution exec = ExecOf(c, how);
  const NaiveLowLatencyRouting naive = NaiveRouteLowLatency(c, in);
  const bool fp8 = c.fp8;
  const int64_t row_bytes = fp8 ? H : 2 * H;

  std::vector<std::unique_ptr<uint8_t[]>> recv_x(R);
  // Scales are stored token index fastest: f32 [El, S, rows], or UE8M0 int32 [El, S/4, rows].
  const int64_t scale_cols = c.ue8m0 ? S / 4 : S;
  std::vector<std::unique_ptr<uint8_t[]>> recv_scales(R);
  std::vector<std::vector<int32_t>> recv_count(R), handle_pos(R);
  std::vector<std::unique_ptr<int32_t[]>> recv_src_info(R);
  std::vector<LowLatencyDispatchRankArgs> args(R);
  for (int r = 0; r < R; ++r) {
    const size_t rows = static_cast<size_t>(El) * rows_per_expert;
    recv_x[r] = Uninit<uint8_t>(rows * row_bytes);
    if (fp8) {
      recv_scales[r] = Uninit<uint8_t>(rows * scale_cols * 4);
      std::memset(recv_scales[r].get(), kGuardByte, rows * scale_cols * 4);
    }
    recv_src_info[r] = Uninit<int32_t>(rows);
    // Guard: the first row past each expert's count must stay untouched.
    for (int j = 0; j < El; ++j) {
      const int64_t n = static_cast<int64_t>(naive.rows[r * El + j].size());
      if (n == rows_per_expert) continue;
      const int64_t row = j * rows_per_expert + n;
      std::memset(recv_x[r].get() + row * row_bytes, kGuardByte, row_bytes);
      recv_src_info[r][row] = -9;
    }
    recv_count[r].assign(El, -9);
    handle_pos[r].assign(static_cast<size_t>(Mll) * K, -9);
    LowLatencyDispatchRankArgs& a = args[r];
    a.num_tokens = in[r].num_tokens;
    a.x = in[r].x.data();
    a.topk_idx = in[r].topk_idx.data();
    a.recv_x = recv_x[r].get();
    a.recv_scales = recv_scales[r].get();
    a.recv_count = recv_count[r].data();
    a.recv_src_info = recv_src_info[r].get();
    a.handle_pos = handle_pos[r].data();
  }
  LowLatencyDispatchOptions options;
  options.use_fp8 = fp8;
  options.round_scale = c.round_scale;
  options.use_ue8m0 = c.ue8m0;
  const absl::Status st = LowLatencyDispatch(shape, options, args, exec);
  ASSERT_TRUE(st.ok()) << st;

  std::vector<e4m3_bits> q;
  std::vector<float> q_scales;
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < El; ++j) {
      const auto& rows = naive.rows[r * El + j];
      ASSERT_EQ(recv_count[r][j], static_cast<int32_t>(rows.size()))
          << "rank " << r << " expert " << j;
      for (size_t i = 0; i < rows.size(); ++i) {
        const auto [s, t] = rows[i];
        const int64_t row = j * rows_per_expert + static_cast<int64_t>(i);
        const bf16_bits* x = &in[s].x[static_cast<size_t>(t) * H];
        if (fp8) {
          NaiveQuantize(x, H, c.round_scale, q, q_scales);
          ASSERT_TRUE(SameArray("ll recv_x (e4m3)", q.data(), recv_x[r].get() + row * row_bytes, H))
              << "rank " << r << " expert " << j << " row " << i;
          for (int g = 0; g < S; ++g) {
            // Word (or f32) [j, col, i] of [El, scale_cols, rows_per_expert].
            const int col = c.ue8m0 ? g / 4 : g;
            uint32_t word;
            std::memcpy(
                &word,
                recv_scales[r].get() +
                    ((j * scale_cols + col) * rows_per_expert + static_cast<int64_t>(i)) * 4,
                4);
            uint32_t want;
            std::memcpy(&want, &q_scales[g], 4);
            if (c.ue8m0) {
              // The exponent byte of the power-of-two scale, group 4j + b in byte b.
              ASSERT_EQ(want & 0x807fffffu, 0u) << "round_scale scale not a power of two";
              ASSERT_EQ((word >> (8 * (g % 4))) & 0xffu, want >> 23)
                  << "ll recv_scales (ue8m0) rank " << r << " expert " << j << " row " << i
                  << " block " << g;
            } else {
              ASSERT_EQ(word, want) << "ll recv_scales rank " << r << " expert " << j << " row "
                                    << i << " block " << g;
            }
          }
        } else {
          ASSERT_EQ(std::memcmp(recv_x[r].get() + row * row_bytes, x, row_bytes), 0)
              << "ll recv_x rank " << r << " expert " << j << " row " << i;
        }
        ASSERT_EQ(recv_src_info[r][row], s * Mll + t)
            << "rank " << r << " expert " << j << " row " << i;
      }
      const int64_t n = static_cast<int64_t>(rows.size());
      if (n < rows_per_expert) {
        const int64_t row = j * rows_per_expert + n;
        for (int64_t b = 0; b < row_bytes; ++b) {
          ASSERT_EQ(recv_x[r][row * row_bytes + b], kGuardByte) << "row past recv_count written";
        }
        ASSERT_EQ(recv_src_info[r][row], -9);
        for (int64_t col = 0; fp8 && col < scale_cols; ++col) {
          for (int b = 0; b < 4; ++b) {
            ASSERT_EQ(recv_scales[r][((j * scale_cols + col) * rows_per_expert + n) * 4 + b],
                      kGuardByte)
                << "scale of a row past recv_count written";
          }
        }
      }
    }
    ASSERT_TRUE(SameArray("handle_pos", naive.handle_pos[r].data(), handle_pos[r].data(),
                          naive.handle_pos[r].size()))
        << "rank " << r;
    for (size_t i = naive.handle_pos[r].size(); i < handle_pos[r].size(); ++i) {
      ASSERT_EQ(handle_pos[r][i], -9) << "handle_pos rows past T written";
    }
  }

  // LowLatencyCombine over random expert outputs in the received rows.
  Rng rng(c.seed ^ 0x11c0);
  std::vector<std::unique_ptr<bf16_bits[]>> y(R), combined(R);
  std::vector<LowLatencyCombineRankArgs> cargs(R);
  for (int r = 0; r < R; ++r) {
    y[r] = Uninit<bf16_bits>(static_cast<size_t>(El) * rows_per_expert * H);
    for (int j = 0; j < El; ++j) {
      FillBf16(y[r].get() + j * rows_per_expert * H, naive.rows[r * El + j].size() * H, rng);
    }
    combined[r] = Uninit<bf16_bits>(static_cast<size_t>(in[r].num_tokens) * H);
    LowLatencyCombineRankArgs& a = cargs[r];
    a.num_tokens = in[r].num_tokens;
    a.topk_idx = in[r].topk_idx.data();
    a.topk_weights = in[r].topk_weights.data();
    a.handle_pos = handle_pos[r].data();
    a.x = y[r].get();
    a.combined_x = combined[r].get();
  }
  const absl::Status cst = LowLatencyCombine(shape, cargs, exec);
  ASSERT_TRUE(cst.ok()) << cst;
  std::vector<float> acc(H);
  std::vector<bf16_bits> want(H);
  for (int s = 0; s < R; ++s) {
    for (int t = 0; t < in[s].num_tokens; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int k = 0; k < K; ++k) {
        const int64_t e = in[s].topk_idx[static_cast<size_t>(t) * K + k];
        if (e < 0) continue;
        const float w = in[s].topk_weights[static_cast<size_t>(t) * K + k];
        const int32_t row = naive.handle_pos[s][static_cast<size_t>(t) * K + k];
        const bf16_bits* yr = y[e / El].get() + ((e % El) * rows_per_expert + row) * H;
        for (int h = 0; h < H; ++h) {
          const float p = w * Bf16ToFloat(yr[h]);
          acc[h] = acc[h] + p;
        }
      }
      for (int h = 0; h < H; ++h) want[h] = FloatToBf16(acc[h]);
      ASSERT_TRUE(SameArray("ll combined_x", want.data(),
                            combined[s].get() + static_cast<size_t>(t) * H, H))
          << "rank " << s << " token " << t;
    }
  }
}

// ---- the sweep ----------------------------------------------------------------------------

const int kRanks[] = {1, 2, 3, 4, 8};
const int kExpertKinds[] = {0, 1, 2};  // E = R, 4R, 256
const int kTopk[] = {1, 2, 6, 8, 9};
const int kHidden[] = {128, 2048, 7168};
const int kTokens[] = {0, 1, 7, 128, 4096};
const int kRoutings[] = {int(Routing::kUniform), int(Routing::kZipf), int(Routing::kOneExpert)};
const int kMasked[] = {0, 30, 100};
const int kFp8[] = {0, 1};
const int kAlignments[] = {1, 128};

/// The swept parameters, in the order of kParamValues.
enum Param { kR, kEKind, kK, kH, kT, kRouting, kMask, kFp8Param, kAlign, kNumParams };
const std::vector<std::vector<int>> kParamValues = {
    {std::begin(kRanks), std::end(kRanks)},
    {std::begin(kExpertKinds), std::end(kExpertKinds)},
    {std::begin(kTopk), std::end(kTopk)},
    {std::begin(kHidden), std::end(kHidden)},
    {std::begin(kTokens), std::end(kTokens)},
    {std::begin(kRoutings), std::end(kRoutings)},
    {std::begin(kMasked), std::end(kMasked)},
    {std::begin(kFp8), std::end(kFp8)},
    {std::begin(kAlignments), std::end(kAlignments)}};

int ExpertsOf(int R, int kind) { return kind == 0 ? R : kind == 1 ? 4 * R : 256; }

int ParamOf(const SweepCase& c, int p) {
  switch (p) {
    case kR:
      return c.num_ranks;
    case kEKind:
      return c.num_experts == c.num_ranks ? 0 : c.num_experts == 4 * c.num_ranks ? 1 : 2;
    case kK:
      return c.num_topk;
    case kH:
      return c.hidden;
    case kT:
      return c.num_tokens;
    case kRouting:
      return int(c.routing);
    case kMask:
      return c.masked_pct;
    case kFp8Param:
      return int(c.fp8);
    case kAlign:
      return c.alignment;
  }
  return -1;
}

SweepCase CaseOf(const int (&v)[kNumParams]) {
  SweepCase c;
  c.num_ranks = v[kR];
  c.num_experts = ExpertsOf(v[kR], v[kEKind]);
  c.num_topk = v[kK];
  c.hidden = v[kH];
  c.num_tokens = v[kT];
  c.routing = Routing(v[kRouting]);
  c.masked_pct = v[kMask];
  c.fp8 = v[kFp8Param] != 0;
  c.alignment = v[kAlign];
  return c;
}

/// Keeps the sweep inside CI's time and memory: bytes a case touches, roughly (inputs,
/// normal receive and combine, low-latency receive and combine), and the low-latency
/// receive buffer of a rank ([El, R*Mll, H], virtual: only touched rows cost memory).
bool WithinBudget(const SweepCase& c) {
  const double tokens = static_cast<double>(c.num_ranks) * c.num_tokens;
  const double row = 2.0 * c.hidden;
  const double touched =
      tokens * row * (3 + 2 * std::min(c.num_topk, c.num_ranks) + 2 * c.num_topk);
  const double ll_virtual = static_cast<double>(c.num_experts) * std::max(1, c.num_tokens) * row;
  return touched <= 128e6 && ll_virtual <= 1.1e9;
}

bool Valid(const SweepCase& c) {
  return c.num_experts % c.num_ranks == 0 && c.num_topk <= c.num_experts && WithinBudget(c);
}

/// A covering requirement: parameter pa has value va (and pb has vb when pb >= 0).
struct Need {
  int pa, va, pb, vb;
  bool required;  ///< Must be covered (the others are covered where the budget allows).
  bool CoveredBy(const SweepCase& c) const {
    return ParamOf(c, pa) == va && (pb < 0 || ParamOf(c, pb) == vb);
  }
};

/// Every single value (required), the required pairs (R, routing), (T, FP8), (K, masked),
/// and every other pair of parameters (covered where a valid case within budget exists).
std::vector<Need> SweepNeeds() {
  std::vector<Need> needs;
  for (int p = 0; p < kNumParams; ++p) {
    for (int v : kParamValues[p]) needs.push_back({p, v, -1, 0, true});
  }
  auto required = [](int a, int b) {
    return (a == kR && b == kRouting) || (a == kT && b == kFp8Param) || (a == kK && b == kMask);
  };
  for (int a = 0; a < kNumParams; ++a) {
    for (int b = a + 1; b < kNumParams; ++b) {
      for (int va : kParamValues[a]) {
        for (int vb : kParamValues[b]) needs.push_back({a, va, b, vb, required(a, b)});
      }
    }
  }
  return needs;
}

/// The seeded covering selection: greedily, for the first uncovered requirement, the one
/// of 300 random valid cases satisfying it that covers most uncovered requirements; then
/// explicit edge cases. Deterministic.
std::vector<SweepCase> MakeSweep() {
  std::mt19937_64 rng(20261129);
  const std::vector<Need> needs = SweepNeeds();
  std::vector<bool> covered(needs.size(), false);
  std::vector<SweepCase> cases;
  for (size_t first = 0; first < needs.size(); ++first) {
    if (covered[first]) continue;
    SweepCase best;
    int best_score = 0;
    for (int attempt = 0; attempt < 300; ++attempt) {
      int v[kNumParams];
      for (int p = 0; p < kNumParams; ++p) v[p] = kParamValues[p][rng() % kParamValues[p].size()];
      v[needs[first].pa] = needs[first].va;
      if (needs[first].pb >= 0) v[needs[first].pb] = needs[first].vb;
      const SweepCase c = CaseOf(v);
      if (!Valid(c)) continue;
      int score = 0;
      for (size_t i = 0; i < needs.size(); ++i) score += !covered[i] && needs[i].CoveredBy(c);
      if (score > best_score) {
        best = c;
        best_score = score;
      }
    }
    if (best_score == 0)
      continue;  // infeasible (e.g. R = 3 with E = 256): the coverage test checks
    for (size_t i = 0; i < needs.size(); ++i) covered[i] = covered[i] || needs[i].CoveredBy(best);
    cases.push_back(best);
  }
  // Explicit edge cases.
  auto edge = [&](int R, int E, int K, int H, int T, Routing g, int mask, bool fp8, int align,
                  bool ragged) {
    SweepCase c;
    c.num_ranks = R, c.num_experts = E, c.num_topk = K, c.hidden = H, c.num_tokens = T;
    c.routing = g, c.masked_pct = mask, c.fp8 = fp8, c.alignment = align, c.ragged = ragged;
    cases.push_back(c);
  };
  edge(4, 16, 6, 256, 7, Routing::kUniform, 0, false, 1, true);  // T = 0 on some ranks
  edge(8, 256, 8, 2048, 128, Routing::kZipf, 30, true, 128, true);
  edge(3, 12, 9, 128, 128, Routing::kUniform, 100, true, 128, false);    // all masked
  edge(2, 2, 2, 7168, 4096, Routing::kOneExpert, 0, false, 128, false);  // hot expert, big
  edge(8, 256, 8, 7168, 128, Routing::kUniform, 0, true, 1, false);      // DeepSeek-V3 decode
  edge(4, 4, 1, 128, 0, Routing::kUniform, 0, true, 128, false);         // T = 0 everywhere
  edge(1, 256, 9, 128, 4096, Routing::kZipf, 30, true, 128, false);
  edge(8, 64, 9, 128, 128, Routing::kOneExpert, 0, true, 128, true);  // duplicates, ragged
  edge(2, 8, 2, 200, 7, Routing::kUniform, 30, false, 1, false);      // H % 128 != 0 (bf16)
  const size_t num_edge = 9;
  for (size_t i = 0; i < cases.size(); ++i) {
    cases[i].seed = 1000 + i;
    cases[i].threads = 1 + static_cast<int>(i % 4);
    cases[i].round_scale = (i % 3) == 1;
    cases[i].ue8m0 =
        cases[i].fp8 && cases[i].round_scale && cases[i].hidden % 512 == 0 && i % 2 == 0;
    cases[i].token_slack = (i % 2) ? 3 : 0;
    if (i + num_edge < cases.size() && i % 5 == 2 && cases[i].num_ranks > 1) cases[i].ragged = true;
  }
  return cases;
}

TEST(HostOpsSweepCoverageTest, CoversEveryValueRequiredPairAndEdgeCase) {
  const std::vector<SweepCase> cases = MakeSweep();
  int optional_missed = 0;
  for (const Need& n : SweepNeeds()) {
    bool hit = false;
    for (const SweepCase& c : cases) hit = hit || n.CoveredBy(c);
    if (n.required) {
      EXPECT_TRUE(hit) << "parameter " << n.pa << " = " << n.va << ", parameter " << n.pb << " = "
                       << n.vb;
    }
    optional_missed += !hit;
  }
  bool ragged = false, all_masked = false, big_hot = false;
  for (const SweepCase& c : cases) {
    EXPECT_TRUE(c.num_experts % c.num_ranks == 0 && c.num_topk <= c.num_experts) << c.Name();
    ragged = ragged || (c.ragged && c.num_ranks > 1 && c.num_tokens > 0);
    all_masked = all_masked || (c.masked_pct == 100 && c.num_tokens > 0);
    big_hot =
        big_hot || (c.routing == Routing::kOneExpert && c.hidden == 7168 && c.num_tokens == 4096);
  }
  EXPECT_TRUE(ragged && all_masked && big_hot);
  // Both scale formats of the low-latency dispatch with round_scale, at a real group size.
  bool ue8m0 = false, f32_round = false;
  for (const SweepCase& c : cases) {
    const bool real = c.num_ranks > 1 && c.num_tokens > 0 && c.fp8 && c.round_scale;
    ue8m0 = ue8m0 || (real && c.ue8m0);
    f32_round = f32_round || (real && !c.ue8m0 && c.hidden % 512 == 0);
  }
  EXPECT_TRUE(ue8m0 && f32_round);
  // Pairs left out are infeasible (E % R, K <= E) or over the CI budget (T = 4096 with
  // large H and R); the sweep still has every value of every parameter.
  EXPECT_LT(optional_missed, 60) << cases.size() << " cases";
}

class HostOpsSweepTest : public ::testing::TestWithParam<SweepCase> {};

TEST_P(HostOpsSweepTest, MatchesNaiveOracle) {
  const SweepCase& c = GetParam();
  const std::vector<RankInput> in = MakeInputs(c);
  for (Exec how : {Exec::kOneOff, Exec::kPersistent}) {
    SCOPED_TRACE(how == Exec::kOneOff ? "one-off" : "persistent pool and scratch");
    RunNormal(c, in, how);
    if (HasFatalFailure()) return;
    RunLowLatency(c, in, how);
    if (HasFatalFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, HostOpsSweepTest, ::testing::ValuesIn(MakeSweep()),
                         [](const ::testing::TestParamInfo<SweepCase>& info) {
                           return std::to_string(info.index) + "_" + info.param.Name();
                         });

// ---- persistent pool and scratch across shapes ------------------------------------------

TEST(HostOpsTest, PersistentScratchAcrossShapes) {
  const std::vector<SweepCase> sweep = MakeSweep();
  int run = 0;
  for (size_t i = 0; i < sweep.size(); i += 3) {  // A spread of shapes, small and large.
    SCOPED_TRACE(sweep[i].Name());
    const std::vector<RankInput> in = MakeInputs(sweep[i]);
    RunNormal(sweep[i], in, Exec::kPersistent);
    if (HasFatalFailure()) return;
    RunLowLatency(sweep[i], in, Exec::kPersistent);
    if (HasFatalFailure()) return;
    ++run;
  }
  EXPECT_GE(run, 10) << "too few shapes to exercise reuse";
}

// ---- determinism across thread counts ----------------------------------------------------

TEST(HostOpsTest, ResultsIndependentOfThreadCount) {
  SweepCase c;
  c.num_ranks = 4, c.num_experts = 16, c.num_topk = 6, c.hidden = 256, c.num_tokens = 300;
  c.routing = Routing::kZipf, c.masked_pct = 30, c.seed = 77;
  const std::vector<RankInput> in = MakeInputs(c);
  const GroupShape shape = ShapeOf(c, c.num_tokens, c.num_tokens);
  std::vector<std::vector<bf16_bits>> first;
  HostWorkerPool pool;
  HostScratch scratch;
  for (int threads : {1, 2, 3, 5, 16, -1, -2, -3, -5, -16}) {
    // Negative: |threads| on the persistent pool and scratch.
    const HostExecution exec =
        threads > 0 ? HostExecution{threads} : HostExecution{-threads, &pool, &scratch};
    std::vector<std::vector<bf16_bits>> recv(
        4, std::vector<bf16_bits>(static_cast<size_t>(4) * 300 * 256 * 4));
    std::vector<std::vector<int32_t>> count(4, std::vector<int32_t>(4)),
        src(4, std::vector<int32_t>(4 * 4 * 300)), handle(4, std::vector<int32_t>(300 * 6));
    std::vector<LowLatencyDispatchRankArgs> args(4);
    for (int r = 0; r < 4; ++r) {
      args[r].num_tokens = in[r].num_tokens;
      args[r].x = in[r].x.data();
      args[r].topk_idx = in[r].topk_idx.data();
      args[r].recv_x = recv[r].data();
      args[r].recv_count = count[r].data();
      args[r].recv_src_info = src[r].data();
      args[r].handle_pos = handle[r].data();
    }
    ASSERT_TRUE(LowLatencyDispatch(shape, {}, args, exec).ok());
    if (first.empty()) {
      first = recv;
    } else {
      for (int r = 0; r < 4; ++r) ASSERT_EQ(first[r], recv[r]) << threads << " threads";
    }
  }
}

// ---- the worker pool ---------------------------------------------------------------------

TEST(HostWorkerPoolTest, RunsEveryIndexOnceOnSlotsBelowTheThreadCount) {
  HostWorkerPool pool;
  HostScratch unused;
  for (int round = 0; round < 200; ++round) {
    const int threads = 1 + round % 5;
    const int64_t n = round % 37;  // 0 too.
    std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
    std::atomic<int> bad_slot{0};
    internal::OpContext ctx(HostExecution{threads, &pool, &unused});
    ctx.ParallelFor(n, [&](int64_t i, int slot) {
      hits[static_cast<size_t>(i)].fetch_add(1);
      if (slot < 0 || slot >= threads) bad_slot.fetch_add(1);
    });
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1) << "round " << round << " index " << i;
    }
    ASSERT_EQ(bad_slot.load(), 0) << "round " << round;
  }
  // Workers are started once, up to the largest thread count asked for (minus the caller).
  EXPECT_EQ(pool.num_workers(), 4);
}

TEST(HostWorkerPoolTest, StartWhileJobsRunIsSafe) {
  HostWorkerPool pool;
  std::atomic<bool> stop{false};
  std::thread starter([&] {
    for (int n = 1; n <= 6 && !stop; ++n) pool.Start(n);
  });
  std::atomic<int64_t> sum{0};
  for (int round = 0; round < 100; ++round) {
    internal::OpContext ctx(HostExecution{3, &pool, nullptr});
    ctx.ParallelFor(50, [&](int64_t i, int) { sum.fetch_add(i); });
  }
  stop = true;
  starter.join();
  EXPECT_EQ(sum.load(), 100 * (49 * 50 / 2));
  EXPECT_GE(pool.num_workers(), 2);
}

// ---- errors -------------------------------------------------------------------------------

/// A small valid normal dispatch (R = 2, E = 4, K = 2, H = 128, M = 4) with every output
/// pre-filled with a sentinel, so tests can break one input and check nothing was written.
struct SmallDispatch {
  static constexpr int R = 2, E = 4, K = 2, H = 128, M = 4;
  GroupShape shape;
  std::vector<std::vector<int64_t>> topk_idx;
  std::vector<std::vector<float>> topk_weights;
  std::vector<std::vector<bf16_bits>> x;
  std::vector<std::vector<uint8_t>> outputs;  // every output buffer, byte-filled 0x5A
  std::vector<DispatchRankArgs> args;

  SmallDispatch() : topk_idx(R), topk_weights(R), x(R), args(R) {
    shape.num_ranks = R, shape.num_experts = E, shape.num_topk = K, shape.hidden = H;
    shape.max_tokens_per_rank = M;
    shape.ll_max_tokens_per_rank = M;
    Rng rng(3);
    for (int r = 0; r < R; ++r) {
      topk_idx[r] = {0, 3, 1, -1, 2, 2, -1, -1};
      topk_weights[r].assign(M * K, 0.5f);
      x[r].resize(M * H);
      FillBf16(x[r].data(), x[r].size(), rng);
      DispatchRankArgs& a = args[r];
      a.num_tokens = M;
      a.x = x[r].data();
      a.topk_idx = topk_idx[r].data();
      a.topk_weights = topk_weights[r].data();
      a.recv_capacity = R * M;
      a.recv_x = Out(R * M * H * 2);
      a.recv_topk_idx = static_cast<int64_t*>(Out(R * M * K * 8));
      a.recv_topk_weights = static_cast<float*>(Out(R * M * K * 4));
      a.recv_tokens_per_expert = static_cast<int32_t*>(Out(E / R * 4));
      a.recv_src_info = static_cast<int32_t*>(Out(R * M * 4));
      a.send_pos = static_cast<int32_t*>(Out(M * R * 4));
      a.rank_prefix = static_cast<int32_t*>(Out(R * 4));
      a.num_recv_tokens = -42;
    }
  }
  void* Out(size_t bytes) {
    outputs.emplace_back(bytes, 0x5A);
    return outputs.back().data();
  }
  bool Untouched() const {
    for (const auto& o : outputs) {
      for (uint8_t b : o)
        if (b != 0x5A) return false;
    }
    for (const auto& a : args)
      if (a.num_recv_tokens != -42) return false;
    return true;
  }
};

TEST(HostOpsErrorTest, SmallDispatchIsValid) {
  SmallDispatch d;
  ASSERT_TRUE(Dispatch(d.shape, {}, d.args).ok());
  // Rank 0 holds experts 0, 1: token 0 (e0) and token 1 (e1) of each source.
  EXPECT_EQ(d.args[0].num_recv_tokens, 4);
  // Rank 1 holds experts 2, 3: token 0 (e3) and token 2 (e2 twice: sent once).
  EXPECT_EQ(d.args[1].num_recv_tokens, 4);
  EXPECT_FALSE(d.Untouched());
}

TEST(HostOpsErrorTest, ExpertIdTooLargeNamesRankTokenKAndValue) {
  SmallDispatch d;
  d.topk_idx[1][2 * 2 + 1] = 4;  // rank 1, token 2, k 1 = E
  const absl::Status st = Dispatch(d.shape, {}, d.args);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("rank 1"));
  EXPECT_THAT(st.message(), HasSubstr("token 2"));
  EXPECT_THAT(st.message(), HasSubstr("k 1"));
  EXPECT_THAT(st.message(), HasSubstr("= 4"));
  EXPECT_TRUE(d.Untouched());
}

TEST(HostOpsErrorTest, ExpertIdBelowMinusOneNamesValue) {
  SmallDispatch d;
  d.topk_idx[0][3 * 2 + 0] = -7;
  const absl::Status st = Dispatch(d.shape, {}, d.args);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("rank 0"));
  EXPECT_THAT(st.message(), HasSubstr("token 3"));
  EXPECT_THAT(st.message(), HasSubstr("-7"));
  EXPECT_TRUE(d.Untouched());
  // The public checker says the same.
  const absl::Status direct = CheckTopkIdx(d.shape, 0, 4, d.topk_idx[0].data());
  EXPECT_EQ(direct.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(direct.message(), HasSubstr("-7"));
  EXPECT_TRUE(CheckTopkIdx(d.shape, 1, 4, d.topk_idx[1].data()).ok());
}

TEST(HostOpsErrorTest, TooManyTokens) {
  SmallDispatch d;
  d.args[1].num_tokens = SmallDispatch::M + 1;
  const absl::Status st = Dispatch(d.shape, {}, d.args);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("num_tokens = 5"));
  EXPECT_TRUE(d.Untouched());
  d.args[1].num_tokens = -1;
  EXPECT_EQ(Dispatch(d.shape, {}, d.args).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(d.Untouched());
}

TEST(HostOpsErrorTest, ReceiveCapacityExceeded) {
  SmallDispatch d;
  d.args[0].recv_capacity = 3;  // rank 0 receives 4 rows
  const absl::Status st = Dispatch(d.shape, {}, d.args);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("recv_capacity = 3"));
  EXPECT_TRUE(d.Untouched());
}

TEST(HostOpsErrorTest, Fp8NeedsHiddenMultipleOf128) {
  SmallDispatch d;
  d.shape.hidden = 100;
  DispatchOptions o;
  o.fp8 = true;
  const absl::Status st = Dispatch(d.shape, o, d.args);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("hidden = 100"));
  EXPECT_TRUE(d.Untouched());
}

TEST(HostOpsErrorTest, BadAlignmentAndRankCount) {
  SmallDispatch d;
  DispatchOptions o;
  o.expert_alignment = 0;
  EXPECT_EQ(Dispatch(d.shape, o, d.args).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Dispatch(d.shape, {}, std::span<DispatchRankArgs>(d.args.data(), 1)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(d.Untouched());
}

TEST(HostOpsErrorTest, MissingOutputOrMixedWeightsIsAnError) {
  SmallDispatch d;
  d.args[1].recv_x = nullptr;  // rank 1 receives rows
  absl::Status st = Dispatch(d.shape, {}, d.args);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("recv_x"));
  EXPECT_TRUE(d.Untouched());
  SmallDispatch e;
  e.args[0].topk_weights = nullptr;  // rank 1 passes weights, rank 0 does not
  st = Dispatch(e.shape, {}, e.args);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("topk_weights"));
  EXPECT_TRUE(e.Untouched());
}

TEST(HostOpsTest, WeightsAreOptional) {
  SmallDispatch d;
  std::vector<float*> recv_weights;
  for (DispatchRankArgs& a : d.args) {
    a.topk_weights = nullptr;
    recv_weights.push_back(a.recv_topk_weights);
  }
  ASSERT_TRUE(Dispatch(d.shape, {}, d.args).ok());
  for (size_t r = 0; r < recv_weights.size(); ++r) {  // zeros without weights
    const int32_t n = d.args[r].num_recv_tokens * d.shape.num_topk;
    ASSERT_GT(n, 0);
    for (int32_t i = 0; i < n; ++i) EXPECT_EQ(recv_weights[r][i], 0.0f) << "rank " << r;
    EXPECT_FALSE(std::signbit(recv_weights[r][0]));
  }
  std::vector<std::vector<bf16_bits>> y(2, std::vector<bf16_bits>(8 * 128, 0x3f80));  // 1.0
  std::vector<std::vector<bf16_bits>> out(2, std::vector<bf16_bits>(4 * 128));
  std::vector<std::vector<float>> out_w(2, std::vector<float>(4 * 2, -1.0f));
  std::vector<CombineRankArgs> c(2);
  for (int r = 0; r < 2; ++r) {
    c[r].num_tokens = 4;
    c[r].send_pos = d.args[r].send_pos;
    c[r].num_recv_tokens = d.args[r].num_recv_tokens;
    c[r].x = y[r].data();
    c[r].combined_x = out[r].data();
    c[r].combined_topk_weights = out_w[r].data();
  }
  ASSERT_TRUE(Combine(d.shape, c).ok());
  for (int r = 0; r < 2; ++r) {
    // Token 0 is on both ranks (1 + 1), tokens 1 and 2 on one, token 3 nowhere (zeros).
    EXPECT_EQ(out[r][0 * 128], 0x4000) << r;
    EXPECT_EQ(out[r][1 * 128], 0x3f80) << r;
    EXPECT_EQ(out[r][2 * 128 + 5], 0x3f80) << r;
    EXPECT_EQ(out[r][3 * 128 + 127], 0x0000) << r;
    EXPECT_EQ(out_w[r], std::vector<float>(8, -1.0f)) << "weights written without weights";
  }
}

TEST(HostOpsErrorTest, CachedHandleMustBeOneDispatchsRows) {
  SmallDispatch d;
  ASSERT_TRUE(Dispatch(d.shape, {}, d.args).ok());
  std::vector<std::vector<int32_t>> handle(2);
  for (int r = 0; r < 2; ++r) handle[r].assign(d.args[r].send_pos, d.args[r].send_pos + 8);
  std::vector<int32_t> counts = {d.args[0].num_recv_tokens, d.args[1].num_recv_tokens};
  SmallDispatch e;
  for (int r = 0; r < 2; ++r) {
    e.args[r].cached_send_pos = handle[r].data();
    e.args[r].cached_num_recv_tokens = counts[r];
  }
  // Source 1's token 0 sent to the row of source 0's token 0 at rank 0.
  ASSERT_EQ(handle[0][0], 0);
  handle[1][0] = 0;
  const absl::Status st = Dispatch(e.shape, {}, e.args);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_TRUE(e.Untouched());
  // A row outside the cached count.
  handle[1][0] = 99;
  EXPECT_THAT(Dispatch(e.shape, {}, e.args).message(), HasSubstr("= 99"));
  EXPECT_TRUE(e.Untouched());
}

TEST(HostOpsErrorTest, LayoutRejectsBadIds) {
  SmallDispatch d;
  std::vector<int32_t> per_rank(2, -1), per_expert(4, -1);
  std::vector<uint8_t> in_rank(8, 9);
  LayoutRankArgs a;
  a.num_tokens = 4;
  a.topk_idx = d.topk_idx[0].data();
  a.num_tokens_per_rank = per_rank.data();
  a.num_tokens_per_expert = per_expert.data();
  a.is_token_in_rank = in_rank.data();
  d.topk_idx[0][5] = 1000;
  const absl::Status st = GetDispatchLayout(d.shape, a);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("1000"));
  EXPECT_THAT(st.message(), HasSubstr("token 2"));
  EXPECT_EQ(per_rank, std::vector<int32_t>(2, -1));
  EXPECT_EQ(per_expert, std::vector<int32_t>(4, -1));
  EXPECT_EQ(in_rank, std::vector<uint8_t>(8, 9));
  a.num_tokens = 5;  // > M
  d.topk_idx[0][5] = 1;
  EXPECT_EQ(GetDispatchLayout(d.shape, a).code(), absl::StatusCode::kInvalidArgument);
}

TEST(HostOpsErrorTest, CombineRejectsBadHandle) {
  SmallDispatch d;
  ASSERT_TRUE(Dispatch(d.shape, {}, d.args).ok());
  std::vector<std::vector<bf16_bits>> y(2, std::vector<bf16_bits>(8 * 128, 0x3f80));
  std::vector<std::vector<bf16_bits>> out(2, std::vector<bf16_bits>(4 * 128, 0x1234));
  std::vector<int32_t> bad_pos(d.args[1].send_pos, d.args[1].send_pos + 8);
  bad_pos[3] = d.args[1].num_recv_tokens;  // token 1, rank 1: one past the end
  std::vector<CombineRankArgs> c(2);
  for (int r = 0; r < 2; ++r) {
    c[r].num_tokens = 4;
    c[r].send_pos = r == 1 ? bad_pos.data() : d.args[r].send_pos;
    c[r].num_recv_tokens = d.args[r].num_recv_tokens;
    c[r].x = y[r].data();
    c[r].combined_x = out[r].data();
  }
  const absl::Status st = Combine(d.shape, c);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("token 1"));
  for (const auto& o : out) EXPECT_EQ(o, std::vector<bf16_bits>(4 * 128, 0x1234));
  c[0].num_tokens = 5;
  EXPECT_EQ(Combine(d.shape, c).code(), absl::StatusCode::kInvalidArgument);
}

TEST(HostOpsErrorTest, LowLatencyRejectsBadIdsAndTooManyTokens) {
  SmallDispatch d;
  const int R = 2, El = 2, Mll = 4, K = 2, H = 128;
  std::vector<std::vector<bf16_bits>> recv(R, std::vector<bf16_bits>(El * R * Mll * H, 0x7777));
  std::vector<std::vector<int32_t>> count(R, std::vector<int32_t>(El, -3)),
      src(R, std::vector<int32_t>(El * R * Mll, -3)), handle(R, std::vector<int32_t>(Mll * K, -3));
  std::vector<LowLatencyDispatchRankArgs> args(R);
  for (int r = 0; r < R; ++r) {
    args[r].num_tokens = 4;
    args[r].x = d.x[r].data();
    args[r].topk_idx = d.topk_idx[r].data();
    args[r].recv_x = recv[r].data();
    args[r].recv_count = count[r].data();
    args[r].recv_src_info = src[r].data();
    args[r].handle_pos = handle[r].data();
  }
  auto untouched = [&] {
    for (int r = 0; r < R; ++r) {
      for (auto v : recv[r])
        if (v != 0x7777) return false;
      for (auto v : count[r])
        if (v != -3) return false;
      for (auto v : src[r])
        if (v != -3) return false;
      for (auto v : handle[r])
        if (v != -3) return false;
    }
    return true;
  };
  d.topk_idx[1][7] = 4;
  absl::Status st = LowLatencyDispatch(d.shape, {}, args);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("rank 1"));
  EXPECT_THAT(st.message(), HasSubstr("token 3"));
  EXPECT_THAT(st.message(), HasSubstr("k 1"));
  EXPECT_TRUE(untouched());
  d.topk_idx[1][7] = -1;
  args[0].num_tokens = Mll + 1;
  EXPECT_EQ(LowLatencyDispatch(d.shape, {}, args).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(untouched());
  args[0].num_tokens = 4;
  GroupShape no_ll = d.shape;
  no_ll.ll_max_tokens_per_rank = 0;
  EXPECT_EQ(LowLatencyDispatch(no_ll, {}, args).code(), absl::StatusCode::kInvalidArgument);
  LowLatencyDispatchOptions fp8;
  fp8.use_fp8 = true;
  GroupShape odd = d.shape;
  odd.hidden = 96;
  EXPECT_EQ(LowLatencyDispatch(odd, fp8, args).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(untouched());
  // use_ue8m0 needs use_fp8, round_scale and hidden % 512 == 0 (H = 128 here); each refusal
  // names what is missing and writes nothing.
  LowLatencyDispatchOptions ue8m0;
  ue8m0.use_ue8m0 = true;
  st = LowLatencyDispatch(d.shape, ue8m0, args);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("use_ue8m0 needs use_fp8"));
  ue8m0.use_fp8 = true;
  st = LowLatencyDispatch(d.shape, ue8m0, args);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("use_ue8m0 needs round_scale"));
  ue8m0.round_scale = true;
  st = LowLatencyDispatch(d.shape, ue8m0, args);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("use_ue8m0 needs hidden % 512 == 0, hidden = 128"));
  EXPECT_TRUE(untouched());

  // LowLatencyCombine: a bad id, then a handle row outside [0, R * Mll).
  ASSERT_TRUE(LowLatencyDispatch(d.shape, {}, args).ok());
  std::vector<std::vector<bf16_bits>> out(R, std::vector<bf16_bits>(Mll * H, 0x4444));
  std::vector<LowLatencyCombineRankArgs> c(R);
  for (int r = 0; r < R; ++r) {
    c[r].num_tokens = 4;
    c[r].topk_idx = d.topk_idx[r].data();
    c[r].topk_weights = d.topk_weights[r].data();
    c[r].handle_pos = handle[r].data();
    c[r].x = recv[r].data();
    c[r].combined_x = out[r].data();
  }
  d.topk_idx[0][0] = -2;
  st = LowLatencyCombine(d.shape, c);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("-2"));
  d.topk_idx[0][0] = 0;
  handle[1][0] = R * Mll;
  st = LowLatencyCombine(d.shape, c);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("handle_pos"));
  for (const auto& o : out) EXPECT_EQ(o, std::vector<bf16_bits>(Mll * H, 0x4444));
}

TEST(HostOpsTest, QuantizeRowFp8MatchesNaive) {
  Rng rng(9);
  for (int H : {128, 256, 7168}) {
    std::vector<bf16_bits> x(H);
    FillBf16(x.data(), H, rng);
    for (int h = 0; h < std::min(H, 128); ++h) x[h] = 0;  // an all-zero block: the floor
    for (bool round_scale : {false, true}) {
      std::vector<e4m3_bits> q(H), want_q;
      std::vector<float> scales(H / 128), want_scales;
      QuantizeRowFp8(x.data(), H, round_scale, q.data(), scales.data());
      NaiveQuantize(x.data(), H, round_scale, want_q, want_scales);
      EXPECT_EQ(q, want_q) << H;
      EXPECT_EQ(scales, want_scales) << H;
    }
  }
}

}  // namespace
}  // namespace epd::kernels::host
