// The CUDA row reduce (row_reduce.h): a rank's combined rows summed by one kernel from where
// the combine recorded its terms (the peers' rows in the host-mapped receive region, this
// node's in the local ranks' mirrors or, through windows, their GPU areas) straight into the
// rank's GPU area (DESIGN.md §5.5 "Rows on the GPU").
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "epd/kernels/cuda_gather.h"
#include "epd/kernels/layout.h"
#include "epd/kernels/row_reduce.h"

namespace epd::kernels::cuda {

/// Most term slots per row one reduce takes (its shared memory: 24 bytes a slot).
inline constexpr int32_t kMaxReduceTerms = 1024;

/// Enqueues ONE kernel on `stream` that writes every row of `r` exactly as
/// kernels::host::ReduceRows does: the same f32 additions and multiplications in the same
/// order (__fadd_rn / __fmul_rn: never fused), the same rounding to bf16; every result bit
/// for bit but a NaN's sign and payload (the GPU's arithmetic makes its canonical NaN where
/// the CPU's keeps an operand's). `r.terms` and `windows` (`num_windows` entries) must be
/// memory the kernel can read (host-mapped pinned or device) and stay unchanged until it
/// ran; every term's x and topk_weights must be readable by the GPU after the windows'
/// translation (GatherWindow: a pointer into a window's host range is read at its device
/// copy). Errors: INVALID_ARGUMENT for rows < 0, terms_per_row outside [0, kMaxReduceTerms],
/// num_windows outside [0, kMaxGatherWindows], or a null table or output with rows;
/// INTERNAL for a launch error.
absl::Status ReduceRowsAsync(const GroupShape& shape, const RowReduce& r,
                             const GatherWindow* windows, int32_t num_windows, cudaStream_t stream);

}  // namespace epd::kernels::cuda
