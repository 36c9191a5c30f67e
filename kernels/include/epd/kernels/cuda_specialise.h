// The low-latency kernels' shape-specialised instances (kernels/cuda/ll_*.cu): which shape
// they are compiled for, and the process-wide switch that lets the launchers
// (cuda_ops.h LowLatencyDispatch, LowLatencyCombine) take them.
#pragma once

#include <cstdint>

#include "epd/kernels/layout.h"

namespace epd::kernels::cuda {

/// The one shape the low-latency kernels also have specialised instances of (DeepSeek-V3
/// decode), with hidden, top-k and experts per rank compile-time constants: H = 7168,
/// K = 8, E / R = 32 (any R). They are bit-identical to the generic kernels; whether they
/// are faster is what `epd_bench --mode=ll --ll_specialised=off,on` measures.
inline constexpr int32_t kLowLatencySpecialisedHidden = 7168;
inline constexpr int32_t kLowLatencySpecialisedTopk = 8;
inline constexpr int32_t kLowLatencySpecialisedExpertsPerRank = 32;

/// Whether the low-latency launchers may use the specialised instances: kEnvironment (the
/// default) = only when the environment variable EPD_LL_SPECIALISED is "1" (read once, at
/// the first launch that asks); kOff / kOn = never / always where the shape matches.
enum class LowLatencySpecialisation : int { kEnvironment = 0, kOff = 1, kOn = 2 };

/// Sets the process-wide choice (tests and the bench's A/B; thread-safe). Launches already
/// enqueued or captured keep the kernel they got.
void SetLowLatencySpecialisation(LowLatencySpecialisation mode);

/// True when a low-latency launch for `shape` now takes a specialised instance: the choice
/// allows it and shape.hidden, num_topk and num_local_experts() are exactly the
/// kLowLatencySpecialised* values. The launchers still take the generic kernels for the
/// paths that have no specialised instance: the dispatch's large routing path and BF16
/// scalar path, the combine's unaligned output.
bool LowLatencySpecialisedFor(const GroupShape& shape);

}  // namespace epd::kernels::cuda
