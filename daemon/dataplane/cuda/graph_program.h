// Graph mode on the CUDA backend: an armed program of low-latency steps, kept
// kProgramDepth instances ahead on every rank's stream, polled, published and disarmed.
// Owned by CudaGroup through GraphProgram::Host. DESIGN.md §3.2 "Graph mode".
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/cuda/cuda_handles.h"
#include "common/cuda/device_alloc.h"
#include "daemon/dataplane/cuda/cuda_rank.h"
#include "daemon/dataplane/lockstep_group.h"
#include "epd/kernels/cuda_ops.h"
#include "proto/abi/shm_abi.h"

namespace epd {

/// Program instances kept enqueued ahead on every rank's stream (DESIGN.md §3.2: far more
/// waits enqueued ahead hung under MPS; 2 lets the client run one step ahead of the engine).
inline constexpr int kProgramDepth = 2;

/// EPD_PROGRAM_TRACE=1 (a diagnostic, off by default): log every instance enqueued and
/// completed, every disarm, and once a second the state of pending instances per rank.
bool ProgramTrace();

/// An armed graph-mode program. Not thread-safe: the owning group's lock guards it. Its
/// ranks stay fixed while it is armed (a rank leaving disarms it). Enqueueing and
/// completing an instance allocate nothing (a fixed ring of kProgramDepth instances).
class GraphProgram {
 public:
  /// What the owning group provides.
  class Host {
   public:
    virtual ~Host() = default;
    /// The group's name, for messages.
    virtual const std::string& ProgramGroupName() const = 0;
    /// Rank r's kernel context for a program step with `num_sms` blocks (0 = default grid;
    /// it leaves the SMs the clients' staging kernels wait for done in, as the group's
    /// low-latency ops do: CudaRankContext::sms_left_per_rank).
    virtual kernels::cuda::CudaRankContext ProgramRankContext(int32_t r, int32_t num_sms) const = 0;
    /// The engine's aux stream of `device` (host writes while the ranks' streams wait).
    virtual cudaStream_t ProgramAuxStream(int device) const = 0;
    /// Rank r's endpoint shm header; null when rank r is not attached.
    virtual abi::EndpointShmHeader* ProgramHeader(int32_t r) const = 0;
    /// Counts one checked instance (ok or failed) in the group's op counters.
    virtual void ProgramInstanceChecked(bool ok) = 0;
    /// Logs a client-caused warning through the group's rate limit.
    virtual void ProgramWarning(const std::string& message) = 0;
  };

  /// Arms `steps` on `ranks` ([R], every rank attached): per rank and instance slot two
  /// events and a mapped pinned status, the go/done/instance words zeroed, the endpoints
  /// marked armed, and kProgramDepth instances enqueued. `num_sms`: blocks per step's
  /// kernel (0 = default). Errors: INTERNAL (CUDA, naming the call).
  static absl::StatusOr<std::unique_ptr<GraphProgram>> Arm(
      Host* host, const kernels::GroupShape& shape, std::vector<ProgramStepPlan> steps,
      const std::vector<std::shared_ptr<CudaRank>>& ranks, int32_t num_sms);

  /// Checks the instances that completed (publishing program_checked and errors) and
  /// enqueues new ones up to kProgramDepth. Returns OK while the program stays armed, or
  /// the error (a launch or device-side failure, a timeout) for which the owner must
  /// disarm it: the ranks' kernel counters may then be out of step.
  absl::Status Poll();

  /// Releases every instance still waiting for its client's go (in instance order; they
  /// run on whatever is staged, and their results are ignored), writes done =
  /// kProgramReleased on every rank's stream and records each rank's `done` event behind
  /// it, publishes `why` (unless OK) and marks the endpoints disarmed. The owner then
  /// waits for those events before the GPUs are free (the program's tail). Each released
  /// instance is waited for at most the kernel timeout + kDisarmGrace, or kStopGrace when
  /// `stopping` (epd's stop: its kernels' waits end on the shutdown word), then left
  /// waiting on its client's go word (logged).
  void Disarm(const absl::Status& why, bool stopping = false);

  /// Whether `rank` (attached as `cr`) takes part in this program.
  bool HoldsRank(int32_t rank, const CudaRank* cr) const {
    return rank >= 0 && static_cast<size_t>(rank) < ranks_.size() && ranks_[rank].rank.get() == cr;
  }
  /// The program's rank r (R entries).
  const std::shared_ptr<CudaRank>& rank(size_t r) const { return ranks_[r].rank; }
  size_t num_ranks() const { return ranks_.size(); }
  const std::vector<ProgramStepPlan>& steps() const { return steps_; }

 private:
  using Clock = std::chrono::steady_clock;
  /// One rank's resources: per instance slot (k % kProgramDepth) an event after the go
  /// wait, an event after the instance, and a pinned mapped status read-back.
  struct ProgramRank {
    std::shared_ptr<CudaRank> rank;
    EventHandle waited[kProgramDepth];
    EventHandle done[kProgramDepth];
    /// [kProgramDepth]: written by the step's kernel itself (KernelHandoff::status_out), or
    /// by EnqueueStatusReadback's kernel if its launch failed.
    PinnedArray<kernels::cuda::DeviceStatus> readback;
  };
  /// An instance enqueued on every rank's stream.
  struct Instance {
    uint64_t k = 0;                    ///< 1, 2, ... since the program was armed.
    int step = 0;                      ///< (k - 1) % steps.
    std::vector<absl::Status> launch;  ///< [R], sized once by Arm.
  };

  GraphProgram(Host* host, const kernels::GroupShape& shape, std::vector<ProgramStepPlan> steps,
               int32_t num_sms)
      : host_(host), shape_(shape), steps_(std::move(steps)), num_sms_(num_sms) {}

  Instance& instance(uint64_t k) { return instances_[k % kProgramDepth]; }
  /// The oldest instance in flight (inflight_ > 0).
  uint64_t front() const { return next_ - static_cast<uint64_t>(inflight_); }
  /// Enqueues instance next_ on every rank's stream.
  void EnqueueInstance();
  /// Enqueues rank r's kernel of step `st` for instance `k`; the kernel writes the instance
  /// word, done = 1 and its DeviceStatus to `status_out` itself (KernelHandoff).
  absl::Status LaunchStep(const ProgramStepPlan& st, int32_t r, uint64_t k,
                          kernels::cuda::DeviceStatus* status_out);
  /// Publishes an error of instance k (step `step`) to every attached endpoint's shm.
  void PublishError(const absl::Status& st, uint64_t k, int step);
  /// Publishes program_checked = k to every attached endpoint's shm.
  void PublishChecked(uint64_t k);
  /// EPD_PROGRAM_TRACE: logs every pending instance's per-rank state.
  void TracePending();

  Host* host_;
  kernels::GroupShape shape_;
  std::vector<ProgramStepPlan> steps_;
  int32_t num_sms_ = 0;
  /// The ranks' kernel timeout (CudaRankContext::timeout_ns), for Disarm's bounded waits.
  int64_t timeout_ns_ = 0;
  /// What Disarm waits for a released instance beyond the kernel timeout, and in all
  /// during epd's stop.
  static constexpr std::chrono::milliseconds kDisarmGrace{500};
  static constexpr std::chrono::milliseconds kStopGrace{200};
  std::vector<ProgramRank> ranks_;
  uint64_t next_ = 1;  ///< The next instance to enqueue.
  /// Instances in flight: next_ - inflight_, ..., next_ - 1 (oldest first; at most
  /// kProgramDepth). Instance k's state, events and read-back are in slot k % kProgramDepth.
  int inflight_ = 0;
  std::array<Instance, kProgramDepth> instances_;
  std::vector<cudaError_t> event_errors_;  ///< [R] scratch of one poll.
  Clock::time_point trace_next_;           ///< EPD_PROGRAM_TRACE: when to log pending next.
};

}  // namespace epd
