// kernels::cuda::CopySpansAsync (epd/kernels/cuda_mirror.h), the CUDA backend's copies
// between a rank's GPU area and its pinned host-mapped mirror across nodes (DESIGN.md §5.5):
// ranges of odd and aligned offsets and lengths, one block and many, to the host with the
// mapped signal (polled by the host, as the engine does) and back to the device. Bytes
// outside the ranges stay untouched. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "common/cuda/device_alloc.h"
#include "epd/kernels/cuda_mirror.h"
#include "tests/gpu/gpu_test_util.h"

namespace epd {
namespace {

namespace kc = kernels::cuda;

TEST(MirrorCopyTest, RangesToTheHostWithTheSignalAndBack) {
  std::string why;
  if (!testing::HaveGpu(&why)) GTEST_SKIP() << why;
  constexpr size_t kBytes = 8 << 20;  // Several blocks' worth.
  std::mt19937_64 rng(3);
  std::vector<uint8_t> pattern(kBytes);
  for (auto& b : pattern) b = static_cast<uint8_t>(rng());
  auto device = testing::DeviceBuffer::Allocate(kBytes);
  ASSERT_TRUE(device.ok()) << device.status();
  ASSERT_EQ(cudaMemcpy(device->get(), pattern.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  constexpr unsigned kMapped = cudaHostAllocPortable | cudaHostAllocMapped;
  auto mirror = AllocatePinnedArray<uint8_t>(kBytes, kMapped);
  auto spans = AllocatePinnedArray<kernels::Region>(kernels::kMaxAreaSpans, kMapped);
  auto signal = AllocatePinnedArray<uint64_t>(1, kMapped);
  auto counter = AllocateDevice(256);
  ASSERT_TRUE(mirror.ok() && spans.ok() && signal.ok() && counter.ok());
  std::memset(mirror->get(), 0xA5, kBytes);
  // Aligned and odd ranges, a large one (many blocks), an empty one.
  const std::vector<kernels::Region> ranges = {
      {0, 4096}, {8192, 3}, {12289, 1000}, {65536, 5 << 20}, {(6 << 20) + 16, 0}, {7 << 20, 777}};
  uint64_t total = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    spans->get()[i] = ranges[i];
    total += ranges[i].bytes;
  }
  auto stream = testing::CudaStream::Create();
  ASSERT_TRUE(stream.ok());
  absl::Status st = kc::CopySpansAsync(
      mirror->get(), device->get(), spans->get(), static_cast<int32_t>(ranges.size()), total,
      reinterpret_cast<uint32_t*>(counter->get()), signal->get(), 42, stream->get());
  ASSERT_TRUE(st.ok()) << st;
  // The host sees the signal without synchronising, then every byte of the ranges.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (__atomic_load_n(signal->get(), __ATOMIC_ACQUIRE) != 42 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
  }
  ASSERT_EQ(__atomic_load_n(signal->get(), __ATOMIC_ACQUIRE), 42u);
  std::vector<uint8_t> expected(kBytes, 0xA5);
  for (const kernels::Region& r : ranges) {
    std::memcpy(expected.data() + r.offset, pattern.data() + r.offset, r.bytes);
  }
  EXPECT_EQ(std::memcmp(mirror->get(), expected.data(), kBytes), 0);
  ASSERT_EQ(cudaStreamSynchronize(stream->get()), cudaSuccess);
  uint32_t ticket = 1;
  ASSERT_EQ(cudaMemcpy(&ticket, counter->get(), 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(ticket, 0u) << "the counter word must be 0 after the copy";

  // Back: the host changes the mirror's ranges; the device gets exactly those.
  for (const kernels::Region& r : ranges) {
    for (uint64_t i = 0; i < r.bytes; ++i) mirror->get()[r.offset + i] ^= 0x5A;
  }
  st = kc::CopySpansAsync(device->get(), mirror->get(), spans->get(),
                          static_cast<int32_t>(ranges.size()), total, nullptr, nullptr, 0,
                          stream->get());
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_EQ(cudaStreamSynchronize(stream->get()), cudaSuccess);
  std::vector<uint8_t> back(kBytes);
  ASSERT_EQ(cudaMemcpy(back.data(), device->get(), kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
  std::vector<uint8_t> want = pattern;
  for (const kernels::Region& r : ranges) {
    for (uint64_t i = 0; i < r.bytes; ++i) want[r.offset + i] ^= 0x5A;
  }
  EXPECT_EQ(std::memcmp(back.data(), want.data(), kBytes), 0);

  // Errors: too many ranges; a signal after a multi-block copy without a counter.
  EXPECT_EQ(
      kc::CopySpansAsync(mirror->get(), device->get(), spans->get(), kernels::kMaxAreaSpans + 1,
                         total, nullptr, nullptr, 0, stream->get())
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kc::CopySpansAsync(mirror->get(), device->get(), spans->get(),
                               static_cast<int32_t>(ranges.size()), total, nullptr, signal->get(),
                               1, stream->get())
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace epd
