// One rank's device resources on the CUDA backend: its data area (one cudaMalloc, zeroed,
// exported by CUDA IPC and recorded in this process's registry), its stream, events and
// pinned read-back. The future home of RDMA memory registration. docs/CUDA_BACKEND.md.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/cuda/cuda_handles.h"
#include "common/cuda/device_alloc.h"
#include "daemon/dataplane/lockstep_group.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/layout.h"
#include "proto/abi/launch_flags.h"

namespace epd {

/// What the engine reads back after each op, per rank: pinned host memory mapped into the
/// device address space, written by kernels (never by a copy: no copy engine on the op path).
struct Readback {
  kernels::cuda::DeviceStatus status;
  int32_t recv_count;  ///< N of a normal dispatch (NormalDispatchArgs::recv_count_out).
  /// The staging_seq or ready_seq a daemon-launched low-latency op's WaitFlagAsync saw
  /// (written by that kernel once its wait passed): tells the engine whether the client's
  /// staging ever started for the op.
  uint64_t ready_seen;
};

/// One attached rank on the CUDA backend. Destroyed when the rank has detached and no op
/// still running holds it: nothing writes its area any more. The destructor removes the
/// area from the registry and synchronises the stream (bounded: every kernel wait is).
struct CudaRank : RankResources {
  int device = 0;  ///< The daemon's CUDA ordinal.
  int32_t rank = 0;
  uint64_t bytes = 0;
  uint64_t launch_flags_offset = 0;  ///< EndpointLayout::launch_flags.offset.
  bool client_launched = false;      ///< LAUNCH_MODE_CLIENT: the engine runs nothing.
  std::string ipc_handle;            ///< cudaIpcMemHandle_t bytes of `area`.
  StreamHandle stream;               // Declared before area: destroyed after it is synchronised.
  EventHandle done;
  EventHandle waited;              ///< Recorded once a stream-ordered op's ready wait has passed.
  PinnedArray<Readback> readback;  ///< [1], mapped.
  DeviceMemory area;

  ~CudaRank() override;

  /// launch_flags.ready_seq / done_seq / staging_seq in the rank's area (layout.h).
  uint8_t* ready_flag() const { return flag(abi::kReadyFlagOffset); }
  uint8_t* done_flag() const { return flag(abi::kDoneFlagOffset); }
  uint8_t* staging_flag() const { return flag(abi::kStagingFlagOffset); }
  /// The launch-flag word at `offset` of launch_flags (abi::k*Offset, proto/abi/launch_flags.h).
  uint8_t* flag(uint64_t offset) const { return area.get() + launch_flags_offset + offset; }
};

/// Creates rank `rank`'s resources on `device`: a stream, its events, the pinned read-back
/// and a zeroed data area of layout.total_bytes, exported by CUDA IPC and registered for
/// FindInProcessCudaArea. Errors: RESOURCE_EXHAUSTED (GPU full), INTERNAL (CUDA, naming the
/// call).
absl::StatusOr<std::shared_ptr<CudaRank>> CreateCudaRank(int device, int32_t rank,
                                                         const kernels::EndpointLayout& layout,
                                                         bool client_launched);

}  // namespace epd
