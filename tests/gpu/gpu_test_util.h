// Shared harness of the GPU tests and the CUDA benchmarks: R "virtual ranks" of one group on
// the current GPU (one cudaMalloc'd data area per rank laid out by EndpointLayout, a device
// array of every rank's base, one stream per rank), RAII wrappers for device memory and
// streams, random inputs, and byte-exact comparison helpers.
//
// Needs a CUDA device; tests call RequireGpu() first (GTEST_SKIP with a reason otherwise).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/layout.h"
#include "epd/kernels/types.h"

// ASSERT (gtest) that an absl::Status is OK; more context can be streamed with <<.
#define EPD_ASSERT_OK(expr)                                 \
  for (const ::absl::Status epd_s_ = (expr); !epd_s_.ok();) \
  GTEST_FAIL() << #expr << ": " << epd_s_ << " "

// Skips the (gtest) test with the reason when no CUDA device is usable.
#define REQUIRE_GPU()                                        \
  do {                                                       \
    std::string why;                                         \
    if (!::epd::testing::HaveGpu(&why)) GTEST_SKIP() << why; \
  } while (0)

namespace epd::testing {

/// True when a CUDA device is usable; `reason` says why not otherwise.
bool HaveGpu(std::string* reason);

/// One cudaMalloc'd device allocation, freed on destruction. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  /// Allocates `bytes` on the current device (zero-filled). Errors: INTERNAL from CUDA.
  static absl::StatusOr<DeviceBuffer> Allocate(size_t bytes);
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  uint8_t* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  uint8_t* ptr_ = nullptr;
  size_t bytes_ = 0;
};

/// One non-blocking CUDA stream, destroyed on destruction. Move-only.
class CudaStream {
 public:
  CudaStream() = default;
  static absl::StatusOr<CudaStream> Create();
  CudaStream(CudaStream&& other) noexcept;
  CudaStream& operator=(CudaStream&& other) noexcept;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  ~CudaStream();

  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

/// R virtual ranks of one group on the current GPU: what the daemon builds across GPUs
/// (one data area per rank + peer bases), in one process.
class VirtualRankGroup {
 public:
  /// Allocates R zeroed data areas of EndpointLayout::Compute(shape).total_bytes, the
  /// device peer_bases array and R streams. `timeout_ns` and `num_sms` /
  /// `ranks_on_device` go into every rank's CudaRankContext (0 = defaults).
  static absl::StatusOr<std::unique_ptr<VirtualRankGroup>> Create(
      const kernels::GroupShape& shape, int64_t timeout_ns = 5'000'000'000, int32_t num_sms = 0,
      int32_t ranks_on_device = 0);

  const kernels::GroupShape& shape() const { return shape_; }
  const kernels::EndpointLayout& layout() const { return layout_; }
  int32_t num_ranks() const { return shape_.num_ranks; }
  /// Device base of rank r's data area.
  uint8_t* base(int32_t r) const { return areas_[r].get(); }
  /// Device address of `region` in rank r's area, as T*.
  template <typename T>
  T* At(int32_t r, const kernels::Region& region) const {
    return reinterpret_cast<T*>(base(r) + region.offset);
  }
  cudaStream_t stream(int32_t r) const { return streams_[r].get(); }
  /// The CudaRankContext of rank r (peer_bases = the device array of all R bases).
  kernels::cuda::CudaRankContext Context(int32_t r) const;
  /// Sets CudaRankContext::all_ranks_on_device in every later Context (default false: the
  /// kernels' .sys-scope flags; true: .gpu scope, correct here since all ranks share a GPU).
  void set_all_ranks_on_device(bool v) { all_ranks_on_device_ = v; }

  /// Synchronous copy of `bytes` from host `src` into rank r's `region` (at byte
  /// `offset` inside it). INVALID_ARGUMENT when it would leave the region.
  absl::Status Upload(int32_t r, const kernels::Region& region, const void* src, size_t bytes,
                      size_t offset = 0);
  /// Synchronous copy out of rank r's `region`.
  absl::Status Download(int32_t r, const kernels::Region& region, void* dst, size_t bytes,
                        size_t offset = 0) const;
  /// Downloads `count` elements of T from the start of rank r's region.
  template <typename T>
  absl::StatusOr<std::vector<T>> DownloadVector(int32_t r, const kernels::Region& region,
                                                size_t count) const {
    std::vector<T> v(count);
    absl::Status s = Download(r, region, v.data(), count * sizeof(T));
    if (!s.ok()) return s;
    return v;
  }

  /// Calls `launch(r, stream(r))` for every rank in order (each enqueues its rank's work on
  /// its own stream), stopping at the first error.
  absl::Status LaunchAll(const std::function<absl::Status(int32_t, cudaStream_t)>& launch);
  /// Waits for every rank's stream. Errors: the first CUDA error.
  absl::Status SynchronizeAll();

 private:
  VirtualRankGroup() = default;
  kernels::GroupShape shape_;
  kernels::EndpointLayout layout_;
  std::vector<DeviceBuffer> areas_;
  DeviceBuffer peer_bases_;  // [R] uint8_t*
  std::vector<CudaStream> streams_;
  int64_t timeout_ns_ = 0;
  int32_t num_sms_ = 0;
  int32_t ranks_on_device_ = 0;
  bool all_ranks_on_device_ = false;
};

/// Rank r's launch_flags word at byte `offset` (proto/abi/launch_flags.h: ready_seq,
/// done_seq, ...), as a device uint64*.
uint64_t* LaunchFlag(VirtualRankGroup& g, int32_t r, uint64_t offset);

/// The KernelHandoff the daemon gives rank r's low-latency op `seq` (launched
/// programmatically behind its ready wait): ready_seq >= seq, then done_seq = seq, the
/// launch_flags words of rank r.
kernels::cuda::KernelHandoff DaemonHandoff(VirtualRankGroup& g, int32_t r, uint64_t seq);

/// One uint64 of device memory, read synchronously (0 when the copy fails).
uint64_t ReadWord(const void* device_word);

// ---- random inputs ------------------------------------------------------------------------

/// `n` bf16 values ~ N(0, stddev) rounded to bf16 (finite, no NaN).
std::vector<kernels::bf16_bits> RandomBf16(size_t n, std::mt19937_64& rng, float stddev = 1.0f);
/// `n` f32 values uniform in [lo, hi).
std::vector<float> RandomFloats(size_t n, std::mt19937_64& rng, float lo = 0.0f, float hi = 1.0f);

/// How RandomTopk routes tokens.
struct RoutingOptions {
  double masked_fraction = 0.0;     ///< Probability that an entry is -1.
  int64_t one_expert = -1;          ///< >= 0: every unmasked entry is this expert (hot expert).
  double duplicate_fraction = 0.0;  ///< Probability an entry repeats an earlier one of its row.
};

/// topk_idx [T, K] int64: distinct experts per row drawn uniformly from [0, E) (K <= E),
/// then masked / duplicated / all-to-one per `options`.
std::vector<int64_t> RandomTopk(int32_t num_tokens, int32_t num_topk, int32_t num_experts,
                                const RoutingOptions& options, std::mt19937_64& rng);

/// Byte-exact comparison: OK, or INTERNAL naming `what`, the first differing byte index
/// and both values (and how many bytes differ).
absl::Status CompareBytes(const void* expected, const void* actual, size_t bytes,
                          const std::string& what);

}  // namespace epd::testing
