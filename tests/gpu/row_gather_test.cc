// The CUDA row gather and FP8 row quantization of the CUDA backend across nodes (DESIGN.md
// §5.5 "Rows on the GPU"; epd/kernels/cuda_gather.h) against their host references
// (kernels::host::GatherRows, QuantizeRowFp8), byte for byte: both scale layouts and
// UE8M0, counts past a block's capacity and negative, rows without a source, sources read
// through a window from the GPU memory they mirror; quantized rows with NaN, infinities,
// zeros and hidden sizes that are not multiples of 128 or of 4. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/cuda/device_alloc.h"
#include "epd/kernels/cuda_gather.h"
#include "epd/kernels/host_node_ops.h"
#include "epd/kernels/host_ops.h"
#include "epd/kernels/types.h"
#include "tests/gpu/gpu_test_util.h"

namespace epd {
namespace {

namespace kc = kernels::cuda;
constexpr unsigned kMapped = cudaHostAllocPortable | cudaHostAllocMapped;

kernels::GroupShape Shape(int hidden) {
  kernels::GroupShape s;
  s.num_ranks = 4;
  s.num_experts = 8;
  s.hidden = hidden;
  s.num_topk = 2;
  s.max_tokens_per_rank = 16;
  s.ll_max_tokens_per_rank = 6;
  return s;
}

TEST(RowGatherGpuTest, QuantizedRowsMatchTheHostBitForBit) {
  std::string why;
  if (!testing::HaveGpu(&why)) GTEST_SKIP() << why;
  for (const int hidden : {7168, 200, 202}) {
    for (const bool round_scale : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "hidden " << hidden << " round_scale " << round_scale);
      const kernels::GroupShape s = Shape(hidden);
      const int rows = 37, S = s.num_scales();
      std::mt19937 rng(hidden + round_scale);
      std::normal_distribution<float> dist(0.0f, 3.0f);
      std::vector<kernels::bf16_bits> x(static_cast<size_t>(rows) * hidden);
      for (auto& v : x) v = kernels::FloatToBf16(dist(rng));
      // Row 1 all zero, row 2 with NaN and infinities, row 3 all NaN, row 4 huge values.
      std::fill(x.begin() + hidden, x.begin() + 2 * hidden, kernels::FloatToBf16(0.0f));
      x[2 * hidden + 5] = kernels::FloatToBf16(std::numeric_limits<float>::quiet_NaN());
      x[2 * hidden + 130 % hidden] = kernels::FloatToBf16(std::numeric_limits<float>::infinity());
      x[2 * hidden + 7] = kernels::FloatToBf16(-std::numeric_limits<float>::infinity());
      std::fill(x.begin() + 3 * hidden, x.begin() + 4 * hidden,
                kernels::FloatToBf16(std::numeric_limits<float>::quiet_NaN()));
      for (int h = 0; h < hidden; ++h) x[4 * hidden + h] = kernels::FloatToBf16(1e30f * (h - 50));
      auto dx = testing::DeviceBuffer::Allocate(x.size() * 2);
      auto out = AllocatePinnedArray<kernels::e4m3_bits>(x.size(), kMapped);
      auto scales = AllocatePinnedArray<float>(static_cast<size_t>(rows) * S, kMapped);
      auto out_copy = testing::DeviceBuffer::Allocate(x.size());
      auto scales_copy = testing::DeviceBuffer::Allocate(static_cast<size_t>(rows) * S * 4);
      ASSERT_TRUE(dx.ok() && out.ok() && scales.ok() && out_copy.ok() && scales_copy.ok());
      ASSERT_EQ(cudaMemcpy(dx->get(), x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      auto stream = testing::CudaStream::Create();
      ASSERT_TRUE(stream.ok());
      absl::Status st = kc::QuantizeRowsFp8Async(
          s, rows, reinterpret_cast<const kernels::bf16_bits*>(dx->get()), round_scale, out->get(),
          scales->get(), stream->get(), reinterpret_cast<kernels::e4m3_bits*>(out_copy->get()),
          reinterpret_cast<float*>(scales_copy->get()));
      ASSERT_TRUE(st.ok()) << st;
      ASSERT_EQ(cudaStreamSynchronize(stream->get()), cudaSuccess);
      // The device copy holds the same bytes.
      std::vector<kernels::e4m3_bits> copy(x.size());
      std::vector<float> copy_scales(static_cast<size_t>(rows) * S);
      ASSERT_EQ(cudaMemcpy(copy.data(), out_copy->get(), copy.size(), cudaMemcpyDeviceToHost),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(copy_scales.data(), scales_copy->get(), copy_scales.size() * 4,
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
      EXPECT_EQ(std::memcmp(copy.data(), out->get(), copy.size()), 0);
      EXPECT_EQ(std::memcmp(copy_scales.data(), scales->get(), copy_scales.size() * 4), 0);
      std::vector<kernels::e4m3_bits> want(static_cast<size_t>(hidden));
      std::vector<float> want_scales(static_cast<size_t>(S));
      for (int r = 0; r < rows; ++r) {
        kernels::host::QuantizeRowFp8(x.data() + static_cast<size_t>(r) * hidden, hidden,
                                      round_scale, want.data(), want_scales.data());
        ASSERT_EQ(std::memcmp(want.data(), out->get() + static_cast<size_t>(r) * hidden, hidden), 0)
            << "row " << r;
        ASSERT_EQ(std::memcmp(want_scales.data(), scales->get() + static_cast<size_t>(r) * S,
                              sizeof(float) * S),
                  0)
            << "scales of row " << r;
      }
    }
  }
}

TEST(RowGatherGpuTest, GatheredRowsMatchTheHostReference) {
  std::string why;
  if (!testing::HaveGpu(&why)) GTEST_SKIP() << why;
  const kernels::GroupShape s = Shape(1024);  // H % 512 == 0: UE8M0 too.
  const int S = s.num_scales(), El = s.num_local_experts();
  const int64_t rpe = s.ll_rows_per_expert();
  const int64_t row_bytes = s.hidden;  // e4m3 rows.
  const int src_rows = 40;
  // Sources: half in host-mapped memory read in place, half in a "mirror" whose window
  // points at device memory holding the real bytes (the mirror itself holds 0xEE).
  std::mt19937 rng(9);
  std::vector<uint8_t> bytes(static_cast<size_t>(src_rows) * row_bytes);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  std::vector<float> sc(static_cast<size_t>(src_rows) * S);
  for (auto& v : sc) v = std::ldexp(1.0f, static_cast<int>(rng() % 20) - 10);
  auto host_rows = AllocatePinnedArray<uint8_t>(bytes.size(), kMapped);
  auto host_scales = AllocatePinnedArray<float>(sc.size(), kMapped);
  auto mirror_rows = AllocatePinnedArray<uint8_t>(bytes.size(), kMapped);
  auto mirror_scales = AllocatePinnedArray<float>(sc.size(), kMapped);
  auto dev_rows = testing::DeviceBuffer::Allocate(bytes.size());
  auto dev_scales = testing::DeviceBuffer::Allocate(sc.size() * 4);
  ASSERT_TRUE(host_rows.ok() && host_scales.ok() && mirror_rows.ok() && mirror_scales.ok() &&
              dev_rows.ok() && dev_scales.ok());
  std::memcpy(host_rows->get(), bytes.data(), bytes.size());
  std::memcpy(host_scales->get(), sc.data(), sc.size() * 4);
  std::memset(mirror_rows->get(), 0xEE, bytes.size());
  std::memset(mirror_scales->get(), 0xEE, sc.size() * 4);
  ASSERT_EQ(cudaMemcpy(dev_rows->get(), bytes.data(), bytes.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev_scales->get(), sc.data(), sc.size() * 4, cudaMemcpyHostToDevice),
            cudaSuccess);
  auto windows = AllocatePinnedArray<kc::GatherWindow>(kc::kMaxGatherWindows, kMapped);
  ASSERT_TRUE(windows.ok());
  windows->get()[0] = {mirror_rows->get(), bytes.size(), dev_rows->get()};
  windows->get()[1] = {reinterpret_cast<const uint8_t*>(mirror_scales->get()), sc.size() * 4,
                       dev_scales->get()};
  auto stream = testing::CudaStream::Create();
  ASSERT_TRUE(stream.ok());

  const int64_t table_rows = kernels::RowSourceRows(s);
  for (const kernels::GatherScales kind :
       {kernels::GatherScales::kNone, kernels::GatherScales::kRows,
        kernels::GatherScales::kLowLatency, kernels::GatherScales::kLowLatencyUe8m0}) {
    SCOPED_TRACE(::testing::Message() << "scales kind " << static_cast<int>(kind));
    const bool ll = kind == kernels::GatherScales::kLowLatency ||
                    kind == kernels::GatherScales::kLowLatencyUe8m0;
    const int32_t blocks = ll ? El : 1;
    const int64_t block_rows = ll ? rpe : s.max_recv_tokens();
    auto sources =
        AllocatePinnedArray<kernels::RowSource>(static_cast<size_t>(table_rows), kMapped);
    auto counts = AllocatePinnedArray<int32_t>(static_cast<size_t>(blocks), kMapped);
    ASSERT_TRUE(sources.ok() && counts.ok());
    // The host reference reads the real bytes where the GPU reads through the window.
    std::vector<kernels::RowSource> ref_sources(static_cast<size_t>(table_rows));
    for (int32_t b = 0; b < blocks; ++b) {
      counts->get()[b] = b == 0   ? static_cast<int32_t>(block_rows) + 5  // Clamped.
                         : b == 1 ? -3                                    // None.
                                  : static_cast<int32_t>(rng() % (block_rows + 1));
      for (int64_t i = 0; i < block_rows; ++i) {
        const int64_t row = b * block_rows + i;
        const int src = static_cast<int>(rng() % src_rows);
        const bool none = rng() % 7 == 0, mirrored = rng() % 2 == 0;
        const size_t xo = static_cast<size_t>(src) * row_bytes, so = static_cast<size_t>(src) * S;
        sources->get()[row] =
            none ? kernels::RowSource{}
                 : kernels::RowSource{(mirrored ? mirror_rows->get() : host_rows->get()) + xo,
                                      (mirrored ? mirror_scales->get() : host_scales->get()) + so};
        ref_sources[row] =
            none ? kernels::RowSource{} : kernels::RowSource{bytes.data() + xo, sc.data() + so};
      }
    }
    const size_t out_rows = static_cast<size_t>(blocks * block_rows);
    const size_t scale_bytes = ll ? static_cast<size_t>(El) * S * rpe * 4 : out_rows * S * 4;
    auto dx = testing::DeviceBuffer::Allocate(out_rows * row_bytes);
    auto ds = testing::DeviceBuffer::Allocate(scale_bytes);
    ASSERT_TRUE(dx.ok() && ds.ok());
    ASSERT_EQ(cudaMemset(dx->get(), 0x5A, out_rows * row_bytes), cudaSuccess);
    ASSERT_EQ(cudaMemset(ds->get(), 0x5A, scale_bytes), cudaSuccess);
    std::vector<uint8_t> want_x(out_rows * row_bytes, 0x5A), want_s(scale_bytes, 0x5A);
    kernels::RowGather g;
    g.row_bytes = row_bytes;
    g.blocks = blocks;
    g.block_rows = block_rows;
    g.counts = counts->get();
    g.scales_kind = kind;
    g.x = want_x.data();
    g.scales = want_s.data();
    g.sources = ref_sources.data();
    kernels::host::GatherRows(s, g);
    g.x = dx->get();
    g.scales = ds->get();
    g.sources = sources->get();
    absl::Status st = kc::GatherRowsAsync(s, g, windows->get(), 2, stream->get());
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_EQ(cudaStreamSynchronize(stream->get()), cudaSuccess);
    std::vector<uint8_t> got_x(want_x.size()), got_s(want_s.size());
    ASSERT_EQ(cudaMemcpy(got_x.data(), dx->get(), got_x.size(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got_s.data(), ds->get(), got_s.size(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(got_x, want_x);
    EXPECT_EQ(got_s, want_s);
  }
  // Bad arguments are refused before a launch.
  kernels::RowGather bad;
  bad.blocks = kc::kMaxGatherBlocks + 1;
  EXPECT_EQ(kc::GatherRowsAsync(s, bad, nullptr, 0, stream->get()).code(),
            absl::StatusCode::kInvalidArgument);
  bad.blocks = 1;
  EXPECT_EQ(kc::GatherRowsAsync(s, bad, nullptr, 0, stream->get()).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace epd
