// The RDMA transport's registration lifecycle (DESIGN.md §5.4): memory regions for a link's
// receive region and send regions, host memory through ibv_reg_mr and CUDA device memory
// through dmabuf (the CUDA driver's export + ibv_reg_dmabuf_mr, built with CUDA only), and
// the lookup of a write source's local key.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/os/scoped_fd.h"
#include "daemon/transport/rdma/rdma_device.h"
#include "daemon/transport/transport.h"

namespace epd::transport::rdma {

/// One registered region: where it lies and its keys.
struct RegisteredRegion {
  uint64_t begin = 0;  ///< Address of its first byte.
  uint64_t end = 0;    ///< One past its last byte.
  uint32_t lkey = 0;
  uint32_t rkey = 0;
};

/// The last of `regions` holding [src, src + bytes) whole, or nullptr when none does: the
/// latest registration wins (memory registered anew at an address a stale registration
/// still covers). Linear in `regions` (a link has a handful); allocates nothing.
const RegisteredRegion* FindRegion(std::span<const RegisteredRegion> regions, const void* src,
                                   uint64_t bytes);

/// Whether GPU memory can be registered: built with CUDA, the driver exports dmabuf
/// (cuMemGetHandleForAddressRange) and every CUDA ordinal of `cuda_devices` reports
/// dmabuf support (none listed: ordinal 0). OK, or FAILED_PRECONDITION saying what is missing.
absl::Status CudaDmabufUsable(std::span<const int> cuda_devices);

/// CUDA device memory exported as a dmabuf: the fd of the page-aligned range that holds the
/// region, and where the region starts in it.
struct DmabufRange {
  ScopedFd fd;
  uint64_t offset = 0;  ///< The region's first byte, from the start of the dmabuf.
  uint64_t bytes = 0;   ///< The region's size.
};

/// Exports `region` (kCudaDevice) through cuMemGetHandleForAddressRange
/// (CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD) over the host pages that cover it. `what` names it
/// in errors. FAILED_PRECONDITION when built without CUDA, the driver has no dmabuf export
/// or refuses this memory (saying to set gpudirect off); INVALID_ARGUMENT for an empty,
/// null or host region.
absl::StatusOr<DmabufRange> ExportCudaDmabuf(const MemoryRegion& region, const std::string& what);

/// Registers `region` on `pd` with `access` (IBV_ACCESS_*): host memory with ibv_reg_mr,
/// CUDA device memory with ibv_reg_dmabuf_mr (its IO virtual address is its device
/// address). `what` names it in errors ("group 'g': receive region"). Errors:
/// FAILED_PRECONDITION when the memlock limit stops it (saying to raise RLIMIT_MEMLOCK) or
/// device memory cannot be exported (built without CUDA, no dmabuf support);
/// INVALID_ARGUMENT for an empty or null region; INTERNAL naming the verbs/CUDA call.
absl::StatusOr<IbvPtr<ibv_mr>> RegisterRegion(ibv_pd* pd, const MemoryRegion& region, int access,
                                              const std::string& what);

}  // namespace epd::transport::rdma
