// LockstepGroup: the backend-independent half of a data-plane group, shared by the host
// and the CUDA data plane: ring popping, validation, op collection across the ranks,
// timeouts, completions and handle state. How ops run in lockstep: docs/DESIGN.md §8.3.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/os/shm_region.h"
#include "daemon/core/logging.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/metrics/metrics.h"
#include "epd/kernels/layout.h"
#include "epd/kernels/op_rules.h"
#include "epd/v1/control.pb.h"
#include "proto/abi/shm_abi.h"

namespace epd {

/// The kernels' GroupShape of a (validated) spec (rules::ShapeOf).
inline kernels::GroupShape ShapeOf(const v1::GroupSpec& spec) { return rules::ShapeOf(spec); }

/// The "epd.engine" logger (GetLogger(kLogEngine): created at the level log_level gives it).
std::shared_ptr<spdlog::logger> EngineLog();

/// "Dispatch", "LowLatencyCombine", ... for an abi::OpKind value ("Invalid" otherwise).
const char* OpName(uint32_t op);

/// Backend state of one attached rank (device memory, streams, ...). Owned by the rank's
/// LockstepEndpoint through a shared_ptr, so an op still running on the GPU can keep it
/// alive after the rank detached.
struct RankResources {
  virtual ~RankResources() = default;
};

/// One attached rank: its shared region and the daemon's view of its ring and handles.
///
/// The region is client-writable (the client maps it read-write). Nothing the daemon
/// dereferences comes from it: the layout (ring, completion and data offsets) is computed
/// here at attach and kept in `shm_layout`; the header's copy of it is for the client and
/// is never read back. The daemon reads back from the header only ring_head (once per
/// slot it pops; compared with its own ring_tail, never used as an index) and the flag
/// words client_waiting and daemon_closed; ring slots are copied into private memory
/// once, then validated, then only the copy is used.
struct LockstepEndpoint {
  /// The endpoint's sealed region. Holds its descriptor until the fd channel took it
  /// (TakeEndpointFds); the mapping lives as long as the endpoint.
  ShmRegion region;
  abi::EndpointShmHeader* header = nullptr;  ///< Written by the daemon; see above.
  abi::EndpointShmLayout shm_layout{};       ///< Private: the region's layout.
  uint64_t endpoint_id = 0;
  uint64_t next_seq = 0;                    ///< Seq the next ring slot must carry.
  uint64_t ring_tail = 0;                   ///< Slots consumed (published to the header).
  uint64_t rejected_requests = 0;           ///< Malformed slots (published to the header).
  std::optional<abi::RequestSlot> request;  ///< Popped, waiting for (or running) the op.
  std::optional<absl::Status> slot_error;   ///< Why `request` was rejected, if it was.
  uint64_t ops_completed = 0;
  rules::HandleTable handles;  ///< Which dispatches' routing and low-latency buffers are current.
  std::shared_ptr<RankResources> backend;  ///< The backend's part of this rank.
  /// "group G rank R (endpoint ID)", the source named in this endpoint's log lines.
  std::string log_name;
  /// Rate limit of the warnings this endpoint's client can cause (malformed or rejected
  /// slots, bad inputs): its uid's, shared with every other endpoint of that uid
  /// (RankClient::log_budget), or one of its own. Never null once attached.
  std::shared_ptr<LogRateLimiter> log_limiter;

  /// Whether the client has taken up this endpoint: the fd channel handed it the region's
  /// descriptor (TakeEndpointFds), which is daemon-private state (the header's
  /// client_mapped, which the client writes, is not trusted for it). An endpoint that
  /// stays unmapped is expired (DataPlaneGroup::RankMapped).
  bool ClientMapped() const { return region.fd() < 0; }

  /// The data area when it lives in the shm region (host backend).
  uint8_t* shm_data() const { return region.data() + shm_layout.data_offset; }
  abi::RequestSlot* ring() const {
    return reinterpret_cast<abi::RequestSlot*>(region.data() + shm_layout.ring_offset);
  }
  abi::Completion* completions() const {
    return reinterpret_cast<abi::Completion*>(region.data() + shm_layout.completion_offset);
  }
};

/// Result of one rank's part of an op.
struct RankOutcome {
  absl::Status status;
  int32_t num_recv_tokens = 0;  ///< Dispatch: N received by the rank.
  int32_t buffer = 0;           ///< Low-latency ops: filled in by LockstepGroup.
  /// The rank mask the op ran with (filled in by LockstepGroup) and, written by the
  /// backend, how many of this rank's token-expert pairs (normal combine: token-rank
  /// routes) it dropped because their rank was masked.
  uint32_t mask_epoch = 0;
  uint32_t num_masked = 0;
  int32_t dropped_pairs = 0;
};

/// One step of a graph-mode program with its fixed low-latency buffers (op_rules.h).
using ProgramStepPlan = rules::ProgramStepPlan;
using rules::ProgramStepName;

/// The program of a kRegisterProgram slot (shm_abi.h encoding), decoded, validated and
/// planned for a group of `shape`: rules::PlanProgram of the slot's words.
inline absl::StatusOr<std::vector<ProgramStepPlan>> DecodeProgram(
    const abi::RequestSlot& slot, const kernels::GroupShape& shape) {
  return rules::PlanProgram(slot, shape);
}

/// What LockstepGroup decided about an op before handing it to the backend.
struct OpPlan {
  uint64_t seq = 0;
  abi::OpKind op = abi::OpKind::kInvalid;
  uint32_t flags = 0;                    ///< Rank 0's flags (all ranks agree on the op's flags).
  int ll_buffer = 0;                     ///< LowLatencyDispatch: the buffer set it writes
                                         ///< (rules::LowLatencyParity).
  int ll_handle_buffer = 0;              ///< LowLatencyCombine: the buffer of its dispatch.
  int ll_out_buffer = 0;                 ///< LowLatencyCombine: the ll_combined_x buffer it writes.
  std::vector<ProgramStepPlan> program;  ///< kRegisterProgram: the agreed program.
  /// When the engine saw the op's first and its last (local, unmasked) rank's request:
  /// the start of the op's trace (the CUDA backend's EPD_OP_TRACE). Unset (epoch) when
  /// not known.
  std::chrono::steady_clock::time_point first_arrival{};
  std::chrono::steady_clock::time_point last_arrival{};
};

/// Options every lockstep group shares.
struct LockstepOptions {
  uint32_t op_timeout_ms = 10000;  ///< Bound on waiting for the ranks of an op.
};

/// The LockstepOptions of a backend's options struct (any struct with op_timeout_ms:
/// HostDataPlaneOptions, CudaDataPlaneOptions).
template <typename BackendOptions>
LockstepOptions LockstepOptionsOf(const BackendOptions& o) {
  LockstepOptions l;
  l.op_timeout_ms = o.op_timeout_ms;
  return l;
}

/// The lockstep core of a group. Thread-safety: every public method locks mu_; the hooks
/// are called with mu_ held except PrepareRank. A successful op allocates nothing here (its
/// per-op state is sized R at construction); error paths may (messages).
class LockstepGroup : public DataPlaneGroup {
 public:
  LockstepGroup(const v1::GroupSpec& spec, LockstepOptions options);
  ~LockstepGroup() override = default;

  absl::Status AttachRank(int32_t rank, const std::string& gpu_uuid, v1::LaunchMode launch_mode,
                          const RankClient& client, v1::EndpointInfo* info) final;
  void DetachRank(int32_t rank) final;
  absl::StatusOr<EndpointFds> TakeEndpointFds(int32_t rank) final;
  absl::StatusOr<v1::RankMask> UpdateRankMask(std::span<const int32_t> mask,
                                              std::span<const int32_t> unmask, bool clean) final;
  absl::StatusOr<v1::RankMask> GetRankMask() const final;
  uint64_t ops_completed() const final { return ops_completed_.load(); }
  uint64_t ops_failed() const final { return ops_failed_.load(); }
  uint64_t rank_ops_completed(int32_t rank) const final;
  /// LockstepEndpoint::ClientMapped of rank `rank` (false when it is not attached).
  bool RankMapped(int32_t rank) const final;

  /// Engine thread: pops requests, starts, finishes or times out the current op. True if
  /// it did work.
  bool Poll();
  /// No work of the group's on a device (DeferredRelease frees memory only when every
  /// group of every engine says so). The host backend has none: true.
  virtual bool Quiescent() { return true; }
  /// Completes everything pending with `status` (shutdown). An op still running in the
  /// backend is completed too; the backend's resources outlive it. Returns how many
  /// requests it completed (every rank's running, popped and queued ones).
  int32_t FailAll(const absl::Status& status);

  const v1::GroupSpec& spec() const { return spec_; }
  /// Whether the spec lists >= 2 nodes (DESIGN.md §5): then only this node's ranks attach.
  bool spanning() const { return spanning_; }
  /// This daemon's node of a spanning group (-1 until the first rank attached; 0 otherwise).
  int32_t self_node() const { return self_node_; }
  /// This node's ranks: [local_first(), local_first() + local_count()) (every rank of a
  /// one-node group).
  int32_t local_first() const { return local_first_; }
  int32_t local_count() const { return local_count_; }
  const kernels::GroupShape& shape() const { return shape_; }
  const kernels::EndpointLayout& layout() const { return layout_; }
  /// The group's metrics (metrics::Default(), label group = the spec's name), registered
  /// while the group lives. Updated by the engine thread without a lock.
  metrics::GroupMetrics& metrics() const { return *metrics_; }

 protected:
  // ---- backend hooks ----
  /// Bytes of the data area placed in the endpoint's shm region of a rank with resources
  /// `res` (PrepareRank's) (host: the whole layout; CUDA: 0, the data area is on the GPU,
  /// except a client-launched rank of a spanning group: its mirror, abi::SpanDataBytes).
  virtual uint64_t ShmDataBytes(const RankResources& res) const = 0;
  /// Allocates rank `rank`'s backend resources (without mu_: may be slow) and fills the
  /// backend's fields of `info` (backend, gpu_uuid, cuda_ipc_handle, launch_mode). Errors:
  /// INVALID_ARGUMENT (launch mode), RESOURCE_EXHAUSTED, INTERNAL.
  virtual absl::StatusOr<std::shared_ptr<RankResources>> PrepareRank(int32_t rank,
                                                                     const std::string& gpu_uuid,
                                                                     v1::LaunchMode launch_mode,
                                                                     v1::EndpointInfo* info) = 0;
  /// A new descriptor (close-on-exec) of the doorbell page of the engine that serves rank
  /// `rank` (attached), for TakeEndpointFds. Called under mu_. RESOURCE_EXHAUSTED when the
  /// process is out of descriptors.
  virtual absl::StatusOr<ScopedFd> DoorbellFd(int32_t rank) const = 0;
  /// Called under mu_ when rank `rank` is being attached (after PrepareRank, with the
  /// resources it returned); an error fails the join and releases them.
  virtual absl::Status RankAttached(int32_t /*rank*/, const std::shared_ptr<RankResources>&) {
    return absl::OkStatus();
  }
  /// Called under mu_ when rank `rank` is detached.
  virtual void RankDetached(int32_t /*rank*/) {}
  /// Called under mu_ before RankAttached with the data part of the rank's new endpoint
  /// region (ShmDataBytes(res) bytes at `shm_data`, zeroed; null when 0) and the rank's
  /// first op number; an error fails the join.
  virtual absl::Status RankRegionReady(int32_t /*rank*/, RankResources& /*res*/,
                                       uint8_t* /*shm_data*/, uint64_t /*first_seq*/) {
    return absl::OkStatus();
  }
  /// Whether rank `rank`'s requests come from the backend (PopBackendRequest) instead of
  /// its ring: a client-launched endpoint of a spanning CUDA group, whose kernels post
  /// commands into its mirror (DESIGN.md §5.5). Called under mu_.
  virtual bool BackendRequestSource(int32_t /*rank*/) const { return false; }
  /// With BackendRequestSource: copies rank `rank`'s request for op `next_seq` into `*slot`
  /// when it has been posted (without blocking); false when not yet. The slot is then
  /// validated like a ring slot. Called under mu_.
  virtual bool PopBackendRequest(int32_t /*rank*/, uint64_t /*next_seq*/,
                                 abi::RequestSlot* /*slot*/) {
    return false;
  }
  /// Called under mu_ right after a completion was written for rank `rank`'s request
  /// `slot` with `outcome` (every path: the op ran, failed before launch, was refused, or
  /// failed at shutdown). `plan` is the op's plan when the backend ran it, else null. A
  /// backend whose client does not read the completion ring answers it here.
  virtual void RankOpEnded(int32_t /*rank*/, const abi::RequestSlot& /*slot*/,
                           const RankOutcome& /*outcome*/, const OpPlan* /*plan*/) {}
  /// Spanning groups: called under mu_ once, at the first attach, with the node of the
  /// attaching rank, which this daemon is for the group from then on (local_first() and
  /// local_count() are set before the call). An error fails that join; the next join
  /// chooses again.
  virtual absl::Status NodeChosen(int32_t /*node*/) { return absl::OkStatus(); }
  /// Spanning groups: called under mu_ when op `seq` failed here before the backend ran
  /// it (a bad request, ranks disagreeing, a rank missing, another node's failure), so
  /// that the backend tells the other nodes, which fail it with the same error.
  virtual void OpFailedHere(uint64_t /*seq*/, uint32_t /*op*/, const absl::Status& /*status*/) {}
  /// Spanning groups: called under mu_ while op `seq` is being collected: an error when
  /// another node failed it or a peer is lost (the op then fails at once with it).
  /// `local_op`: the op (abi::OpKind) a local rank already submitted, -1 when none did; a
  /// node that failed another op is reported as the nodes not being in step.
  virtual absl::Status PeerFailure(uint64_t /*seq*/, int64_t /*local_op*/) {
    return absl::OkStatus();
  }
  /// Why ReadyToStart() is false, for the op's DEADLINE_EXCEEDED message.
  virtual std::string NotReadyReason() const { return "an earlier op is still running on the GPU"; }
  /// Whether the backend can start a (validated) op now, e.g. the previous op has left
  /// the GPU; true commits the backend to the StartOp that follows. While false, the
  /// collected op waits, bounded by op_timeout.
  virtual bool ReadyToStart() { return true; }
  /// Starts `plan` for every rank; `slots[r]` is rank r's validated request (every rank
  /// attached). `outcomes` has one entry per rank (R), each reset to {OK, 0, 0}; it is the
  /// group's, reused from op to op (an op allocates nothing, README "Hot path"): the
  /// backend writes rank r's outcome into outcomes[r]. Returns true when the op finished
  /// synchronously (outcomes written), false when it runs on (then PollOpInto is called
  /// on every Poll).
  virtual bool StartOpInto(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots,
                           std::span<RankOutcome> outcomes) = 0;
  /// True once the running op finished, with `outcomes` (as for StartOpInto) written;
  /// false while it runs. The default (a backend whose ops all finish in StartOpInto)
  /// fails every rank with INTERNAL.
  virtual bool PollOpInto(std::span<RankOutcome> outcomes);
  /// Whether whatever moves the running op on wakes the engine (Engine::Wake), so that
  /// the engine may sleep while PollOpInto returns false (its wait is then bounded by the
  /// engine's idle spin and its 20 ms sleep); false keeps the engine polling the op.
  virtual bool RunningOpWakesEngine() const { return false; }
  /// Wakes whoever polls this group (a daemon-side event: a rank left).
  virtual void WakeEngine() {}
  /// Backend checks of one popped request of rank `rank` (with the shape and handle
  /// checks of ValidateSlot), e.g. a flag the backend does not support. Called under mu_.
  /// An error rejects the slot like any invalid one: the op fails for every rank.
  virtual absl::Status CheckRequest(int32_t /*rank*/, const abi::RequestSlot& /*slot*/) const {
    return absl::OkStatus();
  }
  /// Whether rank `rank` takes part in daemon-run ops at all. An error (e.g. the endpoint
  /// is client-launched, DESIGN.md §3.2) completes every slot of its ring at once with
  /// that error, outside the lockstep (no op of the group is started or failed by it).
  /// Called under mu_.
  virtual absl::Status AcceptsRequests(int32_t /*rank*/) const { return absl::OkStatus(); }
  /// Called under mu_ for every popped request of rank `rank` that completes without the
  /// backend running it: rejected, failed before launch (client error, validation, a rank
  /// that never arrived or left, ranks disagreeing), answered late for an op that already
  /// failed, refused (AcceptsRequests), or failed at shutdown (FailAll). `slot` is the
  /// request as the client wrote it (flags included). The CUDA backend uses it to write
  /// launch_flags.done_seq = slot.seq for a kFlagStreamOrdered request, so that the
  /// client's stream, which waits for it, is released (shm_abi.h).
  virtual void OpEndedWithoutLaunch(int32_t /*rank*/, const abi::RequestSlot& /*slot*/) {}
  /// Whether rank `rank` may register a graph-mode program (DESIGN.md §3.2). The default
  /// (the host backend) refuses with UNIMPLEMENTED. Called under mu_ for every
  /// kRegisterProgram / kUnregisterProgram slot; an error rejects the slot (the op then
  /// fails for every rank). Backends that accept programs get kRegisterProgram (with
  /// OpPlan::program) and kUnregisterProgram through StartOp, and report their outcomes as
  /// for any op; a successful register arms the program (program_armed_).
  virtual absl::Status CheckProgram(int32_t /*rank*/) const {
    return absl::UnimplementedError(
        "graph-mode programs (RegisterProgram) need the CUDA backend with a daemon-launched "
        "endpoint; this backend runs every op from its ring");
  }
  /// Called under mu_ when rank `rank` becomes masked (true) or unmasked (false), between
  /// two ops: the backend prepares what a masked rank's part of an op needs (its endpoint
  /// may be gone), or drops it.
  virtual void RankMaskChanged(int32_t /*rank*/, bool /*masked*/) {}
  /// Whether the backend writes each outcome's mask_epoch and num_masked itself (a group
  /// across nodes: the mask the nodes agreed on for the op), instead of this node's.
  virtual bool BackendReportsOpMask() const { return false; }
  /// With BackendReportsOpMask: the group's mask and epoch as the backend will run the next
  /// op with them (`masked` sized R, nonzero = masked), for GetRankMask / UpdateRankMask.
  virtual uint32_t BackendRankMask(std::vector<uint8_t>* /*masked*/) const { return 0; }
  /// Whether the group masks failed ranks (GroupSpec.on_rank_failure = MASK).
  bool masking() const { return masking_; }
  /// [R] the mask of the op being collected or running: nonzero = rank r is masked (it
  /// takes no part: it sends nothing, its experts receive nothing, the op does not wait for
  /// it; its endpoint may be detached). StartOpInto's slots[r] of a masked rank is a copy
  /// of a taking-part rank's slot with num_tokens 0, and its outcome must be left OK.
  /// Call with mu_ held.
  const std::vector<uint8_t>& rank_masked() const { return rank_masked_; }
  /// Whether rank r has an endpoint (attached, not leaving). With mu_ held.
  bool RankIsAttached(int32_t r) const { return endpoints_[r] != nullptr; }
  /// Called under mu_ at the start of every Poll: background work of the backend (the CUDA
  /// backend runs an armed program's instances here). True if it did work or must keep
  /// the engine polling.
  virtual bool PollBackground() { return false; }
  /// The op being collected or running (this node's numbering; under mu_).
  uint64_t current_seq() const { return current_seq_; }
  /// Counts one program instance in the group's stats (ok: ops_completed, else ops_failed).
  void CountProgramInstance(bool ok) { (ok ? ops_completed_ : ops_failed_).fetch_add(1); }

  /// True while a graph-mode program is armed (set when a RegisterProgram op succeeds;
  /// cleared by UnregisterProgram, or by the backend when it disarms the program itself:
  /// a rank left, a device-side timeout, shutdown). While armed, every ring op other than
  /// UnregisterProgram fails at once with FAILED_PRECONDITION for every rank. Guarded by mu_.
  bool program_armed_ = false;

  /// Rank r's endpoint (null when detached). Call with mu_ held.
  LockstepEndpoint* endpoint(int32_t r) const { return endpoints_[r].get(); }
  /// Rank r's endpoint in the running op: the one it detached from while the op ran (kept,
  /// with its data area and backend resources, until the op finished), else endpoint(r).
  /// Call with mu_ held.
  LockstepEndpoint* op_endpoint(int32_t r) const {
    return op_departed_[r] ? op_departed_[r].get() : endpoints_[r].get();
  }
  /// Logs a line the group's clients can cause (an op timing out, a client that never
  /// staged its inputs, bad ids in a program step, ...) through the group's rate limit
  /// (LogLimited; the owner's uid's budget, see AttachRank): a client repeating it cannot
  /// flood the log. Call with mu_ held.
  template <typename... Args>
  void LogClientCaused(spdlog::level::level_enum level, fmt::format_string<Args...> format,
                       Args&&... args) const {
    LogLimited(*engine_log_, level, *log_limiter_, log_name_, format, std::forward<Args>(args)...);
  }
  /// As LogClientCaused, through rank `rank`'s endpoint's rate limit (the group's when the
  /// rank is detached).
  template <typename... Args>
  void LogRankCaused(int32_t rank, spdlog::level::level_enum level,
                     fmt::format_string<Args...> format, Args&&... args) const {
    LockstepEndpoint* ep = endpoints_[rank].get();
    LogLimited(*engine_log_, level, ep ? *ep->log_limiter : *log_limiter_,
               ep ? absl::string_view(ep->log_name) : absl::string_view(log_name_), format,
               std::forward<Args>(args)...);
  }
  const LockstepOptions& options() const { return options_; }

  mutable std::mutex mu_;  // Guards everything below and the backend's group state.

 private:
  // ---- the request ring (request_validation.cc) ----
  /// Pops each endpoint's new slots into daemon memory, validates and queues them (at most
  /// one ring's worth per endpoint per poll). True if it popped any.
  bool PopRequests();
  /// Copies the slot after `ep`'s tail into `*slot` and advances the tail, when the
  /// client's ring_head says there is one. False when the ring is empty, and when ring_head
  /// is more than a ring past the tail (no client publishes so): the tail then moves to it,
  /// counted as one rejected slot and logged, so a scribbled head cannot hold the engine.
  bool PopSlot(LockstepEndpoint& ep, abi::RequestSlot* slot);
  /// Ends the catch-up wait (catch_up_until_) once its rank is unmasked, gone, no longer
  /// being unmasked, or past the deadline (then its unmask is dropped, with a warning naming
  /// the way back). True while the wait goes on.
  bool UpdateCatchUpLocked();
  /// Counts a malformed or rejected slot of `ep` (published to the header).
  static void CountRejected(LockstepEndpoint& ep);
  /// Pops every slot of rank `rank`'s ring and completes each with `why` (AcceptsRequests
  /// refused the rank). True if it popped any.
  bool RefuseRequests(int32_t rank, LockstepEndpoint& ep, const absl::Status& why);
  /// Checks a popped slot: op, flags, the op rules (shape, FP8, limits), the handle table.
  absl::Status ValidateSlot(int32_t rank, const LockstepEndpoint& ep,
                            const abi::RequestSlot& slot) const;
  /// Completes request `slot` of rank `rank` with `status` without running it.
  void CompleteUnrun(int32_t rank, LockstepEndpoint& ep, const abi::RequestSlot& slot,
                     const absl::Status& status);

  // ---- the lockstep op (lockstep_group.cc) ----
  /// Fails the op being collected for every local rank; a spanning group's other nodes
  /// are told (OpFailedHere), so that one still running it ends it with the same error.
  void FailOp(const absl::Status& status);
  /// Validates the collected op and starts it; false when the backend is not ready.
  bool RunOp();
  /// Completes the running op (running_, running_slots_) with outcomes_ for every rank.
  void FinishOp();
  /// Records the op that ends now in the group's metrics: kind `op`, `code`; an OK op's
  /// latency (from op_started_) and the bytes of rows it delivered (from `slots`/`outcomes`).
  void RecordOpMetrics(uint32_t op, absl::StatusCode code, uint32_t flags,
                       const std::vector<abi::RequestSlot>* slots,
                       const std::vector<RankOutcome>* outcomes);
  /// Counts op current_seq_ of kind `op` in parity_ (started or failed, once per op); a
  /// low-latency dispatch takes its buffer from every handle that owned it.
  void CountOp(uint32_t op);
  /// Whether two ranks' requests are the same op: kind, the agreed flags and a dispatch's
  /// expert_alignment.
  static bool SameOp(const abi::RequestSlot& a, const abi::RequestSlot& b);

  // ---- rank masking (lockstep_mask.cc) ----
  /// Masks `ranks` now (mask epoch + 1 when any was not masked), logging one line with
  /// `why` at `level` that names at most 4 of the ranks it masked, then "and N more". A masked
  /// rank's request waiting for the op being collected is completed with MaskedError. With
  /// `unmask_at_next_op`, each is marked to be unmasked at the next op boundary (before that
  /// completion, whose message then says so). Not while running_ (see pending_mask_).
  void MaskRanksLocked(std::span<const int32_t> ranks, const std::string& why,
                       spdlog::level::level_enum level = spdlog::level::warn,
                       bool unmask_at_next_op = false);
  /// Unmasks every rank r with pending_unmask_[r] that can take part in the op being
  /// collected: attached and caught up (its next request is for that op). One past it waits
  /// for the next boundary, one behind it until it has caught up (PopRequests); a detached
  /// one stays masked until it rejoins. Applies pending_mask_ first, then
  /// SkipOpWhileAllMaskedLocked. Not while running_.
  void ApplyPendingMaskLocked();
  /// Whether every rank of a single-node group is masked: no op can run, none is collected.
  bool AllRanksMaskedLocked() const;
  /// While every rank of a single-node group is masked, the op being collected ran on no
  /// rank once any rank was refused for it (every request for it is refused: MaskedError)
  /// and no rank being unmasked is about to submit it: current_seq_ moves past it (its kind counted
  /// as a refused request had it), so that a rank's later requests are refused at once too and an
  /// unmask finds the rank in step. True when it moved. Not while running_.
  bool SkipOpWhileAllMaskedLocked();
  /// Masks again every just-unmasked rank (rejoined_) whose request for the collected op
  /// was rejected or differs from the first in-step rank's, so that the op runs without
  /// it; it is unmasked again at the next boundary (it then submits the group's next op).
  /// True when it masked any.
  bool ReMaskStrayRejoiners();
  /// FAILED_PRECONDITION for a request of masked rank `rank` for op `seq`; when the rank is
  /// to be unmasked at the next op boundary (pending_unmask_), the message says so instead of
  /// asking for an unmask.
  absl::Status MaskedError(int32_t rank, uint64_t seq) const;
  /// The mask as the RankMask message.
  v1::RankMask MaskMessageLocked() const;
  /// The first local rank that is not masked (local_first_ + local_count_ when none).
  int32_t LeadRank() const;

  v1::GroupSpec spec_;
  bool spanning_ = false;
  int32_t self_node_ = 0;
  int32_t local_first_ = 0;
  int32_t local_count_ = 0;
  kernels::GroupShape shape_;
  kernels::EndpointLayout layout_;
  LockstepOptions options_;
  std::shared_ptr<spdlog::logger> engine_log_;  ///< "epd.engine".
  std::string log_name_;                        ///< "group G", for rate-limited lines.
  /// LogClientCaused's rate limit: the group's own until its first attach that names a
  /// budget (the owner's uid's), then that one. Never null.
  std::shared_ptr<LogRateLimiter> log_limiter_;
  bool log_limiter_is_owners_ = false;  ///< log_limiter_ came from an attach.
  std::vector<std::unique_ptr<LockstepEndpoint>> endpoints_;
  /// [R] endpoints of ranks that detached while the running op held their request: kept
  /// until FinishOp (op_endpoint), since the backend may still use their memory.
  std::vector<std::unique_ptr<LockstepEndpoint>> op_departed_;
  /// departed_[r]: rank r was attached and then detached (left, or its client died) and
  /// has not rejoined; the group's next op that waits for it fails at once (once: later
  /// ops wait op_timeout for a rejoin again, a natural back-off for retrying peers).
  std::vector<bool> departed_;
  /// Rank masking: whether the spec asks for it, the mask (rank_masked()), its epoch (+1
  /// per change) and count, and changes waiting for the next op boundary: an unmask of a
  /// rank that already passed the op being collected (a rejoin while an op is collected,
  /// or a masked rank refused for it), and masks asked while an op runs in the backend.
  bool masking_ = false;
  std::vector<uint8_t> rank_masked_;
  uint32_t mask_epoch_ = 0;
  uint32_t num_masked_ = 0;
  std::vector<uint8_t> pending_unmask_;
  std::vector<uint8_t> pending_mask_;
  /// The op kind of the first request refused for op current_seq_ while every rank was
  /// masked (0: none), counted when SkipOpWhileAllMaskedLocked moves past the op.
  uint32_t all_masked_op_ = 0;
  /// rejoined_[r]: rank r was unmasked and has not yet taken part in a successful op; an op
  /// it disagrees on (or submits a rejected slot for: e.g. a combine of a dispatch it never
  /// saw) masks it again instead of failing the group (ReMaskStrayRejoiners).
  std::vector<uint8_t> rejoined_;
  /// masked_at_seq_[r]: the op being collected when rank r was masked (an unmask after ops
  /// ran without it clears its handle table).
  std::vector<uint64_t> masked_at_seq_;
  std::vector<int32_t> mask_scratch_;  ///< Poll: ranks to mask (capacity R).
  /// The ranks one mask change masked or unmasked, for its log line (capacity R).
  std::vector<int32_t> changed_scratch_;
  uint64_t current_seq_ = 1;  ///< The group op being collected or running.
  std::optional<std::chrono::steady_clock::time_point> op_started_;
  /// While set: rank catch_up_rank_, being unmasked but behind the group and submitting
  /// (its stale requests are refused at once), is waited for: the other ranks' requests for
  /// the next op are not taken until it has caught up (then it is unmasked) or this time
  /// has passed (op_timeout after its first stale request at a boundary; then it stays
  /// masked). Single-node groups only (UpdateCatchUpLocked).
  std::optional<std::chrono::steady_clock::time_point> catch_up_until_;
  int32_t catch_up_rank_ = -1;
  /// [R] when each rank's request for the op being collected was picked up (metrics: the
  /// straggler). Sized R at construction.
  std::vector<std::chrono::steady_clock::time_point> arrived_;
  std::shared_ptr<metrics::GroupMetrics> metrics_;
  std::optional<OpPlan> running_;  ///< The op the backend is running.
  // Per-op state sized R at construction and reused, so that an op allocates nothing
  // (README "Hot path"; tests/unit/hot_path_alloc_test.cc).
  std::vector<abi::RequestSlot> running_slots_;  ///< [R] the collected/running op's slots.
  std::vector<RankOutcome> outcomes_;            ///< [R] the running op's outcomes.
  std::vector<int32_t> missing_;                 ///< Poll: ranks not arrived (capacity R).
  std::vector<int32_t> gone_;                    ///< Poll: missing ranks that left (capacity R).
  std::map<uint64_t, absl::Status> failed_ops_;  ///< Recent failed ops, for late ranks.
  /// Low-latency ops counted before current_seq_ (and the running op): the buffer rule.
  rules::LowLatencyParity parity_;
  uint64_t ll_dispatch_seq_[kernels::kLowLatencyBuffers] = {0, 0};  ///< Owner of buffer b.
  std::atomic<uint64_t> ops_completed_{0};
  std::atomic<uint64_t> ops_failed_{0};
};

/// Allocates the next endpoint id (process-wide, never 0).
uint64_t NextEndpointId();

}  // namespace epd
