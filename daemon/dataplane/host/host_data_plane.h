// HostDataPlane: the host backend (DESIGN.md §4, `--backend=host`). Every endpoint's
// data area lives in its sealed shared region next to its request ring; one engine thread
// polls every ring and, once every rank of a group has submitted op `seq`, runs the op
// for the whole group with kernels/host and completes it for every rank.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/dataplane/data_plane.h"

namespace epd {
namespace peer {
class PeerMesh;
}  // namespace peer
namespace transport {
class TransportSet;
}  // namespace transport

/// Options of the host data plane (from DaemonConfig).
struct HostDataPlaneOptions {
  uint32_t op_timeout_ms = 10000;  ///< Bound on waiting for the ranks of an op.
  uint32_t engine_idle_us = 100;   ///< Engine sleeps after this long with no request.
  int host_threads = 0;            ///< Threads per op (0 = hardware concurrency).
  /// The daemon's peer mesh and transports by name (DESIGN.md §5), for groups whose spec
  /// lists >= 2 nodes (spec.transport, "" = the set's default, picks one; a name the set
  /// cannot run is FAILED_PRECONDITION at CreateGroup); null when the Peer listener is off
  /// (then such a group is FAILED_PRECONDITION). Not owned; must outlive the plane.
  peer::PeerMesh* peer_mesh = nullptr;
  const transport::TransportSet* transports = nullptr;

  /// Test seams (unset in the daemon), called on the engine thread: `on_engine_start` once
  /// before its first poll; `on_kernels(true)` right before and `on_kernels(false)` right
  /// after each op's calls into kernels/host (the reference data movement, which runs on
  /// the plane's persistent worker pool with each group's persistent scratch, and so
  /// allocates nothing per op either). tests/unit/hot_path_alloc_test.cc uses them to count
  /// the engine's heap allocations per op inside and outside the kernels.
  std::function<void()> on_engine_start;
  std::function<void(bool)> on_kernels;
  /// Test seam (unset in the daemon): kernels::host::HostExecution::on_inputs_checked of
  /// every op across nodes (called between the kernels' checks and their writes).
  std::function<void()> on_inputs_checked;
  /// Test seam (unset in the daemon): runs first on each of kernels/host's worker threads
  /// (the plane's HostWorkerPool, host_threads - 1 of them, started with the first group),
  /// so a test can count their allocations too.
  std::function<void()> on_kernel_thread_start;
  /// Test seam (unset in the daemon): a group that spans nodes runs its exchange on a
  /// private copy of each rank's data area (filled with 0xA5 at attach) instead of the shm
  /// region: each op copies in only MirrorInputSpans and back only MirrorOutputSpans
  /// (daemon/dataplane/exchange/mirror_spans.h), as the CUDA backend's copy kernels do
  /// across nodes, so the host tests check those ranges where no GPU is.
  bool stage_through_mirror = false;
  /// Test seam (unset in the daemon), with stage_through_mirror: a dispatch leaves its
  /// received rows to a RowSource table (NodeExchangeHost::ExchangeRowSources) and they are
  /// gathered into the shm area with kernels::host::GatherRows, and its rows to the other
  /// nodes are packed into the send staging the same way (ExchangePackRows, run only when
  /// the exchange polls ExchangeRowsPacked, so that a post before it sends stale rows), both
  /// reading the local ranks' rows from their shm areas through windows, and the token rows
  /// of a normal or BF16 low-latency dispatch stay out of the mirrors; and a combine leaves
  /// its combined rows to a ReduceTable (ExchangeReduceTable), reduced into the shm area
  /// with kernels::host::ReduceRows: as the CUDA backend's kernels do (DESIGN.md §5.5 "Rows
  /// on the GPU").
  bool gather_rows = false;
  /// Test seam (unset in the daemon), with gather_rows: asked for rank `rank` each time the
  /// exchange polls whether its packs ran (ExchangeRowsPacked), before they run: false
  /// holds them (not yet), an error fails them, true runs them.
  std::function<absl::StatusOr<bool>(int32_t rank)> on_pack_poll;
};

/// Creates the host data plane (and its doorbell page) and starts its engine thread.
/// Errors: those of creating the doorbell page (RESOURCE_EXHAUSTED, INTERNAL).
absl::StatusOr<std::unique_ptr<DataPlane>> MakeHostDataPlane(const HostDataPlaneOptions& options);

}  // namespace epd
