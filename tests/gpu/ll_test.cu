// GPU tests of the CUDA low-latency kernels (kernels/cuda/ll_*.cu) against the host
// reference (kernels/host): every output compared bit for bit, over a covering selection of
// ranks / H / K / E / T / masking / routing / FP8, plus the failure cases (bad expert ids,
// T > Mll, a rank that never arrives) and CUDA-graph replay with changing inputs and T.
//
// Combine is compared exactly: the kernels accumulate in f32 in ascending k with the product
// rounded before the add (__fmul_rn / __fadd_rn), the host's order (host/low_latency.cc).
//
// Needs a CUDA GPU with room for R data areas (the DeepSeek-V3 case: about 11 GiB).
// nvcc (EDG) warns about assigning an absl::Status ([[nodiscard]] on operator=) by mistake.
#pragma nv_diag_suppress 2810

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "common/cuda/cuda_handles.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/cuda_specialise.h"
#include "epd/kernels/host_ops.h"
#include "kernels/cuda/common.cuh"
#include "proto/abi/launch_flags.h"
#include "tests/gpu/gpu_test_util.h"

namespace epd::testing {
namespace {

namespace kc = ::epd::kernels::cuda;
namespace kh = ::epd::kernels::host;
using kernels::bf16_bits;
using kernels::GroupShape;

// The dispatch's data format: BF16, FP8 (f32 scales), FP8 with round_scale, FP8 with
// round_scale and UE8M0-packed scales (use_ue8m0).
enum class Fp8 { kOff, kOn, kRoundScale, kUe8m0 };
constexpr bool IsFp8(Fp8 m) { return m != Fp8::kOff; }
constexpr bool RoundsScale(Fp8 m) { return m == Fp8::kRoundScale || m == Fp8::kUe8m0; }
constexpr bool IsUe8m0(Fp8 m) { return m == Fp8::kUe8m0; }

// The scale of block `block` of row `row` of local expert j in an ll_recv_scales region
// (token index fastest; UE8M0 bytes decoded to 2^(code - 127)).
__device__ __host__ inline float ScaleAt(const GroupShape& s, const uint8_t* scales, bool ue8m0,
                                         int64_t j, int64_t row, int32_t block) {
  const uint8_t* p = scales + kernels::LowLatencyScaleOffset(s, ue8m0, j, row, block);
  if (ue8m0) return kernels::FloatFromBits(static_cast<uint32_t>(*p) << 23);
  return *reinterpret_cast<const float*>(p);
}

// ---- the test "expert": y = bf16(dequant(x) * (1 + j/8)), rows [0, recv_count[j]) ----

__device__ __host__ inline float ExpertFactor(int32_t j) { return 1.0f + 0.125f * (j % 8); }

__global__ void ExpertKernel(const uint8_t* recv_x, const uint8_t* recv_scales,
                             const int32_t* recv_count, bf16_bits* y, GroupShape s, bool fp8,
                             bool ue8m0) {
  const int64_t rows_per_expert = s.ll_rows_per_expert();
  const int32_t hidden = s.hidden;
  for (int32_t j = blockIdx.y; j < s.num_local_experts(); j += gridDim.y) {
    const int64_t n = static_cast<int64_t>(recv_count[j]) * hidden;
    const float factor = ExpertFactor(j);
    for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const int64_t row = j * rows_per_expert + i / hidden;
      const int32_t h = static_cast<int32_t>(i % hidden);
      float v;
      if (fp8) {
        v = __fmul_rn(
            kernels::E4m3ToFloat(recv_x[row * hidden + h]),
            ScaleAt(s, recv_scales, ue8m0, j, i / hidden, h / kernels::kFp8BlockChannels));
      } else {
        v = kernels::Bf16ToFloat(reinterpret_cast<const bf16_bits*>(recv_x)[row * hidden + h]);
      }
      y[row * hidden + h] = kernels::FloatToBf16(__fmul_rn(v, factor));
    }
  }
}

absl::Status LaunchExpert(const VirtualRankGroup& g, int32_t r, int32_t buffer, Fp8 mode,
                          cudaStream_t stream) {
  const auto& l = g.layout();
  const GroupShape& s = g.shape();
  dim3 grid(16, std::min(s.num_local_experts(), 8));
  ExpertKernel<<<grid, 256, 0, stream>>>(
      g.At<uint8_t>(r, l.ll_recv_x[buffer]), g.At<uint8_t>(r, l.ll_recv_scales[buffer]),
      g.At<int32_t>(r, l.ll_recv_count[buffer]), g.At<bf16_bits>(r, l.in_ll_combine_x), s,
      IsFp8(mode), IsUe8m0(mode));
  return EPD_CUDA_STATUS(cudaGetLastError());
}

// Host version of ExpertKernel over one rank's rows (local experts spread over threads).
void HostExpert(const GroupShape& s, const uint8_t* recv_x, const uint8_t* recv_scales,
                const int32_t* recv_count, bf16_bits* y, Fp8 mode) {
  const bool fp8 = IsFp8(mode);
  const int64_t rows = s.ll_rows_per_expert();
  const int64_t hidden = s.hidden;
  const int32_t threads =
      std::max(1, std::min<int32_t>(s.num_local_experts(), std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int32_t first = 0; first < threads; ++first) {
    pool.emplace_back([&, first] {
      for (int32_t j = first; j < s.num_local_experts(); j += threads) {
        for (int64_t rr = 0; rr < recv_count[j]; ++rr) {
          const int64_t row = j * rows + rr;
          for (int64_t h = 0; h < hidden; ++h) {
            float v = fp8 ? kernels::E4m3ToFloat(recv_x[row * hidden + h]) *
                                ScaleAt(s, recv_scales, IsUe8m0(mode), j, rr,
                                        static_cast<int32_t>(h / kernels::kFp8BlockChannels))
                          : kernels::Bf16ToFloat(
                                reinterpret_cast<const bf16_bits*>(recv_x)[row * hidden + h]);
            y[row * hidden + h] = kernels::FloatToBf16(v * ExpertFactor(j));
          }
        }
      }
    });
  }
  for (std::thread& t : pool) t.join();
}

// ---- one op's inputs and host reference ----------------------------------------------

struct RankInputs {
  int32_t num_tokens = 0;
  std::vector<bf16_bits> x;       // [T, H]
  std::vector<int64_t> topk_idx;  // [T, K]
  std::vector<float> weights;     // [T, K]
};

struct HostReference {
  // Per rank; recv arrays are [El, R*Mll, row] with only rows [0, count) meaningful.
  std::vector<std::unique_ptr<uint8_t[]>> recv_x;
  std::vector<std::vector<uint8_t>> recv_scales;  // the ll_recv_scales bytes
  std::vector<std::vector<int32_t>> recv_count;
  std::vector<std::vector<int32_t>> recv_src_info;
  std::vector<std::vector<int32_t>> handle_pos;
  std::vector<std::unique_ptr<bf16_bits[]>> y;  // expert outputs, bf16
  std::vector<std::vector<bf16_bits>> combined;
};

// Runs the host dispatch, the host expert and the host combine.
absl::Status ComputeHostReference(const GroupShape& s, Fp8 mode, std::vector<RankInputs>& in,
                                  HostReference* ref) {
  const bool fp8 = IsFp8(mode);
  const int32_t R = s.num_ranks;
  const int64_t rows = static_cast<int64_t>(s.num_local_experts()) * s.ll_rows_per_expert();
  const int64_t row_bytes = fp8 ? s.hidden : 2ll * s.hidden;
  ref->recv_x.clear();
  ref->y.clear();
  ref->recv_scales.assign(R, {});
  ref->recv_count.assign(R, std::vector<int32_t>(s.num_local_experts()));
  ref->recv_src_info.assign(R, std::vector<int32_t>(rows));
  ref->handle_pos.assign(
      R, std::vector<int32_t>(static_cast<size_t>(s.ll_max_tokens_per_rank) * s.num_topk, -1));
  ref->combined.assign(R, {});
  std::vector<kh::LowLatencyDispatchRankArgs> d(R);
  for (int32_t r = 0; r < R; ++r) {
    ref->recv_x.emplace_back(new uint8_t[rows * row_bytes]);
    ref->y.emplace_back(new bf16_bits[rows * s.hidden]);
    if (fp8) ref->recv_scales[r].resize(rows * s.num_scales() * 4);
    d[r].num_tokens = in[r].num_tokens;
    d[r].x = in[r].x.data();
    d[r].topk_idx = in[r].topk_idx.data();
    d[r].recv_x = ref->recv_x[r].get();
    d[r].recv_scales = fp8 ? ref->recv_scales[r].data() : nullptr;
    d[r].recv_count = ref->recv_count[r].data();
    d[r].recv_src_info = ref->recv_src_info[r].data();
    d[r].handle_pos = ref->handle_pos[r].data();
  }
  kh::LowLatencyDispatchOptions opt;
  opt.use_fp8 = fp8;
  opt.round_scale = RoundsScale(mode);
  opt.use_ue8m0 = IsUe8m0(mode);
  absl::Status st = kh::LowLatencyDispatch(s, opt, d);
  if (!st.ok()) return st;
  std::vector<kh::LowLatencyCombineRankArgs> c(R);
  for (int32_t r = 0; r < R; ++r) {
    HostExpert(s, ref->recv_x[r].get(), fp8 ? ref->recv_scales[r].data() : nullptr,
               ref->recv_count[r].data(), ref->y[r].get(), mode);
    ref->combined[r].resize(static_cast<size_t>(in[r].num_tokens) * s.hidden);
    c[r].num_tokens = in[r].num_tokens;
    c[r].topk_idx = in[r].topk_idx.data();
    c[r].topk_weights = in[r].weights.data();
    c[r].handle_pos = ref->handle_pos[r].data();
    c[r].x = ref->y[r].get();
    c[r].combined_x = ref->combined[r].data();
  }
  return kh::LowLatencyCombine(s, c);
}

absl::Status UploadInputs(VirtualRankGroup& g, const std::vector<RankInputs>& in) {
  const auto& l = g.layout();
  for (int32_t r = 0; r < g.num_ranks(); ++r) {
    absl::Status st = g.Upload(r, l.in_x, in[r].x.data(), in[r].x.size() * sizeof(bf16_bits));
    if (st.ok()) st = g.Upload(r, l.in_topk_idx, in[r].topk_idx.data(), in[r].topk_idx.size() * 8);
    if (st.ok())
      st = g.Upload(r, l.in_topk_weights, in[r].weights.data(), in[r].weights.size() * 4);
    if (st.ok()) {
      st = EPD_CUDA_STATUS(cudaMemcpy(kc::LowLatencyNumTokensSlot(g.Context(r)), &in[r].num_tokens,
                                      4, cudaMemcpyHostToDevice));
    }
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

// Compares every dispatch output of every rank (buffer b) with the reference.
absl::Status CheckDispatch(const VirtualRankGroup& g, int32_t b, Fp8 mode,
                           const std::vector<RankInputs>& in, const HostReference& ref) {
  const bool fp8 = IsFp8(mode);
  const GroupShape& s = g.shape();
  const auto& l = g.layout();
  const int64_t rows = s.ll_rows_per_expert();
  const int64_t row_bytes = fp8 ? s.hidden : 2ll * s.hidden;
  for (int32_t r = 0; r < g.num_ranks(); ++r) {
    const std::string who = absl::StrCat("rank ", r, " buffer ", b);
    auto count = g.DownloadVector<int32_t>(r, l.ll_recv_count[b], s.num_local_experts());
    if (!count.ok()) return count.status();
    absl::Status st = CompareBytes(ref.recv_count[r].data(), count->data(), count->size() * 4,
                                   who + " recv_count");
    if (!st.ok()) return st;
    auto pos = g.DownloadVector<int32_t>(r, l.ll_handle_pos[b],
                                         static_cast<size_t>(in[r].num_tokens) * s.num_topk);
    if (!pos.ok()) return pos.status();
    st = CompareBytes(ref.handle_pos[r].data(), pos->data(), pos->size() * 4, who + " handle_pos");
    if (!st.ok()) return st;
    for (int32_t j = 0; j < s.num_local_experts(); ++j) {
      const int64_t n = ref.recv_count[r][j];
      const int64_t first = j * rows;
      std::vector<uint8_t> x(n * row_bytes);
      st = g.Download(r, l.ll_recv_x[b], x.data(), x.size(), first * row_bytes);
      if (st.ok()) {
        st = CompareBytes(ref.recv_x[r].get() + first * row_bytes, x.data(), x.size(),
                          absl::StrCat(who, " recv_x of local expert ", j));
      }
      if (!st.ok()) return st;
      std::vector<int32_t> src(n);
      st = g.Download(r, l.ll_recv_src_info[b], src.data(), n * 4, first * 4);
      if (st.ok()) {
        st = CompareBytes(ref.recv_src_info[r].data() + first, src.data(), n * 4,
                          absl::StrCat(who, " recv_src_info of local expert ", j));
      }
      if (!st.ok()) return st;
      // Scales, token index fastest: [El, cols, rows] of 4-byte words (f32, or 4 UE8M0
      // bytes); rows [0, n) of each column.
      const int64_t cols = IsUe8m0(mode) ? s.num_scales() / 4 : s.num_scales();
      for (int64_t col = 0; fp8 && col < cols; ++col) {
        const int64_t at = ((j * cols + col) * rows) * 4;
        std::vector<uint8_t> sc(n * 4);
        st = g.Download(r, l.ll_recv_scales[b], sc.data(), sc.size(), at);
        if (st.ok()) {
          st = CompareBytes(ref.recv_scales[r].data() + at, sc.data(), sc.size(),
                            absl::StrCat(who, " recv_scales of local expert ", j, " column ", col));
        }
        if (!st.ok()) return st;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckCombine(const VirtualRankGroup& g, int32_t b, const std::vector<RankInputs>& in,
                          const HostReference& ref) {
  for (int32_t r = 0; r < g.num_ranks(); ++r) {
    auto out = g.DownloadVector<bf16_bits>(
        r, g.layout().ll_combined_x[b], static_cast<size_t>(in[r].num_tokens) * g.shape().hidden);
    if (!out.ok()) return out.status();
    absl::Status st = CompareBytes(ref.combined[r].data(), out->data(), out->size() * 2,
                                   absl::StrCat("rank ", r, " buffer ", b, " combined_x"));
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

// Enqueues dispatch (buffer b) on every rank, then reads every rank's status.
absl::Status RunDispatch(VirtualRankGroup& g, int32_t b, Fp8 mode, bool large_path = false) {
  kc::LowLatencyDispatchArgs a;
  a.buffer = b;
  a.use_fp8 = IsFp8(mode);
  a.round_scale = RoundsScale(mode);
  a.use_ue8m0 = IsUe8m0(mode);
  a.large_path = large_path;
  absl::Status st = g.LaunchAll([&](int32_t r, cudaStream_t stream) {
    return kc::LowLatencyDispatch(g.Context(r), a, stream);
  });
  for (int32_t r = 0; r < g.num_ranks() && st.ok(); ++r) {
    st = kc::ReadAndClearStatus(g.Context(r), g.stream(r), "LowLatencyDispatch");
  }
  return st;
}

// Enqueues the test expert + combine on every rank, then reads every rank's status.
absl::Status RunExpertAndCombine(VirtualRankGroup& g, int32_t b, Fp8 mode) {
  kc::LowLatencyCombineArgs a;
  a.buffer = b;
  absl::Status st = g.LaunchAll([&](int32_t r, cudaStream_t stream) {
    absl::Status e = LaunchExpert(g, r, b, mode, stream);
    if (!e.ok()) return e;
    return kc::LowLatencyCombine(g.Context(r), a, stream);
  });
  for (int32_t r = 0; r < g.num_ranks() && st.ok(); ++r) {
    st = kc::ReadAndClearStatus(g.Context(r), g.stream(r), "LowLatencyCombine");
  }
  return st;
}

// ---- the covering sweep -----------------------------------------------------------------

enum class Routing { kUniform, kOneExpert, kDuplicates };

struct SweepCase {
  int32_t ranks;
  int32_t hidden;
  int32_t topk;
  int32_t experts;
  int32_t base_tokens;  // rank r uses kTokenCycle[(index(base) + r) % 4] unless same_tokens
  bool same_tokens;     // every rank uses base_tokens
  double masked;
  Routing routing;
  Fp8 fp8;
};

constexpr int32_t kMll = 128;
constexpr int32_t kTokenCycle[4] = {0, 1, 77, 128};

const char* RoutingName(Routing routing) {
  return routing == Routing::kUniform     ? "uniform"
         : routing == Routing::kOneExpert ? "oneexpert"
                                          : "dups";
}

const char* Fp8Name(Fp8 fp8) {
  return fp8 == Fp8::kOff          ? "bf16"
         : fp8 == Fp8::kOn         ? "fp8"
         : fp8 == Fp8::kRoundScale ? "fp8round"
                                   : "fp8ue8m0";
}

std::string CaseName(const SweepCase& c) {
  return absl::StrCat("R", c.ranks, "_H", c.hidden, "_K", c.topk, "_E", c.experts, "_T",
                      c.base_tokens, c.same_tokens ? "all" : "mix", "_mask",
                      static_cast<int>(c.masked * 100), "_", RoutingName(c.routing), "_",
                      Fp8Name(c.fp8));
}

void PrintTo(const SweepCase& c, std::ostream* os) { *os << CaseName(c); }

// A low-latency group's shape (M = 1: no normal-mode work in these tests).
GroupShape LowLatencyShape(int32_t ranks, int32_t experts, int32_t hidden, int32_t topk,
                           int32_t mll, Fp8 fp8) {
  GroupShape s;
  s.num_ranks = ranks;
  s.num_experts = experts;
  s.hidden = hidden;
  s.num_topk = topk;
  s.max_tokens_per_rank = 1;
  s.ll_max_tokens_per_rank = mll;
  s.use_fp8 = fp8 != Fp8::kOff;
  return s;
}

// One rank's random inputs of `num_tokens` tokens routed as `routing` says.
RankInputs MakeRankInputs(const GroupShape& s, int32_t num_tokens, double masked, Routing routing,
                          std::mt19937_64& rng) {
  RankInputs ri;
  ri.num_tokens = num_tokens;
  ri.x = RandomBf16(static_cast<size_t>(num_tokens) * s.hidden, rng);
  RoutingOptions ro;
  ro.masked_fraction = masked;
  if (routing == Routing::kOneExpert) ro.one_expert = (s.num_experts - 1) / 2;
  if (routing == Routing::kDuplicates) ro.duplicate_fraction = 0.3;
  ri.topk_idx = RandomTopk(num_tokens, s.num_topk, s.num_experts, ro, rng);
  ri.weights = RandomFloats(static_cast<size_t>(num_tokens) * s.num_topk, rng, -1.0f, 1.0f);
  return ri;
}

std::vector<RankInputs> MakeInputs(const SweepCase& c, std::mt19937_64& rng, int32_t salt) {
  const GroupShape s = LowLatencyShape(c.ranks, c.experts, c.hidden, c.topk, kMll, c.fp8);
  std::vector<RankInputs> in;
  int32_t base_index = 0;
  while (kTokenCycle[base_index] != c.base_tokens) ++base_index;
  for (int32_t r = 0; r < c.ranks; ++r) {
    const int32_t t = c.same_tokens ? c.base_tokens : kTokenCycle[(base_index + r + salt) % 4];
    in.push_back(MakeRankInputs(s, t, c.masked, c.routing, rng));
  }
  return in;
}

// Three ops of case `c` (buffers 0, 1, 0) on a fresh group at each flag scope, every output
// compared with the host reference bit for bit.
void RunSweepCase(const SweepCase& c) {
  const GroupShape s = LowLatencyShape(c.ranks, c.experts, c.hidden, c.topk, kMll, c.fp8);
  const Fp8 mode = c.fp8;
  // Every case runs with the flags at .sys scope (ranks on several GPUs) and at .gpu scope
  // (CudaRankContext::all_ranks_on_device: every rank on this GPU).
  for (const bool gpu_scope : {false, true}) {
    SCOPED_TRACE(gpu_scope ? "flags at .gpu scope" : "flags at .sys scope");
    auto group = VirtualRankGroup::Create(s);
    ASSERT_TRUE(group.ok()) << group.status();
    VirtualRankGroup& g = **group;
    g.set_all_ranks_on_device(gpu_scope);
    std::mt19937_64 rng(std::hash<std::string>()(CaseName(c)));

    // Three ops: buffers 0, 1, 0 (the third reuses buffer 0 of the first); after op 2 the
    // views of op 1 (buffer 0) must still hold op 1's results.
    std::vector<int32_t> first_counts;
    std::vector<std::vector<int32_t>> first_handles;
    std::vector<RankInputs> first_inputs;
    HostReference first_ref;
    for (int32_t op = 0; op < 3; ++op) {
      const int32_t b = op % 2;
      std::vector<RankInputs> in = MakeInputs(c, rng, op);
      HostReference ref;
      EPD_ASSERT_OK(ComputeHostReference(s, mode, in, &ref));
      EPD_ASSERT_OK(UploadInputs(g, in));
      EPD_ASSERT_OK(RunDispatch(g, b, mode));
      EPD_ASSERT_OK(CheckDispatch(g, b, mode, in, ref)) << "op " << op;
      EPD_ASSERT_OK(RunExpertAndCombine(g, b, mode));
      EPD_ASSERT_OK(CheckCombine(g, b, in, ref)) << "op " << op;
      if (op == 0) {
        first_inputs = std::move(in);
        first_ref = std::move(ref);
      }
      if (op == 1) {
        // Double buffering: op 0's outputs in buffer 0 are intact after op 1.
        EPD_ASSERT_OK(CheckDispatch(g, 0, mode, first_inputs, first_ref)) << "op 0 after op 1";
        EPD_ASSERT_OK(CheckCombine(g, 0, first_inputs, first_ref)) << "op 0 after op 1";
      }
    }
  }
}

class LowLatencySweep : public ::testing::TestWithParam<SweepCase> {};

TEST_P(LowLatencySweep, MatchesHostBitForBit) {
  REQUIRE_GPU();
  RunSweepCase(GetParam());
}

// A covering selection (not the full product): every value of every parameter appears, and
// most pairs of values do. Ranks other than the first get the other T values in turn
// (T_r = cycle[(index(T) + r + op) % 4] over {0, 1, 77, 128}) unless "all".
INSTANTIATE_TEST_SUITE_P(
    Covering, LowLatencySweep,
    ::testing::Values(
        SweepCase{1, 2048, 1, 1, 0, false, 0.0, Routing::kUniform, Fp8::kOff},
        SweepCase{1, 4096, 8, 64, 77, true, 0.5, Routing::kUniform, Fp8::kOn},
        SweepCase{1, 7168, 6, 256, 128, true, 0.0, Routing::kOneExpert, Fp8::kRoundScale},
        SweepCase{2, 2048, 6, 2, 1, false, 0.0, Routing::kDuplicates, Fp8::kOn},
        SweepCase{2, 4096, 1, 64, 128, false, 0.5, Routing::kOneExpert, Fp8::kOff},
        SweepCase{2, 7168, 8, 256, 77, false, 0.0, Routing::kUniform, Fp8::kOff},
        SweepCase{4, 2048, 8, 64, 128, true, 0.0, Routing::kUniform, Fp8::kRoundScale},
        SweepCase{4, 4096, 6, 4, 0, false, 0.5, Routing::kDuplicates, Fp8::kOff},
        SweepCase{4, 7168, 1, 256, 1, false, 0.0, Routing::kOneExpert, Fp8::kOn},
        SweepCase{8, 2048, 1, 8, 77, false, 0.5, Routing::kUniform, Fp8::kRoundScale},
        SweepCase{8, 4096, 8, 256, 0, false, 0.0, Routing::kOneExpert, Fp8::kOff},
        SweepCase{8, 7168, 6, 64, 1, false, 0.5, Routing::kDuplicates, Fp8::kRoundScale},
        SweepCase{8, 2048, 8, 256, 128, true, 0.5, Routing::kOneExpert, Fp8::kOff},
        SweepCase{8, 4096, 6, 8, 0, true, 0.0, Routing::kUniform, Fp8::kOn},
        // H not a multiple of the kernels' 512-channel chunk: FP8 with a 128-channel tail;
        // BF16 with H % 16 == 8 (a lane's second 16-byte vector past H); BF16 with H % 8 != 0
        // (the scalar path).
        SweepCase{4, 640, 8, 64, 128, true, 0.0, Routing::kUniform, Fp8::kOn},
        SweepCase{4, 1000, 6, 64, 77, false, 0.5, Routing::kDuplicates, Fp8::kOff},
        SweepCase{2, 1002, 8, 64, 128, true, 0.0, Routing::kUniform, Fp8::kOff},
        // DeepSeek-V3 decode: T=128, H=7168, K=8, E=256, 8 ranks; FP8 and BF16.
        SweepCase{8, 7168, 8, 256, 128, true, 0.0, Routing::kUniform, Fp8::kOn},
        SweepCase{8, 7168, 8, 256, 128, true, 0.0, Routing::kUniform, Fp8::kOff},
        // UE8M0-packed scales (use_ue8m0, H % 512 == 0): one int32 per 512 channels per
        // token, written whole by the kernel; DeepSeek-V3 decode among them.
        SweepCase{1, 4096, 1, 8, 1, false, 0.0, Routing::kUniform, Fp8::kUe8m0},
        SweepCase{2, 7168, 8, 256, 77, false, 0.3, Routing::kDuplicates, Fp8::kUe8m0},
        SweepCase{4, 512, 6, 64, 0, false, 0.5, Routing::kOneExpert, Fp8::kUe8m0},
        SweepCase{8, 2048, 6, 64, 128, true, 0.0, Routing::kUniform, Fp8::kUe8m0},
        SweepCase{8, 7168, 8, 256, 128, true, 0.0, Routing::kUniform, Fp8::kUe8m0}),
    [](const ::testing::TestParamInfo<SweepCase>& info) { return CaseName(info.param); });

// ---- the shape-specialised kernels (cuda_ops.h LowLatencySpecialisedFor) ----------------

// Sets the process-wide specialisation choice for a scope, then back to the environment's.
class ScopedSpecialisation {
 public:
  explicit ScopedSpecialisation(kc::LowLatencySpecialisation mode) {
    kc::SetLowLatencySpecialisation(mode);
  }
  ~ScopedSpecialisation() {
    kc::SetLowLatencySpecialisation(kc::LowLatencySpecialisation::kEnvironment);
  }
  ScopedSpecialisation(const ScopedSpecialisation&) = delete;
  ScopedSpecialisation& operator=(const ScopedSpecialisation&) = delete;
};

// The choice: only the exact shape (H = 7168, K = 8, E / R = 32, any R), only when on.
TEST(LowLatencySpecialisedChoice, OnlyTheExactShapeAndOnlyWhenOn) {
  const GroupShape match = LowLatencyShape(8, 256, 7168, 8, kMll, Fp8::kOn);
  {
    ScopedSpecialisation on(kc::LowLatencySpecialisation::kOn);
    EXPECT_TRUE(kc::LowLatencySpecialisedFor(match));
    EXPECT_TRUE(kc::LowLatencySpecialisedFor(LowLatencyShape(2, 64, 7168, 8, kMll, Fp8::kOff)));
    EXPECT_FALSE(kc::LowLatencySpecialisedFor(LowLatencyShape(8, 256, 4096, 8, kMll, Fp8::kOn)));
    EXPECT_FALSE(kc::LowLatencySpecialisedFor(LowLatencyShape(8, 256, 7168, 6, kMll, Fp8::kOn)));
    EXPECT_FALSE(kc::LowLatencySpecialisedFor(LowLatencyShape(2, 256, 7168, 8, kMll, Fp8::kOn)));
  }
  {
    ScopedSpecialisation off(kc::LowLatencySpecialisation::kOff);
    EXPECT_FALSE(kc::LowLatencySpecialisedFor(match));
  }
  const char* env = std::getenv("EPD_LL_SPECIALISED");
  EXPECT_EQ(kc::LowLatencySpecialisedFor(match), env != nullptr && std::strcmp(env, "1") == 0);
}

// The specialised instances against the host, bit for bit, at their shape (R = 8 and, E / R
// being what is fixed, R = 2 with E = 64): FP8 (every scale format) and BF16 dispatch, BF16
// combine, with mixed T, masked ids and duplicate experts. EPD_LL_SPECIALISED=1 in the
// environment selects them too; this test selects them itself either way.
class LowLatencySpecialised : public ::testing::TestWithParam<SweepCase> {};

TEST_P(LowLatencySpecialised, MatchesHostBitForBit) {
  REQUIRE_GPU();
  const SweepCase& c = GetParam();
  ScopedSpecialisation on(kc::LowLatencySpecialisation::kOn);
  ASSERT_TRUE(kc::LowLatencySpecialisedFor(
      LowLatencyShape(c.ranks, c.experts, c.hidden, c.topk, kMll, c.fp8)));
  RunSweepCase(c);
}

INSTANTIATE_TEST_SUITE_P(
    DeepSeekV3Decode, LowLatencySpecialised,
    ::testing::Values(SweepCase{8, 7168, 8, 256, 128, true, 0.0, Routing::kUniform, Fp8::kOn},
                      SweepCase{8, 7168, 8, 256, 128, true, 0.0, Routing::kUniform, Fp8::kOff},
                      SweepCase{8, 7168, 8, 256, 77, false, 0.3, Routing::kDuplicates, Fp8::kUe8m0},
                      SweepCase{8, 7168, 8, 256, 1, false, 0.5, Routing::kOneExpert,
                                Fp8::kRoundScale},
                      SweepCase{2, 7168, 8, 64, 128, false, 0.2, Routing::kDuplicates, Fp8::kOff},
                      SweepCase{2, 7168, 8, 64, 0, false, 0.0, Routing::kUniform, Fp8::kOn}),
    [](const ::testing::TestParamInfo<SweepCase>& info) { return CaseName(info.param); });

// ---- large capacities and top-k ----------------------------------------------------------
//
// Capacities Mll of 1, 128, 1024, 3000 and 4096 and top-k of 1, 8, 32, 48 and 64 (and
// 128), FP8 and BF16, small and DeepSeek-V3 hidden sizes: every routing too large for the
// small path's shared memory or K > 32 takes the large path (cuda_limits.h
// PlanLowLatencyRouting), and DeepSeek-V3 decode is also forced through it. Two ops per case
// (buffers 0 and 1), rank 0 at T = Mll, rank 1 at T = 0, the others in between.

struct LargeCase {
  int32_t ranks;
  int32_t experts;
  int32_t hidden;
  int32_t topk;
  int32_t mll;
  Fp8 fp8;
  Routing routing;
  double masked;
  bool large_path;  // LowLatencyDispatchArgs::large_path (the plan may take it anyway)
  bool gpu_scope;   // CudaRankContext::all_ranks_on_device
};

std::string LargeCaseName(const LargeCase& c) {
  return absl::StrCat("R", c.ranks, "_E", c.experts, "_H", c.hidden, "_K", c.topk, "_Mll", c.mll,
                      "_mask", static_cast<int>(c.masked * 100), "_", RoutingName(c.routing), "_",
                      Fp8Name(c.fp8), c.large_path ? "_forcedlarge" : "",
                      c.gpu_scope ? "_gpuscope" : "_sysscope");
}

void PrintTo(const LargeCase& c, std::ostream* os) { *os << LargeCaseName(c); }

class LowLatencyLarge : public ::testing::TestWithParam<LargeCase> {};

TEST_P(LowLatencyLarge, MatchesHostBitForBit) {
  REQUIRE_GPU();
  const LargeCase& c = GetParam();
  const GroupShape s = LowLatencyShape(c.ranks, c.experts, c.hidden, c.topk, c.mll, c.fp8);
  const Fp8 mode = c.fp8;
  auto group = VirtualRankGroup::Create(s);
  ASSERT_TRUE(group.ok()) << group.status();
  VirtualRankGroup& g = **group;
  g.set_all_ranks_on_device(c.gpu_scope);
  std::mt19937_64 rng(std::hash<std::string>()(LargeCaseName(c)));
  for (int32_t op = 0; op < 2; ++op) {
    std::vector<RankInputs> in;
    for (int32_t r = 0; r < c.ranks; ++r) {
      int32_t t = r == 0 ? c.mll : r == 1 ? 0 : (r * 37 + op * 11 + 5) % (c.mll + 1);
      if (op == 1 && r < 2) t = c.mll - t;  // rank 0 empty, rank 1 full
      in.push_back(MakeRankInputs(s, t, c.masked, c.routing, rng));
    }
    HostReference ref;
    EPD_ASSERT_OK(ComputeHostReference(s, mode, in, &ref));
    EPD_ASSERT_OK(UploadInputs(g, in));
    EPD_ASSERT_OK(RunDispatch(g, op, mode, c.large_path)) << "op " << op;
    EPD_ASSERT_OK(CheckDispatch(g, op, mode, in, ref)) << "op " << op;
    EPD_ASSERT_OK(RunExpertAndCombine(g, op, mode)) << "op " << op;
    EPD_ASSERT_OK(CheckCombine(g, op, in, ref)) << "op " << op;
  }
}

INSTANTIATE_TEST_SUITE_P(
    CapacityAndTopk, LowLatencyLarge,
    ::testing::Values(
        // The specs the conformance check found failing at the first op.
        LargeCase{2, 16, 128, 8, 3000, Fp8::kOn, Routing::kUniform, 0.0, false, true},
        LargeCase{4, 16, 1024, 4, 1024, Fp8::kOn, Routing::kDuplicates, 0.2, false, false},
        LargeCase{4, 32, 256, 2, 1100, Fp8::kOff, Routing::kUniform, 0.5, false, true},
        // Small hidden sizes; H = 1000 is BF16's scalar path, H = 640 FP8 with a tail chunk.
        LargeCase{4, 64, 128, 64, 4096, Fp8::kOn, Routing::kDuplicates, 0.1, false, true},
        LargeCase{2, 16, 256, 8, 4096, Fp8::kRoundScale, Routing::kOneExpert, 0.0, false, false},
        LargeCase{2, 64, 1000, 48, 1024, Fp8::kOff, Routing::kUniform, 0.3, false, true},
        LargeCase{8, 64, 640, 48, 1, Fp8::kOn, Routing::kUniform, 0.0, false, false},
        LargeCase{2, 32, 256, 32, 3000, Fp8::kOff, Routing::kDuplicates, 0.0, false, true},
        LargeCase{1, 128, 512, 128, 128, Fp8::kOff, Routing::kUniform, 0.2, false, true},
        // DeepSeek-V3's hidden size.
        LargeCase{8, 8, 7168, 1, 1, Fp8::kOff, Routing::kOneExpert, 0.0, false, true},
        LargeCase{2, 16, 7168, 8, 4096, Fp8::kOn, Routing::kUniform, 0.0, false, true},
        LargeCase{2, 64, 7168, 64, 1024, Fp8::kOff, Routing::kDuplicates, 0.1, false, false},
        LargeCase{2, 48, 7168, 48, 3000, Fp8::kOn, Routing::kUniform, 0.0, false, true},
        LargeCase{8, 256, 7168, 32, 128, Fp8::kRoundScale, Routing::kUniform, 0.2, false, true},
        // DeepSeek-V3 decode (T = 128, K = 8, E = 256, 8 ranks) through the large path.
        LargeCase{8, 256, 7168, 8, 128, Fp8::kOn, Routing::kUniform, 0.0, true, true},
        LargeCase{8, 256, 7168, 8, 128, Fp8::kOff, Routing::kDuplicates, 0.3, true, false},
        // UE8M0-packed scales on the large path: a big capacity, and DeepSeek-V3 decode.
        LargeCase{2, 16, 512, 8, 4096, Fp8::kUe8m0, Routing::kUniform, 0.1, false, true},
        LargeCase{4, 64, 1024, 48, 1024, Fp8::kUe8m0, Routing::kDuplicates, 0.2, false, false},
        LargeCase{8, 256, 7168, 8, 128, Fp8::kUe8m0, Routing::kUniform, 0.0, true, false}),
    [](const ::testing::TestParamInfo<LargeCase>& info) { return LargeCaseName(info.param); });

// ---- failure cases ----------------------------------------------------------------------

GroupShape SmallShape(int32_t ranks) { return LowLatencyShape(ranks, 64, 2048, 8, kMll, Fp8::kOn); }

SweepCase SmallCase(int32_t ranks) {
  return SweepCase{ranks, 2048, 8, 64, 77, false, 0.0, Routing::kUniform, Fp8::kOn};
}

// `n` DeviceStatus of pinned host memory (KernelHandoff::status_out), or null.
PinnedMemory AllocateStatusOut(int32_t n) {
  void* pinned = nullptr;
  if (cudaHostAlloc(&pinned, n * sizeof(kc::DeviceStatus), cudaHostAllocPortable) != cudaSuccess) {
    return nullptr;
  }
  return PinnedMemory(static_cast<uint8_t*>(pinned));
}

// Runs one valid FP8 op on buffer b and checks everything against the host.
void ExpectValidOp(VirtualRankGroup& g, int32_t b, std::mt19937_64& rng, int32_t salt) {
  std::vector<RankInputs> in = MakeInputs(SmallCase(g.num_ranks()), rng, salt);
  HostReference ref;
  EPD_ASSERT_OK(ComputeHostReference(g.shape(), Fp8::kOn, in, &ref));
  EPD_ASSERT_OK(UploadInputs(g, in));
  EPD_ASSERT_OK(RunDispatch(g, b, Fp8::kOn));
  EPD_ASSERT_OK(CheckDispatch(g, b, Fp8::kOn, in, ref));
  EPD_ASSERT_OK(RunExpertAndCombine(g, b, Fp8::kOn));
  EPD_ASSERT_OK(CheckCombine(g, b, in, ref));
}

// Buffer 0: the status read back as a test does (ReadAndClearStatus). Buffer 1: as the
// daemon does for a stream-ordered op, the kernel itself stores done and copies its status
// to pinned memory (KernelHandoff::status_out) and clears it: the copy must carry rank 1's
// error (and nothing for the others), and the status on the device must be zero after.
TEST(LowLatencyFailure, OutOfRangeIdsGiveInvalidArgumentThenNextOpIsCorrect) {
  REQUIRE_GPU();
  constexpr int32_t R = 4;
  auto group = VirtualRankGroup::Create(SmallShape(R));
  ASSERT_TRUE(group.ok()) << group.status();
  VirtualRankGroup& g = **group;
  PinnedMemory status_out_memory = AllocateStatusOut(R);
  ASSERT_NE(status_out_memory, nullptr);
  void* pinned = status_out_memory.get();
  auto* status_out = reinterpret_cast<kc::DeviceStatus*>(pinned);
  auto done_words = DeviceBuffer::Allocate(R * sizeof(uint64_t));
  ASSERT_TRUE(done_words.ok());
  auto* done = reinterpret_cast<uint64_t*>(done_words->get());
  std::mt19937_64 rng(7);
  for (int32_t b = 0; b < 2; ++b) {
    const bool kernel_status = b == 1;
    SCOPED_TRACE(kernel_status ? "status_out" : "ReadAndClearStatus");
    std::memset(pinned, 0xff, R * sizeof(kc::DeviceStatus));  // Must all be overwritten.
    auto handoff = [&](int32_t r, uint64_t seq) {
      kc::KernelHandoff h;
      if (!kernel_status) return h;
      h.done_flag = done + r;
      h.done_value = seq;
      h.status_out = status_out + r;
      return h;
    };
    // The status of rank r after an op: from status_out, or read (and cleared) from the device.
    auto op_status = [&](int32_t r, const char* op) -> absl::Status {
      if (!kernel_status) {
        // Without a hand-off the kernel leaves status_out alone.
        if (reinterpret_cast<const uint8_t*>(status_out + r)[0] != 0xff) {
          return absl::InternalError(absl::StrCat("rank ", r, ": status_out written"));
        }
        return kc::ReadAndClearStatus(g.Context(r), g.stream(r), op);
      }
      if (cudaStreamSynchronize(g.stream(r)) != cudaSuccess) return absl::InternalError("sync");
      if (ReadWord(done + r) != (std::string(op) == "LowLatencyDispatch" ? 1u : 2u)) {
        return absl::InternalError(absl::StrCat("rank ", r, ": done not written"));
      }
      absl::Status st = kc::StatusFromDevice(status_out[r], g.shape(), r, op, true);
      // The kernel cleared the device's status: a read-back now finds nothing.
      absl::Status left = kc::ReadAndClearStatus(g.Context(r), g.stream(r), op);
      if (!left.ok())
        return absl::InternalError(absl::StrCat("status not cleared: ", left.ToString()));
      return st;
    };
    std::vector<RankInputs> in = MakeInputs(SmallCase(R), rng, b);
    in[1].num_tokens = 5;
    in[1].x.resize(5 * 2048);
    in[1].topk_idx.assign(5 * 8, 3);
    in[1].weights.assign(5 * 8, 0.5f);
    in[1].topk_idx[3] = 64;   // == E
    in[1].topk_idx[17] = -2;  // < -1
    in[1].topk_idx[30] = 1 << 20;
    EPD_ASSERT_OK(UploadInputs(g, in));
    EPD_ASSERT_OK(g.LaunchAll([&](int32_t r, cudaStream_t st) {
      kc::LowLatencyDispatchArgs a;
      a.buffer = b;
      a.use_fp8 = true;
      a.handoff = handoff(r, 1);
      return kc::LowLatencyDispatch(g.Context(r), a, st);
    }));
    for (int32_t r = 0; r < R; ++r) {
      absl::Status st = op_status(r, "LowLatencyDispatch");
      if (r == 1) {
        EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
        EXPECT_NE(st.message().find("3 topk_idx value(s)"), std::string::npos) << st;
      } else {
        EXPECT_TRUE(st.ok()) << "rank " << r << ": " << st;
      }
    }
    EPD_ASSERT_OK(g.LaunchAll([&](int32_t r, cudaStream_t st) {
      kc::LowLatencyCombineArgs ca;
      ca.buffer = b;
      ca.handoff = handoff(r, 2);
      return kc::LowLatencyCombine(g.Context(r), ca, st);
    }));
    absl::Status cs = op_status(1, "LowLatencyCombine");
    EXPECT_EQ(cs.code(), absl::StatusCode::kInvalidArgument) << cs;
    for (int32_t r : {0, 2, 3}) {
      absl::Status st = op_status(r, "LowLatencyCombine");
      EXPECT_TRUE(st.ok()) << "rank " << r << ": " << st;
    }
  }
  // The next ops on the same buffers are correct.
  ExpectValidOp(g, 0, rng, 10);
  ExpectValidOp(g, 1, rng, 11);
}

TEST(LowLatencyFailure, TooManyTokensGivesInvalidArgumentThenNextOpIsCorrect) {
  REQUIRE_GPU();
  auto group = VirtualRankGroup::Create(SmallShape(4));
  ASSERT_TRUE(group.ok()) << group.status();
  VirtualRankGroup& g = **group;
  std::mt19937_64 rng(8);
  std::vector<RankInputs> in = MakeInputs(SmallCase(4), rng, 0);
  EPD_ASSERT_OK(UploadInputs(g, in));
  const int32_t too_many = kMll + 1;
  ASSERT_EQ(
      cudaMemcpy(kc::LowLatencyNumTokensSlot(g.Context(2)), &too_many, 4, cudaMemcpyHostToDevice),
      cudaSuccess);
  kc::LowLatencyDispatchArgs a;
  a.use_fp8 = true;
  EPD_ASSERT_OK(g.LaunchAll(
      [&](int32_t r, cudaStream_t st) { return kc::LowLatencyDispatch(g.Context(r), a, st); }));
  for (int32_t r = 0; r < 4; ++r) {
    absl::Status st = kc::ReadAndClearStatus(g.Context(r), g.stream(r), "LowLatencyDispatch");
    if (r == 2) {
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
      EXPECT_NE(st.message().find("num_tokens = 129"), std::string::npos) << st;
    } else {
      EXPECT_TRUE(st.ok()) << st;
    }
  }
  kc::LowLatencyCombineArgs ca;
  EPD_ASSERT_OK(g.LaunchAll(
      [&](int32_t r, cudaStream_t st) { return kc::LowLatencyCombine(g.Context(r), ca, st); }));
  EPD_ASSERT_OK(g.SynchronizeAll());
  ExpectValidOp(g, 0, rng, 1);
  ExpectValidOp(g, 1, rng, 2);

  // The same with T given by value (LowLatencyDispatchArgs::num_tokens_value), rank 1 bad.
  a.num_tokens_value = 0;
  EPD_ASSERT_OK(g.LaunchAll([&](int32_t r, cudaStream_t st) {
    kc::LowLatencyDispatchArgs v = a;
    v.buffer = 1;
    v.num_tokens_value = r == 1 ? too_many : in[r].num_tokens;
    return kc::LowLatencyDispatch(g.Context(r), v, st);
  }));
  for (int32_t r = 0; r < 4; ++r) {
    absl::Status st = kc::ReadAndClearStatus(g.Context(r), g.stream(r), "LowLatencyDispatch");
    if (r == 1) {
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
      EXPECT_NE(st.message().find("num_tokens = 129"), std::string::npos) << st;
    } else {
      EXPECT_TRUE(st.ok()) << "rank " << r << ": " << st;
    }
  }
  ca.buffer = 1;
  EPD_ASSERT_OK(g.LaunchAll(
      [&](int32_t r, cudaStream_t st) { return kc::LowLatencyCombine(g.Context(r), ca, st); }));
  EPD_ASSERT_OK(g.SynchronizeAll());
  ExpectValidOp(g, 0, rng, 3);
}

TEST(LowLatencyFailure, MissingRankTimesOutOthersKeepWorking) {
  REQUIRE_GPU();
  constexpr int64_t kTimeoutNs = 1'500'000'000;
  // Group A: 4 ranks, rank 3 never launches. Group B: 2 ranks on the same GPU, few SMs, runs
  // while A's ranks spin.
  auto group_a = VirtualRankGroup::Create(SmallShape(4), kTimeoutNs, /*num_sms=*/16);
  ASSERT_TRUE(group_a.ok()) << group_a.status();
  auto group_b = VirtualRankGroup::Create(SmallShape(2), 5'000'000'000, /*num_sms=*/8);
  ASSERT_TRUE(group_b.ok()) << group_b.status();
  VirtualRankGroup& a = **group_a;
  VirtualRankGroup& b = **group_b;
  std::mt19937_64 rng(9);
  std::vector<RankInputs> in = MakeInputs(SmallCase(4), rng, 0);
  EPD_ASSERT_OK(UploadInputs(a, in));

  kc::LowLatencyDispatchArgs da;
  da.use_fp8 = true;
  const auto start = std::chrono::steady_clock::now();
  for (int32_t r = 0; r < 3; ++r) {
    EPD_ASSERT_OK(kc::LowLatencyDispatch(a.Context(r), da, a.stream(r)));
  }
  // Group B works while A spins.
  ExpectValidOp(b, 0, rng, 1);
  const double b_done_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(b_done_s, kTimeoutNs * 1e-9) << "group B waited for group A's timeout";

  for (int32_t r = 0; r < 3; ++r) {
    absl::Status st = kc::ReadAndClearStatus(a.Context(r), a.stream(r), "LowLatencyDispatch");
    EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
    EXPECT_NE(st.message().find("[3]"), std::string::npos) << st;
  }
  const double elapsed_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LE(elapsed_s, kTimeoutNs * 1e-9 + 1.0);
  // The context is healthy.
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  ExpectValidOp(b, 1, rng, 2);

  // Group A after a reset of its low-latency sync state works again.
  for (int32_t r = 0; r < 4; ++r) EPD_ASSERT_OK(kc::ResetLowLatencySync(a.Context(r), a.stream(r)));
  EPD_ASSERT_OK(a.SynchronizeAll());
  ExpectValidOp(a, 0, rng, 3);
  ExpectValidOp(a, 1, rng, 4);
}

// The daemon's shutdown word (CudaRankContext::abort_flag, host-mapped, raised by epd's
// stop): ranks 0-2 dispatch with a 60 s timeout while rank 3 never launches; they still
// wait 100 ms later, and once the host raises the word they end within milliseconds (a poll
// per kAbortPollNs), through the timeout path: DEADLINE_EXCEEDED naming rank 3. Without the
// word's poll they would wait the 60 s.
TEST(LowLatencyFailure, ShutdownWordEndsAMissingRanksWaitAtOnce) {
  REQUIRE_GPU();
  constexpr int64_t kTimeoutNs = 60'000'000'000;
  auto group = VirtualRankGroup::Create(SmallShape(4), kTimeoutNs, /*num_sms=*/16);
  ASSERT_TRUE(group.ok()) << group.status();
  VirtualRankGroup& g = **group;
  std::mt19937_64 rng(31);
  std::vector<RankInputs> in = MakeInputs(SmallCase(4), rng, 0);
  EPD_ASSERT_OK(UploadInputs(g, in));
  void* word_memory = nullptr;
  ASSERT_EQ(
      cudaHostAlloc(&word_memory, sizeof(uint32_t), cudaHostAllocPortable | cudaHostAllocMapped),
      cudaSuccess);
  PinnedMemory word_owner(static_cast<uint8_t*>(word_memory));
  auto* word = static_cast<volatile uint32_t*>(word_memory);
  *word = 0;
  kc::LowLatencyDispatchArgs da;
  da.use_fp8 = true;
  for (int32_t r = 0; r < 3; ++r) {
    kc::CudaRankContext ctx = g.Context(r);
    ctx.abort_flag = static_cast<const uint32_t*>(word_memory);
    EPD_ASSERT_OK(kc::LowLatencyDispatch(ctx, da, g.stream(r)));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  for (int32_t r = 0; r < 3; ++r) {
    EXPECT_EQ(cudaStreamQuery(g.stream(r)), cudaErrorNotReady) << "rank " << r << " did not wait";
  }
  const auto raised = std::chrono::steady_clock::now();
  *word = 1;
  for (int32_t r = 0; r < 3; ++r) EXPECT_EQ(cudaStreamSynchronize(g.stream(r)), cudaSuccess);
  const double took_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - raised).count();
  EXPECT_LT(took_s, 0.5) << "the waits did not end on the shutdown word";
  std::printf("the waits ended %.1f ms after the word was raised\n", 1e3 * took_s);
  for (int32_t r = 0; r < 3; ++r) {
    absl::Status st = kc::ReadAndClearStatus(g.Context(r), g.stream(r), "LowLatencyDispatch");
    EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
    EXPECT_NE(st.message().find("[3]"), std::string::npos) << st;
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// The same as the daemon runs it: ranks 0-2 dispatch with a hand-off that stores done and
// copies the status out (KernelHandoff::status_out), rank 3 never launches. Every block of
// the three ranks times out; status_out must carry the timeout naming rank 3 (every
// block's update is in the copy: block 0 waits for all tickets first), done must be
// written, and the device status must be clear afterwards.
TEST(LowLatencyFailure, MissingRankTimeoutReachesStatusOut) {
  REQUIRE_GPU();
  constexpr int32_t R = 4;
  constexpr int64_t kTimeoutNs = 1'000'000'000;
  auto group = VirtualRankGroup::Create(SmallShape(R), kTimeoutNs);
  ASSERT_TRUE(group.ok()) << group.status();
  VirtualRankGroup& g = **group;
  PinnedMemory status_out_memory = AllocateStatusOut(R);
  ASSERT_NE(status_out_memory, nullptr);
  std::memset(status_out_memory.get(), 0xff, R * sizeof(kc::DeviceStatus));
  auto* status_out = reinterpret_cast<kc::DeviceStatus*>(status_out_memory.get());
  auto done_words = DeviceBuffer::Allocate(R * sizeof(uint64_t));
  ASSERT_TRUE(done_words.ok());
  ASSERT_EQ(cudaMemset(done_words->get(), 0, R * sizeof(uint64_t)), cudaSuccess);
  auto* done = reinterpret_cast<uint64_t*>(done_words->get());
  std::mt19937_64 rng(12);
  std::vector<RankInputs> in = MakeInputs(SmallCase(R), rng, 0);
  EPD_ASSERT_OK(UploadInputs(g, in));
  for (int32_t r = 0; r < R - 1; ++r) {
    kc::LowLatencyDispatchArgs a;
    a.use_fp8 = true;
    a.handoff.done_flag = done + r;
    a.handoff.done_value = 1;
    a.handoff.status_out = status_out + r;
    EPD_ASSERT_OK(kc::LowLatencyDispatch(g.Context(r), a, g.stream(r)));
  }
  for (int32_t r = 0; r < R - 1; ++r) {
    ASSERT_EQ(cudaStreamSynchronize(g.stream(r)), cudaSuccess);
    EXPECT_EQ(ReadWord(done + r), 1u) << "rank " << r;
    absl::Status st = kc::StatusFromDevice(status_out[r], g.shape(), r, "LowLatencyDispatch", true);
    EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << "rank " << r << ": " << st;
    EXPECT_NE(st.message().find("[3]"), std::string::npos) << st;
    absl::Status left = kc::ReadAndClearStatus(g.Context(r), g.stream(r), "LowLatencyDispatch");
    EXPECT_TRUE(left.ok()) << "rank " << r << ": status not cleared: " << left;
  }
  for (int32_t r = 0; r < R; ++r) EPD_ASSERT_OK(kc::ResetLowLatencySync(g.Context(r), g.stream(r)));
  EPD_ASSERT_OK(g.SynchronizeAll());
  ExpectValidOp(g, 0, rng, 1);
}

TEST(LowLatencyFailure, LateRankPairsWithTimedOutOpAndNextOpIsCorrect) {
  REQUIRE_GPU();
  constexpr int64_t kTimeoutNs = 300'000'000;
  auto group = VirtualRankGroup::Create(SmallShape(2), kTimeoutNs, /*num_sms=*/16);
  ASSERT_TRUE(group.ok()) << group.status();
  VirtualRankGroup& g = **group;
  std::mt19937_64 rng(10);
  std::vector<RankInputs> in = MakeInputs(SmallCase(2), rng, 0);
  EPD_ASSERT_OK(UploadInputs(g, in));
  kc::LowLatencyDispatchArgs da;
  da.use_fp8 = true;
  EPD_ASSERT_OK(kc::LowLatencyDispatch(g.Context(0), da, g.stream(0)));
  absl::Status st0 = kc::ReadAndClearStatus(g.Context(0), g.stream(0), "LowLatencyDispatch");
  EXPECT_EQ(st0.code(), absl::StatusCode::kDeadlineExceeded) << st0;
  // Rank 1 arrives late: its op pairs with rank 0's timed-out op and times out too (rank 0
  // never sent its rows), without a reset.
  EPD_ASSERT_OK(kc::LowLatencyDispatch(g.Context(1), da, g.stream(1)));
  absl::Status st1 = kc::ReadAndClearStatus(g.Context(1), g.stream(1), "LowLatencyDispatch");
  EXPECT_EQ(st1.code(), absl::StatusCode::kDeadlineExceeded) << st1;
  ExpectValidOp(g, 1, rng, 1);
  ExpectValidOp(g, 0, rng, 2);
}

TEST(LowLatencyFailure, LauncherRejectsBadArguments) {
  REQUIRE_GPU();
  GroupShape s = SmallShape(2);
  s.use_fp8 = false;
  auto group = VirtualRankGroup::Create(s);
  ASSERT_TRUE(group.ok()) << group.status();
  kc::LowLatencyDispatchArgs a;
  a.buffer = 2;
  EXPECT_EQ(kc::LowLatencyDispatch((*group)->Context(0), a, (*group)->stream(0)).code(),
            absl::StatusCode::kInvalidArgument);
  a.buffer = 0;
  a.use_ue8m0 = true;  // without use_fp8 and round_scale
  absl::Status ue8m0 = kc::LowLatencyDispatch((*group)->Context(0), a, (*group)->stream(0));
  EXPECT_EQ(ue8m0.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(ue8m0.message().find("use_ue8m0 needs use_fp8"), std::string::npos) << ue8m0;
  a.use_ue8m0 = false;
  a.use_fp8 = true;  // the group was created without use_fp8
  EXPECT_EQ(kc::LowLatencyDispatch((*group)->Context(0), a, (*group)->stream(0)).code(),
            absl::StatusCode::kInvalidArgument);
  kc::CudaRankContext bad = (*group)->Context(0);
  bad.rank = 2;
  EXPECT_EQ(kc::LowLatencyCombine(bad, {}, (*group)->stream(0)).code(),
            absl::StatusCode::kInvalidArgument);
  kc::LowLatencyCombineArgs ca;
  ca.x_offset = 8;  // not 16-byte aligned
  EXPECT_EQ(kc::LowLatencyCombine((*group)->Context(0), ca, (*group)->stream(0)).code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- FP8 conversion -------------------------------------------------------------------

// The dispatch kernel quantises with the hardware cvt (common.cuh FloatsToE4m3x2); the host
// with types.h FloatToE4m3. Compare them on every f32 bit pattern (NaNs included).
__global__ void CompareE4m3Kernel(unsigned long long* mismatches, uint32_t* first_mismatch) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < (1ull << 32);
       i += stride) {
    const uint32_t bits = static_cast<uint32_t>(i);
    const float f = __uint_as_float(bits);
    const float g = __uint_as_float(bits ^ 0x80000000u);
    const uint16_t hw = kc::device::FloatsToE4m3x2(f, g);
    if ((hw & 0xffu) != kernels::FloatToE4m3(f) || (hw >> 8) != kernels::FloatToE4m3(g)) {
      atomicAdd(mismatches, 1ull);
      atomicMin(first_mismatch, bits);
    }
  }
}

TEST(Fp8Conversion, HardwareCvtMatchesHostOnEveryFloat) {
  REQUIRE_GPU();
  auto buf = DeviceBuffer::Allocate(16);
  ASSERT_TRUE(buf.ok()) << buf.status();
  auto* mismatches = reinterpret_cast<unsigned long long*>(buf->get());
  auto* first = reinterpret_cast<uint32_t*>(buf->get() + 8);
  ASSERT_EQ(cudaMemset(first, 0xff, 4), cudaSuccess);
  CompareE4m3Kernel<<<1024, 256>>>(mismatches, first);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  unsigned long long count = 0;
  uint32_t first_bits = 0;
  ASSERT_EQ(cudaMemcpy(&count, mismatches, 8, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(&first_bits, first, 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(count, 0u) << "first mismatching f32 bits 0x" << std::hex << first_bits
                       << ": host e4m3 0x"
                       << int{kernels::FloatToE4m3(kernels::FloatFromBits(first_bits))};
}

// ---- CUDA graphs ------------------------------------------------------------------------

// Per rank, one graph [dispatch (FP8, buffer 0) → expert → combine] captured once and replayed
// 100 times with new x / topk_idx / weights and a new T written into the device slot before
// each replay; every replay's outputs are checked against the host.
TEST(LowLatencyGraph, CapturedDispatchExpertCombineReplaysWithChangingInputsAndT) {
  REQUIRE_GPU();
  GroupShape s = SmallShape(8);
  auto group = VirtualRankGroup::Create(s);
  ASSERT_TRUE(group.ok()) << group.status();
  VirtualRankGroup& g = **group;
  EPD_ASSERT_OK(kc::PreloadKernels());
  std::vector<cudaGraphExec_t> execs(g.num_ranks(), nullptr);
  for (int32_t r = 0; r < g.num_ranks(); ++r) {
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(g.stream(r), cudaStreamCaptureModeThreadLocal), cudaSuccess);
    kc::LowLatencyDispatchArgs da;
    da.use_fp8 = true;
    da.round_scale = true;
    absl::Status st = kc::LowLatencyDispatch(g.Context(r), da, g.stream(r));
    if (st.ok()) st = LaunchExpert(g, r, 0, Fp8::kRoundScale, g.stream(r));
    if (st.ok()) st = kc::LowLatencyCombine(g.Context(r), {}, g.stream(r));
    ASSERT_EQ(cudaStreamEndCapture(g.stream(r), &graph), cudaSuccess);
    EPD_ASSERT_OK(st);
    ASSERT_EQ(cudaGraphInstantiate(&execs[r], graph, 0), cudaSuccess);
    cudaGraphDestroy(graph);
  }
  std::mt19937_64 rng(11);
  std::uniform_int_distribution<int32_t> pick_t(0, kMll);
  for (int replay = 0; replay < 100; ++replay) {
    SweepCase c = SmallCase(8);
    c.masked = replay % 3 == 0 ? 0.5 : 0.0;
    std::vector<RankInputs> in = MakeInputs(c, rng, replay);
    for (auto& ri : in) {  // a random T per rank and replay
      ri.num_tokens = pick_t(rng);
      ri.x.resize(static_cast<size_t>(ri.num_tokens) * s.hidden);
      ri.topk_idx.resize(static_cast<size_t>(ri.num_tokens) * s.num_topk);
      ri.weights.resize(static_cast<size_t>(ri.num_tokens) * s.num_topk);
    }
    HostReference ref;
    EPD_ASSERT_OK(ComputeHostReference(s, Fp8::kRoundScale, in, &ref));
    EPD_ASSERT_OK(UploadInputs(g, in));
    for (int32_t r = 0; r < g.num_ranks(); ++r) {
      ASSERT_EQ(cudaGraphLaunch(execs[r], g.stream(r)), cudaSuccess);
    }
    for (int32_t r = 0; r < g.num_ranks(); ++r) {
      EPD_ASSERT_OK(kc::ReadAndClearStatus(g.Context(r), g.stream(r), "graph replay"));
    }
    EPD_ASSERT_OK(CheckDispatch(g, 0, Fp8::kRoundScale, in, ref)) << "replay " << replay;
    EPD_ASSERT_OK(CheckCombine(g, 0, in, ref)) << "replay " << replay;
  }
  for (auto e : execs) cudaGraphExecDestroy(e);
}

// ---- the daemon-launched hand-off inside the kernels (cuda_ops.h KernelHandoff) ----------

// Rank r's staging-kernel ticket word (abi::kReadySignalCounterOffset).
uint32_t* StagingCounter(VirtualRankGroup& g, int32_t r) {
  return reinterpret_cast<uint32_t*>(LaunchFlag(g, r, abi::kReadySignalCounterOffset));
}

// One rank's inputs as a caller holds them: device memory of their own (room for Mll
// tokens), which a staging kernel (CopyDeviceBatchAsync) copies into the rank's regions.
struct CallerTensors {
  DeviceBuffer x, topk_idx, topk_weights;

  // Uploads `in` (synchronously); returns the staging kernel's copies of it into rank r's
  // in_x / in_topk_idx / in_topk_weights.
  absl::StatusOr<std::array<kc::DeviceCopy, 3>> Fill(VirtualRankGroup& g, int32_t r,
                                                     const RankInputs& in) {
    const auto& l = g.layout();
    const std::array<kc::DeviceCopy, 3> copies = {
        kc::DeviceCopy{g.At<uint8_t>(r, l.in_x), x.get(), in.x.size() * 2},
        kc::DeviceCopy{g.At<uint8_t>(r, l.in_topk_idx), topk_idx.get(), in.topk_idx.size() * 8},
        kc::DeviceCopy{g.At<uint8_t>(r, l.in_topk_weights), topk_weights.get(),
                       in.weights.size() * 4}};
    const void* host[3] = {in.x.data(), in.topk_idx.data(), in.weights.data()};
    for (int i = 0; i < 3; ++i) {
      EPD_CUDA_RETURN_IF_ERROR(cudaMemcpy(const_cast<void*>(copies[i].src), host[i],
                                          copies[i].bytes, cudaMemcpyDefault));
    }
    return copies;
  }
};

// CallerTensors for every rank of `g`.
absl::StatusOr<std::vector<CallerTensors>> AllocateCallerTensors(const VirtualRankGroup& g) {
  const GroupShape& s = g.shape();
  const size_t rows = static_cast<size_t>(s.ll_max_tokens_per_rank);
  std::vector<CallerTensors> out(g.num_ranks());
  for (CallerTensors& t : out) {
    EPD_ASSIGN_OR_RETURN(t.x, DeviceBuffer::Allocate(2 * rows * s.hidden));
    EPD_ASSIGN_OR_RETURN(t.topk_idx, DeviceBuffer::Allocate(8 * rows * s.num_topk));
    EPD_ASSIGN_OR_RETURN(t.topk_weights, DeviceBuffer::Allocate(4 * rows * s.num_topk));
  }
  return out;
}

// What the daemon-launched hand-off tests share: an R-rank group whose staging regions hold
// stale inputs, the real inputs `in` (and their host reference) in the caller's own tensors,
// a `seen` word per rank for the ranks' WaitFlagAsync, and the client's stream.
struct HandoffRig {
  std::unique_ptr<VirtualRankGroup> group;
  std::mt19937_64 rng;
  std::vector<RankInputs> in;
  HostReference ref;
  std::vector<CallerTensors> caller;
  DeviceBuffer seen_buffer;
  CudaStream client;

  uint64_t* seen() const { return reinterpret_cast<uint64_t*>(seen_buffer.get()); }

  // Group of R ranks (SmallShape; `num_sms` blocks per kernel, 0 = default), inputs drawn
  // from `seed`.
  static absl::StatusOr<std::unique_ptr<HandoffRig>> Create(int32_t R, uint64_t seed,
                                                            int32_t num_sms) {
    auto rig = std::make_unique<HandoffRig>();
    EPD_ASSIGN_OR_RETURN(rig->group,
                         VirtualRankGroup::Create(SmallShape(R), 5'000'000'000, num_sms));
    VirtualRankGroup& g = *rig->group;
    rig->rng.seed(seed);
    const std::vector<RankInputs> stale = MakeInputs(SmallCase(R), rig->rng, 1);
    rig->in = MakeInputs(SmallCase(R), rig->rng, 2);
    EPD_RETURN_IF_ERROR(ComputeHostReference(g.shape(), Fp8::kOn, rig->in, &rig->ref));
    EPD_RETURN_IF_ERROR(UploadInputs(g, stale));
    EPD_ASSIGN_OR_RETURN(rig->caller, AllocateCallerTensors(g));
    EPD_ASSIGN_OR_RETURN(rig->seen_buffer, DeviceBuffer::Allocate(R * sizeof(uint64_t)));
    EPD_ASSIGN_OR_RETURN(rig->client, CudaStream::Create());
    return rig;
  }
};

// The daemon's side of rank r's combine `seq` of dispatch buffer `buffer`, on its stream:
// the expert outputs, the WaitFlagAsync on `wait_offset` (and on `alt_offset` when given;
// launch_flags words; `seen` as WaitFlagAsync), then the kernel behind it. (An optional, not
// a 0 sentinel: ready_seq's offset is 0.)
absl::Status EnqueueCombineBehindWait(VirtualRankGroup& g, int32_t r, int32_t buffer, uint64_t seq,
                                      uint64_t wait_offset, std::optional<uint64_t> alt_offset,
                                      uint64_t* seen) {
  EPD_RETURN_IF_ERROR(LaunchExpert(g, r, buffer, Fp8::kOn, g.stream(r)));
  EPD_RETURN_IF_ERROR(kc::WaitFlagAsync(LaunchFlag(g, r, wait_offset), seq, 10'000'000'000, seen,
                                        g.stream(r),
                                        alt_offset ? LaunchFlag(g, r, *alt_offset) : nullptr));
  kc::LowLatencyCombineArgs a;
  a.buffer = buffer;
  a.handoff = DaemonHandoff(g, r, seq);
  return kc::LowLatencyCombine(g.Context(r), a, g.stream(r));
}

// As the daemon enqueues a stream-ordered low-latency op (WaitFlagAsync, then the kernel
// launched programmatically with ready/done), while the inputs in the ranks' staging regions
// are still stale; the client side then stages the real inputs and signals ready with one
// CopyDeviceBatchAsync per rank from another stream. The kernels must not run before ready
// (their outputs match the host on the real inputs), must write done, and the batch copy's
// ticket word must be back at 0. Then the same for combine (the expert outputs are written
// on the rank's stream before its wait).
TEST(LowLatencyHandoff, KernelsWaitForReadyThenWriteDone) {
  REQUIRE_GPU();
  constexpr int32_t R = 4;
  auto rig = HandoffRig::Create(R, 31, /*num_sms=*/0);
  ASSERT_TRUE(rig.ok()) << rig.status();
  VirtualRankGroup& g = *(*rig)->group;
  const std::vector<RankInputs>& in = (*rig)->in;
  const HostReference& ref = (*rig)->ref;
  std::vector<CallerTensors>* caller = &(*rig)->caller;  // The caller's tensors.
  uint64_t* seen = (*rig)->seen();
  CudaStream* client = &(*rig)->client;
  std::vector<std::array<kc::DeviceCopy, 3>> copies(R);
  for (int32_t r = 0; r < R; ++r) {
    auto c = (*caller)[r].Fill(g, r, in[r]);
    ASSERT_TRUE(c.ok()) << c.status();
    copies[r] = *c;
  }
  auto flag = [&](int32_t r, uint64_t offset) { return LaunchFlag(g, r, offset); };
  auto counter = [&](int32_t r) { return StagingCounter(g, r); };
  auto handoff = [&](int32_t r, uint64_t seq) { return DaemonHandoff(g, r, seq); };
  constexpr int64_t kWaitNs = 10'000'000'000;

  // ---- dispatch (seq 1) ----
  for (int32_t r = 0; r < R; ++r) {
    EPD_ASSERT_OK(
        kc::WaitFlagAsync(flag(r, abi::kReadyFlagOffset), 1, kWaitNs, seen + r, g.stream(r)));
    kc::LowLatencyDispatchArgs a;
    a.buffer = 0;
    a.use_fp8 = true;
    a.num_tokens_value = in[r].num_tokens;
    a.handoff = handoff(r, 1);
    EPD_ASSERT_OK(kc::LowLatencyDispatch(g.Context(r), a, g.stream(r)));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  for (int32_t r = 0; r < R; ++r) {
    EXPECT_EQ(cudaStreamQuery(g.stream(r)), cudaErrorNotReady) << "rank " << r << " ran early";
    EXPECT_EQ(ReadWord(seen + r), 0u) << "rank " << r;
    EXPECT_EQ(ReadWord(flag(r, abi::kDoneFlagOffset)), 0u) << "rank " << r;
  }
  for (int32_t r = 0; r < R; ++r) {
    EPD_ASSERT_OK(kc::CopyDeviceBatchAsync(copies[r].data(), 3, flag(r, abi::kReadyFlagOffset), 1,
                                           counter(r), client->get()));
  }
  for (int32_t r = 0; r < R; ++r) {
    ASSERT_EQ(cudaStreamSynchronize(g.stream(r)), cudaSuccess);
    EPD_ASSERT_OK(kc::ReadAndClearStatus(g.Context(r), g.stream(r), "LowLatencyDispatch"));
    EXPECT_EQ(ReadWord(seen + r), 1u) << "rank " << r;
    EXPECT_EQ(ReadWord(flag(r, abi::kDoneFlagOffset)), 1u) << "rank " << r;
    EXPECT_EQ(ReadWord(counter(r)) & 0xffffffffu, 0u) << "rank " << r << ": ticket not reset";
  }
  EPD_ASSERT_OK(CheckDispatch(g, 0, Fp8::kOn, in, ref));

  // ---- combine (seq 2): expert outputs first on the rank's stream, then the ready wait ----
  for (int32_t r = 0; r < R; ++r) {
    EPD_ASSERT_OK(
        EnqueueCombineBehindWait(g, r, 0, 2, abi::kReadyFlagOffset, std::nullopt, seen + r));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  for (int32_t r = 0; r < R; ++r) {
    EXPECT_EQ(ReadWord(flag(r, abi::kDoneFlagOffset)), 1u) << "rank " << r << " ran early";
  }
  for (int32_t r = 0; r < R; ++r) {  // No copies: a one-thread signal.
    EPD_ASSERT_OK(kc::CopyDeviceBatchAsync(nullptr, 0, flag(r, abi::kReadyFlagOffset), 2,
                                           counter(r), client->get()));
  }
  for (int32_t r = 0; r < R; ++r) {
    ASSERT_EQ(cudaStreamSynchronize(g.stream(r)), cudaSuccess);
    EPD_ASSERT_OK(kc::ReadAndClearStatus(g.Context(r), g.stream(r), "LowLatencyCombine"));
    EXPECT_EQ(ReadWord(seen + r), 2u) << "rank " << r;
    EXPECT_EQ(ReadWord(flag(r, abi::kDoneFlagOffset)), 2u) << "rank " << r;
  }
  EPD_ASSERT_OK(CheckCombine(g, 0, in, ref));
}

// The early hand-off (layout.h staging_seq; CopyDeviceBatchAsync `started`), as the daemon
// and the client library use it:
//  - dispatch (seq 1): each rank's WaitFlagAsync waits for staging_seq or ready_seq and
//    launches the kernel programmatically. Nothing passes before either word is written;
//    staging_seq = 1 alone (from the host, as a staging kernel's first thread would) lets
//    the wait pass, but the kernel still waits for ready: no done, the stream busy. Then
//    each rank's client stream stages the real inputs and signals ready; the outputs match
//    the host on the real inputs;
//  - dispatch (seq 2): the staging kernels write staging_seq themselves (several blocks
//    each; the counter word's two halves are back at 0 after each op);
//  - combine (seq 3): ranks 0-1 stage with `started` (their staging kernels write
//    staging_seq = 3), ranks 2-3 as a client of an older version (ready only): every
//    wait passes, and the combine matches the host.
TEST(LowLatencyHandoff, StagingStartLaunchesTheKernelWhichStillWaitsForReady) {
  REQUIRE_GPU();
  constexpr int32_t R = 4;
  // 8 blocks per rank leave SMs free for the client's staging kernel, which seq 1's
  // host-written staging_seq lets the kernels precede (the real staging kernel writes it
  // only once its own blocks are all resident: seqs 2 and 3).
  auto rig = HandoffRig::Create(R, 37, /*num_sms=*/8);
  ASSERT_TRUE(rig.ok()) << rig.status();
  VirtualRankGroup& g = *(*rig)->group;
  std::mt19937_64& rng = (*rig)->rng;
  const std::vector<RankInputs>& in = (*rig)->in;
  const HostReference& ref = (*rig)->ref;
  std::vector<CallerTensors>* caller = &(*rig)->caller;
  uint64_t* seen = (*rig)->seen();
  CudaStream* client = &(*rig)->client;
  auto flag = [&](int32_t r, uint64_t offset) { return LaunchFlag(g, r, offset); };
  auto counter = [&](int32_t r) { return StagingCounter(g, r); };
  auto handoff = [&](int32_t r, uint64_t seq) { return DaemonHandoff(g, r, seq); };
  // The daemon's side of dispatch `seq` on `buffer`: the wait, then the kernel.
  auto enqueue_dispatch = [&](uint64_t seq, int32_t buffer, const std::vector<RankInputs>& ins) {
    for (int32_t r = 0; r < R; ++r) {
      EPD_ASSERT_OK(kc::WaitFlagAsync(flag(r, abi::kStagingFlagOffset), seq, 10'000'000'000,
                                      seen + r, g.stream(r), flag(r, abi::kReadyFlagOffset)));
      kc::LowLatencyDispatchArgs a;
      a.buffer = buffer;
      a.use_fp8 = true;
      a.num_tokens_value = ins[r].num_tokens;
      a.handoff = handoff(r, seq);
      EPD_ASSERT_OK(kc::LowLatencyDispatch(g.Context(r), a, g.stream(r)));
    }
  };
  // The client's side: `ins` into the caller's buffers, then one staging kernel per rank
  // (x, topk_idx and topk_weights, which the combine reads; `started` = staging_seq).
  auto stage = [&](uint64_t seq, const std::vector<RankInputs>& ins) {
    for (int32_t r = 0; r < R; ++r) {
      auto copies = (*caller)[r].Fill(g, r, ins[r]);
      ASSERT_TRUE(copies.ok()) << copies.status();
      EPD_ASSERT_OK(kc::CopyDeviceBatchAsync(copies->data(), 3, flag(r, abi::kReadyFlagOffset), seq,
                                             counter(r), client->get(),
                                             flag(r, abi::kStagingFlagOffset)));
    }
  };
  // Every rank's dispatch `seq` ended cleanly: done, staging_seq, the ticket word reset.
  auto finish_dispatch = [&](uint64_t seq) {
    for (int32_t r = 0; r < R; ++r) {
      ASSERT_EQ(cudaStreamSynchronize(g.stream(r)), cudaSuccess);
      EPD_ASSERT_OK(kc::ReadAndClearStatus(g.Context(r), g.stream(r), "LowLatencyDispatch"));
      // The wait passed on the word (not at its bound, which would also let the kernel run).
      EXPECT_EQ(ReadWord(seen + r), seq) << "rank " << r;
      EXPECT_EQ(ReadWord(flag(r, abi::kStagingFlagOffset)), seq) << "rank " << r;
      EXPECT_EQ(ReadWord(flag(r, abi::kDoneFlagOffset)), seq) << "rank " << r;
      EXPECT_EQ(ReadWord(counter(r)) & 0xffffffffu, 0u) << "rank " << r << ": ticket not reset";
    }
  };

  // ---- dispatch (seq 1) ----
  enqueue_dispatch(1, 0, in);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  for (int32_t r = 0; r < R; ++r) EXPECT_EQ(ReadWord(seen + r), 0u) << "rank " << r;
  const uint64_t one = 1;
  for (int32_t r = 0; r < R; ++r) {
    ASSERT_EQ(cudaMemcpy(flag(r, abi::kStagingFlagOffset), &one, 8, cudaMemcpyDefault),
              cudaSuccess);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  for (int32_t r = 0; r < R; ++r) {
    EXPECT_EQ(ReadWord(seen + r), 1u) << "rank " << r << ": the wait did not pass on staging_seq";
    EXPECT_EQ(cudaStreamQuery(g.stream(r)), cudaErrorNotReady) << "rank " << r << " ran early";
    EXPECT_EQ(ReadWord(flag(r, abi::kDoneFlagOffset)), 0u) << "rank " << r;
  }
  stage(1, in);
  finish_dispatch(1);
  EPD_ASSERT_OK(CheckDispatch(g, 0, Fp8::kOn, in, ref));

  // ---- dispatch (seq 2) with staging_seq written by the staging kernel itself, once all
  // its blocks (the x copy takes several) are resident ----
  std::vector<RankInputs> in2 = MakeInputs(SmallCase(R), rng, 3);
  HostReference ref2;
  EPD_ASSERT_OK(ComputeHostReference(g.shape(), Fp8::kOn, in2, &ref2));
  enqueue_dispatch(2, 1, in2);
  stage(2, in2);
  finish_dispatch(2);
  EPD_ASSERT_OK(CheckDispatch(g, 1, Fp8::kOn, in2, ref2));

  // ---- combine (seq 3) of the second dispatch (buffer 1): the expert outputs first on the
  // rank's stream, then the wait ----
  for (int32_t r = 0; r < R; ++r) {
    EPD_ASSERT_OK(EnqueueCombineBehindWait(g, r, 1, 3, abi::kStagingFlagOffset,
                                           abi::kReadyFlagOffset, seen + r));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  for (int32_t r = 0; r < R; ++r) {
    EXPECT_EQ(ReadWord(flag(r, abi::kDoneFlagOffset)), 2u) << "rank " << r << " ran early";
  }
  for (int32_t r = 0; r < R; ++r) {  // No copies: a one-thread signal.
    EPD_ASSERT_OK(kc::CopyDeviceBatchAsync(nullptr, 0, flag(r, abi::kReadyFlagOffset), 3,
                                           counter(r), client->get(),
                                           r < 2 ? flag(r, abi::kStagingFlagOffset) : nullptr));
  }
  // Every rank first, then the checks: a rank whose wait never passed shows as a peer that
  // did not arrive on the others, and as `seen` left at 2 on itself.
  std::vector<absl::Status> combined(R);
  for (int32_t r = 0; r < R; ++r) {
    ASSERT_EQ(cudaStreamSynchronize(g.stream(r)), cudaSuccess);
    combined[r] = kc::ReadAndClearStatus(g.Context(r), g.stream(r), "LowLatencyCombine");
  }
  for (int32_t r = 0; r < R; ++r) {
    EXPECT_EQ(ReadWord(seen + r), 3u) << "rank " << r << ": its wait did not pass on "
                                      << (r < 2 ? "staging_seq" : "ready_seq (older client)");
  }
  for (int32_t r = 0; r < R; ++r) {
    EPD_ASSERT_OK(combined[r]);
    EXPECT_EQ(ReadWord(flag(r, abi::kDoneFlagOffset)), 3u) << "rank " << r;
    EXPECT_EQ(ReadWord(flag(r, abi::kStagingFlagOffset)), r < 2 ? 3u : 2u) << "rank " << r;
  }
  EPD_ASSERT_OK(CheckCombine(g, 1, in2, ref2));
}

TEST(LowLatencyHandoff, WaitFlagGivesUpAtItsBoundAndCopyBatchChecksItsArguments) {
  REQUIRE_GPU();
  auto words = DeviceBuffer::Allocate(64);
  ASSERT_TRUE(words.ok());
  auto* flag = reinterpret_cast<uint64_t*>(words->get());
  auto stream = CudaStream::Create();
  ASSERT_TRUE(stream.ok());
  // Never written: the stream moves on after the bound (50 ms), and `seen` stays untouched.
  const auto start = std::chrono::steady_clock::now();
  EPD_ASSERT_OK(kc::WaitFlagAsync(flag, 1, 50'000'000, flag + 1, stream->get()));
  ASSERT_EQ(cudaStreamSynchronize(stream->get()), cudaSuccess);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  EXPECT_EQ(ReadWord(flag + 1), 0u);
  EXPECT_EQ(kc::WaitFlagAsync(nullptr, 1, 1, nullptr, stream->get()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kc::WaitFlagAsync(flag, 1, 0, nullptr, stream->get()).code(),
            absl::StatusCode::kInvalidArgument);
  kc::DeviceCopy copies[kc::kMaxBatchCopies + 1] = {};
  absl::Status st =
      kc::CopyDeviceBatchAsync(copies, kc::kMaxBatchCopies + 1, nullptr, 0, nullptr, stream->get());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("num_copies"), std::string::npos) << st;
  copies[0] = {nullptr, words->get(), 8};
  EXPECT_EQ(kc::CopyDeviceBatchAsync(copies, 1, nullptr, 0, nullptr, stream->get()).code(),
            absl::StatusCode::kInvalidArgument);
  auto big = DeviceBuffer::Allocate(1 << 20);
  ASSERT_TRUE(big.ok());
  copies[0] = {big->get(), big->get() + (1 << 19), 1 << 19};  // Several blocks: needs a counter.
  st = kc::CopyDeviceBatchAsync(copies, 1, flag, 3, nullptr, stream->get());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_EQ(ReadWord(flag), 0u);
  // A started word without a signal is refused; with one, both get the value.
  st = kc::CopyDeviceBatchAsync(nullptr, 0, nullptr, 4, nullptr, stream->get(), flag + 2);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("started word without a signal"), std::string::npos) << st;
  EPD_ASSERT_OK(kc::CopyDeviceBatchAsync(nullptr, 0, flag, 5, nullptr, stream->get(), flag + 2));
  ASSERT_EQ(cudaStreamSynchronize(stream->get()), cudaSuccess);
  EXPECT_EQ(ReadWord(flag), 5u);
  EXPECT_EQ(ReadWord(flag + 2), 5u);
}

// The staging kernel's wait for done (cuda_ops.h DoneWait; the client under MPS): the
// signal is stored first, then the stream holds until done >= value (written here from the
// host, as the daemon's kernel or the client's ReleaseStreams would), for a one-block
// signal and for a multi-block copy (whose last block waits: the copy lands, the ticket
// word is back at 0); a larger value passes too (kReleasedSeq); never written, the stream
// goes on at the bound; bad arguments are refused before any launch.
TEST(LowLatencyHandoff, StagingKernelWaitsForDoneThenTheStreamGoesOn) {
  REQUIRE_GPU();
  auto words = DeviceBuffer::Allocate(64);
  ASSERT_TRUE(words.ok());
  uint64_t* signal = reinterpret_cast<uint64_t*>(words->get());
  uint64_t* done = signal + 1;
  uint32_t* counter = reinterpret_cast<uint32_t*>(signal + 2);
  auto stream = CudaStream::Create();
  ASSERT_TRUE(stream.ok());
  auto write_done = [&](uint64_t v) {
    ASSERT_EQ(cudaMemcpy(done, &v, sizeof(v), cudaMemcpyHostToDevice), cudaSuccess);
  };
  // Polls `word` until it reads `value` (bounded: 10 s), so a loaded machine does not fail it.
  auto eventually = [&](const void* word, uint64_t value) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (ReadWord(word) != value && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return ReadWord(word);
  };
  const int64_t kBound = 10'000'000'000;

  // One block, no copies.
  EPD_ASSERT_OK(kc::CopyDeviceBatchAsync(nullptr, 0, signal, 3, counter, stream->get(), nullptr,
                                         kc::DoneWait{done, 3, kBound}));
  EXPECT_EQ(eventually(signal, 3), 3u) << "the signal comes before the wait";
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(cudaStreamQuery(stream->get()), cudaErrorNotReady) << "went on before done";
  write_done(2);  // An older op's done does not pass.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(cudaStreamQuery(stream->get()), cudaErrorNotReady) << "went on at done = 2";
  auto start = std::chrono::steady_clock::now();
  write_done(3);
  ASSERT_EQ(cudaStreamSynchronize(stream->get()), cudaSuccess);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));

  // Several blocks (a 1 MiB copy: 16 blocks); the last one to finish waits.
  const size_t bytes = 1 << 20;
  auto src = DeviceBuffer::Allocate(bytes);
  auto dst = DeviceBuffer::Allocate(bytes);
  ASSERT_TRUE(src.ok() && dst.ok());
  std::vector<uint8_t> pattern(bytes);
  for (size_t i = 0; i < bytes; ++i) pattern[i] = static_cast<uint8_t>(i * 7 + 1);
  ASSERT_EQ(cudaMemcpy(src->get(), pattern.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  const kc::DeviceCopy copy{dst->get(), src->get(), bytes};
  uint64_t* started = signal + 3;  // As the client passes it: staging_seq and the done wait.
  EPD_ASSERT_OK(kc::CopyDeviceBatchAsync(&copy, 1, signal, 4, counter, stream->get(), started,
                                         kc::DoneWait{done, 4, kBound}));
  EXPECT_EQ(eventually(signal, 4), 4u);
  EXPECT_EQ(ReadWord(started), 4u);
  // Both ticket halves are back at 0 before the wait: the next op's staging may take them
  // while this kernel still waits (it runs on the same stream only after it, but the
  // reset must not wait for done).
  EXPECT_EQ(ReadWord(counter) & 0xffffffffu, 0u) << "ticket word not reset before the wait";
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(cudaStreamQuery(stream->get()), cudaErrorNotReady);
  write_done(uint64_t{1} << 62);  // Any larger value passes (the client's kReleasedSeq).
  ASSERT_EQ(cudaStreamSynchronize(stream->get()), cudaSuccess);
  std::vector<uint8_t> copied(bytes);
  ASSERT_EQ(cudaMemcpy(copied.data(), dst->get(), bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(copied, pattern);
  EXPECT_EQ(ReadWord(counter) & 0xffffffffu, 0u) << "ticket word not reset";

  // Never written: the stream goes on at the bound (50 ms).
  write_done(0);
  start = std::chrono::steady_clock::now();
  EPD_ASSERT_OK(kc::CopyDeviceBatchAsync(nullptr, 0, signal, 5, counter, stream->get(), nullptr,
                                         kc::DoneWait{done, 5, 50'000'000}));
  ASSERT_EQ(cudaStreamSynchronize(stream->get()), cudaSuccess);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  EXPECT_EQ(ReadWord(signal), 5u);

  // A done wait needs a signal and a bound.
  absl::Status st = kc::CopyDeviceBatchAsync(nullptr, 0, nullptr, 6, counter, stream->get(),
                                             nullptr, kc::DoneWait{done, 6, kBound});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("done wait needs a signal"), std::string::npos) << st;
  st = kc::CopyDeviceBatchAsync(nullptr, 0, signal, 6, counter, stream->get(), nullptr,
                                kc::DoneWait{done, 6, 0});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("timeout_ns > 0"), std::string::npos) << st;
  ASSERT_EQ(cudaStreamSynchronize(stream->get()), cudaSuccess);
  EXPECT_EQ(ReadWord(signal), 5u) << "a refused call launched something";
}

// The default grid leaves sms_left_per_rank SMs per rank of the GPU to other work (the
// daemon's low-latency ops under MPS: one per rank for its clients' DoneWait kernels).
TEST(LowLatencyHandoff, DefaultGridLeavesSmsPerRankForDoneWaits) {
  REQUIRE_GPU();
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  kc::CudaRankContext ctx;
  ctx.shape.num_ranks = 8;
  for (const int32_t on_device : {1, 2, 4, 8}) {
    ctx.ranks_on_device = on_device;
    int32_t blocks = 0;
    ctx.sms_left_per_rank = 0;
    EPD_ASSERT_OK(kc::ResolveNumBlocks(ctx, &blocks));
    EXPECT_EQ(blocks, sms / on_device) << on_device << " ranks";
    ctx.sms_left_per_rank = 1;
    EPD_ASSERT_OK(kc::ResolveNumBlocks(ctx, &blocks));
    EXPECT_EQ(blocks, (sms - on_device) / on_device) << on_device << " ranks";
    EXPECT_LE(blocks * on_device + on_device, sms) << "no SM left per rank";
  }
  // An explicit grid is taken as given with no SM to leave, and capped so they stay free.
  ctx.ranks_on_device = 8;
  int32_t blocks = 0;
  ctx.num_sms = 20;
  ctx.sms_left_per_rank = 0;
  EPD_ASSERT_OK(kc::ResolveNumBlocks(ctx, &blocks));
  EXPECT_EQ(blocks, 20);
  ctx.sms_left_per_rank = 1;
  EPD_ASSERT_OK(kc::ResolveNumBlocks(ctx, &blocks));
  EXPECT_EQ(blocks, std::min(20, (sms - 8) / 8));
  ctx.num_sms = 4;
  EPD_ASSERT_OK(kc::ResolveNumBlocks(ctx, &blocks));
  EXPECT_EQ(blocks, 4);
}

}  // namespace
}  // namespace epd::testing
