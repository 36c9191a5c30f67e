// A group on the CUDA backend: lockstep ops launched on every rank's stream (daemon-
// launched mode), started and polled without blocking, the stream-release protocol for
// stream-ordered requests, and the group's graph-mode program. DESIGN.md §3.2.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "daemon/dataplane/cuda/cuda_plane.h"
#include "daemon/dataplane/cuda/cuda_rank.h"
#include "daemon/dataplane/cuda/graph_program.h"
#include "daemon/dataplane/exchange/node_exchange.h"
#include "daemon/dataplane/lockstep_group.h"
#include "daemon/dataplane/op_gpu_timer.h"
#include "daemon/dataplane/op_launch_trace.h"
#include "daemon/metrics/expert_tally.h"
#include "epd/kernels/cuda_mirror.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/cuda_reduce.h"
#include "epd/kernels/host_ops.h"

namespace epd {

/// TimingEvents on CUDA events (cudaEventRecord / Query / ElapsedTime); a failed call's
/// error is cleared (not sticky), and the op is then not timed.
class CudaTimingEvents final : public TimingEvents {
 public:
  bool Record(void* event, void* stream) override;
  State Query(void* event) override;
  bool ElapsedMs(void* begin, void* end, float* ms) override;
};

/// One group on the CUDA backend. Served by the engine of its first attached rank's GPU;
/// one group op per GPU at a time (CudaDataPlaneImpl::TryClaimGpus). A group that spans
/// nodes runs its ops through the exchange on each rank's pinned mirror instead (copy
/// kernels only, no GPU claim: DESIGN.md §5.5, cuda_span.cc). A successful op and a
/// graph-mode instance allocate nothing on the engine thread (README "Hot path").
class CudaGroup : public LockstepGroup, private GraphProgram::Host, private NodeExchangeHost {
 public:
  CudaGroup(CudaDataPlaneImpl* plane, const v1::GroupSpec& spec);
  ~CudaGroup() override;
  /// No work of this group's on a GPU: no op running or abandoned, no graph-mode program
  /// armed or still draining. Takes mu_ (EngineHost::FirstBusyGroup, between rounds).
  bool Quiescent() override;
  /// A group that spans nodes (DESIGN.md §5.5): its exchange, made before the first rank
  /// attaches (`join_secret_digest` goes into its Peer mesh registration).
  void MakeExchange(std::string join_secret_digest, SpanTransport span_transport);

  // ---- graceful stop (cuda_group_stop.cc; the plane's Shutdown drives it) ----
  /// What Stop did, summed into the plane's GpuDrainReport.
  struct StopReport {
    int32_t ops_failed = 0;         ///< Requests completed with the stop's status (FailAll).
    bool program_disarmed = false;  ///< An armed graph-mode program was released.
  };
  /// Shutdown, with the engines stopped and the plane's shutdown word raised (so the
  /// group's kernels end their spins): disarms the program (its waiting instances released,
  /// program_done = kProgramReleased behind them), completes every running, popped and
  /// queued request with `status` (ops never launched get done_seq = seq on their stream),
  /// and notes every stream-ordered request in flight: until its client writes ready_seq,
  /// its staging kernel, still to run on the client's stream, will write into this group's
  /// GPU memory (StagingsLanded). Later ops of the group are refused.
  StopReport Stop(const absl::Status& status);
  /// After Stop: whether every noted staging has landed (ready_seq >= its seq, read from the
  /// GPU by a kernel into pinned memory: the first call only enqueues the reads, later ones
  /// see them); `missed` (when not null) gets "group G rank R op N" for each one that has
  /// not. `awaited` (when not null) gets how many have not.
  bool StagingsLanded(std::vector<std::string>* missed = nullptr, int32_t* awaited = nullptr);
  /// Whether every stream of the group's ranks (attached, stand-ins, masked areas, and those
  /// of a running, abandoned or disarmed op) is idle; `busy` (when not null) gets "group G
  /// rank R" for each one that is not. Clears a non-sticky CUDA error.
  bool StreamsIdle(std::vector<std::string>* busy = nullptr);
  /// After Stop, once the stagings landed or the drain's first bound passed: releases from
  /// the host whatever may still wait: the daemon's ready waits of the running op
  /// (ReleaseReadyWaits), then on every daemon-launched rank's area done_seq = kReleasedSeq
  /// and, for a disarmed program's ranks, program_done = kProgramReleased, written from the
  /// engine's aux stream (not behind the ranks' own streams), so every client wait on this
  /// group's memory (a stream wait, a staging kernel's DoneWait) passes. Bounded: the aux
  /// stream carries only stream memory writes.
  void ReleaseClients();

 protected:
  /// 0 (the data area is on the GPU), except for a client-launched rank of a spanning
  /// group: its mirror and command block (abi::SpanDataBytes).
  uint64_t ShmDataBytes(const RankResources& res) const override;
  absl::StatusOr<std::shared_ptr<RankResources>> PrepareRank(int32_t rank,
                                                             const std::string& gpu_uuid,
                                                             v1::LaunchMode launch_mode,
                                                             v1::EndpointInfo* info) override;
  absl::Status RankAttached(int32_t rank, const std::shared_ptr<RankResources>& res) override;
  /// A FAIL-policy group's rank: dropped from the next ops, its resources freed with its
  /// last reference, between engine rounds (DeferredRelease); a masking group's:
  /// KeepAsStandIn.
  void RankDetached(int32_t rank) override;
  // A client-launched rank of a spanning group (DESIGN.md §5.5 "Client-launched"): its
  // mirror in its endpoint region, its requests from its command block, its answers there.
  absl::Status RankRegionReady(int32_t rank, RankResources& res, uint8_t* shm_data,
                               uint64_t first_seq) override;
  bool BackendRequestSource(int32_t rank) const override;
  bool PopBackendRequest(int32_t rank, uint64_t next_seq, abi::RequestSlot* slot) override;
  void RankOpEnded(int32_t rank, const abi::RequestSlot& slot, const RankOutcome& outcome,
                   const OpPlan* plan) override;
  bool ReadyToStart() override;
  bool StartOpInto(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots,
                   std::span<RankOutcome> outcomes) override;
  bool PollOpInto(std::span<RankOutcome> outcomes) override;
  void WakeEngine() override;
  /// Every rank of the group rings the engine the group adopted (its first rank's GPU).
  absl::StatusOr<ScopedFd> DoorbellFd(int32_t rank) const override;
  absl::Status CheckRequest(int32_t rank, const abi::RequestSlot& slot) const override;
  absl::Status AcceptsRequests(int32_t rank) const override;
  void OpEndedWithoutLaunch(int32_t rank, const abi::RequestSlot& slot) override;
  absl::Status CheckProgram(int32_t rank) const override;
  bool PollBackground() override;
  /// Rank masking (one-node, daemon-launched groups): a masked rank's part of each op runs
  /// on its own area, or, once it detached, on the area it left (kept as its stand-in),
  /// with T = 0; the mask reaches the kernels through mask_arrays_ (UploadMask).
  void RankMaskChanged(int32_t rank, bool masked) override;
  // Spanning groups (DESIGN.md §5.5): the exchange's hooks.
  absl::Status NodeChosen(int32_t node) override;
  void OpFailedHere(uint64_t seq, uint32_t op, const absl::Status& status) override;
  absl::Status PeerFailure(uint64_t seq, int64_t local_op) override;
  std::string NotReadyReason() const override;
  /// While a spanning op is in the exchange the transport wakes the engine; while its
  /// copies run on the GPU the engine polls.
  bool RunningOpWakesEngine() const override {
    // While the GPU packs the rows to send, the exchange polls it: no wake comes.
    return spanning() && span_phase_ == SpanPhase::kExchanging && !exchange_->packing();
  }

 private:
  using Clock = std::chrono::steady_clock;

  /// An op on the GPU: the ranks it runs on (kept alive until it finished), per-rank
  /// launch errors, which ranks' streams wait for their client (kFlagStreamOrdered), when
  /// it started. Every vector has R entries (SizeOp); a program's tail too.
  struct GpuOp {
    abi::OpKind op = abi::OpKind::kInvalid;
    uint64_t seq = 0;
    std::vector<std::shared_ptr<CudaRank>> ranks;
    std::vector<absl::Status> launch;
    std::vector<bool> stream_ordered;
    std::vector<bool> ready_wait;  ///< The rank's stream got the ready_seq stream wait.
    /// The most pairs (or routes) the rank's op can drop: DeviceStatus::dropped_pairs, read
    /// back from its area (client-writable), is checked against it.
    std::vector<int64_t> max_dropped;
    /// A masking group's rank that left during the op before its stream staged the inputs
    /// (its ready wait released by RankDetached): the op fails for every rank.
    std::vector<bool> left_unstaged;
    /// A failed launch wrote the rank's done_seq on its own stream (ReleaseRanksAfterFailed-
    /// Launch): its client may already have written a later ready_seq, which a release from
    /// the host must not overwrite (ReleaseReadyWait skips the rank). Also set by a graceful
    /// stop once it has settled the rank's ready wait (ReleaseClients).
    std::vector<bool> done_written;
    /// Launched through op graphs: the streams they were launched on (one per GPU;
    /// capacity R, cleared per op). The op has left the GPU once these and every rank's
    /// done event are complete (GraphStreamsBusy).
    std::vector<cudaStream_t> graph_streams;
    /// Launched fused (cuda_group_fused.cc): lead[r] is the rank whose stream ran rank r's
    /// part (the first rank of its GPU); -1 on every other path. [R]
    std::vector<int32_t> lead;
    Clock::time_point started;
  };

  // NodeExchangeHost: each local rank's pinned mirror.
  // The running op's ranks (it keeps a rank that detached meanwhile alive), else ranks_.
  uint8_t* ExchangeRankData(int32_t rank) const override { return SpanRank(rank).mirror->base; }
  transport::MemoryRegion ExchangeRankRegion(int32_t rank, uint64_t* memory_id) const override {
    const CudaRankMirror& m = *SpanRank(rank).mirror;
    *memory_id = m.memory_id;
    return {m.base, CudaRankMirror::MirrorBytes(layout()), transport::MemoryKind::kHost};
  }
  RankRouting& ExchangeRankRouting(int32_t rank) const override {
    return SpanRank(rank).mirror->routing;
  }
  const CudaRank& SpanRank(int32_t rank) const {
    return gpu_op_ && gpu_op_->ranks[rank] ? *gpu_op_->ranks[rank] : *ranks_[rank];
  }
  const rules::HandleTable& ExchangeRankHandles(int32_t rank) const override {
    return endpoint(rank)->handles;
  }
  uint64_t ExchangeCurrentSeq() const override { return current_seq(); }
  /// Join refuses MASK for a spanning group on this backend: no rank is ever masked here.
  const std::vector<uint8_t>& ExchangeRankMasked() const override { return rank_masked(); }
  void ExchangeWarning(const std::string& message) const override {
    LogClientCaused(spdlog::level::warn, "{}", message);
  }
  /// Rows on the GPU (DESIGN.md §5.5): a daemon-launched rank's received rows are gathered
  /// by a kernel into its GPU area (StageOut), from the receive region and quantized rows
  /// registered with CUDA here, and from the local ranks' GPU areas.
  std::unique_ptr<ExchangeHostMapping> ExchangeMapHostMemory(void* p,
                                                             uint64_t bytes) const override;
  kernels::RowSource* ExchangeRowSources(int32_t rank) const override {
    const CudaRank& cr = SpanRank(rank);
    // A client-launched local rank's rows are in its client's memory, which the daemon's
    // kernels cannot read: then every row is copied.
    if (ClientLaunchedInOp() || !cr.mirror || !cr.mirror->row_sources) return nullptr;
    // One gather takes at most kMaxGatherBlocks blocks (a low-latency dispatch has one per
    // local expert): beyond that the exchange copies the rows through the mirror.
    if (span_plan_ != nullptr && span_plan_->op == abi::OpKind::kLowLatencyDispatch &&
        shape().num_local_experts() > kernels::cuda::kMaxGatherBlocks) {
      return nullptr;
    }
    cr.mirror->rows_pending = true;
    return cr.mirror->row_sources.get();
  }
  bool ExchangeRowsQuantized(int32_t rank, uint64_t seq) const override {
    const CudaRank& cr = SpanRank(rank);
    return cr.mirror && !cr.client_launched && seq != 0 && cr.mirror->quantized_seq == seq;
  }
  /// The send side: a daemon-launched rank's rows to the other nodes are packed by a kernel
  /// (the row gather) from its GPU area into the exchange's send staging, and the exchange
  /// posts once its `packed` event passed.
  bool ExchangePacksRows(int32_t rank) const override {
    const CudaRank& cr = SpanRank(rank);
    return !cr.client_launched && cr.mirror && cr.mirror->windows;
  }
  absl::Status ExchangePackRows(int32_t rank, const kernels::RowGather& g) const override;
  /// Whether a local rank of the running spanning op is client-launched.
  bool ClientLaunchedInOp() const;
  absl::StatusOr<bool> ExchangeRowsPacked(int32_t rank) const override;
  /// Enqueues rank `r`'s gather of the running dispatch's rows (its rows_pending) on its
  /// stream, reading the local ranks on its GPU from their areas rather than their mirrors.
  absl::Status GatherRankRows(const OpPlan& plan, const CudaRank& cr);
  /// The windows of op `plan` for rank `cr`'s gather and pack (CudaRankMirror::windows),
  /// built at the first use in the op: every daemon-launched local rank on its GPU (mirror
  /// onto area) and the GPU copies of a low-latency FP8 dispatch's quantized tokens. Their
  /// number.
  int32_t OpWindows(const OpPlan& plan, const CudaRank& cr) const;
  /// Whether op `plan`'s rows stay on the GPU (MirrorInputSpans' BackendRows; a low-latency
  /// FP8 dispatch's quantized tokens only in the ranks' GPU copies): a dispatch's token
  /// rows, a combine's rows from this node's ranks, when every local rank is
  /// daemon-launched on one GPU, so that every gather, pack and reduce reads them from the
  /// areas through OpWindows and the exchange never reads them on the host.
  bool RowsOnBackend(const OpPlan& plan) const;

  /// The combines' reduce on the GPU (DESIGN.md §5.5 "Rows on the GPU"): a daemon-launched
  /// rank's combined rows are recorded by the exchange as terms in its mirror's reduce table
  /// and summed by a kernel into its GPU area (StageOut: ReduceRankRows). Null for a
  /// client-launched rank (its client's kernels copy its outputs) and for more top-k slots
  /// than one reduce takes (kMaxReduceTerms): the exchange reduces those.
  /// Also null while a local rank of the op is client-launched: its rows are in its client's
  /// memory, which the daemon's kernels cannot read.
  kernels::ReduceTable* ExchangeReduceTable(int32_t rank) const override;
  /// Enqueues rank `cr`'s reduce of the running combine's rows (its reduce_pending) on its
  /// stream, reading this node's rows from the local ranks' GPU areas through OpWindows,
  /// as GatherRankRows does.
  absl::Status ReduceRankRows(const OpPlan& plan, const CudaRank& cr);
  /// Records rank `cr`'s `gathered` event after its gather or reduce (StageOutAll holds the
  /// other stream-ordered ranks' done_seq behind it).
  absl::Status RecordGathered(const CudaRank& cr);

  // ---- a group that spans nodes (DESIGN.md §5.5) ----
  /// Where the running spanning op is: its inputs being copied into the mirrors, the
  /// exchange on the mirrors, its outputs being copied back to the GPU.
  enum class SpanPhase { kIdle, kStagingIn, kExchanging, kStagingOut };
  /// Enqueues every local rank's ready wait (stream-ordered) and copy of the op's inputs
  /// into its mirror; the op then runs on in PollSpanning.
  bool StartSpanning(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots);
  bool PollSpanning(std::span<RankOutcome> outcomes);
  /// Rank r's part of StartSpanning on its stream.
  absl::Status StageIn(const OpPlan& plan, const abi::RequestSlot& slot, int32_t r,
                       bool* ready_wait);
  /// Rank r's copy of its outputs (when `outcome` is OK) to its GPU area (and its gather,
  /// then its `gathered` event).
  absl::Status StageOut(const OpPlan& plan, const abi::RequestSlot& slot, int32_t r,
                        const RankOutcome& outcome);
  /// StageOut of every local rank, then on each rank's stream done_seq (stream-ordered;
  /// after the other ranks' gathers, which may read its area) and the done event. Errors
  /// go to the op's per-rank launch status.
  void StageOutAll(GpuOp& op);
  /// Ends the spanning op with `status` for every local rank without the exchange's
  /// result (staging failed or timed out): tells the other nodes and releases the streams.
  void FailSpanning(const absl::Status& status);
  void PublishJoined(int32_t changed, bool joined);

  // GraphProgram::Host.
  const std::string& ProgramGroupName() const override { return spec().name(); }
  kernels::cuda::CudaRankContext ProgramRankContext(int32_t r, int32_t num_sms) const override;
  cudaStream_t ProgramAuxStream(int device) const override;
  abi::EndpointShmHeader* ProgramHeader(int32_t r) const override;
  void ProgramInstanceChecked(bool ok) override { CountProgramInstance(ok); }
  void ProgramWarning(const std::string& message) override;

  /// Register / unregister (from StartOpInto, GPUs claimed): writes every rank's outcome.
  void ProgramOp(const OpPlan& plan, std::span<RankOutcome> outcomes);
  /// Disarms the armed program (GraphProgram::Disarm); its tail keeps the GPUs claimed
  /// until it has left the GPU (ProgramTailDone). No-op when none is armed. `stopping`:
  /// epd's stop (GraphProgram::Disarm's shorter bound).
  void DisarmProgram(const absl::Status& why, bool stopping = false);
  /// True once the disarmed program's tail has left the GPU (then releases it).
  bool ProgramTailDone();

  // ---- rank masking (cuda_group_mask.cc) ----
  /// RankDetached of a masking group: rank `rank` stays in every op as a masked rank, played
  /// on the area it left (standins_); a running op it left before staging its inputs is
  /// released from the host and fails (GpuOp::left_unstaged).
  void KeepAsStandIn(int32_t rank);
  /// When a rank rejoined a masked slot (bases_dirty_): copies host_bases_ to every GPU's
  /// peer array before an op's launches (the group's GPUs claimed and idle), then drops the
  /// stand-ins of attached ranks (freed later, DeferredRelease). Errors: CUDA.
  absl::Status UploadPeerBases();
  /// Copies rank_masked() to every GPU's mask array (mask_arrays_) when it changed
  /// (mask_dirty_), synchronously, before an op's launches (the GPUs are claimed and idle).
  /// Errors: CUDA (INTERNAL, RESOURCE_EXHAUSTED).
  absl::Status UploadMask();

  /// Recomputes devices_ from ranks_ and standins_ (capacity R: allocates nothing).
  void UpdateDevices();
  /// Rank r's resources in the next op: its attached rank, else its masked stand-in (null
  /// when neither).
  const std::shared_ptr<CudaRank>& OpRank(int32_t r) const {
    if (masked_areas_[r]) return masked_areas_[r];
    return ranks_[r] ? ranks_[r] : standins_[r];
  }
  /// A live rank was masked: its part of the ops that run without it is played on an area of
  /// its own (masked_areas_), so that they never write the area its client reads its last
  /// results from. On allocation failure its own area is used, and a warning says so.
  void UseMaskedArea(int32_t rank);
  /// Copies `bases` [R] into the peer array of every GPU of the group (devices_, and
  /// `fresh`'s when not null: a rank being attached, whose stream may be used), allocating
  /// a GPU's array at its first rank. Synchronous. Errors: CUDA.
  absl::Status CopyPeerBases(const std::vector<uint8_t*>& bases, const CudaRank* fresh);
  /// Rank r's kernel context (kernels::cuda::MakeRankContext) with `num_sms` blocks.
  kernels::cuda::CudaRankContext Context(int32_t r, int32_t num_sms) const;

  // ---- per-GPU op graphs (cuda_group_graphs.cc) ----
  // With CudaDataPlaneOptions::op_graphs, an op that an op graph covers is launched as one
  // cudaGraphLaunch per GPU of the group instead of every rank's launches: each variant of
  // the op is captured once, at its first op, for every rank of the group on that GPU (the
  // per-rank path below, captured), with the op's seq and each rank's T read by the
  // kernels from the ranks' Readback words, which the engine writes before the launch.
  // Covered: low-latency dispatch and combine with every rank stream-ordered and none
  // masked, under kernel_ready_wait (MPS), on one node, no program armed. Everything else
  // (normal ops, masked ranks, the stream-wait hand-off without MPS, spanning groups, a
  // variant whose capture failed) takes the per-rank path (LaunchRank).

  /// What one set of op graphs serves: the op, its low-latency buffers and its FP8
  /// options. Everything else its kernels take is fixed while the group's ranks are
  /// (ranks_generation_) or read from the ranks' Readback words.
  struct OpGraphKey {
    abi::OpKind op = abi::OpKind::kInvalid;
    int buffer = 0;         ///< LowLatencyDispatch: OpPlan::ll_buffer.
    int handle_buffer = 0;  ///< LowLatencyCombine: OpPlan::ll_handle_buffer.
    int out_buffer = 0;     ///< LowLatencyCombine: OpPlan::ll_out_buffer.
    bool use_fp8 = false;
    bool round_scale = false;
    bool use_ue8m0 = false;
    bool operator==(const OpGraphKey&) const = default;
  };
  /// One GPU's graph of a variant: every rank of the group on that GPU, launched on the
  /// stream of the first of them.
  struct OpGraphDevice {
    int device = 0;
    cudaStream_t stream = nullptr;
    GraphExecHandle exec;
  };
  /// A variant's graphs, one per GPU of the group; `failed`: its capture failed once (a
  /// warning was logged), so its ops take the per-rank path until the ranks change.
  struct OpGraphSet {
    OpGraphKey key;
    bool failed = false;
    std::vector<OpGraphDevice> devices;
  };
  /// At most this many variants are kept per group; later ones take the per-rank path.
  static constexpr size_t kMaxOpGraphVariants = 32;

  /// Whether every rank of `plan` takes the kernel hand-off under kernel_ready_wait (a
  /// wait kernel, then the op's kernel writing done_seq itself): a one-node low-latency op,
  /// every rank daemon-launched, stream-ordered and unmasked, no program armed, no work
  /// left on a rank's stream. What op graphs and fused launches can cover.
  bool EveryRankHandsOffInAKernel(const OpPlan& plan,
                                  const std::vector<abi::RequestSlot>& slots) const;
  /// The variant of `plan` when op graphs cover it (see above), given `slots`.
  std::optional<OpGraphKey> OpGraphVariant(const OpPlan& plan,
                                           const std::vector<abi::RequestSlot>& slots) const;
  /// The graphs of `key`, captured now at its first op (allocates; logs a warning and
  /// returns null when the capture fails). Drops every graph first when the group's ranks
  /// changed since they were captured.
  const OpGraphSet* OpGraphsFor(const OpGraphKey& key, const OpPlan& plan,
                                const std::vector<abi::RequestSlot>& slots);
  /// Captures one GPU's graph of `plan` for the ranks of the group on `device`.
  /// Errors: CUDA (INTERNAL), naming the call; the ranks' streams are out of capture on
  /// every path.
  absl::Status CaptureOpGraph(int device, const OpPlan& plan,
                              const std::vector<abi::RequestSlot>& slots, OpGraphDevice* out);
  /// Launches `set` for `plan` into `op` (its per-rank state, as StartOpInto's per-rank
  /// path fills it): writes the ranks' Readback words, then one cudaGraphLaunch per GPU.
  void LaunchOpGraphs(const OpGraphSet& set, const OpPlan& plan,
                      const std::vector<abi::RequestSlot>& slots, GpuOp& op);
  /// The CUDA enqueue calls of `op` on the per-rank path (EPD_OP_TRACE's launch count).
  int32_t PerRankLaunchCalls(const OpPlan& plan, const GpuOp& op) const;
  /// EPD_OP_TRACE: the running op ended (seen now), its GPU time `gpu_ns` if timed; logs
  /// the group's summary once a second.
  void TraceOpDone(std::optional<uint64_t> gpu_ns);
  /// Whether a graph of `op` is still running on one of its launch streams (a done event
  /// that is a graph node is complete only once its node ran; the whole graph is checked
  /// too, whatever the event semantics of graph nodes). Clears a non-sticky error.
  static bool GraphStreamsBusy(const GpuOp& op);
  /// Hands every op graph to the plane's DeferredRelease (never destroyed on the engine
  /// path beside another group's launches: DESIGN.md §8.2).
  void DropOpGraphs();
  /// After a failed launch of every rank of `device` at once (an op graph's or a fused
  /// launch's): each of those ranks' status is read back, its client's stream released
  /// (done_seq) and its done event recorded, on its own stream; op.launch[r] = `st`.
  void ReleaseRanksAfterFailedLaunch(int device, const OpPlan& plan, GpuOp& op,
                                     const absl::Status& st);

  // ---- fused launches (cuda_group_fused.cc) ----
  // With CudaDataPlaneOptions::fused_launch, a daemon-launched low-latency op is, per GPU of
  // the group, one WaitFlagsAsync for the ready flags of every rank there and one fused
  // kernel for all of them behind it (programmatic), on the stream of the first of them,
  // with one begin and one done event: four enqueue calls per GPU whatever the ranks, where
  // the per-rank path makes four per rank, and the ranks' blocks start together. Covered as
  // op graphs are (every rank stream-ordered and unmasked, under kernel_ready_wait, on one
  // node, no program armed, no work left on a rank's stream), with at most
  // kernels::cuda::kMaxFusedRanks ranks per GPU.

  /// The ranks of the group on one GPU, for the fused launch.
  struct FusedDevice {
    int device = 0;
    std::vector<int32_t> ranks;  ///< Ascending; ranks.front() owns the launch stream.
  };
  /// Whether a fused launch covers `plan` (see above); refreshes fused_devices_ when the
  /// group's ranks changed (allocates only then).
  bool FusedLaunchCovers(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots);
  /// Before work is enqueued on rank r's own stream outside an op (a done_seq write): when
  /// the running or abandoned op ran r's part fused on another rank's stream, r's stream
  /// first waits for that stream's done event, so the write lands after the kernel's own
  /// done_seq store (done_seq never goes back) and after its last access to r's area.
  void OrderAfterFusedOp(int32_t r) const;
  /// Launches `plan` fused on every GPU of the group into `op` (as StartOpInto's per-rank
  /// path fills it); a GPU whose launch fails gets ReleaseRanksAfterFailedLaunch.
  void LaunchFused(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots, GpuOp& op);
  /// The bound of a daemon-launched op's ready wait kernel, in ns: op_timeout + twice the
  /// engine's grace, so it outlasts the engine's give-up, after which ReleaseReadyWaits
  /// writes ready_seq from the host.
  int64_t ReadyWaitBoundNs() const;
  /// Rank r's hand-off of a stream-ordered low-latency op for `slot` (KernelHandoff: ready
  /// and done at slot.seq, or read from `seq_word` when set; status written by the kernel).
  kernels::cuda::KernelHandoff HandoffFor(const abi::RequestSlot& slot, int32_t r,
                                          const uint64_t* seq_word) const;
  /// Rank r's LowLatencyDispatch / LowLatencyCombine arguments for `plan`, as both launch
  /// paths pass them (`captured`: T from the rank's Readback word, for op graphs).
  kernels::cuda::LowLatencyDispatchArgs DispatchArgsFor(const OpPlan& plan,
                                                        const abi::RequestSlot& slot, int32_t r,
                                                        const kernels::cuda::KernelHandoff& handoff,
                                                        bool captured) const;
  kernels::cuda::LowLatencyCombineArgs CombineArgsFor(
      const OpPlan& plan, int32_t r, const kernels::cuda::KernelHandoff& handoff) const;
  /// Enqueues rank r's part of `plan` on its stream: for a stream-ordered slot first the
  /// wait for ready_seq >= seq (then *ready_wait = true), then the op's kernels. A
  /// stream-ordered low-latency op's kernel checks ready_seq and writes done_seq itself
  /// (KernelHandoff), and with kernel_ready_wait() the wait is a WaitFlagAsync kernel
  /// (SpinsForReady) instead of cuStreamWaitValue64.
  /// `captured`: the launches are being captured into an op graph (CaptureOpGraph):
  /// the op's seq and the rank's T come from its Readback words (op_seq, op_num_tokens)
  /// instead of `slot`, and the begin event is a graph node (cudaEventRecordExternal).
  absl::Status LaunchRank(const OpPlan& plan, const abi::RequestSlot& slot, int32_t r,
                          bool* ready_wait, bool captured = false);
  absl::Status ResetSync();
  /// Serves this group from the engine of `device` unless an engine already does.
  void AdoptEngine(int device);
  /// Gives every vector of `op` R entries (no allocation when they already have).
  void SizeOp(GpuOp& op) const;
  /// Whether rank r's part of `op` hands off inside its low-latency kernel (LaunchRank).
  static bool KernelHandsOff(const GpuOp& op, size_t r);
  /// Whether that rank's ready wait is a WaitFlagAsync kernel (Readback::ready_seen).
  bool SpinsForReady(const GpuOp& op, size_t r) const {
    return !spanning() && KernelHandsOff(op, r) && plane_->kernel_ready_wait();
  }
  /// Moves a finished op's vectors back into spare_ for the next op, dropping its rank
  /// references (DropOpRanks: a rank that left during the op is not kept by the spare).
  void RecycleOp(std::optional<GpuOp>& op);
  /// Drops every rank reference of `op`. A last one hands the rank to DeferredRelease.
  void DropOpRanks(GpuOp& op);
  /// Enqueues done_seq = seq on rank `cr`'s stream (after everything already on it).
  absl::Status WriteDone(const CudaRank& cr, uint64_t seq) const;
  /// For every stream-ordered rank of `op` whose stream still waits for ready_seq (its
  /// client never wrote it), writes ready_seq = op.seq from the host so that the stream
  /// and the op's kernels (bounded by op_timeout) can end. Used when the op is given up
  /// on and before the group's memory is freed.
  void ReleaseReadyWaits(const GpuOp& op) const;
  /// ReleaseReadyWaits for rank r of `op` alone; true when it wrote ready_seq (the rank's
  /// stream was still waiting for its client).
  bool ReleaseReadyWait(const GpuOp& op, size_t r) const;

  /// A stream-ordered request in flight at Stop whose client had not written ready_seq: its
  /// rank (kept alive) and seq.
  struct PendingStaging {
    std::shared_ptr<CudaRank> rank;
    int32_t r = 0;
    uint64_t seq = 0;
    bool landed = false;  ///< Seen landed by StagingLanded.
    /// When StagingLanded may enqueue the next read of ready_seq (not one per poll).
    std::chrono::steady_clock::time_point next_read{};
  };
  /// Whether the client of `p` has written ready_seq >= p.seq, as last read into its
  /// Readback::stop_ready; when not, and a read is due, enqueues the next one (a one-thread
  /// kernel on the engine's aux stream: no copy engine, no wait). True when the read cannot
  /// be enqueued (nothing to wait for then).
  /// `read`: the ranks whose ready_seq a read was enqueued for in this pass (a rank's
  /// stagings share one read: one kernel per rank, not one per pending op).
  bool StagingLanded(PendingStaging& p, std::vector<const CudaRank*>* read);
  /// Calls f(int32_t r, const CudaRank&) for every rank resource whose stream the group may
  /// have used (see StreamsIdle), each once.
  template <typename F>
  void ForEachStreamRank(F&& f) const;

  CudaDataPlaneImpl* plane_;
  /// Set by Stop (under mu_): OpEndedWithoutLaunch notes the clients' stagings still to come.
  bool stopping_ = false;
  std::vector<PendingStaging> pending_stagings_;  ///< Guarded by mu_ (Stop's notes).
  /// The ranks of a program disarmed by Stop (ReleaseClients writes their program_done).
  std::vector<std::shared_ptr<CudaRank>> stopped_program_ranks_;
  std::atomic<GpuEngine*> engine_{nullptr};
  std::mutex engine_mu_;  // Serialises AdoptEngine.
  // Guarded by LockstepGroup::mu_:
  std::vector<std::shared_ptr<CudaRank>> ranks_;  // Attached ranks.
  /// [R] a rank that detached from a masking group: its resources, kept as its masked
  /// stand-in (its area's sync state stays in step with the others', so no reset) until a
  /// process rejoins the slot. Null otherwise.
  std::vector<std::shared_ptr<CudaRank>> standins_;
  /// [R] an attached rank that is masked: the scratch area its masked part runs on (every
  /// peer array names it), allocated at its first mask and kept, from its unmask, in
  /// spare_masked_areas_ (the rank's own area is then reset into step: needs_sync_reset_).
  /// When the rank detaches it becomes its stand-in. Null otherwise.
  std::vector<std::shared_ptr<CudaRank>> masked_areas_;
  /// [R] an attached rank's masked area after its unmask, kept for its next mask (so that
  /// masks and unmasks in a loop allocate once); dropped when the rank detaches.
  std::vector<std::shared_ptr<CudaRank>> spare_masked_areas_;
  /// GPU -> device array [R] of uint8, the rank mask the kernels read
  /// (CudaRankContext::rank_masked); allocated at the first mask.
  std::map<int, DeviceMemory> mask_arrays_;
  bool mask_dirty_ = false;   ///< rank_masked() changed since the last UploadMask.
  bool bases_dirty_ = false;  ///< host_bases_ changed since the last UploadPeerBases.
  bool any_masked_ = false;   ///< The uploaded mask has a masked rank (else null in contexts).
  std::vector<uint8_t*> host_bases_;        // [R] data-area bases.
  std::map<int, DeviceMemory> peer_bases_;  // GPU → device array [R].
  /// The distinct GPUs of the attached ranks, ascending (capacity R): what an op claims.
  std::vector<int> devices_;
  bool needs_sync_reset_ = false;  // Kernel sync state must be zeroed.
  // The per-op state is sized R once and moved, never reallocated (README "Hot path"): the
  // next op's GpuOp waits in spare_ while no op is on the GPU, moves into gpu_op_ while one
  // runs (into abandoned_ if it is given up on), and back into spare_ once it has left.
  GpuOp spare_;
  std::optional<GpuOp> gpu_op_;     // The op running on the GPU.
  std::optional<GpuOp> abandoned_;  // An op given up on, still on the GPU.
  /// [R] scratch of one poll (PollOpInto): each rank's cudaEventQuery.
  std::vector<cudaError_t> event_errors_;
  /// The op graphs (cuda_group_graphs.cc), at most kMaxOpGraphVariants, captured for the
  /// group's ranks of generation op_graphs_generation_.
  std::vector<OpGraphSet> op_graphs_;
  /// Bumped whenever an op's ranks (OpRank) change: graphs of an older one are dropped.
  uint64_t ranks_generation_ = 0;
  uint64_t op_graphs_generation_ = 0;
  /// The group's ranks per GPU for fused launches, of generation fused_generation_.
  std::vector<FusedDevice> fused_devices_;
  uint64_t fused_generation_ = 0;
  bool fused_fits_ = false;  ///< No GPU of fused_devices_ holds more than kMaxFusedRanks.
  /// A fused launcher refused the group's ops (INVALID_ARGUMENT before anything was
  /// enqueued): ranks of this generation take the per-rank path (logged once).
  std::optional<uint64_t> fused_refused_generation_;
  /// Work was enqueued on a rank's stream outside an op (OpEndedWithoutLaunch's done_seq
  /// write): the next op takes the per-rank path, which orders its launches behind it.
  bool streams_touched_ = false;
  /// EPD_OP_TRACE: the running op's timestamps and the group's window of them.
  OpLaunchTrace::Op trace_op_;
  std::unique_ptr<OpLaunchTrace> trace_;
  /// The running op's GPU time: each rank's op_begin → done (epd_op_gpu_seconds).
  CudaTimingEvents timing_events_;
  OpGpuTimer gpu_timer_;
  /// Per-expert received-token totals of the ranks' dispatch kernels, read at scrape time
  /// (epd_expert_received_tokens_total); shared with the ranks and the group's metrics.
  /// Null for a spanning group.
  std::shared_ptr<metrics::ExpertTokenTally> expert_tally_;
  std::unique_ptr<GraphProgram> program_;  // The armed graph-mode program.
  std::optional<GpuOp> program_tail_;      // A disarmed program still on the GPU.
  // A spanning group's (null / unused otherwise); the op's state lives in gpu_op_.
  std::unique_ptr<NodeExchange> exchange_;
  kernels::host::HostScratch kernel_scratch_;  // Reserved by MakeExchange.
  SpanPhase span_phase_ = SpanPhase::kIdle;
  /// EPD_OP_TRACE: the running spanning op's phase times (engine thread), logged per op.
  struct SpanTrace {
    Clock::time_point start, staged, sent, finish_begin, finished, done;
  };
  SpanTrace span_trace_;
  void LogSpanTrace();
  const OpPlan* span_plan_ = nullptr;
  bool span_rows_on_backend_ = false;  ///< RowsOnBackend of the running spanning op.
  const std::vector<abi::RequestSlot>* span_slots_ = nullptr;
  std::vector<RankOutcome> span_outcomes_;  // [R] the exchange's outcomes.
  /// Client-launched spanning ranks: scratch of one answer (kMaxAreaSpans each), and when
  /// the last command arrived (the engine keeps polling for a while after it: the client's
  /// kernels ring no doorbell).
  std::vector<kernels::Region> answer_spans_;
  std::vector<abi::SpanCopy> answer_copies_;
  Clock::time_point last_command_{};
  /// Whether a client-launched spanning rank is attached and its last command arrived
  /// within kClientCommandsHot: the engine then keeps polling their command words instead
  /// of sleeping (a command waits at most the engine's 20 ms sleep otherwise).
  bool ClientCommandsHot();
  /// Whether rank r is a client-launched rank of this spanning group (attached).
  bool ClientSpanRank(int32_t r) const {
    return spanning() && ranks_[r] && ranks_[r]->client_launched && ranks_[r]->mirror;
  }
};

}  // namespace epd
