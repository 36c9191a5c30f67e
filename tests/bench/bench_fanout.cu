// The fan-out copy bound of the normal ops (bench_cuda.h FanoutBound): the dispatch's and
// the combine's HBM byte pattern, on the bench's routing (floors.h FanoutPlan), without the
// ops' logic (no counts, no flags, no metadata, no waits on other ranks). Kernel variants:
//   dispatch "vec"    a warp a token, 16-byte loads of the row (4 per lane in flight), each
//                     chunk stored at every destination row;
//            "vec_cs" the same with streaming (evict-first) stores;
//            "vec8"   as vec with 8 vectors a lane in flight, 512 threads a block;
//            "bulk"   / "bulk3" (sm_90 and later) a lane a warp moves rows by TMA bulk copies:
//                     the row into shared memory (2 or 3 slots, the next rows loading while
//                     the current one is stored), one bulk store per destination;
//   combine  "vec"    a warp a token, its rows read 2 at a time (4 16-byte vectors a lane
//                     each), summed in f32, the bf16 sum stored once;
//            "vec_cs" the same with streaming loads and stores;
//            "wide"   every row of the token in flight at once (up to 8, 2 vectors a lane).
// Each launch has `blocks` blocks, one per SM (its shared memory keeps a second block off).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "common/cuda/cuda_handles.h"
#include "common/cuda/device_alloc.h"
#include "common/status_macros.h"
#include "kernels/cuda/bulk_copy.cuh"
#include "tests/bench/bench_cuda.h"
#include "tests/gpu/gpu_test_util.h"

namespace epd::bench {
namespace {

using ::epd::testing::DeviceBuffer;

constexpr int kDispatchThreads = 1024;
constexpr int kCombineThreads = 512;
constexpr int kUnroll = 4;
/// The bulk variants' warps per block at most (each has its own row slots).
constexpr int kBulkMaxWarps = 16;

/// Error codes of the bound kernels (a device word the host reads after each variant).
enum BoundError : int { kNoError = 0, kBulkLoadTimedOut = 1, kBulkUnavailable = 2 };

template <bool kStreaming>
__device__ __forceinline__ uint4 Load(const uint4* p) {
  if constexpr (kStreaming) {
    return __ldcs(p);
  } else {
    return __ldg(p);
  }
}

template <bool kStreaming>
__device__ __forceinline__ void Store(uint4* p, uint4 v) {
  if constexpr (kStreaming) {
    __stcs(p, v);
  } else {
    *p = v;
  }
}

/// The calling warp's first token: tokens w, w + W, ... are warp w's of W in the grid.
__device__ __forceinline__ int64_t FirstWarpToken() {
  return int64_t{blockIdx.x} * (blockDim.x / 32) + threadIdx.x / 32;
}
/// W, the warps of the grid.
__device__ __forceinline__ int64_t WarpTokenStride() {
  return int64_t{gridDim.x} * (blockDim.x / 32);
}

/// Token t's rows: n of them (warp-uniform), lane l < n holding the l-th (0 for the rest).
struct TokenRows {
  int n;
  int32_t lane_row;
};
__device__ __forceinline__ TokenRows LoadTokenRows(const int32_t* row_begin, const int32_t* rows,
                                                   int64_t t, int lane) {
  const int32_t begin = row_begin[t];
  const int n = row_begin[t + 1] - begin;
  return {n, lane < n ? rows[begin + lane] : 0};
}

/// Dispatch, registers: warp w takes tokens w, w + W, ...; each chunk of kVecs vectors a
/// lane is loaded once and stored at each destination row of the token. kThreads a block.
template <int kVecs, bool kStreaming, int kThreads>
__global__ void __launch_bounds__(kThreads, 1)
    FanoutDispatchVecKernel(const uint4* __restrict__ src, uint4* __restrict__ dst,
                            const int32_t* __restrict__ row_begin, const int32_t* __restrict__ rows,
                            int64_t num_tokens, int64_t row_vecs) {
  const int lane = threadIdx.x & 31;
  for (int64_t t = FirstWarpToken(); t < num_tokens; t += WarpTokenStride()) {
    const auto [n, my_row] = LoadTokenRows(row_begin, rows, t, lane);
    if (n == 0) continue;
    const uint4* s = src + t * row_vecs;
    for (int64_t base = 0; base < row_vecs; base += 32 * kVecs) {
      uint4 v[kVecs];
#pragma unroll
      for (int u = 0; u < kVecs; ++u) {
        const int64_t i = base + lane + 32 * u;
        if (i < row_vecs) v[u] = Load<false>(s + i);
      }
      for (int k = 0; k < n; ++k) {
        uint4* o = dst + int64_t{__shfl_sync(~0u, my_row, k)} * row_vecs;
#pragma unroll
        for (int u = 0; u < kVecs; ++u) {
          const int64_t i = base + lane + 32 * u;
          if (i < row_vecs) Store<kStreaming>(o + i, v[u]);
        }
      }
    }
  }
}

/// Adds the 8 bf16 values of `v` to `acc` (a bf16 is the high half of an f32).
__device__ __forceinline__ void AddBf16x8(float (&acc)[8], uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    acc[2 * j] += __uint_as_float(w[j] << 16);
    acc[2 * j + 1] += __uint_as_float(w[j] & 0xffff0000u);
  }
}

/// f32 to bf16, rounded to nearest even (finite values).
__device__ __forceinline__ uint32_t Bf16Bits(float f) {
  const uint32_t b = __float_as_uint(f);
  return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ uint4 PackBf16x8(const float (&acc)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = Bf16Bits(acc[2 * j]) | (Bf16Bits(acc[2 * j + 1]) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

/// Combine, registers: warp w takes tokens w, w + W, ...; per chunk of kVecs vectors a
/// lane, the token's rows are read kRowsInFlight at a time and summed in f32; the sum is
/// stored once as bf16 (zeros for a token without rows).
template <int kVecs, int kRowsInFlight, bool kStreaming>
__global__ void __launch_bounds__(kCombineThreads, 1)
    FanoutCombineVecKernel(const uint4* __restrict__ rows_buf, uint4* __restrict__ out,
                           const int32_t* __restrict__ row_begin, const int32_t* __restrict__ rows,
                           int64_t num_tokens, int64_t row_vecs) {
  const int lane = threadIdx.x & 31;
  for (int64_t t = FirstWarpToken(); t < num_tokens; t += WarpTokenStride()) {
    const auto [n, my_row] = LoadTokenRows(row_begin, rows, t, lane);
    uint4* o = out + t * row_vecs;
    for (int64_t base = 0; base < row_vecs; base += 32 * kVecs) {
      float acc[kVecs][8] = {};
      for (int k = 0; k < n; k += kRowsInFlight) {
        uint4 v[kRowsInFlight][kVecs];
#pragma unroll
        for (int s = 0; s < kRowsInFlight; ++s) {
          const bool has_row = k + s < n;
          const uint4* p = rows_buf + int64_t{__shfl_sync(~0u, my_row, (k + s) & 31)} * row_vecs;
#pragma unroll
          for (int u = 0; u < kVecs; ++u) {
            const int64_t i = base + lane + 32 * u;
            v[s][u] = has_row && i < row_vecs ? Load<kStreaming>(p + i) : make_uint4(0, 0, 0, 0);
          }
        }
#pragma unroll
        for (int s = 0; s < kRowsInFlight; ++s) {
#pragma unroll
          for (int u = 0; u < kVecs; ++u) AddBf16x8(acc[u], v[s][u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kVecs; ++u) {
        const int64_t i = base + lane + 32 * u;
        if (i < row_vecs) Store<kStreaming>(o + i, PackBf16x8(acc[u]));
      }
    }
  }
}

#ifdef EPD_BULK_COPY
/// A bulk row load not landed within this many SM clock cycles (seconds) is an error.
constexpr long long kBulkWaitCycles = 4'000'000'000LL;

/// Waits until every bulk group of the thread but the newest has read its shared memory.
__device__ __forceinline__ void BulkWaitReadAllButNewest() {
  asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
}
#endif

/// Dispatch, bulk copies (sm_90 and later): lane 0 of warp w takes tokens w, w + W, ...
/// (those with a destination), each row loaded into one of the warp's kSlots shared-memory
/// slots and bulk-stored at each destination row, one bulk group a token; while a token's
/// stores run, the next kSlots - 1 rows are loading. Dynamic shared memory: kSlots row
/// slots per warp, then kSlots mbarriers per warp. `error` gets a BoundError.
template <int kSlots>
__global__ void __launch_bounds__(kBulkMaxWarps * 32, 1)
    FanoutDispatchBulkKernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst,
                             const int32_t* __restrict__ row_begin,
                             const int32_t* __restrict__ rows, int64_t num_tokens,
                             uint32_t row_bytes, int* error) {
#ifdef EPD_BULK_COPY
  namespace dev = ::epd::kernels::cuda::device;
  extern __shared__ __align__(128) uint8_t smem[];
  if ((threadIdx.x & 31) != 0) return;
  const int warp = threadIdx.x / 32;
  const int warps_per_block = blockDim.x / 32;
  uint8_t* slots = smem + static_cast<size_t>(warp) * kSlots * row_bytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + static_cast<size_t>(warps_per_block) *
                                                          kSlots * row_bytes) +
                   warp * kSlots;
  for (int s = 0; s < kSlots; ++s) dev::InitBulkBarrier(&bars[s]);
  const int64_t stride = WarpTokenStride();
  auto with_rows = [&](int64_t t) {
    while (t < num_tokens && row_begin[t + 1] == row_begin[t]) t += stride;
    return t;
  };
  auto load = [&](int slot, int64_t t) {
    dev::BulkLoad(slots + static_cast<size_t>(slot) * row_bytes, src + t * row_bytes, row_bytes,
                  &bars[slot]);
  };
  // Slot k % kSlots holds the warp's k-th token (num_tokens: none); the first kSlots - 1
  // are loaded before the loop, the (k + kSlots - 1)-th into the slot of the (k - 1)-th
  // once that one's stores have read it.
  int64_t token[kSlots];
  uint32_t parity[kSlots] = {};
  int64_t next = with_rows(FirstWarpToken());
  for (int s = 0; s < kSlots; ++s) {
    token[s] = num_tokens;
    if (s < kSlots - 1 && next < num_tokens) {
      token[s] = next;
      load(s, next);
      next = with_rows(next + stride);
    }
  }
  for (int k = 0; token[k % kSlots] < num_tokens; ++k) {
    const int cur = k % kSlots;
    const long long t0 = clock64();
    while (!dev::BulkBarrierDone(&bars[cur], parity[cur])) {
      if (clock64() - t0 > kBulkWaitCycles) {
        atomicExch(error, kBulkLoadTimedOut);
        dev::BulkWaitWritten();
        return;
      }
    }
    parity[cur] ^= 1u;
    const int64_t t = token[cur];
    token[cur] = num_tokens;
    for (int32_t j = row_begin[t]; j < row_begin[t + 1]; ++j) {
      dev::BulkStore(dst + static_cast<int64_t>(rows[j]) * row_bytes,
                     slots + static_cast<size_t>(cur) * row_bytes, row_bytes);
    }
    dev::BulkCommit();
    if (next < num_tokens) {
      const int ahead = (k + kSlots - 1) % kSlots;
      BulkWaitReadAllButNewest();
      token[ahead] = next;
      load(ahead, next);
      next = with_rows(next + stride);
    }
  }
  dev::BulkWaitWritten();
#else
  if (threadIdx.x == 0 && blockIdx.x == 0) atomicExch(error, kBulkUnavailable);
#endif
}

/// Counts into `mismatches` the 16-byte vectors a bound run got wrong: a dispatch's
/// destination rows against their token's row; a combine's output rows against the f32 sum
/// of the token's rows in order (as the combine variants add them), compared as values.
/// A warp a token, rows as in the bound kernels.
__global__ void CheckFanoutKernel(bool dispatch, const uint4* __restrict__ tokens,
                                  const uint4* __restrict__ rows_buf,
                                  const int32_t* __restrict__ row_begin,
                                  const int32_t* __restrict__ rows, int64_t num_tokens,
                                  int64_t row_vecs, unsigned long long* mismatches) {
  const int lane = threadIdx.x & 31;
  unsigned long long bad = 0;
  for (int64_t t = FirstWarpToken(); t < num_tokens; t += WarpTokenStride()) {
    const int32_t begin = row_begin[t], end = row_begin[t + 1];
    const uint4* token = tokens + t * row_vecs;
    for (int64_t i = lane; i < row_vecs; i += 32) {
      if (dispatch) {
        const uint4 want = token[i];
        for (int32_t j = begin; j < end; ++j) {
          const uint4 got = rows_buf[int64_t{rows[j]} * row_vecs + i];
          bad += got.x != want.x || got.y != want.y || got.z != want.z || got.w != want.w;
        }
      } else {
        float want[8] = {}, got[8] = {};
        for (int32_t j = begin; j < end; ++j) {
          AddBf16x8(want, rows_buf[int64_t{rows[j]} * row_vecs + i]);
        }
        const uint4 rounded = PackBf16x8(want);
        float w[8] = {};
        AddBf16x8(w, rounded);
        AddBf16x8(got, token[i]);
        bool same = true;
        for (int k = 0; k < 8; ++k) same &= w[k] == got[k];
        bad += same ? 0 : 1;
      }
    }
  }
  if (bad != 0) atomicAdd(mismatches, bad);
}

/// Shared memory that keeps a second block of a launch off an SM (over half of an SM's).
size_t OneBlockPerSmShared(const cudaDeviceProp& prop) {
  return prop.sharedMemPerMultiprocessor / 2 + 1024;
}

template <typename Kernel>
absl::Status AllowShared(Kernel kernel, size_t bytes) {
  EPD_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(bytes)));
  return absl::OkStatus();
}

}  // namespace

struct FanoutBound::Buffers {
  DeviceBuffer tokens;     // [num_tokens, max_row_bytes]
  DeviceBuffer rows;       // [num_rows, max_row_bytes]
  DeviceBuffer row_begin;  // [num_tokens + 1] int32
  DeviceBuffer row_index;  // [num_rows] int32
  DeviceBuffer error;      // int32 BoundError
  testing::CudaStream stream;
};

FanoutBound::FanoutBound() = default;
FanoutBound::~FanoutBound() = default;

absl::StatusOr<std::unique_ptr<FanoutBound>> FanoutBound::Create(const FanoutPlan& plan,
                                                                 int64_t max_row_bytes) {
  if (max_row_bytes <= 0 || max_row_bytes % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("FanoutBound: max_row_bytes=", max_row_bytes,
                                                   " is not a positive multiple of 16"));
  }
  if (plan.row_begin.size() != static_cast<size_t>(plan.num_tokens) + 1 ||
      plan.rows.size() != static_cast<size_t>(plan.num_rows)) {
    return absl::InvalidArgumentError(
        "FanoutBound: the plan's index arrays do not match its sizes");
  }
  std::unique_ptr<FanoutBound> b(new FanoutBound());
  b->plan_ = plan;
  b->max_row_bytes_ = max_row_bytes;
  int device = 0;
  EPD_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  EPD_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&b->prop_, device));
  b->buf_ = std::make_unique<Buffers>();
  Buffers& m = *b->buf_;
  const size_t row = static_cast<size_t>(max_row_bytes);
  EPD_ASSIGN_OR_RETURN(m.tokens,
                       DeviceBuffer::Allocate(static_cast<size_t>(plan.num_tokens) * row));
  EPD_ASSIGN_OR_RETURN(m.rows, DeviceBuffer::Allocate(std::max<size_t>(1, plan.num_rows) * row));
  EPD_ASSIGN_OR_RETURN(m.row_begin, DeviceBuffer::Allocate(plan.row_begin.size() * 4));
  EPD_ASSIGN_OR_RETURN(m.row_index,
                       DeviceBuffer::Allocate(std::max<size_t>(1, plan.rows.size()) * 4));
  EPD_ASSIGN_OR_RETURN(m.error, DeviceBuffer::Allocate(sizeof(int)));
  EPD_ASSIGN_OR_RETURN(m.stream, testing::CudaStream::Create());
  EPD_CUDA_RETURN_IF_ERROR(cudaMemcpy(m.row_begin.get(), plan.row_begin.data(),
                                      plan.row_begin.size() * 4, cudaMemcpyHostToDevice));
  if (!plan.rows.empty()) {
    EPD_CUDA_RETURN_IF_ERROR(cudaMemcpy(m.row_index.get(), plan.rows.data(), plan.rows.size() * 4,
                                        cudaMemcpyHostToDevice));
  }
  EPD_RETURN_IF_ERROR(FillPatternAsync(m.tokens.get(), m.tokens.bytes(), 11, m.stream.get()));
  EPD_RETURN_IF_ERROR(FillPatternAsync(m.rows.get(), m.rows.bytes(), 12, m.stream.get()));
  EPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.stream.get()));
  return b;
}

std::vector<std::string> FanoutBound::Variants(FanoutKind kind) const {
  if (kind == FanoutKind::kCombine) return {"vec", "vec_cs", "wide"};
  std::vector<std::string> v = {"vec", "vec_cs", "vec8"};
  if (prop_.major >= 9) {
    v.push_back("bulk");
    v.push_back("bulk3");
  }
  return v;
}

absl::Status FanoutBound::Launch(FanoutKind kind, const std::string& variant, int64_t row_bytes,
                                 int32_t blocks) {
  Buffers& m = *buf_;
  const cudaStream_t s = m.stream.get();
  const int64_t n = plan_.num_tokens;
  const int64_t vecs = row_bytes / 16;
  const auto* row_begin = reinterpret_cast<const int32_t*>(m.row_begin.get());
  const auto* rows = reinterpret_cast<const int32_t*>(m.row_index.get());
  const size_t one_block = OneBlockPerSmShared(prop_);
  if (kind == FanoutKind::kDispatch) {
    const auto* src = reinterpret_cast<const uint4*>(m.tokens.get());
    auto* dst = reinterpret_cast<uint4*>(m.rows.get());
    auto launch = [&](auto kernel, int threads) -> absl::Status {
      EPD_RETURN_IF_ERROR(AllowShared(kernel, one_block));
      kernel<<<blocks, threads, one_block, s>>>(src, dst, row_begin, rows, n, vecs);
      return EPD_CUDA_STATUS(cudaGetLastError());
    };
    constexpr int kT = kDispatchThreads;
    if (variant == "vec") return launch(&FanoutDispatchVecKernel<kUnroll, false, kT>, kT);
    if (variant == "vec_cs") return launch(&FanoutDispatchVecKernel<kUnroll, true, kT>, kT);
    // 8 vectors a lane take more registers than 1024 threads leave: half the threads.
    if (variant == "vec8") return launch(&FanoutDispatchVecKernel<8, false, kT / 2>, kT / 2);
    if (variant == "bulk" || variant == "bulk3") {
      const int slots = variant == "bulk" ? 2 : 3;
      const size_t per_warp = static_cast<size_t>(slots) * (row_bytes + sizeof(uint64_t));
      const int warps = static_cast<int>(
          std::min<size_t>(kBulkMaxWarps, (prop_.sharedMemPerBlockOptin - 128) / per_warp));
      if (warps < 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "FanoutBound: ", variant, " rows of ", row_bytes, " bytes do not fit shared memory"));
      }
      const size_t shared = std::max(one_block, warps * per_warp);
      auto kernel = slots == 2 ? &FanoutDispatchBulkKernel<2> : &FanoutDispatchBulkKernel<3>;
      EPD_RETURN_IF_ERROR(AllowShared(kernel, shared));
      kernel<<<blocks, warps * 32, shared, s>>>(m.tokens.get(), m.rows.get(), row_begin, rows, n,
                                                static_cast<uint32_t>(row_bytes),
                                                reinterpret_cast<int*>(m.error.get()));
      return EPD_CUDA_STATUS(cudaGetLastError());
    }
  } else {
    const auto* src = reinterpret_cast<const uint4*>(m.rows.get());
    auto* out = reinterpret_cast<uint4*>(m.tokens.get());
    auto launch = [&](auto kernel) -> absl::Status {
      EPD_RETURN_IF_ERROR(AllowShared(kernel, one_block));
      kernel<<<blocks, kCombineThreads, one_block, s>>>(src, out, row_begin, rows, n, vecs);
      return EPD_CUDA_STATUS(cudaGetLastError());
    };
    if (variant == "vec") return launch(&FanoutCombineVecKernel<kUnroll, 2, false>);
    if (variant == "vec_cs") return launch(&FanoutCombineVecKernel<kUnroll, 2, true>);
    if (variant == "wide") return launch(&FanoutCombineVecKernel<2, 8, false>);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("FanoutBound: no ", kind == FanoutKind::kDispatch ? "dispatch" : "combine",
                   " variant '", variant, "'"));
}

absl::Status FanoutBound::Check(FanoutKind kind, const std::string& variant, int64_t row_bytes,
                                int32_t blocks) {
  const std::string key =
      absl::StrCat(kind == FanoutKind::kDispatch ? "d/" : "c/", variant, "/", row_bytes);
  if (std::find(checked_.begin(), checked_.end(), key) != checked_.end()) {
    return absl::OkStatus();
  }
  Buffers& m = *buf_;
  const cudaStream_t s = m.stream.get();
  // The output cleared to bytes no run writes (0xff..: a NaN, and no pattern word).
  DeviceBuffer& out = kind == FanoutKind::kDispatch ? m.rows : m.tokens;
  EPD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(out.get(), 0xff, out.bytes(), s));
  EPD_RETURN_IF_ERROR(Launch(kind, variant, row_bytes, blocks));
  EPD_ASSIGN_OR_RETURN(DeviceBuffer mismatches, DeviceBuffer::Allocate(sizeof(uint64_t)));
  CheckFanoutKernel<<<prop_.multiProcessorCount * 4, 256, 0, s>>>(
      kind == FanoutKind::kDispatch, reinterpret_cast<const uint4*>(m.tokens.get()),
      reinterpret_cast<const uint4*>(m.rows.get()),
      reinterpret_cast<const int32_t*>(m.row_begin.get()),
      reinterpret_cast<const int32_t*>(m.row_index.get()), plan_.num_tokens, row_bytes / 16,
      reinterpret_cast<unsigned long long*>(mismatches.get()));
  EPD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  uint64_t bad = 0;
  EPD_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(&bad, mismatches.get(), sizeof(bad), cudaMemcpyDeviceToHost, s));
  int error = kNoError;
  EPD_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(&error, m.error.get(), sizeof(error), cudaMemcpyDeviceToHost, s));
  EPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  if (error != kNoError || bad != 0) {
    return absl::InternalError(absl::StrCat("FanoutBound: variant ", variant, " with rows of ",
                                            row_bytes, " bytes moved the wrong bytes: ", bad,
                                            " of its 16-byte vectors differ, error word ", error));
  }
  checked_.push_back(key);
  // Finite values again where the run did not write (rows narrower than the buffer's).
  EPD_RETURN_IF_ERROR(FillPatternAsync(out.get(), out.bytes(), 13, s));
  EPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  return absl::OkStatus();
}

absl::StatusOr<double> FanoutBound::Time(FanoutKind kind, const std::string& variant,
                                         int64_t row_bytes, int32_t blocks, int warmup,
                                         int iterations) {
  if (row_bytes <= 0 || row_bytes % 16 != 0 || row_bytes > max_row_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("FanoutBound: row_bytes=", row_bytes,
                                                   " is not a multiple of 16 in (0, ",
                                                   max_row_bytes_, "]"));
  }
  if (blocks < 1 || iterations < 1 || warmup < 0) {
    return absl::InvalidArgumentError(absl::StrCat("FanoutBound: blocks=", blocks,
                                                   " iterations=", iterations, " warmup=", warmup));
  }
  Buffers& m = *buf_;
  EPD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(m.error.get(), 0, sizeof(int), m.stream.get()));
  EPD_RETURN_IF_ERROR(Check(kind, variant, row_bytes, blocks));
  for (int i = 0; i < warmup; ++i) EPD_RETURN_IF_ERROR(Launch(kind, variant, row_bytes, blocks));
  EPD_ASSIGN_OR_RETURN(EventHandle start, CreateEvent(cudaEventDefault));
  EPD_ASSIGN_OR_RETURN(EventHandle end, CreateEvent(cudaEventDefault));
  EPD_CUDA_RETURN_IF_ERROR(cudaEventRecord(start.get(), m.stream.get()));
  for (int i = 0; i < iterations; ++i) {
    EPD_RETURN_IF_ERROR(Launch(kind, variant, row_bytes, blocks));
  }
  EPD_CUDA_RETURN_IF_ERROR(cudaEventRecord(end.get(), m.stream.get()));
  EPD_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(end.get()));
  float ms = 0;
  EPD_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start.get(), end.get()));
  int error = kNoError;
  EPD_CUDA_RETURN_IF_ERROR(cudaMemcpy(&error, m.error.get(), sizeof(int), cudaMemcpyDeviceToHost));
  if (error != kNoError) {
    return absl::InternalError(absl::StrCat("FanoutBound: variant ", variant,
                                            error == kBulkLoadTimedOut
                                                ? ": a bulk row load did not land within its bound"
                                                : ": bulk copies are not compiled for this GPU"));
  }
  return 1000.0 * ms / iterations;
}

absl::StatusOr<std::vector<BoundTiming>> FanoutBound::TimeVariants(FanoutKind kind,
                                                                   int64_t row_bytes,
                                                                   int32_t blocks, int warmup,
                                                                   int iterations) {
  std::vector<BoundTiming> out;
  for (const std::string& v : Variants(kind)) {
    EPD_ASSIGN_OR_RETURN(const double us, Time(kind, v, row_bytes, blocks, warmup, iterations));
    out.push_back({v, blocks, us});
  }
  return out;
}

}  // namespace epd::bench
