// GPU tests: the routing words the kernels read back from an endpoint's memory, which its
// client can rewrite through its CUDA IPC mapping (send_pos, the low-latency handle
// positions, the counts the ranks exchange in their sync regions), hold out-of-range values.
// Every such value is read once into a register and bound-checked: the op fails with
// DeviceStatus::bad_routing ("routing value(s) ... outside their buffers") instead of reading
// or writing outside the group's buffers. Each value is chosen so that an unchecked kernel
// would land exactly in a neighbour group's data area on the same GPU, which must stay
// byte-for-byte intact; the attacked group's next op is correct.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_normal.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/layout.h"
#include "kernels/cuda/common.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace epd::testing {
namespace {

namespace kc = epd::kernels::cuda;
using kernels::bf16_bits;
using kernels::GroupShape;
using kernels::Region;

#define RB_ASSERT_OK(expr)                      \
  do {                                          \
    const ::absl::Status rb_status_ = (expr);   \
    ASSERT_TRUE(rb_status_.ok()) << rb_status_; \
  } while (0)

constexpr uint8_t kCanary = 0x5A;

/// The whole data area of rank r of `g`.
Region Area(const VirtualRankGroup& g) { return Region{0, g.layout().total_bytes}; }

/// Fills every rank's data area of `g` with kCanary.
absl::Status FillCanary(VirtualRankGroup& g) {
  for (int32_t r = 0; r < g.num_ranks(); ++r) {
    EPD_CUDA_RETURN_IF_ERROR(cudaMemset(g.base(r), kCanary, g.layout().total_bytes));
  }
  return EPD_CUDA_STATUS(cudaDeviceSynchronize());
}

/// OK when every byte of every rank's area of `g` is still kCanary.
absl::Status CheckCanary(const VirtualRankGroup& g) {
  std::vector<uint8_t> want(g.layout().total_bytes, kCanary), got(want.size());
  for (int32_t r = 0; r < g.num_ranks(); ++r) {
    EPD_RETURN_IF_ERROR(g.Download(r, Area(g), got.data(), got.size()));
    EPD_RETURN_IF_ERROR(
        CompareBytes(want.data(), got.data(), got.size(), absl::StrCat("neighbour rank ", r)));
  }
  return absl::OkStatus();
}

/// The row of `row_bytes`-byte rows from `region_start` whose row lies in the middle of the
/// neighbour's rank-0 area: what an unchecked kernel would write or read there. When that
/// row does not fit an int32 (the allocations are far apart), a huge row instead.
int32_t RowIntoNeighbour(const uint8_t* region_start, int64_t row_bytes,
                         const VirtualRankGroup& neighbour) {
  const uint8_t* target = neighbour.base(0) + neighbour.layout().total_bytes / 2;
  const int64_t row =
      (reinterpret_cast<intptr_t>(target) - reinterpret_cast<intptr_t>(region_start)) / row_bytes;
  if (row <= 0 || row > std::numeric_limits<int32_t>::max()) return 1 << 30;
  return static_cast<int32_t>(row);
}

/// Each rank's status after its stream finished (read and cleared).
std::vector<absl::Status> Statuses(VirtualRankGroup& g, const char* op) {
  std::vector<absl::Status> out;
  for (int32_t r = 0; r < g.num_ranks(); ++r) {
    out.push_back(kc::ReadAndClearStatus(g.Context(r), g.stream(r), op));
  }
  return out;
}

void ExpectRoutingError(const absl::Status& st) {
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("routing value(s)"), std::string::npos) << st;
}

class RoutingBoundsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!HaveGpu(&why)) GTEST_SKIP() << why;
  }

  /// The attacked group and, allocated after it, its neighbour filled with kCanary.
  void Make(const GroupShape& shape) {
    auto g = VirtualRankGroup::Create(shape, /*timeout_ns=*/2'000'000'000);
    ASSERT_TRUE(g.ok()) << g.status();
    group_ = std::move(*g);
    auto n = VirtualRankGroup::Create(shape, /*timeout_ns=*/2'000'000'000);
    ASSERT_TRUE(n.ok()) << n.status();
    neighbour_ = std::move(*n);
    RB_ASSERT_OK(FillCanary(*neighbour_));
  }

  /// Uploads rank r's x [T, H], topk_idx [T, K] and weights, and T into both token slots.
  void Stage(int32_t r, int32_t T, std::mt19937_64& rng, int64_t one_expert = -1) {
    const GroupShape& s = group_->shape();
    const auto& l = group_->layout();
    const std::vector<bf16_bits> x = RandomBf16(static_cast<size_t>(T) * s.hidden, rng);
    RoutingOptions routing;
    routing.one_expert = one_expert;
    const std::vector<int64_t> idx = RandomTopk(T, s.num_topk, s.num_experts, routing, rng);
    const std::vector<float> w = RandomFloats(idx.size(), rng);
    RB_ASSERT_OK(group_->Upload(r, l.in_x, x.data(), x.size() * 2));
    RB_ASSERT_OK(group_->Upload(r, l.in_topk_idx, idx.data(), idx.size() * 8));
    RB_ASSERT_OK(group_->Upload(r, l.in_topk_weights, w.data(), w.size() * 4));
    const kc::CudaRankContext ctx = group_->Context(r);
    RB_ASSERT_OK(kc::SetNormalNumTokensAsync(ctx, T, group_->stream(r)));
    RB_ASSERT_OK(kc::SetLowLatencyNumTokensAsync(ctx, T, group_->stream(r)));
    RB_ASSERT_OK(group_->SynchronizeAll());
  }

  /// Launches `launch(ctx, stream)` on every rank; each rank's status of `op` once done.
  template <typename Launch>
  std::vector<absl::Status> Run(const char* op, Launch launch) {
    EXPECT_TRUE(
        group_
            ->LaunchAll([&](int32_t r, cudaStream_t st) { return launch(group_->Context(r), st); })
            .ok());
    return Statuses(*group_, op);
  }
  /// Normal dispatch (cached or not) on every rank; each rank's status.
  std::vector<absl::Status> Dispatch(bool cached) {
    kc::NormalDispatchArgs a;
    a.with_weights = false;
    a.cached = cached;
    return Run("Dispatch", [&](const kc::CudaRankContext& ctx, cudaStream_t st) {
      return kc::NormalDispatch(ctx, a, st);
    });
  }
  std::vector<absl::Status> Combine() {
    return Run("Combine", [](const kc::CudaRankContext& ctx, cudaStream_t st) {
      return kc::NormalCombine(ctx, {}, st);
    });
  }
  std::vector<absl::Status> LowLatencyDispatch(int32_t buffer) {
    kc::LowLatencyDispatchArgs a;
    a.buffer = buffer;
    return Run("LowLatencyDispatch", [&](const kc::CudaRankContext& ctx, cudaStream_t st) {
      return kc::LowLatencyDispatch(ctx, a, st);
    });
  }
  std::vector<absl::Status> LowLatencyCombine(int32_t buffer) {
    kc::LowLatencyCombineArgs a;
    a.buffer = buffer;
    return Run("LowLatencyCombine", [&](const kc::CudaRankContext& ctx, cudaStream_t st) {
      return kc::LowLatencyCombine(ctx, a, st);
    });
  }

  std::unique_ptr<VirtualRankGroup> group_;
  std::unique_ptr<VirtualRankGroup> neighbour_;
};

void ExpectAllOk(const std::vector<absl::Status>& statuses, const std::string& what) {
  for (size_t r = 0; r < statuses.size(); ++r) {
    EXPECT_TRUE(statuses[r].ok()) << what << " rank " << r << ": " << statuses[r];
  }
}

// send_pos, rewritten by the client between its dispatch and the cached re-dispatch and
// combine that read it as rows at every rank: rows past the receive capacity (one aimed at
// the neighbour's area) and below -1 are counted and skipped.
TEST_F(RoutingBoundsTest, RewrittenSendPosFailsCachedDispatchAndCombineAndMissesTheNeighbour) {
  const GroupShape shape{2, 4, 256, 2, 16, 0, false};
  ASSERT_NO_FATAL_FAILURE(Make(shape));
  std::mt19937_64 rng(21);
  const int32_t T = 12, R = shape.num_ranks;
  for (int32_t r = 0; r < R; ++r) ASSERT_NO_FATAL_FAILURE(Stage(r, T, rng));
  ExpectAllOk(Dispatch(false), "dispatch");

  const auto& l = group_->layout();
  auto pos = group_->DownloadVector<int32_t>(0, l.send_pos, static_cast<size_t>(T) * R);
  ASSERT_TRUE(pos.ok()) << pos.status();
  std::vector<int32_t> bad = *pos;
  const int64_t row_bytes = 2 * int64_t{shape.hidden};
  int rewritten = 0;
  for (int32_t t = 0; t < T; ++t) {
    for (int32_t r = 0; r < R; ++r) {
      int32_t& p = bad[static_cast<size_t>(t) * R + r];
      if (p < 0) continue;
      // Rank r's recv_x row that would be rank 0 of the neighbour; then other bad rows.
      p = rewritten % 3 == 0
              ? RowIntoNeighbour(group_->base(r) + l.recv_x.offset, row_bytes, *neighbour_)
              : (rewritten % 3 == 1 ? static_cast<int32_t>(shape.max_recv_tokens()) : -7);
      ++rewritten;
    }
  }
  ASSERT_GE(rewritten, 3);
  RB_ASSERT_OK(group_->Upload(0, l.send_pos, bad.data(), bad.size() * 4));

  std::vector<absl::Status> cached = Dispatch(true);
  ExpectRoutingError(cached[0]);
  EXPECT_NE(cached[0].message().find(absl::StrCat(rewritten, " routing value(s)")),
            std::string::npos)
      << cached[0];
  EXPECT_TRUE(cached[1].ok()) << cached[1];
  RB_ASSERT_OK(CheckCanary(*neighbour_));

  std::vector<absl::Status> combined = Combine();
  ExpectRoutingError(combined[0]);
  EXPECT_TRUE(combined[1].ok()) << combined[1];
  RB_ASSERT_OK(CheckCanary(*neighbour_));

  // A fresh dispatch rewrites send_pos; then everything works.
  ExpectAllOk(Dispatch(false), "dispatch after");
  ExpectAllOk(Dispatch(true), "cached dispatch after");
  ExpectAllOk(Combine(), "combine after");
  auto fresh = group_->DownloadVector<int32_t>(0, l.send_pos, static_cast<size_t>(T) * R);
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(*fresh, *pos);
  RB_ASSERT_OK(CheckCanary(*neighbour_));
}

// The low-latency handle positions, rewritten by the client between the dispatch and the
// combine that reads them as rows of its peers' expert outputs.
TEST_F(RoutingBoundsTest, RewrittenHandlePositionsFailTheLowLatencyCombine) {
  const GroupShape shape{2, 4, 256, 2, 1, 8, false};
  ASSERT_NO_FATAL_FAILURE(Make(shape));
  std::mt19937_64 rng(22);
  const int32_t T = 6, K = shape.num_topk;
  for (int32_t r = 0; r < shape.num_ranks; ++r) ASSERT_NO_FATAL_FAILURE(Stage(r, T, rng));
  ExpectAllOk(LowLatencyDispatch(0), "dispatch");
  const auto& l = group_->layout();
  auto pos = group_->DownloadVector<int32_t>(1, l.ll_handle_pos[0], static_cast<size_t>(T) * K);
  ASSERT_TRUE(pos.ok()) << pos.status();
  std::vector<int32_t> bad = *pos;
  int rewritten = 0;
  for (int32_t& p : bad) {
    if (p < 0) continue;
    p = rewritten++ % 2 == 0 ? static_cast<int32_t>(shape.ll_rows_per_expert()) : (1 << 30);
  }
  ASSERT_GE(rewritten, 2);
  RB_ASSERT_OK(group_->Upload(1, l.ll_handle_pos[0], bad.data(), bad.size() * 4));
  std::vector<absl::Status> combined = LowLatencyCombine(0);
  EXPECT_TRUE(combined[0].ok()) << combined[0];
  ExpectRoutingError(combined[1]);
  EXPECT_NE(combined[1].message().find(absl::StrCat(rewritten, " routing value(s)")),
            std::string::npos)
      << combined[1];
  RB_ASSERT_OK(CheckCanary(*neighbour_));
  ExpectAllOk(LowLatencyDispatch(1), "dispatch after");
  ExpectAllOk(LowLatencyCombine(1), "combine after");
}

// A peer's counts in the sync region (written by the peer's kernel, or by a client through
// its IPC mapping) give the first row of this rank in each expert's block: a count that
// puts the rows outside the block (here: into the neighbour's area) is caught per row.
// Rank 0's part of the exchange is written from the host, as a hostile rank 0 would.
TEST_F(RoutingBoundsTest, PeerCountsOutsideTheExpertBlockFailTheLowLatencyDispatch) {
  const GroupShape shape{2, 4, 256, 2, 1, 8, false};
  ASSERT_NO_FATAL_FAILURE(Make(shape));
  std::mt19937_64 rng(23);
  const int32_t T = 4, R = shape.num_ranks, E = shape.num_experts;
  constexpr int64_t kExpert = 1;  // Local expert 1 of rank 0: every token of rank 1 goes there.
  ASSERT_NO_FATAL_FAILURE(Stage(1, T, rng, kExpert));
  const auto& l = group_->layout();
  const int64_t row_bytes = 2 * int64_t{shape.hidden};
  const uint8_t* block =
      group_->base(0) + l.ll_recv_x[0].offset +
      kExpert % shape.num_local_experts() * shape.ll_rows_per_expert() * row_bytes;
  std::vector<int32_t> counts(E, 0);
  counts[kExpert] = RowIntoNeighbour(block, row_bytes, *neighbour_);
  // Rank 1's first dispatch has seq 1 (parity 1); rank 0's counts and both of its flags.
  using Exchange = kc::device::LowLatencyExchange;
  uint8_t* exchange = group_->base(1) + l.sync.offset + kc::kSyncLowLatencyExchangeOffset;
  const uint32_t seq = 1;
  RB_ASSERT_OK(EPD_CUDA_STATUS(cudaMemcpy(exchange + Exchange::Counts(1, 0, R, E), counts.data(),
                                          counts.size() * 4, cudaMemcpyHostToDevice)));
  RB_ASSERT_OK(EPD_CUDA_STATUS(
      cudaMemcpy(exchange + Exchange::CountFlag(0), &seq, 4, cudaMemcpyHostToDevice)));
  RB_ASSERT_OK(EPD_CUDA_STATUS(
      cudaMemcpy(exchange + Exchange::DataFlag(0), &seq, 4, cudaMemcpyHostToDevice)));
  kc::LowLatencyDispatchArgs a;
  a.buffer = 0;
  RB_ASSERT_OK(kc::LowLatencyDispatch(group_->Context(1), a, group_->stream(1)));
  absl::Status st =
      kc::ReadAndClearStatus(group_->Context(1), group_->stream(1), "LowLatencyDispatch");
  ExpectRoutingError(st);
  EXPECT_NE(st.message().find(absl::StrCat(T, " routing value(s)")), std::string::npos) << st;
  RB_ASSERT_OK(CheckCanary(*neighbour_));

  // Both ranks' low-latency state reset, the group works again.
  for (int32_t r = 0; r < R; ++r) {
    RB_ASSERT_OK(kc::ResetLowLatencySync(group_->Context(r), group_->stream(r)));
    ASSERT_NO_FATAL_FAILURE(Stage(r, T, rng));
  }
  ExpectAllOk(LowLatencyDispatch(0), "dispatch after");
  ExpectAllOk(LowLatencyCombine(0), "combine after");
  RB_ASSERT_OK(CheckCanary(*neighbour_));
}

}  // namespace
}  // namespace epd::testing
