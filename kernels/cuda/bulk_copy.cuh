// Hopper bulk copies (the TMA's cp.async.bulk, non-tensor): a row from global memory into
// shared memory, completed on an mbarrier, and from shared memory to global memory, in
// bulk groups. Only compiled for sm_90 and later (EPD_BULK_COPY); callers keep another path
// for older architectures. Every address is 16-byte aligned and every size a multiple of 16.
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define EPD_BULK_COPY 1
#endif

namespace epd::kernels::cuda::device {

#ifdef EPD_BULK_COPY

/// The shared-memory address of `p` (a pointer into shared memory).
__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/// Initializes the mbarrier at `bar` for one arrival a phase and makes it visible to the
/// bulk copies (the async proxy). Call from one thread before any use.
__device__ __forceinline__ void InitBulkBarrier(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(SharedAddress(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/// Starts a bulk copy of `bytes` from global `src` into shared `dst`; the mbarrier `bar`
/// completes its current phase when the bytes have landed (this call makes the phase's one
/// arrival and announces the bytes).
__device__ __forceinline__ void BulkLoad(void* dst, const void* src, uint32_t bytes,
                                         uint64_t* bar) {
  asm volatile(
      "{\n\t.reg .b64 state;\n\t"
      "mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n\t}" ::"r"(SharedAddress(bar)),
      "r"(bytes)
      : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(SharedAddress(dst)),
      "l"(src), "r"(bytes), "r"(SharedAddress(bar))
      : "memory");
}

/// True once the phase of parity `parity` of mbarrier `bar` has completed (one bounded
/// probe: the caller loops with its own deadline).
__device__ __forceinline__ bool BulkBarrierDone(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(SharedAddress(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

/// Starts a bulk copy of `bytes` from shared `src` to global `dst`, in the current bulk
/// group (BulkCommit closes it).
__device__ __forceinline__ void BulkStore(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(SharedAddress(src)), "r"(bytes)
               : "memory");
}

/// Closes the calling thread's current bulk group.
__device__ __forceinline__ void BulkCommit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

/// Waits until every bulk group of the calling thread has read its shared memory (which may
/// then be overwritten).
__device__ __forceinline__ void BulkWaitRead() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

/// Waits until every bulk group of the calling thread has completed its writes, and orders
/// them before the thread's later ordinary memory operations (its fences and flags).
__device__ __forceinline__ void BulkWaitWritten() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

#endif  // EPD_BULK_COPY

}  // namespace epd::kernels::cuda::device
