// Helpers shared by the CUDA benchmark sources (bench_cuda.h).
#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "common/cuda/device_alloc.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_ops.h"
#include "tests/bench/bench_cuda.h"
#include "tests/gpu/gpu_test_util.h"

namespace epd::bench {
namespace {

/// The three driver-API entry points the gate needs, resolved through the runtime
/// (cudaGetDriverEntryPointByVersion) instead of linking libcuda: epd_bench must start on
/// machines without the NVIDIA driver, where it runs only --backend=host.
struct DriverApi {
  CUresult (*wait_value32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int) = nullptr;
  CUresult (*write_value32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int) = nullptr;
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;

  static absl::StatusOr<const DriverApi*> Get() {
    static DriverApi api;
    static absl::Status status = [] {
      auto resolve = [](const char* name, void** fn) -> absl::Status {
        cudaDriverEntryPointQueryResult q{};
        EPD_CUDA_RETURN_IF_ERROR(
            cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &q));
        if (q != cudaDriverEntryPointSuccess || *fn == nullptr) {
          return absl::InternalError(absl::StrCat("driver entry point ", name, " not found"));
        }
        return absl::OkStatus();
      };
      EPD_RETURN_IF_ERROR(
          resolve("cuStreamWaitValue32", reinterpret_cast<void**>(&api.wait_value32)));
      EPD_RETURN_IF_ERROR(
          resolve("cuStreamWriteValue32", reinterpret_cast<void**>(&api.write_value32)));
      return resolve("cuGetErrorString", reinterpret_cast<void**>(&api.get_error_string));
    }();
    if (!status.ok()) return status;
    return &api;
  }
};

absl::Status DriverStatus(CUresult r, const char* call) {
  if (r == CUDA_SUCCESS) return absl::OkStatus();
  const char* msg = nullptr;
  if (auto api = DriverApi::Get(); api.ok()) (*api)->get_error_string(r, &msg);
  return absl::InternalError(absl::StrCat(call, " failed: ", msg != nullptr ? msg : "?"));
}

__global__ void FillWords(uint32_t* p, size_t n_words, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n_words;
       i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    // Keep bf16 halves (and f32 words) finite: clear the top exponent bit of each half.
    p[i] = (h * 2246822519u) & 0xbfffbfffu;
  }
}

}  // namespace

absl::Status FillPatternAsync(void* dst, size_t bytes, uint32_t seed, cudaStream_t stream) {
  if (bytes % 4 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("FillPatternAsync: bytes=", bytes, " is not a multiple of 4"));
  }
  if (bytes == 0) return absl::OkStatus();
  FillWords<<<1024, 256, 0, stream>>>(static_cast<uint32_t*>(dst), bytes / 4, seed);
  return EPD_CUDA_STATUS(cudaGetLastError());
}

void PrintFixedCostSplit(const char* bench, const char* mode, const char* op,
                         const std::string& device, const FixedCostSplit& f, bool json) {
  if (json) {
    std::printf(
        "{\"bench\":\"%s\",\"figure\":\"ll_fixed_cost\",\"mode\":\"%s\",\"op\":\"%s\","
        "\"device\":\"%s\",\"op_p50_us\":%.2f,\"t0_p50_us\":%.2f,\"memcpy_p50_us\":%.2f,"
        "\"data_us\":%.2f,\"data_over_memcpy\":%.3f}\n",
        bench, mode, op, device.c_str(), f.op_us, f.fixed_us, f.memcpy_us, f.data_us,
        f.data_over_memcpy);
  } else {
    std::printf(" %s op p50 %.2f, T=0 p50 %.2f, memcpy p50 %.2f: (op - T0) / memcpy %.2fx;", op,
                f.op_us, f.fixed_us, f.memcpy_us, f.data_over_memcpy);
  }
}

absl::StatusOr<Percentiles> TimeDeviceCopy(size_t bytes, int warmup, int iterations) {
  using ::epd::testing::CudaStream;
  using ::epd::testing::DeviceBuffer;
  EPD_ASSIGN_OR_RETURN(DeviceBuffer src, DeviceBuffer::Allocate(bytes));
  EPD_ASSIGN_OR_RETURN(DeviceBuffer dst, DeviceBuffer::Allocate(bytes));
  EPD_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
  cudaEvent_t a = nullptr, b = nullptr;
  EPD_CUDA_RETURN_IF_ERROR(cudaEventCreate(&a));
  absl::Status st = EPD_CUDA_STATUS(cudaEventCreate(&b));
  std::vector<double> us;
  for (int it = 0; it < warmup + iterations && st.ok(); ++it) {
    st.Update(EPD_CUDA_STATUS(cudaEventRecord(a, stream.get())));
    if (st.ok()) {
      st.Update(EPD_CUDA_STATUS(
          cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, stream.get())));
    }
    if (st.ok()) st.Update(EPD_CUDA_STATUS(cudaEventRecord(b, stream.get())));
    if (st.ok()) st.Update(EPD_CUDA_STATUS(cudaEventSynchronize(b)));
    float ms = 0;
    if (st.ok()) st.Update(EPD_CUDA_STATUS(cudaEventElapsedTime(&ms, a, b)));
    if (st.ok() && it >= warmup) us.push_back(1000.0 * ms);
  }
  cudaEventDestroy(a);
  if (b != nullptr) cudaEventDestroy(b);
  if (!st.ok()) return st;
  return ComputePercentiles(std::move(us));
}

absl::StatusOr<Percentiles> TimeHostDeviceRoundTrip(size_t bytes, int warmup, int iterations) {
  using ::epd::testing::CudaStream;
  using ::epd::testing::DeviceBuffer;
  bytes = std::max<size_t>(bytes, 1);
  EPD_ASSIGN_OR_RETURN(DeviceBuffer dev, DeviceBuffer::Allocate(bytes));
  EPD_ASSIGN_OR_RETURN(PinnedMemory host, AllocatePinned(bytes));
  EPD_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
  EPD_ASSIGN_OR_RETURN(EventHandle a, CreateEvent(cudaEventDefault));
  EPD_ASSIGN_OR_RETURN(EventHandle b, CreateEvent(cudaEventDefault));
  std::vector<double> us;
  for (int it = 0; it < warmup + iterations; ++it) {
    EPD_CUDA_RETURN_IF_ERROR(cudaEventRecord(a.get(), stream.get()));
    EPD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(host.get(), dev.get(), bytes, cudaMemcpyDeviceToHost, stream.get()));
    EPD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dev.get(), host.get(), bytes, cudaMemcpyHostToDevice, stream.get()));
    EPD_CUDA_RETURN_IF_ERROR(cudaEventRecord(b.get(), stream.get()));
    EPD_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(b.get()));
    float ms = 0;
    EPD_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, a.get(), b.get()));
    if (it >= warmup) us.push_back(1000.0 * ms);
  }
  return ComputePercentiles(std::move(us));
}

// ---- GatedTimer ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<GatedTimer>> GatedTimer::Create(int32_t ranks) {
  std::unique_ptr<GatedTimer> t(new GatedTimer());
  EPD_RETURN_IF_ERROR(DriverApi::Get().status());
  void* gate = nullptr;
  EPD_CUDA_RETURN_IF_ERROR(cudaMalloc(&gate, 4));
  t->gate_ = static_cast<uint32_t*>(gate);
  EPD_CUDA_RETURN_IF_ERROR(cudaMemset(gate, 0, 4));
  EPD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&t->trigger_, cudaStreamNonBlocking));
  t->start_.assign(ranks, nullptr);
  t->end_.assign(ranks, nullptr);
  for (int32_t r = 0; r < ranks; ++r) {
    EPD_CUDA_RETURN_IF_ERROR(cudaEventCreate(&t->start_[r]));
    EPD_CUDA_RETURN_IF_ERROR(cudaEventCreate(&t->end_[r]));
  }
  return t;
}

GatedTimer::~GatedTimer() {
  for (cudaEvent_t e : start_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  for (cudaEvent_t e : end_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  if (trigger_ != nullptr) cudaStreamDestroy(trigger_);
  if (gate_ != nullptr) cudaFree(gate_);
}

absl::StatusOr<GatedTimer::Sample> GatedTimer::RunOnce(const std::vector<cudaStream_t>& streams,
                                                       int iteration, const Launch& launch,
                                                       const After& after) {
  const int32_t ranks = static_cast<int32_t>(streams.size());
  if (ranks != static_cast<int32_t>(start_.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("GatedTimer: ", ranks, " streams for a timer of ", start_.size()));
  }
  EPD_ASSIGN_OR_RETURN(const DriverApi* driver, DriverApi::Get());
  const CUdeviceptr gate = reinterpret_cast<CUdeviceptr>(gate_);
  ++gate_value_;
  const auto host_start = std::chrono::steady_clock::now();
  for (int32_t r = 0; r < ranks; ++r) {
    EPD_RETURN_IF_ERROR(
        DriverStatus(driver->wait_value32(streams[r], gate, gate_value_, CU_STREAM_WAIT_VALUE_GEQ),
                     "cuStreamWaitValue32"));
    EPD_CUDA_RETURN_IF_ERROR(cudaEventRecord(start_[r], streams[r]));
    EPD_RETURN_IF_ERROR(launch(r, iteration, streams[r]));
    EPD_CUDA_RETURN_IF_ERROR(cudaEventRecord(end_[r], streams[r]));
  }
  if (gate_delay_us_ > 0) std::this_thread::sleep_for(std::chrono::microseconds(gate_delay_us_));
  EPD_RETURN_IF_ERROR(
      DriverStatus(driver->write_value32(trigger_, gate, gate_value_, 0), "cuStreamWriteValue32"));
  for (cudaStream_t s : streams) EPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  if (after) EPD_RETURN_IF_ERROR(after(iteration));
  const auto host_end = std::chrono::steady_clock::now();
  float first_start = 0, last_end = 0, shortest = 1e30f;
  for (int32_t r = 0; r < ranks; ++r) {
    float s = 0, e = 0;
    EPD_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&s, start_[0], start_[r]));
    EPD_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&e, start_[0], end_[r]));
    first_start = std::min(first_start, s);
    last_end = std::max(last_end, e);
    shortest = std::min(shortest, e - s);
  }
  return Sample{1000.0 * (last_end - first_start), 1000.0 * shortest,
                std::chrono::duration<double, std::micro>(host_end - host_start).count()};
}

absl::StatusOr<OpTimes> GatedTimer::Run(const std::vector<cudaStream_t>& streams, int warmup,
                                        int iterations, const Launch& launch, const After& after) {
  OpTimesBuilder times;
  for (int it = 0; it < warmup + iterations; ++it) {
    EPD_ASSIGN_OR_RETURN(const Sample s, RunOnce(streams, it, launch, after));
    if (it >= warmup) times.Add(s.span, s.after_last, s.host);
  }
  return times.Build();
}

}  // namespace epd::bench
