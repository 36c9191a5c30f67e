// ReduceRowsAsync (cuda_reduce.h): a rank's combined rows summed into its GPU area.
// A block takes a row at a time: its terms into shared memory (translated through the
// windows once), then each thread 8 channels at a time, every term in slot order, with
// kernels::host::ReduceRows' operations (round-to-nearest add and multiply, never fused).
#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "epd/kernels/cuda_reduce.h"
#include "epd/kernels/types.h"

namespace epd::kernels::cuda {
namespace {

constexpr int kReduceThreads = 256;
constexpr int kVec = 8;  // Channels a thread takes at once: one 16-byte load of bf16.
/// Most blocks: enough rows in flight to cover the PCIe latency of host-mapped terms.
constexpr int64_t kMaxReduceBlocks = 1056;

struct ReduceParams {
  RowReduce r;
  int64_t hidden;
  int32_t num_topk;
  const GatherWindow* windows;
  int32_t num_windows;
};

/// Channels [h, h + n) of row `x` (n <= kVec) into v: one 16-byte load when whole and
/// aligned. Lanes past n are zero and never stored.
__device__ __forceinline__ void LoadChannels(const bf16_bits* x, int64_t h, int n,
                                             bf16_bits (&v)[kVec]) {
  const bf16_bits* p = x + h;
  if (n == kVec && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
    const uint4 w = *reinterpret_cast<const uint4*>(p);
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = static_cast<bf16_bits>(words[i] & 0xffffu);
      v[2 * i + 1] = static_cast<bf16_bits>(words[i] >> 16);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kVec; ++i) v[i] = i < n ? p[i] : bf16_bits{0};
}

__global__ void __launch_bounds__(kReduceThreads) ReduceRowsKernel(const ReduceParams p) {
  extern __shared__ __align__(16) uint8_t smem[];  // [terms_per_row] ReduceTerm: the row's terms.
  __shared__ GatherWindow windows[kMaxGatherWindows];
  auto* terms = reinterpret_cast<ReduceTerm*>(smem);
  const RowReduce& r = p.r;
  for (int32_t i = static_cast<int32_t>(threadIdx.x); i < p.num_windows; i += blockDim.x) {
    windows[i] = p.windows[i];
  }
  const int64_t H = p.hidden;
  for (int64_t t = blockIdx.x; t < r.rows; t += gridDim.x) {
    __syncthreads();  // The windows are in; the last row's terms are no longer read.
    for (int32_t j = static_cast<int32_t>(threadIdx.x); j < r.terms_per_row; j += blockDim.x) {
      ReduceTerm term = r.terms[t * r.terms_per_row + j];
      if (term.x != nullptr) {
        term.x =
            reinterpret_cast<const bf16_bits*>(TranslateWindow(term.x, windows, p.num_windows));
      }
      if (term.topk_weights != nullptr) {
        term.topk_weights = reinterpret_cast<const float*>(
            TranslateWindow(term.topk_weights, windows, p.num_windows));
      }
      terms[j] = term;
    }
    __syncthreads();
    bf16_bits* out = r.combined_x + t * H;
    for (int64_t h = static_cast<int64_t>(threadIdx.x) * kVec; h < H;
         h += static_cast<int64_t>(blockDim.x) * kVec) {
      const int n = H - h < kVec ? static_cast<int>(H - h) : kVec;
      float acc[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[i] = 0.0f;
      for (int32_t j = 0; j < r.terms_per_row; ++j) {
        const ReduceTerm& term = terms[j];
        if (term.x == nullptr) continue;
        bf16_bits v[kVec];
        LoadChannels(term.x, h, n, v);
        if (r.weighted) {
#pragma unroll
          for (int i = 0; i < kVec; ++i) {
            acc[i] = __fadd_rn(acc[i], __fmul_rn(term.weight, Bf16ToFloat(v[i])));
          }
        } else {
#pragma unroll
          for (int i = 0; i < kVec; ++i) acc[i] = __fadd_rn(acc[i], Bf16ToFloat(v[i]));
        }
      }
      bf16_bits* o = out + h;
      if (n == kVec && (reinterpret_cast<uintptr_t>(o) & 15) == 0) {
        uint32_t words[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          words[i] = static_cast<uint32_t>(FloatToBf16(acc[2 * i])) |
                     (static_cast<uint32_t>(FloatToBf16(acc[2 * i + 1])) << 16);
        }
        *reinterpret_cast<uint4*>(o) = make_uint4(words[0], words[1], words[2], words[3]);
      } else {
        for (int i = 0; i < n; ++i) o[i] = FloatToBf16(acc[i]);
      }
    }
    if (r.combined_topk_weights == nullptr) continue;
    for (int32_t k = static_cast<int32_t>(threadIdx.x); k < p.num_topk; k += blockDim.x) {
      float w = 0.0f;
      for (int32_t j = 0; j < r.terms_per_row; ++j) {
        if (terms[j].x != nullptr && terms[j].topk_weights != nullptr) {
          w = __fadd_rn(w, terms[j].topk_weights[k]);
        }
      }
      r.combined_topk_weights[t * p.num_topk + k] = w;
    }
  }
}

}  // namespace

absl::Status ReduceRowsAsync(const GroupShape& shape, const RowReduce& r,
                             const GatherWindow* windows, int32_t num_windows,
                             cudaStream_t stream) {
  if (r.rows < 0 || r.terms_per_row < 0 || r.terms_per_row > kMaxReduceTerms) {
    return absl::InvalidArgumentError(absl::StrCat("ReduceRowsAsync: rows = ", r.rows,
                                                   ", terms_per_row = ", r.terms_per_row,
                                                   " (at most ", kMaxReduceTerms, ")"));
  }
  if (num_windows < 0 || num_windows > kMaxGatherWindows || (num_windows > 0 && !windows)) {
    return absl::InvalidArgumentError(absl::StrCat("ReduceRowsAsync: num_windows = ", num_windows,
                                                   " is outside [0, ", kMaxGatherWindows,
                                                   "] or has no table"));
  }
  if (r.rows == 0) return absl::OkStatus();
  if (r.combined_x == nullptr || (r.terms_per_row > 0 && r.terms == nullptr)) {
    return absl::InvalidArgumentError("ReduceRowsAsync: a null destination or term table");
  }
  const unsigned grid =
      static_cast<unsigned>(r.rows < kMaxReduceBlocks ? r.rows : kMaxReduceBlocks);
  const size_t shared = sizeof(ReduceTerm) * static_cast<size_t>(r.terms_per_row);
  ReduceParams p{r, shape.hidden, shape.num_topk, windows, num_windows};
  void* args[] = {&p};
  return EPD_CUDA_STATUS(cudaLaunchKernel(reinterpret_cast<const void*>(&ReduceRowsKernel),
                                          dim3(grid), dim3(kReduceThreads), args, shared, stream));
}

}  // namespace epd::kernels::cuda
