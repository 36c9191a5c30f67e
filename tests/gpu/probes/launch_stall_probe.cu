// epd_launch_stall_probe: which CUDA runtime calls, made on one thread, hold back a kernel
// launch made meanwhile on another (docs/DESIGN.md §8.2 "Freeing GPU memory"). No epd code:
// the daemon's situation reduced to three threads on one GPU. A scratch-grade tool: any
// CUDA error ends it with a message.
//
//   epd_launch_stall_probe [SPIN_MS=3000] [DEVICE=0]
//
// For each call: a kernel spins (bounded by SPIN_MS, %globaltimer) until a flag is set; 20 ms
// after it started, a "control" thread makes the call; 50 ms after it started, an "engine"
// thread launches the kernel that sets the flag. One row per call:
//   call | call took (ms) | launch took (ms) | spin timed out
// A call that waits for the device and holds back launches meanwhile (cudaFree and
// cudaFreeHost, measured on the H200) shows both near SPIN_MS and "yes"; a call that waits
// for the device without holding back launches takes about 30 ms (until the flag ends the
// spin), the launch little, "no"; a call that waits for nothing takes little, "no".
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "tests/common/cuda_or_die.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Status {
  volatile int started;
  volatile int timed_out;
};

__device__ __forceinline__ long long GlobalTimer() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins until *flag is non-zero or bound_ns have passed; says which in status (mapped host
// memory).
__global__ void Spin(const volatile int* flag, Status* status, long long bound_ns) {
  status->started = 1;
  __threadfence_system();
  const long long start = GlobalTimer();
  while (*flag == 0) {
    if (GlobalTimer() - start > bound_ns) {
      status->timed_out = 1;
      break;
    }
  }
  __threadfence_system();
}

__global__ void SetFlag(volatile int* flag) { *flag = 1; }

double MsSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

/// One call under test: `prepare` runs before the spin starts, `call` on the control
/// thread during it, `cleanup` once the device is idle again.
struct Case {
  std::string name;
  std::function<void()> prepare, call, cleanup;
};

}  // namespace

int main(int argc, char** argv) {
  // As the daemon (cuda_data_plane.cc): enough hardware queues that two streams never share.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  const long long spin_ms = argc > 1 ? atoll(argv[1]) : 3000;
  const int device = argc > 2 ? atoi(argv[2]) : 0;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count <= device) {
    fprintf(stderr, "no CUDA device %d\n", device);
    return 2;
  }
  CK(cudaSetDevice(device));
  CK(cudaFree(nullptr));
  cudaStream_t spin_stream, flag_stream;
  CK(cudaStreamCreateWithFlags(&spin_stream, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&flag_stream, cudaStreamNonBlocking));
  int* flag = nullptr;
  CK(cudaMalloc(&flag, sizeof(int)));
  Status* status = nullptr;
  CK(cudaHostAlloc(&status, sizeof(Status), cudaHostAllocMapped | cudaHostAllocPortable));

  constexpr size_t kSmall = 2ull << 20, kLarge = 256ull << 20;
  constexpr unsigned kPinnedFlags = cudaHostAllocPortable | cudaHostAllocMapped;  // The daemon's.
  void* p = nullptr;
  void* host = nullptr;
  cudaStream_t s = nullptr;
  cudaEvent_t e = nullptr;
  cudaIpcMemHandle_t ipc;
  int word = 1;
  auto free_p = [&] { CK(cudaFree(p)); };
  auto free_host = [&] { CK(cudaFreeHost(host)); };
  auto malloc_p = [&](size_t bytes) { return [&p, bytes] { CK(cudaMalloc(&p, bytes)); }; };
  auto malloc_host = [&](size_t bytes) {
    return [&host, bytes] { CK(cudaHostAlloc(&host, bytes, kPinnedFlags)); };
  };
  const std::vector<Case> cases = {
      {"(no call)", [] {}, [] {}, [] {}},
      {"cudaMalloc 2 MiB", [] {}, malloc_p(kSmall), free_p},
      {"cudaMalloc 256 MiB", [] {}, malloc_p(kLarge), free_p},
      {"cudaHostAlloc 2 MiB", [] {}, malloc_host(kSmall), free_host},
      {"cudaHostAlloc 256 MiB", [] {}, malloc_host(kLarge), free_host},
      {"cudaMallocHost 2 MiB", [] {}, [&] { CK(cudaMallocHost(&host, kSmall)); }, free_host},
      {"cudaHostRegister 2 MiB", [&] { host = aligned_alloc(4096, kSmall); },
       [&] { CK(cudaHostRegister(host, kSmall, cudaHostRegisterPortable)); },
       [&] {
         CK(cudaHostUnregister(host));
         free(host);
       }},
      {"cudaHostUnregister 2 MiB",
       [&] {
         host = aligned_alloc(4096, kSmall);
         CK(cudaHostRegister(host, kSmall, cudaHostRegisterPortable));
       },
       [&] { CK(cudaHostUnregister(host)); }, [&] { free(host); }},
      {"cudaMemset 2 MiB (device)", malloc_p(kSmall), [&] { CK(cudaMemset(p, 0, kSmall)); },
       free_p},
      {"cudaMemcpy 4 B host to device", malloc_p(kSmall),
       [&] { CK(cudaMemcpy(p, &word, sizeof(word), cudaMemcpyHostToDevice)); }, free_p},
      {"cudaIpcGetMemHandle", malloc_p(kSmall), [&] { CK(cudaIpcGetMemHandle(&ipc, p)); }, free_p},
      {"cudaStreamCreateWithFlags", [] {},
       [&] { CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); },
       [&] { CK(cudaStreamDestroy(s)); }},
      {"cudaStreamDestroy", [&] { CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); },
       [&] { CK(cudaStreamDestroy(s)); }, [] {}},
      {"cudaEventCreateWithFlags", [] {},
       [&] { CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); },
       [&] { CK(cudaEventDestroy(e)); }},
      {"cudaEventDestroy", [&] { CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); },
       [&] { CK(cudaEventDestroy(e)); }, [] {}},
      {"cudaMemGetInfo", [] {},
       [] {
         size_t free_bytes = 0, total = 0;
         CK(cudaMemGetInfo(&free_bytes, &total));
       },
       [] {}},
      {"cudaFree 2 MiB", malloc_p(kSmall), free_p, [] {}},
      {"cudaFreeHost 2 MiB", malloc_host(kSmall), free_host, [] {}},
  };

  printf(
      "spin bound %lld ms; the control thread calls at 20 ms, the engine thread launches at "
      "50 ms\n",
      spin_ms);
  printf("%-32s | %14s | %16s | %s\n", "call", "call took (ms)", "launch took (ms)",
         "spin timed out");
  for (const Case& c : cases) {
    c.prepare();
    CK(cudaMemset(flag, 0, sizeof(int)));
    CK(cudaDeviceSynchronize());
    status->started = 0;
    status->timed_out = 0;
    Spin<<<1, 1, 0, spin_stream>>>(flag, status, spin_ms * 1000000);
    CK(cudaGetLastError());
    const Clock::time_point wait_start = Clock::now();
    while (status->started == 0) {
      if (MsSince(wait_start) > 5000) {
        fprintf(stderr, "%s: the spin kernel did not start in 5 s\n", c.name.c_str());
        return 1;
      }
    }
    const Clock::time_point t0 = Clock::now();
    double call_ms = 0, launch_ms = 0;
    std::thread control([&] {
      std::this_thread::sleep_until(t0 + std::chrono::milliseconds(20));
      const Clock::time_point t = Clock::now();
      c.call();
      call_ms = MsSince(t);
    });
    std::thread engine([&] {
      std::this_thread::sleep_until(t0 + std::chrono::milliseconds(50));
      const Clock::time_point t = Clock::now();
      SetFlag<<<1, 1, 0, flag_stream>>>(flag);
      launch_ms = MsSince(t);
    });
    control.join();
    engine.join();
    CK(cudaDeviceSynchronize());
    CK(cudaGetLastError());
    printf("%-32s | %14.1f | %16.1f | %s\n", c.name.c_str(), call_ms, launch_ms,
           status->timed_out ? "yes" : "no");
    fflush(stdout);
    c.cleanup();
  }
  return 0;
}
