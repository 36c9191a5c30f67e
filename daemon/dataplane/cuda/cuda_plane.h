// The CUDA data plane's class (made by MakeCudaDataPlane, cuda_data_plane.h): GPUs, peer
// access, one engine per GPU, the GPU claim table, the default launch mode. Internal to
// daemon/dataplane/cuda/; CudaGroup (cuda_group.h) uses it. docs/CUDA_BACKEND.md.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/cuda/cuda_handles.h"
#include "common/cuda/device_alloc.h"
#include "daemon/dataplane/cuda/cuda_data_plane.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/dataplane/engine_host.h"
#include "epd/kernels/host_ops.h"

namespace epd {

class CudaGroup;

/// One engine per GPU: a thread, a doorbell page and the groups it polls.
struct GpuEngine {
  int device = 0;
  EngineHost<CudaGroup> host;
  /// For host writes into launch_flags while the ranks' own streams are held by a
  /// program's waits (graph mode). Created at start-up, before any rank's stream: every
  /// stream takes one of the CUDA_DEVICE_MAX_CONNECTIONS hardware queues, and a write
  /// queued behind a stream memory wait on a shared queue would wait with it.
  StreamHandle aux;
};

class CudaDataPlaneImpl : public DataPlane {
 public:
  explicit CudaDataPlaneImpl(const CudaDataPlaneOptions& options) : options_(options) {}
  ~CudaDataPlaneImpl() override { Shutdown(); }

  /// Discovers the GPUs, enables peer access, loads the kernels and starts one engine per
  /// GPU. Errors: those of MakeCudaDataPlane.
  absl::Status Init();
  std::string backend_name() const override { return "cuda"; }
  uint64_t BytesPerRank(const v1::GroupSpec& spec) const override;
  absl::StatusOr<uint64_t> FreeBytes(const std::string& gpu_uuid) const override;
  /// A group that spans nodes: its kernel scratch, exchange buffers and every rank's pinned
  /// mirror and routing state (DESIGN.md §5.5), host memory counted against FreeBytes.
  uint64_t GroupPrivateBytes(const v1::GroupSpec& spec) const override;
  absl::StatusOr<std::unique_ptr<DataPlaneGroup>> CreateGroup(const v1::GroupSpec& spec) override {
    return CreateGroup(spec, GroupCreateOptions{});
  }
  absl::StatusOr<std::unique_ptr<DataPlaneGroup>> CreateGroup(
      const v1::GroupSpec& spec, const GroupCreateOptions& options) override;
  /// A group that spans nodes: daemon-launched (the only mode it has for now, DESIGN.md
  /// §5.5). A group that masks failed ranks (on_rank_failure MASK): daemon-launched (the
  /// daemon runs a masked rank's part of each op). Otherwise client-launched when the group's
  /// kernels can run side by side: MPS is active, or the daemon has a GPU for every rank (one rank
  /// per GPU). Otherwise daemon-launched: ranks of several client processes on one GPU without MPS
  /// would time-slice (DESIGN.md §3.2), while the daemon runs every rank's kernels from its one
  /// context.
  v1::LaunchMode DefaultLaunchMode(const v1::GroupSpec& spec) const override;
  /// Stops the data plane, bounded (kGpuDrainBound, gpu_drain.h), before epd frees its GPU
  /// memory: stops the engines, raises shutdown_word() (every daemon kernel's spin ends as a
  /// timeout), stops every group (CudaGroup::Stop: programs disarmed, every request failed
  /// with UNAVAILABLE), waits for the clients' staging kernels still to come and for the
  /// daemon's streams to go idle, releases every client wait on the groups' memory from the
  /// host (CudaGroup::ReleaseClients), waits for the streams again, and logs what it did
  /// (DescribeGpuDrain). Idempotent.
  void Shutdown() override;

  const CudaDataPlaneOptions& options() const { return options_; }
  /// The shutdown word every daemon kernel's spin waits poll (CudaRankContext::abort_flag):
  /// host-mapped pinned uint32, 0 until Shutdown stores 1. Lives as long as the plane.
  const uint32_t* shutdown_word() const { return shutdown_word_.get(); }
  /// Whether daemon-launched low-latency ops wait for ready_seq in a WaitFlagAsync kernel
  /// (CudaDataPlaneOptions::kernel_ready_wait; by default: MPS is active for this daemon).
  bool kernel_ready_wait() const { return kernel_ready_wait_; }
  /// The daemon's ordinal of `gpu_uuid` ("" = the first GPU). NOT_FOUND otherwise.
  absl::StatusOr<int> DeviceOf(const std::string& gpu_uuid) const;
  const std::string& UuidOf(int device) const { return uuids_.at(device); }
  bool PeerAccess(int a, int b) const { return a == b || peer_.at(a).count(b) > 0; }
  GpuEngine* EngineOf(int device) { return engines_.at(device).get(); }

  /// Claims every GPU in `devices` (daemon ordinals) for `group`'s next op when none of
  /// them runs another group's op (one group op per GPU at a time: spinning kernels must
  /// all be resident). Allocates nothing (the holder table is sized at Init).
  bool TryClaimGpus(std::span<const int> devices, const CudaGroup* group);
  /// Releases the GPUs `group` holds. Allocates nothing.
  void ReleaseGpus(const CudaGroup* group);
  /// kernels/host's worker threads for the exchange of groups that span nodes (started by
  /// the first such group; every engine uses it one op at a time, under pool_mu()).
  kernels::host::HostWorkerPool& kernel_pool() { return kernel_pool_; }
  /// Serialises the engines' use of kernel_pool() (one engine per GPU).
  std::mutex& pool_mu() { return pool_mu_; }
  /// Where the groups' ranks and arrays go to be freed: dropped by an engine thread between
  /// rounds, with every engine's round held off and every group quiescent (never beside a
  /// half-launched op: deferred_release.h).
  DeferredRelease& deferred_release() { return deferred_release_; }
  /// Held by a group's destructor from before it leaves its engine's list until its ops
  /// are drained: AllEnginesQuiescent is false meanwhile.
  class GroupEnding {
   public:
    explicit GroupEnding(CudaDataPlaneImpl& plane) : plane_(plane) { ++plane_.groups_ending_; }
    ~GroupEnding() { --plane_.groups_ending_; }
    GroupEnding(const GroupEnding&) = delete;
    GroupEnding& operator=(const GroupEnding&) = delete;

   private:
    CudaDataPlaneImpl& plane_;
  };

 private:
  CudaDataPlaneOptions options_;
  kernels::host::HostWorkerPool kernel_pool_;  // Outlives the engines' groups.
  std::mutex pool_mu_;
  bool kernel_ready_wait_ = false;    // See kernel_ready_wait().
  std::map<int, std::string> uuids_;  // ordinal → UUID.
  /// GPUs below the oldest supported architecture: UUID → why (they serve no rank).
  std::map<std::string, std::string> unsupported_;
  std::map<int, std::set<int>> peer_;  // ordinal → peers it can access.
  /// DeferredRelease::MaybeRelease's test: no group is being destroyed and no engine has a
  /// busy group (EngineHost::FirstBusyGroup). When memory has waited 30 s, warns (once a
  /// minute at most) naming the group that keeps a GPU busy.
  bool AllEnginesQuiescent();
  DeferredRelease deferred_release_;   // Outlives the engines (declared before them).
  std::atomic<int> groups_ending_{0};  // GroupEnding scopes alive.
  /// [1] mapped pinned: see shutdown_word(). Declared before engines_: freed after them.
  PinnedArray<uint32_t> shutdown_word_;
  /// Whether every engine's aux stream is idle; `busy` (when not null) names those that are not.
  bool AuxStreamsIdle(std::vector<std::string>* busy);
  /// When AllEnginesQuiescent last warned of memory waiting (engine threads, under the
  /// release's exclusive lock: one at a time).
  std::chrono::steady_clock::time_point last_release_warning_{};
  /// Filled by Init before any engine starts and not changed after (engine threads walk it).
  std::map<int, std::unique_ptr<GpuEngine>> engines_;
  std::mutex claim_mu_;
  /// [max ordinal + 1], indexed by ordinal: the group whose op runs on the GPU, or null.
  /// Sized once at Init, so claiming and releasing per op allocate nothing.
  std::vector<const CudaGroup*> gpu_holder_;
  std::atomic<bool> shut_down_{false};
};

}  // namespace epd
