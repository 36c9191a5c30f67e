// CudaDataPlane: the CUDA backend's factory and options (compiled only with CUDA). The
// plane is split by concern in this folder: cuda_plane.h (GPUs, engines, GPU claims),
// cuda_rank.h (a rank's memory and its CUDA IPC export), cuda_group.h (lockstep launch and
// the stream-release protocol), graph_program.h (graph mode). Design, launch modes, graph
// mode and the hot path: docs/CUDA_BACKEND.md "The daemon's data plane, file by file" and
// DESIGN.md §3.2.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/peer/peer_mesh.h"
#include "daemon/transport/transport.h"
#include "daemon/transport/transport_set.h"

namespace epd {

/// Options of the CUDA data plane (from DaemonConfig).
struct CudaDataPlaneOptions {
  uint32_t op_timeout_ms = 10000;      ///< Bound on waiting for the ranks of an op, and of
                                       ///< every spin wait in the kernels.
  uint32_t engine_idle_us = 100;       ///< An engine sleeps after this long with no request.
  std::vector<std::string> gpu_uuids;  ///< GPUs to use; empty = every visible GPU.
  int32_t num_sms = 0;                 ///< Blocks per rank's kernel; 0 = SM count / ranks of
                                       ///< the group on that GPU (every rank resident).
  /// How a daemon-launched low-latency op waits for its client's ready flag: true = a
  /// one-warp spinning kernel with the op's kernel launched programmatically behind it
  /// (faster under MPS: docs/BENCHMARKS.md "Hand-off"); false = cuStreamWaitValue64,
  /// which without MPS is the only sane choice: the client's and the daemon's contexts
  /// then time-slice the GPU, and a spinning kernel would hold the slice the client's
  /// staging kernel needs (DESIGN.md §3.2). Unset = true exactly when MPS is active for
  /// this daemon (DetectMps at start-up). Either way the op's kernel checks ready_seq and
  /// writes done_seq itself.
  std::optional<bool> kernel_ready_wait;
  /// Launch each daemon-launched op that a per-GPU op graph covers as one cudaGraphLaunch
  /// per GPU (each op variant captured once, at its first op) instead of every rank's
  /// launches (DaemonConfig cuda_op_graphs; docs/CUDA_BACKEND.md "Op graphs"). Covered:
  /// low-latency ops with every rank stream-ordered and unmasked, under kernel_ready_wait.
  bool op_graphs = false;
  /// Launch each daemon-launched low-latency op as one fused kernel per GPU for every rank
  /// of the group there (kernels::cuda::LowLatencyDispatchRanks / LowLatencyCombineRanks,
  /// behind one WaitFlagsAsync for the ranks' ready flags) instead of each rank's own
  /// launches (DaemonConfig cuda_fused_launch; docs/CUDA_BACKEND.md "Fused launches").
  /// Covered: every rank stream-ordered and unmasked, under kernel_ready_wait, one node,
  /// no program armed, at most kernels::cuda::kMaxFusedRanks ranks per GPU. Op graphs,
  /// when on, take precedence.
  bool fused_launch = true;
  /// The daemon's peer mesh and transports by name (DESIGN.md §5), for groups whose spec
  /// lists >= 2
  /// nodes (run through the exchange on pinned host mirrors, DESIGN.md §5.5); null when the
  /// Peer listener is off (then such a group is FAILED_PRECONDITION). Not owned; must
  /// outlive the plane.
  peer::PeerMesh* peer_mesh = nullptr;
  const transport::TransportSet* transports = nullptr;
  /// kernels/host threads per op of a group that spans nodes (0 = hardware concurrency).
  int host_threads = 0;
  /// Test seam (unset in the daemon): called once on each engine thread (one per GPU)
  /// before its first poll. tests/gpu/cuda_hot_path_alloc_test.cc marks the engine threads
  /// with it to count their heap allocations per op.
  std::function<void()> on_engine_start;
};

/// Creates the CUDA data plane and starts its engines. Errors: FAILED_PRECONDITION when no
/// GPU is usable, NOT_FOUND for an unknown entry of gpu_uuids, INTERNAL for CUDA errors
/// (naming the call), and those of creating the doorbell pages.
absl::StatusOr<std::unique_ptr<DataPlane>> MakeCudaDataPlane(const CudaDataPlaneOptions& options);

/// Ops launched through per-GPU op graphs (CudaDataPlaneOptions::op_graphs) by every CUDA
/// data plane of this process since it started: tests tell the graph path from the
/// per-rank one by it.
uint64_t CudaOpGraphLaunchesForTesting();

/// Ops launched as fused kernels (CudaDataPlaneOptions::fused_launch), one count per GPU
/// launch, by every CUDA data plane of this process since it started.
uint64_t CudaFusedLaunchesForTesting();

/// The device address of the data area exported as `cuda_ipc_handle` by a CUDA data plane
/// of THIS process. CUDA cannot open an IPC handle in the process that exported it, so an
/// in-process client (tests; a daemon embedded in its client) maps its endpoint through
/// this instead of cudaIpcOpenMemHandle. NOT_FOUND when no live endpoint of this process
/// has that handle.
absl::StatusOr<void*> FindInProcessCudaArea(const std::string& cuda_ipc_handle);

}  // namespace epd
