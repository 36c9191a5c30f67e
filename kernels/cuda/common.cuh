// Device helpers shared by the CUDA kernels (low-latency and normal mode): system-scope
// acquire/release flag access, bounded waits timed with %globaltimer, status-word updates,
// 16-byte vector loads/stores, and the layout of the low-latency part of the sync region.
// Device-only code: no allocation, no logging, no __trap, no assert.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "epd/kernels/abort_poll.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/layout.h"

namespace epd::kernels::cuda::device {

// ---- timers and system-scope memory operations ----------------------------------------

/// Nanoseconds of the GPU's global timer (coarse: about 1 µs steps on Hopper).
__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t LdAcquireSys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

/// Relaxed system-scope load, for data published before a flag that was read with
/// LdAcquireSys (no "memory" clobber, so independent loads can be in flight together).
__device__ __forceinline__ int32_t LdRelaxedSys(const int32_t* p) {
  int32_t v;
  asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ void StReleaseSys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void StRelaxedSys(int32_t* p, int32_t v) {
  asm volatile("st.relaxed.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

/// 64-bit words shared with the CPU (host-mapped memory), acquire / release at system scope.
__device__ __forceinline__ uint64_t LdAcquireSys64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StReleaseSys64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/// 64-bit acquire load / release store at GPU scope: the stream-ordered hand-off words
/// (layout.h launch_flags), all in memory of the endpoint's GPU and touched only on it; why
/// .gpu suffices across processes: docs/CUDA_BACKEND.md "Memory scope of the flags". Words
/// the CPU reads (ready_seen, KernelHandoff::status_out) are stored separately, volatile.
__device__ __forceinline__ uint64_t LdAcquireGpu64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StReleaseGpu64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/// Whether the daemon's shutdown word `abort` (CudaRankContext::abort_flag: host-mapped
/// pinned memory the host stores nonzero into while kernels run) is raised: a relaxed load
/// at system scope (it is never cached). False for null (a client's launches).
__device__ __forceinline__ bool AbortRaised(const uint32_t* abort) {
  if (abort == nullptr) return false;
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(abort) : "memory");
  return v != 0;
}

/// The end test of one iteration of a bounded spin wait: the global timer passed
/// `deadline_ns`, or `abort` is raised (read only when `poll` says so: AbortPoll). A wait
/// that ends on the abort word takes its timeout path, so the op fails as it would on a
/// timeout and its hand-off (done, status) still happens.
__device__ __forceinline__ bool SpinMustEnd(uint64_t deadline_ns, const uint32_t* abort,
                                            AbortPoll* poll) {
  const uint64_t now = GlobalTimerNs();
  if (abort == nullptr) return now > deadline_ns;
  return SpinEnds(now, deadline_ns, poll, [abort] { return AbortRaised(abort); });
}

/// Spins until *flag >= target (LdAcquireGpu64), the global timer passes deadline_ns or
/// `abort` is raised (SpinMustEnd). Returns true on arrival (*value = what was read).
__device__ __forceinline__ bool WaitFlag64AtLeast(const uint64_t* flag, uint64_t target,
                                                  uint64_t deadline_ns, uint64_t* value,
                                                  const uint32_t* abort = nullptr) {
  AbortPoll poll;
  for (;;) {
    const uint64_t v = LdAcquireGpu64(flag);
    if (v >= target) {
      *value = v;
      return true;
    }
    if (SpinMustEnd(deadline_ns, abort, &poll)) return false;
  }
}

/// Acquire-release fence at GPU scope (fence.acq_rel.gpu) for the hand-off words (see
/// LdAcquireGpu64). Placed after __syncthreads() and before a flag store / ticket atomic, it
/// releases every write the block made before the barrier; after a flag load / ticket
/// atomic, it acquires.
__device__ __forceinline__ void FenceAcqRelGpu() {
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

// Scope-selectable variants for the low-latency kernels. `gpu` = every rank of the group
// is on this GPU (CudaRankContext::all_ranks_on_device): .gpu scope then orders the flags
// and data among all the threads that touch them and is cheaper than .sys
// (docs/CUDA_BACKEND.md "Memory scope of the flags").
// Across GPUs (peer access over NVLink) only .sys is correct. The branch is uniform.

__device__ __forceinline__ uint32_t LdAcquire(const uint32_t* p, bool gpu) {
  uint32_t v;
  if (gpu) {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  } else {
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  }
  return v;
}

__device__ __forceinline__ int32_t LdRelaxed(const int32_t* p, bool gpu) {
  int32_t v;
  if (gpu) {
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p));
  } else {
    asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p));
  }
  return v;
}

__device__ __forceinline__ void StRelease(uint32_t* p, uint32_t v, bool gpu) {
  if (gpu) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  } else {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  }
}

__device__ __forceinline__ void FenceAcqRel(bool gpu) {
  if (gpu) {
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
  } else {
    asm volatile("fence.acq_rel.sys;" ::: "memory");
  }
}

/// True when sequence number `a` is at or past `b` (wrap-around safe).
__device__ __forceinline__ bool SeqAtLeast(uint32_t a, uint32_t b) {
  return static_cast<int32_t>(a - b) >= 0;
}

/// Spins until `*flag` (written by a release store of the same scope) reaches `target`, the
/// global timer passes `deadline_ns` or `abort` is raised (SpinMustEnd; null = never); `gpu`
/// selects .gpu scope (see LdAcquire). Returns true on arrival. Every wait in the kernels
/// goes through this (or an equivalent bounded loop).
__device__ __forceinline__ bool WaitFlagAtLeast(const uint32_t* flag, uint32_t target,
                                                uint64_t deadline_ns, bool gpu = false,
                                                const uint32_t* abort = nullptr) {
  AbortPoll poll;
  while (!SeqAtLeast(LdAcquire(flag, gpu), target)) {
    if (SpinMustEnd(deadline_ns, abort, &poll)) return false;
  }
  return true;
}

// ---- status word ------------------------------------------------------------------------

__device__ __forceinline__ DeviceStatus* StatusOf(uint8_t* base, uint64_t sync_offset) {
  return reinterpret_cast<DeviceStatus*>(base + sync_offset + kSyncStatusOffset);
}

/// Records that `peer` never arrived (timed out) in `status`.
__device__ __forceinline__ void RecordMissingPeer(DeviceStatus* status, int32_t peer) {
  atomicOr(&status->timed_out, 1u);
  if (peer >= 0 && peer < kMaxStatusRanks) {
    atomicOr(&status->missing_ranks[peer / 32], 1u << (peer % 32));
  }
}

/// A KernelHandoff's ready or done value: `value`, or the op's word *h.seq_word when the
/// handoff names one (written by the host before the launch: a CUDA graph replays with
/// each op's sequence number). A volatile load: the word may be host-mapped memory.
__device__ __forceinline__ uint64_t HandoffValue(const KernelHandoff& h, uint64_t value) {
  return h.seq_word != nullptr ? *reinterpret_cast<const volatile uint64_t*>(h.seq_word) : value;
}

/// The ready wait of a KernelHandoff, by one thread per block before the block reads any
/// input: until *ready_flag >= ready_value (acquire, GPU scope), `deadline_ns` or `abort`
/// (the daemon's shutdown word); with `record` (the rank's block 0) a timeout is recorded
/// as a missing `rank` (the op then goes on: it fails anyway). No-op without a ready flag.
__device__ __forceinline__ void WaitReady(const KernelHandoff& h, uint64_t deadline_ns,
                                          DeviceStatus* status, int32_t rank, bool record,
                                          const uint32_t* abort) {
  uint64_t ready = 0;
  if (h.ready_flag != nullptr &&
      !WaitFlag64AtLeast(h.ready_flag, HandoffValue(h, h.ready_value), deadline_ns, &ready,
                         abort) &&
      record) {
    RecordMissingPeer(status, rank);
  }
}

/// Stores the hand-off's instance word (if any), then releases done (KernelHandoff): one
/// thread, after a barrier that follows every write done announces.
__device__ __forceinline__ void StoreDone(const KernelHandoff& h) {
  if (h.instance_flag != nullptr) {
    *reinterpret_cast<volatile uint64_t*>(h.instance_flag) = h.instance_value;
  }
  const uint64_t done = HandoffValue(h, h.done_value);
  FenceAcqRelGpu();
  StReleaseGpu64(h.done_flag, done);
}

/// KernelHandoff::status_out: one thread copies the rank's DeviceStatus to `out` and zeroes
/// it (as EnqueueStatusReadback's kernel), once every block's status update is ordered
/// before this thread (the callers' tickets / flags and fences). Only the words the kernels
/// ever write (everything before `reserved`; the rest stays zero on both sides), loaded all
/// at once before the stores: one round trip instead of one per word. Volatile loads: the
/// words were updated by other blocks' atomics (L2), never cached here.
__device__ __forceinline__ void CopyStatusOut(DeviceStatus* status, DeviceStatus* out) {
  constexpr int kWords = static_cast<int>(offsetof(DeviceStatus, reserved) / sizeof(uint32_t));
  volatile uint32_t* src = reinterpret_cast<volatile uint32_t*>(status);
  volatile uint32_t* dst = reinterpret_cast<volatile uint32_t*>(out);
  uint32_t words[kWords];
#pragma unroll
  for (int i = 0; i < kWords; ++i) words[i] = src[i];
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    dst[i] = words[i];
    src[i] = 0;
  }
}

/// Records a run-time T outside [0, capacity].
__device__ __forceinline__ void RecordBadNumTokens(DeviceStatus* status, int32_t num_tokens) {
  atomicExch(&status->bad_num_tokens, num_tokens);
  atomicOr(&status->has_bad_num_tokens, 1u);
}

// ---- 16-byte vectors --------------------------------------------------------------------

__device__ __forceinline__ uint4 LdVec16(const void* p) {
  return *reinterpret_cast<const uint4*>(p);
}
__device__ __forceinline__ void StVec16(void* p, const uint4& v) {
  *reinterpret_cast<uint4*>(p) = v;
}

/// Two f32 → two e4m3 (`lo` in the low byte): round to nearest even, saturating to ±448
/// (hardware cvt.rn.satfinite.e4m3x2.f32). Meant to be bit-identical to types.h
/// FloatToE4m3; tests/gpu/ll_test.cu (Fp8Conversion) compares the two on all 2^32 floats.
__device__ __forceinline__ uint16_t FloatsToE4m3x2(float lo, float hi) {
  return static_cast<uint16_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ int LaneId() { return static_cast<int>(threadIdx.x & 31u); }
__device__ __forceinline__ int WarpId() { return static_cast<int>(threadIdx.x >> 5); }

/// Adds `count` to entry `j` of `stats` and publishes the new total (one thread per j).
__device__ __forceinline__ void AddExpertTokens(const ExpertTokenStats& stats, int32_t j,
                                                int64_t count) {
  if (stats.totals == nullptr || count <= 0) return;
  const uint64_t total = stats.totals[j] + static_cast<uint64_t>(count);
  stats.totals[j] = total;
  if (stats.mirror != nullptr) *reinterpret_cast<volatile uint64_t*>(stats.mirror + j) = total;
}

// ---- the low-latency part of the sync region -------------------------------------------

/// Per-rank low-latency counters, at sync + kSyncLowLatencyStateOffset. Written only by the
/// rank's own kernels (and host helpers).
struct LowLatencyState {
  uint32_t dispatch_seq;      ///< Dispatches completed (the next one uses seq + 1).
  uint32_t combine_seq;       ///< Combines completed.
  uint32_t dispatch_ticket;   ///< Blocks of the running dispatch that finished writing.
  uint32_t combine_ticket;    ///< Blocks of the running combine that finished.
  uint32_t dispatch_aborted;  ///< = seq when a block of dispatch seq timed out.
  int32_t num_tokens;         ///< The run-time T slot (LowLatencyNumTokensSlot).
  int32_t dispatch_num_tokens[kLowLatencyBuffers];  ///< T of the last dispatch per buffer.
};
static_assert(sizeof(LowLatencyState) <= 4096 - 256, "LowLatencyState overflows its slot");

/// The inter-rank exchange area (cuda_limits.h).
using LowLatencyExchange = ::epd::kernels::cuda::LowLatencyExchange;

}  // namespace epd::kernels::cuda::device
