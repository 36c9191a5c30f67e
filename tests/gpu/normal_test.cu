// GPU tests of the normal-mode CUDA ops (kernels/include/epd/kernels/cuda_normal.h):
// GetDispatchLayout, Dispatch (BF16 / FP8, expert alignment, cached re-dispatch) and
// Combine, compared byte for byte with kernels/host (host_ops.h) on R virtual ranks of one
// GPU, combined_x included (both sum in f32 in ascending rank order, one bf16 rounding).
// Sweep (a covering selection, not the product): R 1, 2, 4, 8; H 2048, 4096, 7168; K 1, 6, 8;
// E = R, 64, 256; masked 0 and 0.5; uniform, one-expert and duplicate routing; FP8 on/off;
// T 0, 1, 333, 4096 (also mixed); alignment 1 and 128. Plus: prefill beside decode groups,
// CUDA-graph replay with new T, bad ids and T, a rank that never arrives, a layout over 4 GiB,
// and part of the sweep under each kernel variant (EPD_NORMAL_KERNELS) and with each op's
// second kernel launched programmatically (EPD_NORMAL_PDL) and the inter-rank flags at .gpu
// scope (EPD_NORMAL_GPU_SCOPE).
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "common/cuda/cuda_handles.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_normal.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/host_ops.h"
#include "epd/kernels/layout.h"
#include "kernels/cuda/normal_common.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace epd::testing {
namespace {

namespace kc = epd::kernels::cuda;
namespace kh = epd::kernels::host;
using kernels::bf16_bits;
using kernels::EndpointLayout;
using kernels::GroupShape;
using kernels::Region;

#define NM_ASSERT_OK(expr)                      \
  do {                                          \
    const ::absl::Status nm_status_ = (expr);   \
    ASSERT_TRUE(nm_status_.ok()) << nm_status_; \
  } while (0)

// ---- fast deterministic inputs (the big cases fill ~GBs; mt19937 + normal is too slow) ----

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// bf16 values with random sign and mantissa and exponents in [2^-7, 2^8]: finite, and
/// sums of up to 8 of them stay finite.
std::vector<bf16_bits> FastBf16(size_t n, uint64_t seed) {
  std::vector<bf16_bits> v(n);
  uint64_t state = seed;
  for (size_t i = 0; i < n; i += 4) {
    const uint64_t bits = SplitMix64(state);
    for (size_t j = 0; j < 4 && i + j < n; ++j) {
      const uint32_t r = static_cast<uint32_t>(bits >> (16 * j)) & 0xffffu;
      const uint32_t sign = r & 0x8000u;
      const uint32_t exponent = 120u + ((r >> 7) & 0xfu);
      v[i + j] = static_cast<bf16_bits>(sign | (exponent << 7) | (r & 0x7fu));
    }
  }
  return v;
}

std::vector<uint8_t> FastBytes(size_t n, uint64_t seed) {
  std::vector<uint8_t> v(n);
  uint64_t state = seed;
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t bits = SplitMix64(state);
    std::memcpy(v.data() + i, &bits, std::min<size_t>(8, n - i));
  }
  return v;
}

std::vector<float> FastFloats(size_t n, uint64_t seed) {
  std::vector<float> v(n);
  uint64_t state = seed;
  for (size_t i = 0; i < n; ++i) {
    v[i] = static_cast<float>(SplitMix64(state) >> 40) * (1.0f / 16777216.0f);
  }
  return v;
}

bool SkipWithoutGpu() {
  std::string reason;
  if (HaveGpu(&reason)) return false;
  std::cout << "[  SKIPPED ] needs a CUDA GPU: " << reason << "\n";
  return true;
}

// ---- one group: inputs, host reference, GPU launches, comparisons -------------------------

/// One case of the sweep.
struct NormalCase {
  std::string name;
  int32_t num_ranks = 2;
  int32_t hidden = 2048;
  int32_t num_topk = 8;
  int32_t num_experts = 64;
  /// T per rank; one value = the same T on every rank.
  std::vector<int32_t> num_tokens = {333};
  bool fp8 = false;
  int32_t expert_alignment = 1;
  bool with_weights = true;
  RoutingOptions routing;
  uint64_t seed = 1;
  int32_t num_sms = 0;          ///< CudaRankContext::num_sms (0 = default).
  int32_t ranks_on_device = 0;  ///< CudaRankContext::ranks_on_device (0 = R).
  /// CudaRankContext::all_ranks_on_device: true, as for any virtual-rank group (the normal
  /// kernels' flags are then at .gpu scope unless EPD_NORMAL_GPU_SCOPE=0).
  bool all_ranks_on_device = true;
};

std::string Describe(const NormalCase& c) {
  std::string tokens;
  for (int32_t t : c.num_tokens) absl::StrAppend(&tokens, tokens.empty() ? "" : "/", t);
  return absl::StrCat(c.name, " R=", c.num_ranks, " H=", c.hidden, " K=", c.num_topk,
                      " E=", c.num_experts, " T=", tokens, c.fp8 ? " fp8" : " bf16",
                      " align=", c.expert_alignment, " masked=", c.routing.masked_fraction,
                      c.routing.one_expert >= 0 ? " one-expert" : "",
                      c.routing.duplicate_fraction > 0 ? " duplicates" : "");
}

// gtest prints parameters with this instead of a byte dump.
void PrintTo(const NormalCase& c, std::ostream* os) { *os << Describe(c); }

/// A virtual-rank group running one NormalCase, with its host reference.
class NormalGroup {
 public:
  explicit NormalGroup(NormalCase c) : c_(std::move(c)) {}

  VirtualRankGroup& group() { return *group_; }

  int32_t Tokens(int32_t r) const {
    return c_.num_tokens.size() == 1 ? c_.num_tokens[0] : c_.num_tokens[r];
  }
  int64_t RowBytes() const { return c_.fp8 ? c_.hidden : 2 * int64_t{c_.hidden}; }

  /// Allocates the group (M = the largest T of the case), draws inputs and uploads them.
  absl::Status Prepare() {
    const int32_t R = c_.num_ranks;
    shape_.num_ranks = R;
    shape_.num_experts = c_.num_experts;
    shape_.hidden = c_.hidden;
    shape_.num_topk = c_.num_topk;
    int32_t max_tokens = 1;
    for (int32_t r = 0; r < R; ++r) max_tokens = std::max(max_tokens, Tokens(r));
    shape_.max_tokens_per_rank = max_tokens;
    shape_.use_fp8 = c_.fp8;
    EPD_ASSIGN_OR_RETURN(
        group_, VirtualRankGroup::Create(shape_, 5'000'000'000, c_.num_sms, c_.ranks_on_device));
    group_->set_all_ranks_on_device(c_.all_ranks_on_device);
    // Allocated here, never while a stream captures (an allocation invalidates a capture).
    void* p = nullptr;
    EPD_CUDA_RETURN_IF_ERROR(
        cudaHostAlloc(&p, sizeof(int32_t) * R, cudaHostAllocPortable | cudaHostAllocMapped));
    recv_count_out_.reset(static_cast<uint8_t*>(p));
    std::memset(p, 0xff, sizeof(int32_t) * R);
    return DrawInputs(c_.seed);
  }

  /// Sets new T per rank (each <= the M the group was prepared with) and draws and uploads
  /// new inputs for them (x, scales, topk, weights, the T slot).
  absl::Status DrawInputs(uint64_t seed, std::vector<int32_t> num_tokens = {}) {
    if (!num_tokens.empty()) c_.num_tokens = std::move(num_tokens);
    const int32_t R = c_.num_ranks;
    const EndpointLayout& l = group_->layout();
    std::mt19937_64 rng(seed);
    x_.resize(R);
    scales_.resize(R);
    topk_.resize(R);
    weights_.resize(R);
    for (int32_t r = 0; r < R; ++r) {
      const int32_t T = Tokens(r);
      x_[r] = FastBytes(T * RowBytes(), seed * 1000 + r);
      if (!c_.fp8) {
        std::vector<bf16_bits> bf = FastBf16(static_cast<size_t>(T) * c_.hidden, seed * 1000 + r);
        std::memcpy(x_[r].data(), bf.data(), x_[r].size());
      }
      if (c_.fp8) scales_[r] = FastFloats(static_cast<size_t>(T) * shape_.num_scales(), r + 7);
      topk_[r] = RandomTopk(T, c_.num_topk, c_.num_experts, c_.routing, rng);
      weights_[r] = FastFloats(static_cast<size_t>(T) * c_.num_topk, seed * 31 + r);
      EPD_RETURN_IF_ERROR(UploadInputs(r));
      EPD_RETURN_IF_ERROR(group_->Upload(r, l.in_topk_idx, topk_[r].data(), topk_[r].size() * 8));
      EPD_RETURN_IF_ERROR(
          group_->Upload(r, l.in_topk_weights, weights_[r].data(), weights_[r].size() * 4));
      EPD_RETURN_IF_ERROR(kc::SetNormalNumTokensAsync(group_->Context(r), T, group_->stream(r)));
    }
    return group_->SynchronizeAll();
  }

  /// Replaces x (and scales) with new values (for the cached re-dispatch).
  absl::Status RedrawX(uint64_t seed) {
    for (int32_t r = 0; r < c_.num_ranks; ++r) {
      x_[r] = FastBytes(x_[r].size(), seed + r);
      if (c_.fp8) scales_[r] = FastFloats(scales_[r].size(), seed * 3 + r);
      EPD_RETURN_IF_ERROR(UploadInputs(r));
    }
    return absl::OkStatus();
  }

  // -- GetDispatchLayout.
  absl::Status LaunchLayout() {
    return group_->LaunchAll([&](int32_t r, cudaStream_t s) {
      return kc::GetDispatchLayout(group_->Context(r), {}, s);
    });
  }
  absl::Status CheckLayout() {
    const EndpointLayout& l = group_->layout();
    for (int32_t r = 0; r < c_.num_ranks; ++r) {
      EPD_RETURN_IF_ERROR(
          kc::ReadAndClearStatus(group_->Context(r), group_->stream(r), "GetDispatchLayout"));
      const int32_t T = Tokens(r);
      std::vector<int32_t> per_rank(c_.num_ranks), per_expert(c_.num_experts);
      std::vector<uint8_t> in_rank(static_cast<size_t>(T) * c_.num_ranks);
      kh::LayoutRankArgs args;
      args.num_tokens = T;
      args.topk_idx = topk_[r].data();
      args.num_tokens_per_rank = per_rank.data();
      args.num_tokens_per_expert = per_expert.data();
      args.is_token_in_rank = in_rank.data();
      EPD_RETURN_IF_ERROR(kh::GetDispatchLayout(shape_, args));
      const std::string where = absl::StrCat(Describe(c_), " rank ", r, " layout ");
      EPD_RETURN_IF_ERROR(Compare(r, l.layout_tokens_per_rank, per_rank.data(), per_rank.size() * 4,
                                  where + "num_tokens_per_rank"));
      EPD_RETURN_IF_ERROR(Compare(r, l.layout_tokens_per_expert, per_expert.data(),
                                  per_expert.size() * 4, where + "num_tokens_per_expert"));
      EPD_RETURN_IF_ERROR(Compare(r, l.layout_is_token_in_rank, in_rank.data(), in_rank.size(),
                                  where + "is_token_in_rank"));
    }
    return absl::OkStatus();
  }

  // -- Dispatch.
  absl::Status LaunchDispatch(bool cached) {
    return group_->LaunchAll(
        [&](int32_t r, cudaStream_t s) { return LaunchDispatchRank(r, cached, s); });
  }
  absl::Status LaunchDispatchRank(int32_t r, bool cached, cudaStream_t s) {
    kc::NormalDispatchArgs args;
    args.fp8 = c_.fp8;
    args.expert_alignment = c_.expert_alignment;
    args.with_weights = c_.with_weights;
    args.cached = cached;
    // N comes back through host-mapped pinned memory written by the kernel (no copy).
    args.recv_count_out = reinterpret_cast<int32_t*>(recv_count_out_.get()) + r;
    args.phase_ns = phase_ns_ != nullptr ? phase_ns_ + r * kc::kNormalDispatchPhases : nullptr;
    return kc::NormalDispatch(group_->Context(r), args, s);
  }
  /// Device uint64 [R, kNormalDispatchPhases] the dispatches stamp (null = none).
  void set_phase_ns(uint64_t* phase_ns) { phase_ns_ = phase_ns; }

  /// Runs the host Dispatch on the current inputs (cached: with the previous send_pos).
  absl::Status HostDispatch(bool cached) {
    const int32_t R = c_.num_ranks;
    const int32_t K = c_.num_topk;
    if (!cached) {
      // Rows each rank receives: tokens with at least one valid expert on it.
      num_recv_.assign(R, 0);
      const int32_t per_rank = c_.num_experts / R;
      for (int32_t s = 0; s < R; ++s) {
        for (int32_t t = 0; t < Tokens(s); ++t) {
          uint64_t mask = 0;
          for (int32_t k = 0; k < K; ++k) {
            const int64_t e = topk_[s][static_cast<size_t>(t) * K + k];
            if (e >= 0) mask |= 1ull << (e / per_rank);
          }
          for (int32_t r = 0; r < R; ++r) num_recv_[r] += (mask >> r) & 1;
        }
      }
    }
    const int64_t S = shape_.num_scales();
    recv_x_.assign(R, {});
    recv_scales_.assign(R, {});
    recv_src_info_.assign(R, {});
    if (!cached) {
      recv_topk_idx_.assign(R, {});
      recv_topk_weights_.assign(R, {});
      recv_tokens_per_expert_.assign(R, std::vector<int32_t>(shape_.num_local_experts()));
      rank_prefix_.assign(R, std::vector<int32_t>(R));
    }
    std::vector<std::vector<int32_t>> send_pos(R);
    std::vector<kh::DispatchRankArgs> args(R);
    for (int32_t r = 0; r < R; ++r) {
      const int64_t N = num_recv_[r];
      recv_x_[r].assign(N * RowBytes(), 0);
      if (c_.fp8) recv_scales_[r].assign(N * S, 0.0f);
      recv_src_info_[r].assign(N, 0);
      if (!cached) {
        recv_topk_idx_[r].assign(N * K, 0);
        recv_topk_weights_[r].assign(N * K, 0.0f);
      }
      send_pos[r].assign(static_cast<size_t>(Tokens(r)) * R, 0);
      kh::DispatchRankArgs& a = args[r];
      a.num_tokens = Tokens(r);
      a.x = x_[r].data();
      a.x_scales = c_.fp8 ? scales_[r].data() : nullptr;
      a.topk_idx = topk_[r].data();
      a.topk_weights = c_.with_weights ? weights_[r].data() : nullptr;
      if (cached) {
        a.cached_send_pos = send_pos_[r].data();
        a.cached_num_recv_tokens = static_cast<int32_t>(N);
      }
      a.recv_capacity = N;
      a.recv_x = recv_x_[r].data();
      a.recv_scales = c_.fp8 ? recv_scales_[r].data() : nullptr;
      a.recv_topk_idx = cached ? nullptr : recv_topk_idx_[r].data();
      a.recv_topk_weights = cached ? nullptr : recv_topk_weights_[r].data();
      a.recv_tokens_per_expert = recv_tokens_per_expert_[r].data();
      a.recv_src_info = recv_src_info_[r].data();
      a.send_pos = send_pos[r].data();
      a.rank_prefix = rank_prefix_[r].data();
    }
    kh::DispatchOptions options;
    options.fp8 = c_.fp8;
    options.expert_alignment = c_.expert_alignment;
    EPD_RETURN_IF_ERROR(kh::Dispatch(shape_, options, args));
    for (int32_t r = 0; r < R; ++r) {
      if (args[r].num_recv_tokens != num_recv_[r]) {
        return absl::InternalError(absl::StrCat("test bug: host N = ", args[r].num_recv_tokens,
                                                ", expected ", num_recv_[r]));
      }
    }
    send_pos_ = std::move(send_pos);
    return absl::OkStatus();
  }

  absl::Status CheckDispatch(bool cached) {
    const EndpointLayout& l = group_->layout();
    const int32_t R = c_.num_ranks;
    for (int32_t r = 0; r < R; ++r) {
      EPD_RETURN_IF_ERROR(
          kc::ReadAndClearStatus(group_->Context(r), group_->stream(r), "NormalDispatch"));
    }
    for (int32_t r = 0; r < R; ++r) {
      const std::string where =
          absl::StrCat(Describe(c_), cached ? " cached" : "", " rank ", r, " ");
      const int64_t N = num_recv_[r];
      EPD_RETURN_IF_ERROR(
          Compare(r, l.recv_x, recv_x_[r].data(), recv_x_[r].size(), where + "recv_x"));
      if (c_.fp8) {
        EPD_RETURN_IF_ERROR(Compare(r, l.recv_scales, recv_scales_[r].data(),
                                    N * shape_.num_scales() * 4, where + "recv_scales"));
      }
      EPD_RETURN_IF_ERROR(
          Compare(r, l.recv_src_info, recv_src_info_[r].data(), N * 4, where + "recv_src_info"));
      EPD_RETURN_IF_ERROR(
          Compare(r, l.send_pos, send_pos_[r].data(), send_pos_[r].size() * 4, where + "send_pos"));
      // Cached: these must still hold the first dispatch's values.
      EPD_RETURN_IF_ERROR(Compare(r, l.recv_topk_idx, recv_topk_idx_[r].data(), N * c_.num_topk * 8,
                                  where + "recv_topk_idx"));
      if (c_.with_weights) {
        EPD_RETURN_IF_ERROR(Compare(r, l.recv_topk_weights, recv_topk_weights_[r].data(),
                                    N * c_.num_topk * 4, where + "recv_topk_weights"));
      }
      EPD_RETURN_IF_ERROR(Compare(r, l.recv_tokens_per_expert, recv_tokens_per_expert_[r].data(),
                                  recv_tokens_per_expert_[r].size() * 4,
                                  where + "recv_tokens_per_expert"));
      EPD_RETURN_IF_ERROR(
          Compare(r, l.rank_prefix, rank_prefix_[r].data(), R * 4, where + "rank_prefix"));
      const int32_t n32 = static_cast<int32_t>(N);
      EPD_RETURN_IF_ERROR(Compare(r, l.recv_count, &n32, 4, where + "recv_count"));
      // The kernel's write into host-mapped memory (NormalDispatchArgs::recv_count_out).
      const int32_t mapped = reinterpret_cast<const volatile int32_t*>(recv_count_out_.get())[r];
      if (mapped != n32) {
        return absl::InternalError(
            absl::StrCat(where, "recv_count_out = ", mapped, ", expected N = ", n32));
      }
      // The optional CPU sync reads the same counts.
      EPD_ASSIGN_OR_RETURN(kc::NormalDispatchCounts counts,
                           kc::ReadNormalDispatchCounts(group_->Context(r), group_->stream(r)));
      if (counts.num_recv_tokens != n32 ||
          counts.recv_tokens_per_expert != recv_tokens_per_expert_[r] ||
          counts.rank_prefix != rank_prefix_[r]) {
        return absl::InternalError(where + "ReadNormalDispatchCounts differs from the host");
      }
    }
    return absl::OkStatus();
  }

  // -- Combine.
  absl::Status PrepareCombine(uint64_t seed) {
    const EndpointLayout& l = group_->layout();
    combine_x_.assign(c_.num_ranks, {});
    combine_w_.assign(c_.num_ranks, {});
    for (int32_t r = 0; r < c_.num_ranks; ++r) {
      const int64_t N = num_recv_[r];
      combine_x_[r] = FastBf16(N * c_.hidden, seed + r);
      combine_w_[r] = FastFloats(N * c_.num_topk, seed * 7 + r);
      EPD_RETURN_IF_ERROR(
          group_->Upload(r, l.in_combine_x, combine_x_[r].data(), combine_x_[r].size() * 2));
      EPD_RETURN_IF_ERROR(
          group_->Upload(r, l.in_combine_weights, combine_w_[r].data(), combine_w_[r].size() * 4));
    }
    return absl::OkStatus();
  }
  absl::Status LaunchCombine() {
    return group_->LaunchAll([&](int32_t r, cudaStream_t s) { return LaunchCombineRank(r, s); });
  }
  absl::Status LaunchCombineRank(int32_t r, cudaStream_t s) {
    kc::NormalCombineArgs args;
    args.with_weights = c_.with_weights;
    return kc::NormalCombine(group_->Context(r), args, s);
  }
  absl::Status CheckCombine() {
    const int32_t R = c_.num_ranks;
    std::vector<std::vector<bf16_bits>> out(R);
    std::vector<std::vector<float>> out_w(R);
    std::vector<kh::CombineRankArgs> args(R);
    for (int32_t r = 0; r < R; ++r) {
      out[r].assign(static_cast<size_t>(Tokens(r)) * c_.hidden, 0);
      out_w[r].assign(static_cast<size_t>(Tokens(r)) * c_.num_topk, 0.0f);
      kh::CombineRankArgs& a = args[r];
      a.num_tokens = Tokens(r);
      a.send_pos = send_pos_[r].data();
      a.num_recv_tokens = static_cast<int32_t>(num_recv_[r]);
      a.x = combine_x_[r].data();
      a.topk_weights = c_.with_weights ? combine_w_[r].data() : nullptr;
      a.combined_x = out[r].data();
      a.combined_topk_weights = c_.with_weights ? out_w[r].data() : nullptr;
    }
    EPD_RETURN_IF_ERROR(kh::Combine(shape_, args));
    const EndpointLayout& l = group_->layout();
    for (int32_t r = 0; r < R; ++r) {
      EPD_RETURN_IF_ERROR(
          kc::ReadAndClearStatus(group_->Context(r), group_->stream(r), "NormalCombine"));
      const std::string where = absl::StrCat(Describe(c_), " rank ", r, " combine ");
      EPD_RETURN_IF_ERROR(
          Compare(r, l.combined_x, out[r].data(), out[r].size() * 2, where + "combined_x"));
      if (c_.with_weights) {
        EPD_RETURN_IF_ERROR(Compare(r, l.combined_topk_weights, out_w[r].data(),
                                    out_w[r].size() * 4, where + "combined_topk_weights"));
      }
    }
    return absl::OkStatus();
  }

  /// The whole sequence for one case: layout, dispatch, combine, cached re-dispatch, and a
  /// combine of the cached dispatch (new expert outputs).
  absl::Status RunAll() {
    EPD_RETURN_IF_ERROR(Prepare());
    EPD_RETURN_IF_ERROR(LaunchLayout());
    EPD_RETURN_IF_ERROR(CheckLayout());
    EPD_RETURN_IF_ERROR(HostDispatch(false));
    EPD_RETURN_IF_ERROR(LaunchDispatch(false));
    EPD_RETURN_IF_ERROR(group_->SynchronizeAll());
    EPD_RETURN_IF_ERROR(CheckDispatch(false));
    EPD_RETURN_IF_ERROR(PrepareCombine(c_.seed * 101));
    EPD_RETURN_IF_ERROR(LaunchCombine());
    EPD_RETURN_IF_ERROR(group_->SynchronizeAll());
    EPD_RETURN_IF_ERROR(CheckCombine());
    EPD_RETURN_IF_ERROR(RedrawX(c_.seed * 977));
    EPD_RETURN_IF_ERROR(HostDispatch(true));
    EPD_RETURN_IF_ERROR(LaunchDispatch(true));
    EPD_RETURN_IF_ERROR(group_->SynchronizeAll());
    EPD_RETURN_IF_ERROR(CheckDispatch(true));
    EPD_RETURN_IF_ERROR(PrepareCombine(c_.seed * 131));
    EPD_RETURN_IF_ERROR(LaunchCombine());
    EPD_RETURN_IF_ERROR(group_->SynchronizeAll());
    return CheckCombine();
  }

  std::vector<std::vector<int64_t>>& topk() { return topk_; }
  absl::Status UploadTopk(int32_t r) {
    return group_->Upload(r, group_->layout().in_topk_idx, topk_[r].data(), topk_[r].size() * 8);
  }

 private:
  uint64_t* phase_ns_ = nullptr;
  absl::Status UploadInputs(int32_t r) {
    const EndpointLayout& l = group_->layout();
    EPD_RETURN_IF_ERROR(group_->Upload(r, l.in_x, x_[r].data(), x_[r].size()));
    if (c_.fp8) {
      EPD_RETURN_IF_ERROR(group_->Upload(r, l.in_scales, scales_[r].data(), scales_[r].size() * 4));
    }
    return absl::OkStatus();
  }
  absl::Status Compare(int32_t r, const Region& region, const void* expected, size_t bytes,
                       const std::string& what) {
    if (bytes == 0) return absl::OkStatus();
    std::vector<uint8_t> got(bytes);
    EPD_RETURN_IF_ERROR(group_->Download(r, region, got.data(), bytes));
    return CompareBytes(expected, got.data(), bytes, what);
  }

  NormalCase c_;
  GroupShape shape_;
  std::unique_ptr<VirtualRankGroup> group_;
  std::vector<std::vector<uint8_t>> x_;
  std::vector<std::vector<float>> scales_;
  std::vector<std::vector<int64_t>> topk_;
  std::vector<std::vector<float>> weights_;
  std::vector<int64_t> num_recv_;
  std::vector<std::vector<uint8_t>> recv_x_;
  std::vector<std::vector<float>> recv_scales_;
  std::vector<std::vector<int64_t>> recv_topk_idx_;
  std::vector<std::vector<float>> recv_topk_weights_;
  std::vector<std::vector<int32_t>> recv_src_info_;
  std::vector<std::vector<int32_t>> recv_tokens_per_expert_;
  std::vector<std::vector<int32_t>> rank_prefix_;
  PinnedMemory recv_count_out_;  ///< [R] int32, mapped: each rank's dispatch writes its N.
  std::vector<std::vector<int32_t>> send_pos_;
  std::vector<std::vector<bf16_bits>> combine_x_;
  std::vector<std::vector<float>> combine_w_;
};

class NormalGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (SkipWithoutGpu()) GTEST_SKIP() << "needs a CUDA GPU";
    NM_ASSERT_OK(kc::PreloadKernels());
  }
};

// ---- the sweep ---------------------------------------------------------------------------

std::vector<NormalCase> SweepCases() {
  std::vector<NormalCase> cases;
  auto add = [&](NormalCase c) {
    c.seed = cases.size() + 11;
    cases.push_back(std::move(c));
  };
  RoutingOptions masked;
  masked.masked_fraction = 0.5;
  RoutingOptions hot;
  hot.one_expert = 3;
  RoutingOptions dups;
  dups.duplicate_fraction = 0.25;
  add({"single-rank", 1, 2048, 1, 1, {333}});
  add({"single-rank-topk8", 1, 4096, 8, 64, {4096}, true, 128});
  add({"one-token-fp8", 2, 4096, 1, 2, {1}, true, 128});
  add({"masked", 2, 7168, 6, 64, {333}, false, 1, true, masked});
  add({"no-weights", 2, 2048, 8, 256, {333}, false, 1, false});
  add({"fp8-align", 4, 2048, 8, 256, {4096}, true, 128});
  add({"empty", 4, 4096, 6, 64, {0}});
  add({"mixed-T", 4, 2048, 8, 64, {0, 1, 333, 4096}, false, 128});
  add({"mixed-T-fp8-masked", 4, 7168, 6, 256, {4096, 0, 333, 1}, true, 1, true, masked});
  add({"deepseek-fp8", 8, 7168, 8, 256, {4096}, true, 128});
  add({"deepseek-bf16", 8, 7168, 8, 256, {4096}, false, 1});
  add({"hot-expert-masked", 8, 2048, 6, 64, {333}, false, 128, true, RoutingOptions{0.5, 3, 0.0}});
  add({"hot-expert", 2, 7168, 8, 256, {4096}, true, 1, true, hot});
  add({"E=R-duplicates", 8, 4096, 8, 8, {333}, false, 1, true, dups});
  add({"one-token-8-ranks", 8, 2048, 1, 256, {1}, true, 1});
  add({"mixed-T-8", 8, 4096, 6, 64, {1, 0, 333, 4096, 333, 0, 1, 4096}, false, 128, true, masked});
  // Rows that are not a multiple of the warp's vector stride (tail lanes idle), and rows
  // that are not a multiple of 16 bytes (bf16 units, scalar combine).
  add({"ragged-hidden", 2, 2056, 6, 64, {333}, false, 1, true, masked});
  add({"tiny-odd-hidden", 4, 100, 3, 8, {333}, false, 128});
  // The dispatch's layout tiles (NormalDispatchTiling): 16 tiles of 256 tokens over 3 blocks
  // (a block takes several tiles, the last tile partial); M = 20000: 40 tiles of 512 tokens
  // (two passes of the block per tile) over 5 blocks, masked ranks.
  add({"tiles-over-3-blocks", 2, 2048, 8, 64, {4000, 1000}, false, 1, true, {}, 0, 3});
  add({"long-tiles-fp8-masked", 2, 1024, 4, 16, {20000, 17001}, true, 1, true, masked, 0, 5});
  // Top-k above the layout scan's batch of 8 ids, with duplicates across batches: each
  // expert counted once per row.
  RoutingOptions wide_dups;
  wide_dups.duplicate_fraction = 0.3;
  wide_dups.masked_fraction = 0.1;
  add({"topk12-duplicates", 4, 2048, 12, 64, {1000, 333, 0, 4096}, false, 1, true, wide_dups});
  // Rows of bf16 units (4104 bytes, not a multiple of 16) over several copy chunks: 17
  // chunks of 128 units, cut into parts by EPD_NORMAL_COPY_PARTS.
  add({"bf16-units-17-chunks", 4, 2052, 8, 64, {2000, 1, 0, 777}, false, 1, true, masked});
  return cases;
}

class NormalSweepTest : public NormalGpuTest, public ::testing::WithParamInterface<NormalCase> {};

TEST_P(NormalSweepTest, MatchesHostBitForBit) {
  NormalGroup g(GetParam());
  NM_ASSERT_OK(g.RunAll());
}

INSTANTIATE_TEST_SUITE_P(Sweep, NormalSweepTest, ::testing::ValuesIn(SweepCases()),
                         [](const ::testing::TestParamInfo<NormalCase>& info) {
                           std::string n = absl::StrCat(info.index, "_", info.param.name);
                           for (char& ch : n) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return n;
                         });

// ---- kernel variants (EPD_NORMAL_KERNELS) --------------------------------------------------

/// Sets an environment variable for its lifetime, then restores the old value (or its
/// absence).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_.c_str(), old_.c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::string old_;
  bool had_ = false;
};

/// Runs RunAll on the sweep's cases named in `picked` under each of `variants`
/// (EPD_NORMAL_KERNELS), as the environment has it otherwise.
void RunPickedCasesUnderVariants(std::initializer_list<const char*> picked,
                                 std::initializer_list<const char*> variants) {
  const std::vector<NormalCase> cases = SweepCases();
  for (const char* variant : variants) {
    ScopedEnv env("EPD_NORMAL_KERNELS", variant);
    for (const NormalCase& c : cases) {
      if (std::none_of(picked.begin(), picked.end(),
                       [&](const char* name) { return c.name == name; })) {
        continue;
      }
      const char* pdl = std::getenv("EPD_NORMAL_PDL");
      const char* scope = std::getenv("EPD_NORMAL_GPU_SCOPE");
      SCOPED_TRACE(absl::StrCat(
          "EPD_NORMAL_KERNELS=", variant, " EPD_NORMAL_PDL=", pdl != nullptr ? pdl : "",
          " EPD_NORMAL_GPU_SCOPE=", scope != nullptr ? scope : "", ": ", Describe(c)));
      NormalGroup g(c);
      NM_ASSERT_OK(g.RunAll());
    }
  }
}

TEST_F(NormalGpuTest, EveryKernelVariantMatchesHostBitForBit) {
  // Cases of the sweep under each variant: 16-byte rows (bulk copies on sm_90) and bf16-unit
  // rows (every variant falls back to the vector copy), masked ranks, T of 0 and 1, blocks
  // owning several tiles, a single rank.
  RunPickedCasesUnderVariants(
      {"single-rank-topk8", "deepseek-fp8", "deepseek-bf16", "mixed-T-8", "one-token-8-ranks",
       "ragged-hidden", "tiny-odd-hidden", "tiles-over-3-blocks", "long-tiles-fp8-masked"},
      {"static", "block", "balanced", "bulk"});
}

// ---- programmatic launch of each op's second kernel (EPD_NORMAL_PDL) ------------------------

__global__ void PtxVersionProbe() {}

/// The PTX version (e.g. 90) this binary's kernels run from on the current GPU: built with the
/// same architectures as the library's.
int ProbePtxVersion() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, PtxVersionProbe) == cudaSuccess ? attr.ptxVersion : 0;
}

TEST_F(NormalGpuTest, ProgrammaticLaunchIsOnWhereTheKernelsHaveIt) {
  // The tests below only test the programmatic path if the switch takes effect: where the
  // kernels run from sm_90 PTX (the H200 with the default architectures: griddepcontrol),
  // EPD_NORMAL_PDL=1 must turn it on.
  {
    ScopedEnv env("EPD_NORMAL_PDL", "0");
    const absl::StatusOr<bool> off = kc::normal::NormalProgrammaticFromEnv();
    ASSERT_TRUE(off.ok()) << off.status();
    EXPECT_FALSE(*off);
  }
  ScopedEnv env("EPD_NORMAL_PDL", "1");
  const absl::StatusOr<bool> on = kc::normal::NormalProgrammaticFromEnv();
  ASSERT_TRUE(on.ok()) << on.status();
  const int ptx = ProbePtxVersion();
  ASSERT_GT(ptx, 0);
  EXPECT_EQ(*on, ptx >= 90) << "ptxVersion " << ptx;
}

/// The switch tests' cases (both copies, 8 ranks, T of 0 and 1, masked ranks, blocks owning
/// several tiles) under the balanced and bulk kernels, with EPD_NORMAL_PDL = `pdl` and
/// EPD_NORMAL_GPU_SCOPE = `gpu_scope`.
void RunPickedCasesWithSwitches(const char* pdl, const char* gpu_scope) {
  ScopedEnv pdl_env("EPD_NORMAL_PDL", pdl);
  ScopedEnv scope_env("EPD_NORMAL_GPU_SCOPE", gpu_scope);
  RunPickedCasesUnderVariants({"deepseek-fp8", "deepseek-bf16", "mixed-T-8", "ragged-hidden",
                               "tiny-odd-hidden", "long-tiles-fp8-masked"},
                              {"balanced", "bulk"});
}

TEST_F(NormalGpuTest, ProgrammaticLaunchMatchesHostBitForBit) {
  // Layout, dispatch, combine and cached re-dispatch with every op's second kernel launched
  // programmatically: a copy or combine that read the notify's or barrier's writes (tile
  // bases, sequence number, token counter) before that grid ended would differ from the
  // host. The vector copy (16-byte and bf16-unit rows) and the bulk copy, 8 ranks, T of 0
  // and 1, masked ranks, blocks owning several tiles. The flags at .sys scope (the default
  // is .gpu on one GPU), so that path is covered on one GPU too.
  RunPickedCasesWithSwitches(/*pdl=*/"1", /*gpu_scope=*/"0");
}

/// Runs a case's ops with environment variable `name` = `value` (not a value it takes):
/// INVALID_ARGUMENT naming both.
void ExpectEnvValueRefused(const char* name, const char* value) {
  ScopedEnv env(name, value);
  NormalGroup g(NormalCase{"bad-env", 2, 2048, 8, 64, {333}});
  const absl::Status st = g.RunAll();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find(name), absl::string_view::npos) << st;
  EXPECT_NE(st.message().find(value), absl::string_view::npos) << st;
}

TEST_F(NormalGpuTest, GpuScopeFlagsMatchHostBitForBit) {
  // The inter-rank flags at .gpu scope (every rank on this GPU), with the programmatic launch
  // as the lead may run both: a missing order between a rank's writes and its flags would
  // show as rows or counts that differ from the host.
  RunPickedCasesWithSwitches(/*pdl=*/"1", /*gpu_scope=*/"1");
}

TEST_F(NormalGpuTest, PhaseStampsAreSetInOrderAndLeaveTheResultsAsTheHostHasThem) {
  // NormalDispatchArgs::phase_ns (the bench's --normal_phases): every phase of every rank
  // stamped, in op order, by a fresh and by a cached dispatch under both copies; the results
  // still bit for bit the host's. A stamp left at 0 or out of order fails.
  for (const char* variant : {"balanced", "bulk"}) {
    SCOPED_TRACE(variant);
    ScopedEnv env("EPD_NORMAL_KERNELS", variant);
    NormalGroup g(NormalCase{"phases", 8, 7168, 8, 256, {1000, 0, 1, 2048, 517, 64, 999, 3}});
    NM_ASSERT_OK(g.Prepare());
    const size_t count = static_cast<size_t>(8) * kc::kNormalDispatchPhases;
    absl::StatusOr<DeviceBuffer> buf = DeviceBuffer::Allocate(count * 8);
    NM_ASSERT_OK(buf.status());
    g.set_phase_ns(reinterpret_cast<uint64_t*>(buf->get()));
    for (const bool cached : {false, true}) {
      SCOPED_TRACE(cached ? "cached" : "fresh");
      NM_ASSERT_OK(EPD_CUDA_STATUS(cudaMemset(buf->get(), 0, count * 8)));
      // The rank streams are non-blocking: the zeroing must be done before they stamp.
      NM_ASSERT_OK(EPD_CUDA_STATUS(cudaDeviceSynchronize()));
      if (cached) NM_ASSERT_OK(g.RedrawX(4242));
      NM_ASSERT_OK(g.HostDispatch(cached));
      NM_ASSERT_OK(g.LaunchDispatch(cached));
      NM_ASSERT_OK(g.group().SynchronizeAll());
      NM_ASSERT_OK(g.CheckDispatch(cached));
      std::vector<uint64_t> stamps(count);
      NM_ASSERT_OK(EPD_CUDA_STATUS(
          cudaMemcpy(stamps.data(), buf->get(), count * 8, cudaMemcpyDeviceToHost)));
      for (int32_t r = 0; r < 8; ++r) {
        const uint64_t* t = stamps.data() + r * kc::kNormalDispatchPhases;
        for (int i = 0; i < kc::kNormalDispatchPhases; ++i) {
          EXPECT_NE(t[i], 0u) << "rank " << r << " phase " << i;
          if (i > 0) EXPECT_GE(t[i], t[i - 1]) << "rank " << r << " phase " << i;
        }
      }
    }
  }
}

TEST_F(NormalGpuTest, GpuScopeOnlyWhereEveryRankIsOnThisGpu) {
  NormalGroup g(NormalCase{"scope", 2, 2048, 8, 64, {333}});
  NM_ASSERT_OK(g.Prepare());
  kc::CudaRankContext ctx = g.group().Context(0);
  ScopedEnv env("EPD_NORMAL_GPU_SCOPE", "1");
  for (const bool all : {false, true}) {
    ctx.all_ranks_on_device = all;
    const absl::StatusOr<bool> scope = kc::normal::NormalGpuScopeFromEnv(ctx);
    ASSERT_TRUE(scope.ok()) << scope.status();
    EXPECT_EQ(*scope, all);
  }
}

TEST_F(NormalGpuTest, UnknownGpuScopeValueIsRefusedNamingIt) {
  ExpectEnvValueRefused("EPD_NORMAL_GPU_SCOPE", "gpu");
}

TEST_F(NormalGpuTest, CopyPartsMatchHostBitForBit) {
  // The dispatch copy's tokens cut into parts taken by different warps
  // (EPD_NORMAL_COPY_PARTS; the default, 4, runs in every other test): one part (a token an
  // item), 3 (uneven parts: the FP8 row's 4 chunks in 2 + 2, the 17 chunks of a 2052-wide
  // bf16-unit row in 6 + 6 + 5), and 16 (capped: the FP8 row's 4 chunks, the bf16-unit
  // row's 17 in 9 parts of 2). Every token order, T of 0 and 1, masked ranks, top-k 12 with
  // duplicates. NormalCopyParts::For's arithmetic has its own unit test (layout_test.cc).
  for (const char* parts : {"1", "3", "16"}) {
    SCOPED_TRACE(std::string("EPD_NORMAL_COPY_PARTS=") + parts);
    ScopedEnv env("EPD_NORMAL_COPY_PARTS", parts);
    RunPickedCasesUnderVariants({"mixed-T-fp8-masked", "mixed-T-8", "bf16-units-17-chunks",
                                 "tiny-odd-hidden", "topk12-duplicates"},
                                {"balanced", "static", "block"});
  }
}

TEST_F(NormalGpuTest, UnknownCopyPartsValueIsRefusedNamingIt) {
  for (const char* bad : {"0", "17", "four", "-1"}) {
    ExpectEnvValueRefused("EPD_NORMAL_COPY_PARTS", bad);
    ScopedEnv env("EPD_NORMAL_COPY_PARTS", bad);
    const absl::StatusOr<int32_t> parts = kc::normal::NormalCopyPartsFromEnv();
    ASSERT_FALSE(parts.ok()) << bad;
    EXPECT_EQ(parts.status().message(),
              absl::StrCat("EPD_NORMAL_COPY_PARTS = \"", bad, "\" is not a whole number in [1, ",
                           kc::normal::kMaxCopyParts, "]"));
  }
  ScopedEnv env("EPD_NORMAL_COPY_PARTS", "7");
  const absl::StatusOr<int32_t> parts = kc::normal::NormalCopyPartsFromEnv();
  ASSERT_TRUE(parts.ok()) << parts.status();
  EXPECT_EQ(*parts, 7);
}

TEST_F(NormalGpuTest, UnknownProgrammaticLaunchValueIsRefusedNamingIt) {
  ExpectEnvValueRefused("EPD_NORMAL_PDL", "yes");
}

TEST_F(NormalGpuTest, UnknownKernelVariantIsRefusedNamingIt) {
  ExpectEnvValueRefused("EPD_NORMAL_KERNELS", "fastest");
}

// ---- two groups on one GPU, launched concurrently ----------------------------------------

TEST_F(NormalGpuTest, PrefillGroupBesideDecodeGroupRunConcurrently) {
  // 4 + 4 ranks share the GPU: ranks_on_device = 8 sizes each rank's grid so all are resident.
  NormalCase prefill{"prefill", 4, 7168, 8, 256, {4096}, true, 128};
  prefill.ranks_on_device = 8;
  prefill.seed = 101;
  NormalCase decode{"decode", 4, 7168, 8, 256, {32}, false, 1};
  decode.ranks_on_device = 8;
  decode.seed = 202;
  NormalGroup a(prefill), b(decode);
  NM_ASSERT_OK(a.Prepare());
  NM_ASSERT_OK(b.Prepare());
  NM_ASSERT_OK(a.HostDispatch(false));
  NM_ASSERT_OK(b.HostDispatch(false));
  // Interleave the two groups' launches; several decode steps while one prefill dispatch runs.
  for (int32_t r = 0; r < 4; ++r) {
    NM_ASSERT_OK(a.LaunchDispatchRank(r, false, a.group().stream(r)));
    NM_ASSERT_OK(b.LaunchDispatchRank(r, false, b.group().stream(r)));
  }
  for (int step = 0; step < 3; ++step) {
    for (int32_t r = 0; r < 4; ++r)
      NM_ASSERT_OK(b.LaunchDispatchRank(r, false, b.group().stream(r)));
  }
  NM_ASSERT_OK(a.group().SynchronizeAll());
  NM_ASSERT_OK(b.group().SynchronizeAll());
  NM_ASSERT_OK(a.CheckDispatch(false));
  NM_ASSERT_OK(b.CheckDispatch(false));
  NM_ASSERT_OK(a.PrepareCombine(5));
  NM_ASSERT_OK(b.PrepareCombine(6));
  for (int32_t r = 0; r < 4; ++r) {
    NM_ASSERT_OK(a.LaunchCombineRank(r, a.group().stream(r)));
    NM_ASSERT_OK(b.LaunchCombineRank(r, b.group().stream(r)));
  }
  NM_ASSERT_OK(a.group().SynchronizeAll());
  NM_ASSERT_OK(b.group().SynchronizeAll());
  NM_ASSERT_OK(a.CheckCombine());
  NM_ASSERT_OK(b.CheckCombine());
}

// ---- CUDA graphs: captured once, replayed with new inputs and a new T ---------------------

/// Each rank captures [Dispatch, Combine] on its stream once. T comes from the device slot
/// and sequence numbers from the device op counter, so replays with other T and inputs
/// (slot and inputs written outside the graph) must match the host every time. `pdl`: the
/// EPD_NORMAL_PDL value during the capture (the programmatic edges are captured), `scope` the
/// EPD_NORMAL_GPU_SCOPE value.
void CaptureAndReplayDispatchCombine(const char* pdl, const char* scope) {
  NormalGroup g({"graph", 4, 2048, 8, 64, {4096}, false, 128});
  NM_ASSERT_OK(g.Prepare());
  struct ExecDeleter {
    void operator()(CUgraphExec_st* e) const { cudaGraphExecDestroy(e); }
  };
  std::vector<std::unique_ptr<CUgraphExec_st, ExecDeleter>> execs;
  for (int32_t r = 0; r < 4; ++r) {
    cudaStream_t s = g.group().stream(r);
    ScopedEnv env("EPD_NORMAL_PDL", pdl);
    ScopedEnv scope_env("EPD_NORMAL_GPU_SCOPE", scope);
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    const absl::Status d = g.LaunchDispatchRank(r, false, s);
    const absl::Status c = g.LaunchCombineRank(r, s);
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
    NM_ASSERT_OK(d);
    NM_ASSERT_OK(c);
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    cudaGraphDestroy(graph);
    execs.emplace_back(exec);
  }
  const std::vector<std::vector<int32_t>> replays = {
      {333, 0, 4096, 1}, {4096, 4096, 4096, 4096}, {1, 1, 0, 1}, {0, 0, 0, 0}, {77, 333, 5, 4096}};
  for (size_t i = 0; i < replays.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("replay ", i));
    NM_ASSERT_OK(g.DrawInputs(500 + i, replays[i]));
    NM_ASSERT_OK(g.HostDispatch(false));
    NM_ASSERT_OK(g.PrepareCombine(900 + i));  // expert outputs, read by the captured combine
    for (int32_t r = 0; r < 4; ++r) {
      ASSERT_EQ(cudaGraphLaunch(execs[r].get(), g.group().stream(r)), cudaSuccess);
    }
    NM_ASSERT_OK(g.group().SynchronizeAll());
    NM_ASSERT_OK(g.CheckDispatch(false));
    NM_ASSERT_OK(g.CheckCombine());
  }
}

TEST_F(NormalGpuTest, CapturedDispatchCombineReplaysWithNewInputsAndT) {
  CaptureAndReplayDispatchCombine("0", "0");
}

TEST_F(NormalGpuTest, CapturedWithPdlAndGpuScopeReplaysWithNewInputsAndT) {
  CaptureAndReplayDispatchCombine("1", "1");
}

// ---- device-side errors ------------------------------------------------------------------

TEST_F(NormalGpuTest, BadExpertIdsAreCountedThenNextOpWorks) {
  NormalGroup g({"bad-ids", 2, 256, 4, 8, {16}});
  NM_ASSERT_OK(g.Prepare());
  g.topk()[1][5] = 8;   // == E
  g.topk()[1][9] = -7;  // < -1
  NM_ASSERT_OK(g.UploadTopk(1));
  NM_ASSERT_OK(g.LaunchLayout());
  NM_ASSERT_OK(g.group().SynchronizeAll());
  absl::Status layout_status =
      kc::ReadAndClearStatus(g.group().Context(1), g.group().stream(1), "GetDispatchLayout");
  EXPECT_EQ(layout_status.code(), absl::StatusCode::kInvalidArgument) << layout_status;
  EXPECT_NE(std::string(layout_status.message()).find("2 topk_idx"), std::string::npos)
      << layout_status;
  NM_ASSERT_OK(kc::ReadAndClearStatus(g.group().Context(0), g.group().stream(0), "layout"));

  NM_ASSERT_OK(g.LaunchDispatch(false));
  NM_ASSERT_OK(g.group().SynchronizeAll());
  absl::Status st =
      kc::ReadAndClearStatus(g.group().Context(1), g.group().stream(1), "NormalDispatch");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(std::string(st.message()).find("2 topk_idx"), std::string::npos) << st;
  NM_ASSERT_OK(kc::ReadAndClearStatus(g.group().Context(0), g.group().stream(0), "dispatch"));

  // Fix the ids: the next dispatch and combine match the host.
  g.topk()[1][5] = 1;
  g.topk()[1][9] = -1;
  NM_ASSERT_OK(g.UploadTopk(1));
  NM_ASSERT_OK(g.HostDispatch(false));
  NM_ASSERT_OK(g.LaunchDispatch(false));
  NM_ASSERT_OK(g.group().SynchronizeAll());
  NM_ASSERT_OK(g.CheckDispatch(false));
  NM_ASSERT_OK(g.PrepareCombine(3));
  NM_ASSERT_OK(g.LaunchCombine());
  NM_ASSERT_OK(g.group().SynchronizeAll());
  NM_ASSERT_OK(g.CheckCombine());
}

TEST_F(NormalGpuTest, BadRunTimeTokenCountIsReportedAndTreatedAsZero) {
  NormalGroup g({"bad-T", 2, 256, 2, 4, {8}});
  NM_ASSERT_OK(g.Prepare());
  const kc::CudaRankContext ctx1 = g.group().Context(1);
  NM_ASSERT_OK(kc::SetNormalNumTokensAsync(ctx1, 9, g.group().stream(1)));  // > M = 8
  NM_ASSERT_OK(g.LaunchDispatch(false));
  NM_ASSERT_OK(g.group().SynchronizeAll());
  absl::Status st = kc::ReadAndClearStatus(ctx1, g.group().stream(1), "NormalDispatch");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(std::string(st.message()).find("num_tokens = 9"), std::string::npos) << st;
  NM_ASSERT_OK(kc::ReadAndClearStatus(g.group().Context(0), g.group().stream(0), "dispatch"));
  // Rank 1 sent nothing: rank 0 received only its own rows.
  NM_ASSERT_OK(kc::SetNormalNumTokensAsync(ctx1, 8, g.group().stream(1)));
  NM_ASSERT_OK(g.HostDispatch(false));
  NM_ASSERT_OK(g.LaunchDispatch(false));
  NM_ASSERT_OK(g.group().SynchronizeAll());
  NM_ASSERT_OK(g.CheckDispatch(false));
}

TEST_F(NormalGpuTest, MissingRankTimesOutThenResetAndNextOpWorks) {
  NormalCase c{"missing-rank", 4, 512, 4, 16, {64}};
  NormalGroup g(c);
  NM_ASSERT_OK(g.Prepare());
  // Ranks 0..2 dispatch with a 50 ms bound; rank 3 never comes.
  for (int32_t r = 0; r < 3; ++r) {
    kc::CudaRankContext ctx = g.group().Context(r);
    ctx.timeout_ns = 50'000'000;
    kc::NormalDispatchArgs args;
    NM_ASSERT_OK(kc::NormalDispatch(ctx, args, g.group().stream(r)));
  }
  for (int32_t r = 0; r < 3; ++r) {
    absl::Status st =
        kc::ReadAndClearStatus(g.group().Context(r), g.group().stream(r), "NormalDispatch");
    EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
    EXPECT_NE(std::string(st.message()).find("[3]"), std::string::npos) << st;
  }
  // Every stream is idle: reset the normal sync state of every rank, then the group works.
  for (int32_t r = 0; r < 4; ++r) {
    NM_ASSERT_OK(kc::ResetNormalSync(g.group().Context(r), g.group().stream(r)));
  }
  NM_ASSERT_OK(g.HostDispatch(false));
  NM_ASSERT_OK(g.LaunchDispatch(false));
  NM_ASSERT_OK(g.group().SynchronizeAll());
  NM_ASSERT_OK(g.CheckDispatch(false));
  NM_ASSERT_OK(g.PrepareCombine(9));
  NM_ASSERT_OK(g.LaunchCombine());
  NM_ASSERT_OK(g.group().SynchronizeAll());
  NM_ASSERT_OK(g.CheckCombine());
}

// ---- a layout over 4 GiB per rank ----------------------------------------------------------

/// Value of channel c of row `row` of rank r in the pattern tests: a small integer, exact in
/// bf16, so sums of two are exact too.
__host__ __device__ inline float PatternValue(int r, int64_t row, int64_t c) {
  return static_cast<float>(static_cast<int>((r * 131 + row * 7 + c) % 61) - 30);
}

__global__ void FillPattern(bf16_bits* x, int r, int64_t rows, int64_t hidden) {
  const int64_t n = rows * hidden;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    x[i] = kernels::FloatToBf16(PatternValue(r, i / hidden, i % hidden));
  }
}

/// Counts rows of recv_x [N, H] that differ from the pattern of their source token
/// (recv_src_info gives src_rank * M + src_token).
__global__ void CheckRecvPattern(const bf16_bits* recv_x, const int32_t* src_info, int64_t rows,
                                 int64_t hidden, int32_t max_tokens, unsigned long long* bad) {
  const int64_t n = rows * hidden;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / hidden;
    const int32_t info = src_info[row];
    const bf16_bits want =
        kernels::FloatToBf16(PatternValue(info / max_tokens, info % max_tokens, i % hidden));
    if (recv_x[i] != want) atomicAdd(bad, 1ull);
  }
}

/// Counts values of combined_x [T, H] that differ from Σ_r pattern(r, send_pos[t, r], c).
__global__ void CheckCombinedPattern(const bf16_bits* combined, const int32_t* send_pos,
                                     int32_t num_ranks, int64_t rows, int64_t hidden,
                                     unsigned long long* bad) {
  const int64_t n = rows * hidden;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / hidden;
    float acc = 0.0f;
    for (int r = 0; r < num_ranks; ++r) {
      const int32_t pos = send_pos[t * num_ranks + r];
      if (pos >= 0) acc += PatternValue(r, pos, i % hidden);
    }
    if (combined[i] != kernels::FloatToBf16(acc)) atomicAdd(bad, 1ull);
  }
}

TEST_F(NormalGpuTest, LayoutOver4GiBWritesRowsPast4GiB) {
  // R = 2, H = 2^25 (64 MiB a bf16 row), M = 72: in_x is 4.5 GiB, recv_x and in_combine_x
  // 9 GiB, combined_x 4.5 GiB per rank (27 GiB a rank). Every token goes to both ranks, so
  // rank 1's tokens land in rows 72..143 of recv_x, 4.5..9 GiB into the region.
  GroupShape shape;
  shape.num_ranks = 2;
  shape.num_experts = 2;
  shape.hidden = 1 << 25;
  shape.num_topk = 2;
  shape.max_tokens_per_rank = 72;
  const int64_t H = shape.hidden;
  const int32_t T = shape.max_tokens_per_rank;
  const EndpointLayout layout = EndpointLayout::Compute(shape);
  ASSERT_GT(layout.recv_x.bytes, 1ull << 32);
  ASSERT_GT(layout.in_x.bytes, 1ull << 32);
  ASSERT_GT(layout.total_bytes, 5ull << 32);
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  if (free_bytes < 2 * layout.total_bytes + (2ull << 30)) {
    GTEST_SKIP() << "needs " << 2 * layout.total_bytes << " bytes of GPU memory, " << free_bytes
                 << " free";
  }
  auto group_or = VirtualRankGroup::Create(shape, 10'000'000'000);
  NM_ASSERT_OK(group_or.status());
  VirtualRankGroup& g = **group_or;
  std::vector<int64_t> topk(static_cast<size_t>(T) * 2);
  for (int32_t t = 0; t < T; ++t) {
    topk[2 * t] = t % 2;  // both experts, in either order
    topk[2 * t + 1] = 1 - t % 2;
  }
  for (int32_t r = 0; r < 2; ++r) {
    FillPattern<<<1024, 256, 0, g.stream(r)>>>(g.At<bf16_bits>(r, layout.in_x), r, T, H);
    NM_ASSERT_OK(g.Upload(r, layout.in_topk_idx, topk.data(), topk.size() * 8));
    NM_ASSERT_OK(kc::SetNormalNumTokensAsync(g.Context(r), T, g.stream(r)));
  }
  NM_ASSERT_OK(g.SynchronizeAll());
  NM_ASSERT_OK(g.LaunchAll([&](int32_t r, cudaStream_t s) {
    kc::NormalDispatchArgs args;
    args.with_weights = false;
    return kc::NormalDispatch(g.Context(r), args, s);
  }));
  NM_ASSERT_OK(g.SynchronizeAll());
  unsigned long long* bad = nullptr;
  ASSERT_EQ(cudaMalloc(&bad, sizeof(unsigned long long)), cudaSuccess);
  for (int32_t r = 0; r < 2; ++r) {
    NM_ASSERT_OK(kc::ReadAndClearStatus(g.Context(r), g.stream(r), "NormalDispatch"));
    auto counts = kc::ReadNormalDispatchCounts(g.Context(r), g.stream(r));
    NM_ASSERT_OK(counts.status());
    EXPECT_EQ(counts->num_recv_tokens, 2 * T);
    EXPECT_EQ(counts->rank_prefix, (std::vector<int32_t>{0, T}));
    auto src_info = g.DownloadVector<int32_t>(r, layout.recv_src_info, 2 * T);
    NM_ASSERT_OK(src_info.status());
    for (int32_t row = 0; row < 2 * T; ++row) ASSERT_EQ((*src_info)[row], row) << "row " << row;
    ASSERT_EQ(cudaMemset(bad, 0, sizeof(unsigned long long)), cudaSuccess);
    CheckRecvPattern<<<2048, 256>>>(g.At<bf16_bits>(r, layout.recv_x),
                                    g.At<int32_t>(r, layout.recv_src_info), 2 * T, H, T, bad);
    unsigned long long host_bad = 1;
    ASSERT_EQ(cudaMemcpy(&host_bad, bad, sizeof(host_bad), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(host_bad, 0u) << "rank " << r << ": recv_x values differ from their source rows";
  }
  // Combine: every rank's in_combine_x rows hold pattern(r, row, c); token t of rank s sums
  // rows send_pos[t, 0] of rank 0 and send_pos[t, 1] of rank 1 (exact small integers).
  for (int32_t r = 0; r < 2; ++r) {
    FillPattern<<<1024, 256, 0, g.stream(r)>>>(g.At<bf16_bits>(r, layout.in_combine_x), r, 2 * T,
                                               H);
  }
  NM_ASSERT_OK(g.LaunchAll(
      [&](int32_t r, cudaStream_t s) { return kc::NormalCombine(g.Context(r), {}, s); }));
  NM_ASSERT_OK(g.SynchronizeAll());
  for (int32_t r = 0; r < 2; ++r) {
    NM_ASSERT_OK(kc::ReadAndClearStatus(g.Context(r), g.stream(r), "NormalCombine"));
    ASSERT_EQ(cudaMemset(bad, 0, sizeof(unsigned long long)), cudaSuccess);
    CheckCombinedPattern<<<2048, 256>>>(g.At<bf16_bits>(r, layout.combined_x),
                                        g.At<int32_t>(r, layout.send_pos), 2, T, H, bad);
    unsigned long long host_bad = 1;
    ASSERT_EQ(cudaMemcpy(&host_bad, bad, sizeof(host_bad), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(host_bad, 0u) << "rank " << r << ": combined_x differs from the pattern sums";
  }
  cudaFree(bad);
}

}  // namespace
}  // namespace epd::testing
