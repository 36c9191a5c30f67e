// What both backends' daemon-run host ops share per rank: the rank's private routing state
// (RankRouting) and the per-rank steps around kernels/host (checked topk_idx copy, layout,
// publishing routing into the data area). The data area is addressed through a HOST pointer
// to its EndpointLayout regions: the host backend's shm data area, or a CUDA rank's pinned
// host mirror (DESIGN.md §5.5).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "epd/kernels/host_ops.h"
#include "epd/kernels/layout.h"
#include "proto/abi/shm_abi.h"

namespace epd {

/// One rank's daemon-private routing state. The data area is client-writable (host shm) or
/// copied from client-writable memory (a CUDA mirror), so nothing there is read as an index
/// or size: the op's topk_idx is copied once into `topk_idx` and checked there, and the
/// routing that a combine and a cached re-dispatch read as row indices (send_pos, the
/// low-latency handle positions) is kept here. After a dispatch it is published into the
/// area's send_pos / ll_handle_pos regions for the client to read, never read back. Sized
/// at construction: an op allocates nothing.
struct RankRouting {
  std::vector<int64_t> topk_idx;  ///< [max(M, Mll), K]: the current op's checked copy.
  std::vector<int32_t> send_pos;  ///< [M, R]: the routing of the last normal dispatch.
  std::vector<int32_t> ll_handle_pos[kernels::kLowLatencyBuffers];  ///< [Mll, K] per buffer.

  /// The bytes a RankRouting of `s` holds.
  static uint64_t BytesFor(const kernels::GroupShape& s) {
    return static_cast<uint64_t>(s.max_input_tokens()) * s.num_topk * sizeof(int64_t) +
           static_cast<uint64_t>(s.max_tokens_per_rank) * s.num_ranks * sizeof(int32_t) +
           uint64_t{kernels::kLowLatencyBuffers} * s.ll_max_tokens_per_rank * s.num_topk *
               sizeof(int32_t);
  }
  /// Throws std::bad_alloc when out of memory (callers turn it into RESOURCE_EXHAUSTED).
  explicit RankRouting(const kernels::GroupShape& s);
};

/// Brackets an op's calls into kernels/host with a test hook (`hook(true)` before,
/// `hook(false)` after; HostDataPlaneOptions::on_kernels). A null or empty hook does nothing.
class KernelScope {
 public:
  explicit KernelScope(const std::function<void(bool)>* hook) : hook_(hook) {
    if (hook_ && *hook_) (*hook_)(true);
  }
  ~KernelScope() {
    if (hook_ && *hook_) (*hook_)(false);
  }
  KernelScope(const KernelScope&) = delete;
  KernelScope& operator=(const KernelScope&) = delete;

 private:
  const std::function<void(bool)>* hook_;
};

/// Region `r` of the data area at `data` (host memory laid out by an EndpointLayout).
template <typename T>
T* RegionPtr(uint8_t* data, const kernels::Region& r) {
  return reinterpret_cast<T*>(data + r.offset);
}

/// Copies rank `rank`'s staged topk_idx [T, K] (the area's in_topk_idx) once into
/// `routing.topk_idx` and checks the copy (kernels::host::CheckTopkIdx); the op reads only
/// the copy. INTERNAL when T exceeds the copy (T comes from a validated slot), else the
/// check's INVALID_ARGUMENT naming the rank and the bad id.
absl::StatusOr<const int64_t*> TakeTopkIdx(const kernels::GroupShape& shape,
                                           const kernels::EndpointLayout& layout, uint8_t* data,
                                           RankRouting& routing, int32_t rank, int32_t num_tokens);

/// Copies `rows` rows of `row_elems` int32 of private routing `src` to region `dst` of the
/// area at `data`, for the client to read (never read back).
void PublishRouting(uint8_t* data, const std::vector<int32_t>& src, int64_t rows, int64_t row_elems,
                    const kernels::Region& dst);

/// GetDispatchLayout of rank `rank` (it needs no other rank's data) from its validated
/// `slot`, into the area at `data`; the rank's outcome.
absl::Status RunLayoutOp(const kernels::GroupShape& shape, const kernels::EndpointLayout& layout,
                         uint8_t* data, RankRouting& routing, int32_t rank,
                         const abi::RequestSlot& slot, const kernels::host::HostExecution& exec,
                         const std::function<void(bool)>* on_kernels);

}  // namespace epd
