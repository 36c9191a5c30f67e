// Small gtest-side helpers of the GPU tests that read results back (header-only: the
// benchmark also compiles gpu_test_util.cc and links no gtest).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace epd::testing {

/// `bytes` bytes at byte `offset` of device or host memory `p`, copied to the host (a
/// failed copy is a test failure and leaves zeros).
inline std::vector<uint8_t> Fetch(const void* p, size_t offset, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  if (bytes == 0) return out;
  const cudaError_t err =
      cudaMemcpy(out.data(), static_cast<const uint8_t*>(p) + offset, bytes, cudaMemcpyDefault);
  EXPECT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
  return out;
}

/// The bytes of `count` values of T at host address `p`.
template <typename T>
std::vector<uint8_t> Bytes(const T* p, size_t count) {
  const auto* b = reinterpret_cast<const uint8_t*>(p);
  return std::vector<uint8_t>(b, b + count * sizeof(T));
}

/// Ends a stream capture still open when it goes out of scope (a failed assertion between
/// cudaStreamBeginCapture and cudaStreamEndCapture returns early): the graph is discarded
/// and the error cleared, so later tests see a usable stream.
class EndCaptureOnExit {
 public:
  explicit EndCaptureOnExit(cudaStream_t stream) : stream_(stream) {}
  ~EndCaptureOnExit() {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream_, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone) {
      cudaGraph_t g = nullptr;
      cudaStreamEndCapture(stream_, &g);
      if (g != nullptr) cudaGraphDestroy(g);
    }
    cudaGetLastError();
  }
  EndCaptureOnExit(const EndCaptureOnExit&) = delete;
  EndCaptureOnExit& operator=(const EndCaptureOnExit&) = delete;

 private:
  cudaStream_t stream_;
};

}  // namespace epd::testing
