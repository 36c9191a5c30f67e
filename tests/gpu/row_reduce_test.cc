// The CUDA row reduce of the CUDA backend across nodes (DESIGN.md §5.5 "Rows on the GPU";
// epd/kernels/cuda_reduce.h) against its host reference (kernels::host::ReduceRows), byte
// for byte: weighted (low-latency) and not, with combined_topk_weights, hidden sizes that
// are not multiples of the kernel's 8 channels, rows and outputs not 16-byte aligned, empty
// slots between terms, terms read through a window from the GPU memory their mirror holds
// (the mirror itself holds 0xEE), sums that cancel (the f32 order shows), infinities, NaN,
// overflow and subnormal products. A NaN result is compared as a NaN (its sign and payload
// are the GPU's canonical one, the CPU keeps an operand's); every other result bit for bit.
// Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/cuda/device_alloc.h"
#include "epd/kernels/cuda_reduce.h"
#include "epd/kernels/host_node_ops.h"
#include "epd/kernels/types.h"
#include "tests/gpu/gpu_test_util.h"

namespace epd {
namespace {

namespace kc = kernels::cuda;
using kernels::bf16_bits;
constexpr unsigned kMapped = cudaHostAllocPortable | cudaHostAllocMapped;
constexpr float kInf = std::numeric_limits<float>::infinity();

bool IsNan(bf16_bits b) { return (b & 0x7fff) > 0x7f80; }

/// Source rows [rows, hidden]: mixed magnitudes, an eighth +-2^30 (cancelling sums show the
/// order), row 0 with infinities and a NaN, row 1 near the bf16 maximum (sums overflow),
/// row 2 subnormal.
std::vector<bf16_bits> SourceRows(std::mt19937& rng, int rows, int hidden) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<bf16_bits> v(static_cast<size_t>(rows) * hidden);
  for (auto& b : v) {
    const float big = rng() % 2 == 0 ? 0x1p30f : -0x1p30f;
    b = kernels::FloatToBf16(
        rng() % 8 == 0 ? big : dist(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 24) - 8));
  }
  v[0] = kernels::FloatToBf16(kInf);
  v[hidden / 2] = kernels::FloatToBf16(-kInf);
  v[hidden - 1] = kernels::FloatToBf16(std::numeric_limits<float>::quiet_NaN());
  for (int h = 0; h < hidden; ++h) {
    v[static_cast<size_t>(hidden) + h] = kernels::FloatToBf16(h % 2 ? 3.0e38f : -3.0e38f);
    v[static_cast<size_t>(2) * hidden + h] = kernels::FloatToBf16(1e-39f * (h % 5 - 2));
  }
  return v;
}

TEST(RowReduceGpuTest, ReducedRowsMatchTheHostReference) {
  std::string why;
  if (!testing::HaveGpu(&why)) GTEST_SKIP() << why;
  auto stream = testing::CudaStream::Create();
  ASSERT_TRUE(stream.ok());
  constexpr int kSrcRows = 24, kRows = 37;
  for (const int hidden : {7168, 202, 9}) {
    for (const int K : {1, 3, 8}) {
      for (const bool weighted : {false, true}) {
        for (const bool misaligned : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "hidden " << hidden << " K " << K << " weighted "
                                            << weighted << " misaligned output " << misaligned);
          kernels::GroupShape s;
          s.num_ranks = 2;
          s.num_experts = 8;
          s.hidden = hidden;
          s.num_topk = K;
          s.max_tokens_per_rank = kRows;
          s.ll_max_tokens_per_rank = kRows;
          std::mt19937 rng(hidden * 31 + K * 7 + weighted * 3 + misaligned);
          const std::vector<bf16_bits> x = SourceRows(rng, kSrcRows, hidden);
          std::vector<float> w(static_cast<size_t>(kSrcRows) * K);
          std::uniform_real_distribution<float> wd(-2.0f, 2.0f);
          for (auto& v : w) v = wd(rng);
          w[0] = kInf;
          const size_t xb = x.size() * 2, wb = w.size() * 4;
          // Half the rows are read in place from host-mapped memory (the peers' rows in the
          // receive region), half through a window from device memory (a local rank's area;
          // its mirror holds 0xEE).
          auto host_x = AllocatePinnedArray<bf16_bits>(x.size(), kMapped);
          auto host_w = AllocatePinnedArray<float>(w.size(), kMapped);
          auto mirror_x = AllocatePinnedArray<bf16_bits>(x.size(), kMapped);
          auto mirror_w = AllocatePinnedArray<float>(w.size(), kMapped);
          auto dev_x = testing::DeviceBuffer::Allocate(xb);
          auto dev_w = testing::DeviceBuffer::Allocate(wb);
          auto windows = AllocatePinnedArray<kc::GatherWindow>(kc::kMaxGatherWindows, kMapped);
          auto terms =
              AllocatePinnedArray<kernels::ReduceTerm>(static_cast<size_t>(kRows) * K, kMapped);
          ASSERT_TRUE(host_x.ok() && host_w.ok() && mirror_x.ok() && mirror_w.ok() && dev_x.ok() &&
                      dev_w.ok() && windows.ok() && terms.ok());
          std::memcpy(host_x->get(), x.data(), xb);
          std::memcpy(host_w->get(), w.data(), wb);
          std::memset(mirror_x->get(), 0xEE, xb);
          std::memset(mirror_w->get(), 0xEE, wb);
          ASSERT_EQ(cudaMemcpy(dev_x->get(), x.data(), xb, cudaMemcpyHostToDevice), cudaSuccess);
          ASSERT_EQ(cudaMemcpy(dev_w->get(), w.data(), wb, cudaMemcpyHostToDevice), cudaSuccess);
          windows->get()[0] = {reinterpret_cast<const uint8_t*>(mirror_x->get()), xb, dev_x->get()};
          windows->get()[1] = {reinterpret_cast<const uint8_t*>(mirror_w->get()), wb, dev_w->get()};
          // The host reference reads the real bytes where the GPU reads through the window.
          std::vector<kernels::ReduceTerm> ref(static_cast<size_t>(kRows) * K);
          const float weights[] = {0.5f, -1.25f, 0.0f, -0.0f, 1e-30f, 3.0f, kInf};
          for (size_t i = 0; i < ref.size(); ++i) {
            // Row 0 starts with the source row of infinities and NaN, row 1 with two of
            // the row near the maximum (an overflow); elsewhere some slots are empty.
            const bool forced =
                i == 0 || (i == static_cast<size_t>(K) && K > 1) || i == static_cast<size_t>(K) + 1;
            if (!forced && rng() % 5 == 0) {
              terms->get()[i] = ref[i] = kernels::ReduceTerm{};
              continue;
            }
            const size_t row = i == 0 ? 0 : forced ? 1 : rng() % kSrcRows;
            const bool mirrored = rng() % 2 == 0;
            const float weight = rng() % 3 == 0 ? weights[rng() % 7] : wd(rng);
            const bf16_bits* gx = (mirrored ? mirror_x->get() : host_x->get()) + row * hidden;
            const float* gw = (mirrored ? mirror_w->get() : host_w->get()) + row * K;
            const bool with_w = !weighted;
            terms->get()[i] = {gx, with_w ? gw : nullptr, weight};
            ref[i] = {x.data() + row * hidden, with_w ? w.data() + row * K : nullptr, weight};
          }
          const size_t out_elems = static_cast<size_t>(kRows) * hidden + 8;
          auto dout = testing::DeviceBuffer::Allocate(out_elems * 2);
          auto dout_w = testing::DeviceBuffer::Allocate(static_cast<size_t>(kRows) * K * 4);
          ASSERT_TRUE(dout.ok() && dout_w.ok());
          ASSERT_EQ(cudaMemset(dout->get(), 0x5A, out_elems * 2), cudaSuccess);
          ASSERT_EQ(cudaMemset(dout_w->get(), 0x5A, static_cast<size_t>(kRows) * K * 4),
                    cudaSuccess);
          std::vector<bf16_bits> want(out_elems, 0x5A5A);
          std::vector<float> want_w(static_cast<size_t>(kRows) * K);
          std::memset(want_w.data(), 0x5A, want_w.size() * 4);
          const int first = misaligned ? 1 : 0;  // Output rows 2 bytes past 16.
          kernels::RowReduce r;
          r.combined_x = want.data() + first;
          r.combined_topk_weights = weighted ? nullptr : want_w.data();
          r.rows = kRows;
          r.terms_per_row = K;
          r.terms = ref.data();
          r.weighted = weighted;
          kernels::host::ReduceRows(s, r);
          r.combined_x = reinterpret_cast<bf16_bits*>(dout->get()) + first;
          r.combined_topk_weights = weighted ? nullptr : reinterpret_cast<float*>(dout_w->get());
          r.terms = terms->get();
          absl::Status st = kc::ReduceRowsAsync(s, r, windows->get(), 2, stream->get());
          ASSERT_TRUE(st.ok()) << st;
          ASSERT_EQ(cudaStreamSynchronize(stream->get()), cudaSuccess);
          std::vector<bf16_bits> got(out_elems);
          std::vector<float> got_w(want_w.size());
          ASSERT_EQ(cudaMemcpy(got.data(), dout->get(), out_elems * 2, cudaMemcpyDeviceToHost),
                    cudaSuccess);
          ASSERT_EQ(
              cudaMemcpy(got_w.data(), dout_w->get(), got_w.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
          int mismatches = 0, nans = 0;
          for (size_t i = 0; i < out_elems; ++i) {
            if (IsNan(want[i]) && IsNan(got[i])) {
              ++nans;
              continue;
            }
            if (want[i] != got[i] && ++mismatches <= 5) {
              ADD_FAILURE() << "element " << i << " (row " << (i - first) / hidden << "): want 0x"
                            << std::hex << want[i] << ", got 0x" << got[i];
            }
          }
          EXPECT_EQ(mismatches, 0);
          EXPECT_GT(nans, 0);  // The NaN and inf - inf sums were there.
          for (size_t i = 0; i < want_w.size(); ++i) {
            const bool both_nan = std::isnan(want_w[i]) && std::isnan(got_w[i]);
            EXPECT_TRUE(both_nan || std::memcmp(&want_w[i], &got_w[i], 4) == 0)
                << "weight " << i << ": want " << want_w[i] << ", got " << got_w[i];
          }
        }
      }
    }
  }
}

TEST(RowReduceGpuTest, BadArgumentsAreRefusedBeforeALaunch) {
  std::string why;
  if (!testing::HaveGpu(&why)) GTEST_SKIP() << why;
  auto stream = testing::CudaStream::Create();
  ASSERT_TRUE(stream.ok());
  kernels::GroupShape s;
  s.num_ranks = 1;
  s.num_experts = 1;
  s.hidden = 16;
  s.num_topk = 2;
  kernels::RowReduce r;
  EXPECT_TRUE(kc::ReduceRowsAsync(s, r, nullptr, 0, stream->get()).ok());  // No rows.
  r.rows = -1;
  EXPECT_EQ(kc::ReduceRowsAsync(s, r, nullptr, 0, stream->get()).code(),
            absl::StatusCode::kInvalidArgument);
  r.rows = 1;
  r.terms_per_row = kc::kMaxReduceTerms + 1;
  EXPECT_EQ(kc::ReduceRowsAsync(s, r, nullptr, 0, stream->get()).code(),
            absl::StatusCode::kInvalidArgument);
  r.terms_per_row = 2;  // Null table and output.
  EXPECT_EQ(kc::ReduceRowsAsync(s, r, nullptr, 0, stream->get()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kc::ReduceRowsAsync(s, r, nullptr, kc::kMaxGatherWindows + 1, stream->get()).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace epd
