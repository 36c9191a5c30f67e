// The stream-ordered hand-off of daemon-launched mode done by kernels (cuda_ops.h
// CopyDeviceBatchAsync, WaitFlagAsync; DESIGN.md §3.2; why not stream memory operations:
// cuda_ops.h and docs/BENCHMARKS.md "Hand-off").
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_ops.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/copy_bytes.cuh"

namespace epd::kernels::cuda {
namespace {

/// The copies of one CopyDeviceBatchAsync, by value (kernel parameter space).
struct BatchCopyParams {
  DeviceCopy copies[kMaxBatchCopies];
  int32_t num_copies;
  uint64_t* signal;
  uint64_t signal_value;
  uint32_t* counter;
  uint64_t* started;
  DoneWait done_wait;
};

/// Ticket word of a multi-block BatchCopySignalKernel: the low 16 bits count the blocks
/// that have started, the high 16 bits those that have finished (at most kMaxBlocks = 32).
constexpr uint32_t kFinishTicket = 1u << 16;

__global__ void BatchCopySignalKernel(const BatchCopyParams p) {
  if (p.started != nullptr && threadIdx.x == 0) {
    // Once every block of this kernel is resident (the last one to start), the daemon may
    // launch its kernel (a hint: that kernel waits for the signal below before it reads
    // anything). Not sooner: a low-latency kernel's blocks fill whole SMs (1024 threads,
    // the register file), so a block of this kernel not yet resident might never be.
    if (gridDim.x == 1 || (atomicAdd(p.counter, 1u) & (kFinishTicket - 1)) == gridDim.x - 1) {
      asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p.started), "l"(p.signal_value)
                   : "memory");
    }
  }
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int32_t c = 0; c < p.num_copies; ++c) {
    device::CopyBytes(static_cast<uint8_t*>(p.copies[c].dst),
                      static_cast<const uint8_t*>(p.copies[c].src), p.copies[c].bytes, first,
                      stride);
  }
  if (p.signal == nullptr) return;
  __syncthreads();
  if (threadIdx.x != 0) return;
  device::FenceAcqRelGpu();
  if (gridDim.x > 1) {
    // The last block to finish stores the signal: each block releases its copies with the
    // fence before its ticket; the last one acquires them all with the fence after it.
    const uint32_t ticket = atomicAdd(p.counter, kFinishTicket) / kFinishTicket;
    if (ticket != gridDim.x - 1) return;
    device::FenceAcqRelGpu();
    *p.counter = 0;
  }
  device::StReleaseGpu64(p.signal, p.signal_value);
  if (p.done_wait.flag == nullptr) return;
  // DoneWait: the stream's next work waits for the daemon's done word (bounded).
  const uint64_t deadline = device::GlobalTimerNs() + static_cast<uint64_t>(p.done_wait.timeout_ns);
  uint64_t seen = 0;
  if (device::WaitFlag64AtLeast(p.done_wait.flag, p.done_wait.value, deadline, &seen) &&
      p.done_wait.clear && seen == p.done_wait.value) {
    // The program step's acknowledgement: value back to 0, unless something else was
    // written since it was read (kProgramReleased stays).
    atomicCAS(reinterpret_cast<unsigned long long*>(p.done_wait.flag),
              static_cast<unsigned long long>(p.done_wait.value), 0ull);
  }
}

__global__ void WaitFlagKernel(const uint64_t* flag, uint64_t value, int64_t timeout_ns,
                               uint64_t* seen, const uint64_t* alt_flag, const uint64_t* value_word,
                               const uint32_t* abort_flag) {
  if (threadIdx.x == 0) {
    if (value_word != nullptr) value = *reinterpret_cast<const volatile uint64_t*>(value_word);
    const uint64_t deadline = device::GlobalTimerNs() + static_cast<uint64_t>(timeout_ns);
    uint64_t v = 0;
    bool arrived = false;
    AbortPoll poll;
    for (;;) {  // As WaitFlag64AtLeast, on either word.
      v = device::LdAcquireGpu64(flag);
      if (v < value && alt_flag != nullptr) v = device::LdAcquireGpu64(alt_flag);
      if ((arrived = v >= value) || device::SpinMustEnd(deadline, abort_flag, &poll)) break;
    }
    if (arrived && seen != nullptr) *reinterpret_cast<volatile uint64_t*>(seen) = v;
  }
  __syncwarp();
  // The kernel launched after this one with programmatic stream serialization may start
  // (Hopper and newer; on Ampere the dependent kernel starts when this one exits).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// The waits of one WaitFlagsAsync, by value (kernel parameter space).
struct FlagWaitsParams {
  FlagWait waits[kMaxFusedRanks];
  int32_t num_waits;
  int64_t timeout_ns;
  const uint32_t* abort_flag;  // The daemon's shutdown word, or null.
};

// Warp w waits for waits[w] (lane 0 spins, as WaitFlagKernel); the block lets the next
// kernel start once every warp is past its wait.
__global__ void WaitFlagsKernel(const FlagWaitsParams p) {
  const int32_t w = static_cast<int32_t>(threadIdx.x >> 5);
  if ((threadIdx.x & 31) == 0 && w < p.num_waits) {
    // Copied by value, as RunFusedRank copies its params (ll_internal.h).
    const FlagWait wait = p.waits[w];
    const uint64_t deadline = device::GlobalTimerNs() + static_cast<uint64_t>(p.timeout_ns);
    uint64_t v = 0;
    bool arrived = false;
    AbortPoll poll;
    for (;;) {  // As WaitFlag64AtLeast, on either word.
      v = device::LdAcquireGpu64(wait.flag);
      if (v < wait.value && wait.alt_flag != nullptr) v = device::LdAcquireGpu64(wait.alt_flag);
      if ((arrived = v >= wait.value) || device::SpinMustEnd(deadline, p.abort_flag, &poll)) {
        break;
      }
    }
    if (arrived && wait.seen != nullptr) *reinterpret_cast<volatile uint64_t*>(wait.seen) = v;
  }
  __syncthreads();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

absl::Status PreloadHandoffKernels() {
  cudaFuncAttributes attr;
  EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, BatchCopySignalKernel));
  EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, WaitFlagKernel));
  EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, WaitFlagsKernel));
  return absl::OkStatus();
}
const bool kHandoffPreloadRegistered = RegisterPreloadHook(&PreloadHandoffKernels);

}  // namespace

absl::Status CopyDeviceBatchAsync(const DeviceCopy* copies, int num_copies, uint64_t* signal,
                                  uint64_t signal_value, uint32_t* counter, cudaStream_t stream,
                                  uint64_t* started, const DoneWait& done_wait) {
  (void)kHandoffPreloadRegistered;
  if (started != nullptr && signal == nullptr) {
    return absl::InvalidArgumentError(
        "CopyDeviceBatchAsync: a started word without a signal (nothing to announce)");
  }
  if (done_wait.flag != nullptr && (signal == nullptr || done_wait.timeout_ns <= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CopyDeviceBatchAsync: a done wait needs a signal (", signal == nullptr ? "none" : "set",
        ") and done_wait.timeout_ns > 0 (got ", done_wait.timeout_ns, ")"));
  }
  if (done_wait.clear && (done_wait.flag == nullptr || done_wait.value == 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("CopyDeviceBatchAsync: done_wait.clear needs done_wait.flag (",
                     done_wait.flag == nullptr ? "null" : "set", ") and done_wait.value > 0 (got ",
                     done_wait.value, ")"));
  }
  if (num_copies < 0 || num_copies > kMaxBatchCopies || (num_copies > 0 && copies == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("CopyDeviceBatchAsync: num_copies = ", num_copies, " is outside [0, ",
                     kMaxBatchCopies, "]"));
  }
  BatchCopyParams p{};
  uint64_t largest = 0;
  int32_t n = 0;
  for (int c = 0; c < num_copies; ++c) {
    if (copies[c].bytes == 0) continue;
    if (copies[c].dst == nullptr || copies[c].src == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("CopyDeviceBatchAsync: copy ", c, " has a null destination or source"));
    }
    p.copies[n++] = copies[c];
    largest = std::max(largest, copies[c].bytes);
  }
  p.num_copies = n;
  if (n == 0 && signal == nullptr) return absl::OkStatus();
  p.signal = signal;
  p.signal_value = signal_value;
  p.counter = counter;
  p.started = started;
  p.done_wait = done_wait;
  // As CopyDeviceAsync: blocks by the largest copy, at most 32.
  const uint64_t blocks = CopyBlocks(largest, 32);
  if (signal != nullptr && blocks > 1 && counter == nullptr) {
    return absl::InvalidArgumentError(
        "CopyDeviceBatchAsync: a signal after a multi-block copy needs a counter word");
  }
  // cudaLaunchKernel returns this launch's own status; `<<<>>>` + cudaGetLastError would
  // also return an error the caller left pending, and a client would then take a launched
  // kernel (maybe waiting for done) for one that never ran.
  void* args[] = {&p};
  return EPD_CUDA_STATUS(cudaLaunchKernel(reinterpret_cast<const void*>(&BatchCopySignalKernel),
                                          dim3(static_cast<unsigned>(blocks)),
                                          dim3(n == 0 ? 32 : kCopyThreads), args, 0, stream));
}

absl::Status WaitFlagAsync(const uint64_t* flag, uint64_t value, int64_t timeout_ns, uint64_t* seen,
                           cudaStream_t stream, const uint64_t* alt_flag,
                           const uint64_t* value_word, const uint32_t* abort_flag) {
  if (flag == nullptr || timeout_ns <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("WaitFlagAsync: flag = ", flag == nullptr ? "null" : "set",
                     ", timeout_ns = ", timeout_ns, " (need a flag and timeout_ns > 0)"));
  }
  WaitFlagKernel<<<1, 32, 0, stream>>>(flag, value, timeout_ns, seen, alt_flag, value_word,
                                       abort_flag);
  return EPD_CUDA_STATUS(cudaGetLastError());
}

absl::Status WaitFlagsAsync(std::span<const FlagWait> waits, int64_t timeout_ns,
                            cudaStream_t stream, const uint32_t* abort_flag) {
  if (waits.empty() || waits.size() > static_cast<size_t>(kMaxFusedRanks) || timeout_ns <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("WaitFlagsAsync: waits.size() = ", waits.size(),
                                                   " (need 1..kMaxFusedRanks = ", kMaxFusedRanks,
                                                   "), timeout_ns = ", timeout_ns, " (need > 0)"));
  }
  FlagWaitsParams p{};
  for (size_t i = 0; i < waits.size(); ++i) {
    if (waits[i].flag == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("WaitFlagsAsync: waits[", i, "].flag is null"));
    }
    p.waits[i] = waits[i];
  }
  p.num_waits = static_cast<int32_t>(waits.size());
  p.timeout_ns = timeout_ns;
  p.abort_flag = abort_flag;
  // cudaLaunchKernel reports this launch's error only (cudaGetLastError would also return
  // one an earlier call left pending, and the daemon would then treat a running wait as
  // never launched).
  void* args[] = {&p};
  return EPD_CUDA_STATUS(cudaLaunchKernel(reinterpret_cast<const void*>(&WaitFlagsKernel), dim3(1),
                                          dim3(32 * p.num_waits), args, 0, stream));
}

}  // namespace epd::kernels::cuda
