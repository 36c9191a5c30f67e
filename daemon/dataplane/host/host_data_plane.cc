// The host backend's data plane: shm endpoints, one engine, group ops by kernels/host. The
// lockstep part is LockstepGroup (daemon/dataplane/lockstep_group.h); this file adds the
// data area in each endpoint's shm region and runs each op on the engine thread. A group
// that spans nodes runs its ops through NodeExchange (daemon/dataplane/exchange/) on the
// endpoints' shm data areas.
#include "daemon/dataplane/host/host_data_plane.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/os/shm_region.h"
#include "common/status_macros.h"
#include "daemon/dataplane/engine_host.h"
#include "daemon/dataplane/exchange/mirror_spans.h"
#include "daemon/dataplane/exchange/node_exchange.h"
#include "daemon/dataplane/exchange/rank_routing.h"
#include "daemon/dataplane/lockstep_group.h"
#include "daemon/peer/peer_mesh.h"
#include "daemon/transport/transport.h"
#include "epd/kernels/host_ops.h"
#include "epd/kernels/layout.h"
#include "proto/abi/shm_abi.h"

namespace epd {
namespace {

using kernels::EndpointLayout;

class HostGroup;

/// One attached rank's daemon-private memory on the host backend: its routing state
/// (RankRouting; its data area is the shm region's). Sized at attach: an op allocates
/// nothing.
struct HostRank : RankResources {
  RankRouting routing;
  /// HostDataPlaneOptions::stage_through_mirror: the copy of the data area the exchange
  /// works on; empty otherwise.
  std::vector<uint8_t> mirror;
  /// HostDataPlaneOptions::gather_rows: the rank's RowSource table, and whether the running
  /// op's rows were left to it.
  std::vector<kernels::RowSource> row_sources;
  bool rows_pending = false;
  /// HostDataPlaneOptions::gather_rows: where a combine records the rank's combined rows
  /// (its terms in reduce_terms), and whether the running op's rows were left to it.
  std::vector<kernels::ReduceTerm> reduce_terms;
  kernels::ReduceTable reduce;
  bool reduce_pending = false;
  uint64_t quantized_seq = 0;  ///< As CudaRankMirror::quantized_seq.
  explicit HostRank(const kernels::GroupShape& s) : routing(s) {}
};

/// What a masked rank's part of an op works on in place of its endpoint (which may be
/// gone): a data area and routing state of its own, written with the rank's empty outputs
/// and never read by the others (no pair is routed to a masked rank). Made when the rank is
/// masked, freed when it is unmasked.
struct MaskedRankArea {
  RankRouting routing;
  std::vector<uint8_t> area;
  MaskedRankArea(const kernels::GroupShape& s, uint64_t bytes) : routing(s), area(bytes, 0) {}
};

class HostDataPlaneImpl : public DataPlane {
 public:
  explicit HostDataPlaneImpl(const HostDataPlaneOptions& options);
  ~HostDataPlaneImpl() override { Shutdown(); }

  absl::Status Init();
  std::string backend_name() const override { return "host"; }
  uint64_t BytesPerRank(const v1::GroupSpec& spec) const override {
    return abi::ComputeEndpointShmLayout(EndpointLayout::Compute(ShapeOf(spec)).total_bytes)
        .total_bytes;
  }
  /// The kernel scratch the group reserves at creation, every rank's routing state and a
  /// spanning group's exchange buffers: all in host memory, as the endpoints are.
  uint64_t GroupPrivateBytes(const v1::GroupSpec& spec) const override {
    const kernels::GroupShape shape = ShapeOf(spec);
    return kernels::host::HostScratch::ReservedBytes(shape, options_.host_threads) +
           static_cast<uint64_t>(spec.num_ranks()) * RankRouting::BytesFor(shape) +
           NodeExchangeBytes(spec, shape);
  }
  absl::StatusOr<uint64_t> FreeBytes(const std::string&) const override { return ShmFreeBytes(); }
  absl::StatusOr<std::unique_ptr<DataPlaneGroup>> CreateGroup(const v1::GroupSpec& spec) override {
    return CreateGroup(spec, GroupCreateOptions{});
  }
  absl::StatusOr<std::unique_ptr<DataPlaneGroup>> CreateGroup(
      const v1::GroupSpec& spec, const GroupCreateOptions& options) override;
  void Shutdown() override;

  const HostDataPlaneOptions& options() const { return options_; }
  /// kernels/host's worker threads, shared by every group (all run on the one engine
  /// thread, one op at a time).
  kernels::host::HostWorkerPool& kernel_pool() { return kernel_pool_; }
  const ShmRegion& doorbell() const { return engine_.doorbell(); }
  void WakeEngine() { engine_.Wake(); }
  void Unregister(HostGroup* group) { engine_.Remove(group); }

 private:
  HostDataPlaneOptions options_;
  kernels::host::HostWorkerPool kernel_pool_;  // Outlives engine_ (declared first).
  EngineHost<HostGroup> engine_;               // The one engine, serving every group.
  std::atomic<bool> shut_down_{false};
};

class HostGroup : public LockstepGroup, private NodeExchangeHost {
 public:
  HostGroup(HostDataPlaneImpl* plane, const v1::GroupSpec& spec)
      : LockstepGroup(spec, LockstepOptionsOf(plane->options())),
        plane_(plane),
        masked_areas_(spec.num_ranks()),
        dispatch_args_(spec.num_ranks()),
        combine_args_(spec.num_ranks()),
        ll_dispatch_args_(spec.num_ranks()),
        ll_combine_args_(spec.num_ranks()) {
    // Scratch for the group's largest ops, and the plane's kernel threads, made here so
    // that no op allocates (README "Hot path").
    const int threads = plane->options().host_threads;
    kernel_scratch_.Reserve(shape(), threads);
    plane->kernel_pool().Start(threads);
  }
  ~HostGroup() override { plane_->Unregister(this); }
  /// A spanning group: its exchange, before the first rank attaches (`join_secret_digest`
  /// goes into its Peer mesh registration).
  void MakeExchange(std::string join_secret_digest, SpanTransport span_transport) {
    NodeExchangeOptions o;
    o.op_timeout_ms = plane_->options().op_timeout_ms;
    o.exec = Execution();
    o.on_kernels = &plane_->options().on_kernels;
    o.peer_mesh = plane_->options().peer_mesh;
    o.transport = span_transport.transport;
    o.transport_name = std::move(span_transport.name);
    HostDataPlaneImpl* plane = plane_;
    o.wake = [plane] { plane->WakeEngine(); };
    o.join_secret_digest = std::move(join_secret_digest);
    NodeExchangeHost* host = this;
    exchange_ = std::make_unique<NodeExchange>(spec(), shape(), layout(), host, std::move(o));
  }

 protected:
  uint64_t ShmDataBytes(const RankResources&) const override { return layout().total_bytes; }
  absl::StatusOr<std::shared_ptr<RankResources>> PrepareRank(int32_t rank,
                                                             const std::string& gpu_uuid,
                                                             v1::LaunchMode launch_mode,
                                                             v1::EndpointInfo* info) override;
  /// A one-node op runs synchronously on the engine thread (true), with the per-rank
  /// kernel arguments kept in the group: no allocation outside kernels/host. A spanning
  /// op runs through the exchange (false; PollOpInto).
  bool StartOpInto(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots,
                   std::span<RankOutcome> outcomes) override {
    if (spanning()) {
      span_plan_ = &plan;
      span_slots_ = &slots;
      if (!MakeStandIns()) {
        for (int32_t r = 0; r < static_cast<int32_t>(outcomes.size()); ++r) {
          if (!rank_masked()[r]) outcomes[r].status = stand_in_error_;
        }
        return true;
      }
      if (plane_->options().stage_through_mirror) StageMirrors(plan, slots, /*in=*/true, outcomes);
      exchange_->Start(plan, slots);
      return false;
    }
    Execute(plan, slots, outcomes);
    return true;
  }
  bool PollOpInto(std::span<RankOutcome> outcomes) override {
    if (!exchange_->Poll(outcomes)) return false;
    if (plane_->options().stage_through_mirror) {
      StageMirrors(*span_plan_, *span_slots_, /*in=*/false, outcomes);
    }
    return true;
  }
  absl::Status NodeChosen(int32_t node) override {
    windows_.reserve(static_cast<size_t>(local_count()));
    pending_packs_.reserve(static_cast<size_t>(local_count()) * spec().nodes_size());
    return exchange_->Init(node, local_first(), local_count());
  }
  void OpFailedHere(uint64_t seq, uint32_t op, const absl::Status& status) override {
    if (exchange_ && exchange_->ready()) exchange_->OpFailedHere(seq, op, status);
  }
  absl::Status PeerFailure(uint64_t seq, int64_t local_op) override {
    return exchange_ && exchange_->ready() ? exchange_->PeerFailure(seq, local_op)
                                           : absl::OkStatus();
  }
  bool ReadyToStart() override { return !spanning() || exchange_->ReadyToStart(); }
  bool BackendReportsOpMask() const override {
    return spanning() && masking() && exchange_ && exchange_->ready();
  }
  uint32_t BackendRankMask(std::vector<uint8_t>* masked) const override {
    return exchange_->NextMask(masked);
  }
  std::string NotReadyReason() const override {
    return exchange_ && exchange_->ready() ? exchange_->NotReadyReason() : std::string();
  }
  bool PollBackground() override {
    return spanning() && exchange_ && exchange_->ready() && exchange_->PollBackground();
  }
  // A spanning op waits for the transport, whose wake callback wakes the engine: the
  // engine polls engine_idle_us after its last work, then sleeps until woken.
  bool RunningOpWakesEngine() const override {
    return spanning() && !(exchange_ && exchange_->packing());  // The pack is polled.
  }
  /// Spanning groups: publish this node's joined ranks to the peers (for their errors).
  absl::Status RankAttached(int32_t rank, const std::shared_ptr<RankResources>&) override {
    PublishJoined(rank, true);
    return absl::OkStatus();
  }
  void RankDetached(int32_t rank) override { PublishJoined(rank, false); }
  void PublishJoined(int32_t changed, bool joined) {
    if (!spanning() || !exchange_ || !exchange_->ready()) return;
    std::vector<bool> bits(local_count());
    for (int32_t i = 0; i < local_count(); ++i) {
      const int32_t r = local_first() + i;
      bits[i] = r == changed ? joined : endpoint(r) != nullptr;
    }
    exchange_->SetLocalRanksJoined(bits);
  }
  void WakeEngine() override { plane_->WakeEngine(); }
  /// A masked rank's stand-in is made by the first op that needs it (Execute), so that
  /// ranks leaving a group that is being torn down allocate nothing; freed when unmasked.
  void RankMaskChanged(int32_t rank, bool masked) override {
    if (!masked) masked_areas_[rank].reset();
  }
  /// The plane's one doorbell page serves every rank.
  absl::StatusOr<ScopedFd> DoorbellFd(int32_t /*rank*/) const override {
    return plane_->doorbell().DupFd();
  }
  /// The host backend has no streams: a stream-ordered request (kFlagStreamOrdered,
  /// CUDA daemon-launched mode) is INVALID_ARGUMENT.
  absl::Status CheckRequest(int32_t /*rank*/, const abi::RequestSlot& slot) const override {
    if (slot.flags & abi::kFlagStreamOrdered) {
      return absl::InvalidArgumentError(absl::StrCat(
          OpName(slot.op), ": request flag kFlagStreamOrdered (0x", absl::Hex(slot.flags),
          ") needs the CUDA backend; the host backend has no CUDA streams to order on"));
    }
    return absl::OkStatus();
  }

 private:
  // NodeExchangeHost: the endpoints' shm data areas (or the test seam's mirrors).
  uint8_t* ExchangeRankData(int32_t rank) const override {
    if (rank_masked()[rank]) return masked_areas_[rank]->area.data();  // MakeStandIns.
    std::vector<uint8_t>& mirror = static_cast<HostRank&>(*op_endpoint(rank)->backend).mirror;
    return mirror.empty() ? op_endpoint(rank)->shm_data() : mirror.data();
  }
  transport::MemoryRegion ExchangeRankRegion(int32_t rank, uint64_t* memory_id) const override {
    // An endpoint's shm mapping (or test mirror) lives as long as the endpoint: a new
    // attach is a new endpoint id.
    const LockstepEndpoint* ep = op_endpoint(rank);
    *memory_id = ep->endpoint_id;
    return {ExchangeRankData(rank), layout().total_bytes, transport::MemoryKind::kHost};
  }
  /// stage_through_mirror: copies every local rank's MirrorInputSpans from its shm area into
  /// its mirror (`in`), or MirrorOutputSpans of each rank whose outcome is OK back.
  void StageMirrors(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots, bool in,
                    std::span<RankOutcome> outcomes) {
    if (in) {
      // gather_rows: the gathers and the pack read the local ranks' rows from their shm
      // areas, as the CUDA backend's read their GPU areas (GatherWindow).
      windows_.clear();
      for (int32_t r = local_first(); r < local_first() + local_count(); ++r) {
        if (rank_masked()[r] || !plane_->options().gather_rows) continue;
        windows_.push_back({ExchangeRankData(r), layout().total_bytes, op_endpoint(r)->shm_data()});
      }
      rows_on_backend_ = RowsOnBackend(plan);
      pending_packs_.clear();  // A failed op's packs never run.
    }
    for (int32_t r = local_first(); r < local_first() + local_count(); ++r) {
      if (rank_masked()[r]) continue;  // A stand-in: no shm area.
      uint8_t* shm = op_endpoint(r)->shm_data();
      uint8_t* mirror = ExchangeRankData(r);
      uint64_t total = 0;
      int32_t n = 0;
      if (in) {
        // gather_rows: a low-latency FP8 dispatch's tokens quantized here into the exchange's
        // rows, as the CUDA backend's kernel does, and its x left out of the mirror.
        const NodeExchange::QuantizedRows q = exchange_->QuantizedRowsOf(r);
        const bool quantize = plan.op == abi::OpKind::kLowLatencyDispatch &&
                              rules::DecodeFlags(plan.flags).use_fp8 && q.x != nullptr;
        if (quantize) {
          kernels::host::QuantizeRowsFp8(
              shape(), slots[r].num_tokens,
              reinterpret_cast<const kernels::bf16_bits*>(shm + layout().in_x.offset),
              rules::DecodeFlags(plan.flags).round_scale, q.x, q.scales);
          host_rank(r).quantized_seq = plan.seq;
        }
        n = MirrorInputSpans(
            shape(), layout(), plan, slots[r], r, endpoint(r)->handles.num_recv_tokens(),
            exchange_->LowLatencyCounts(plan.ll_handle_buffer), spans_.data(), &total, quantize,
            BackendRows{rows_on_backend_, local_first(), local_count(),
                        &exchange_->DispatchCounts()});
      } else if (outcomes[r].status.ok()) {
        n = MirrorOutputSpans(shape(), layout(), plan, slots[r], outcomes[r], mirror, spans_.data(),
                              &total, host_rank(r).rows_pending || host_rank(r).reduce_pending);
      }
      // The rows left to the backend first, then the copies, in the CUDA backend's order
      // (StageOut): a copy of a range the rows own would overwrite them with 0xA5.
      if (!in && host_rank(r).rows_pending && outcomes[r].status.ok()) {
        kernels::host::GatherRows(shape(),
                                  DispatchRowGather(shape(), layout(), plan, shm, mirror,
                                                    host_rank(r).row_sources.data()),
                                  windows_);
      }
      if (!in && host_rank(r).reduce_pending && outcomes[r].status.ok()) {
        kernels::host::ReduceRows(
            shape(), CombineRowReduce(shape(), layout(), plan, shm, host_rank(r).reduce), windows_);
      }
      if (!in) host_rank(r).rows_pending = host_rank(r).reduce_pending = false;
      for (int32_t i = 0; i < n; ++i) {
        const kernels::Region& s = spans_[i];
        std::memcpy((in ? mirror : shm) + s.offset, (in ? shm : mirror) + s.offset, s.bytes);
      }
    }
  }
  HostRank& host_rank(int32_t r) const { return static_cast<HostRank&>(*op_endpoint(r)->backend); }
  std::unique_ptr<ExchangeHostMapping> ExchangeMapHostMemory(void* /*p*/,
                                                             uint64_t /*bytes*/) const override {
    if (!plane_->options().stage_through_mirror || !plane_->options().gather_rows) return nullptr;
    return std::make_unique<ExchangeHostMapping>();  // Host memory: nothing to map.
  }
  bool ExchangeRowsQuantized(int32_t rank, uint64_t seq) const override {
    return !rank_masked()[rank] && host_rank(rank).quantized_seq == seq;
  }
  /// gather_rows: whether op `plan`'s rows stay out of the mirrors (MirrorInputSpans'
  /// BackendRows): every local rank's received rows are gathered, its rows to the other
  /// nodes packed and its combines reduced through the windows, so the exchange never reads
  /// a dispatch's token rows or a combine's rows from this node there.
  bool RowsOnBackend(const OpPlan& plan) const {
    const bool fp8 = rules::DecodeFlags(plan.flags).use_fp8;
    if (!plane_->options().gather_rows || !exchange_->rows_on_backend() ||
        !(plan.op == abi::OpKind::kDispatch || plan.op == abi::OpKind::kCombine ||
          plan.op == abi::OpKind::kLowLatencyCombine ||
          (plan.op == abi::OpKind::kLowLatencyDispatch && !fp8))) {
      return false;
    }
    for (int32_t r = local_first(); r < local_first() + local_count(); ++r) {
      if (rank_masked()[r]) return false;  // A stand-in's rows are copied.
    }
    return true;
  }
  bool ExchangePacksRows(int32_t rank) const override {
    return plane_->options().gather_rows && !rank_masked()[rank];
  }
  /// Held until ExchangeRowsPacked, so that a post before it sends stale rows (the previous
  /// op's, or the zeros of a new staging).
  absl::Status ExchangePackRows(int32_t rank, const kernels::RowGather& g) const override {
    pending_packs_.push_back({rank, g});
    return absl::OkStatus();
  }
  absl::StatusOr<bool> ExchangeRowsPacked(int32_t rank) const override {
    if (plane_->options().on_pack_poll) {
      absl::StatusOr<bool> go = plane_->options().on_pack_poll(rank);
      if (!go.ok() || !*go) {
        if (!go.ok()) std::erase_if(pending_packs_, [&](const auto& p) { return p.first == rank; });
        return go;
      }
    }
    for (const auto& [r, g] : pending_packs_) {
      if (r == rank) kernels::host::GatherRows(shape(), g, windows_);
    }
    std::erase_if(pending_packs_, [&](const auto& p) { return p.first == rank; });
    return true;
  }
  kernels::RowSource* ExchangeRowSources(int32_t rank) const override {
    if (rank_masked()[rank]) return nullptr;  // A stand-in: its rows are copied.
    HostRank& h = host_rank(rank);
    h.rows_pending = true;
    return h.row_sources.data();
  }
  kernels::ReduceTable* ExchangeReduceTable(int32_t rank) const override {
    if (rank_masked()[rank]) return nullptr;  // A stand-in: reduced by the exchange.
    HostRank& h = host_rank(rank);
    h.reduce_pending = true;
    h.reduce.terms = h.reduce_terms.data();
    return &h.reduce;
  }
  RankRouting& ExchangeRankRouting(int32_t rank) const override { return Private(rank); }
  const rules::HandleTable& ExchangeRankHandles(int32_t rank) const override {
    return endpoint(rank)->handles;
  }
  uint64_t ExchangeCurrentSeq() const override { return current_seq(); }
  const std::vector<uint8_t>& ExchangeRankMasked() const override { return rank_masked(); }
  /// Makes the stand-in of every rank the op runs masked (once per masking, not per op);
  /// false (stand_in_error_ set) when out of memory.
  bool MakeStandIns() {
    const EndpointLayout& L = layout();
    for (int r = local_first(); r < local_first() + local_count(); ++r) {
      if (!rank_masked()[r] || masked_areas_[r]) continue;
      try {
        masked_areas_[r] = std::make_unique<MaskedRankArea>(shape(), L.total_bytes);
      } catch (const std::bad_alloc&) {
        stand_in_error_ = absl::ResourceExhaustedError(
            absl::StrCat("group ", spec().name(), ": out of host memory for masked rank ", r,
                         "'s stand-in (", L.total_bytes,
                         " bytes of data area and its routing state); free memory, or rejoin "
                         "or unmask the rank"));
        return false;
      }
    }
    return true;
  }
  void ExchangeWarning(const std::string& message) const override {
    LogClientCaused(spdlog::level::warn, "{}", message);
  }

  kernels::host::HostExecution Execution() {
    return {plane_->options().host_threads, &plane_->kernel_pool(), &kernel_scratch_,
            &plane_->options().on_inputs_checked};
  }
  void Execute(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots,
               std::span<RankOutcome> out);
  /// Region `r` of rank `rank`'s data area in its shm region (client-writable: outputs,
  /// and inputs read as values only).
  template <typename T>
  T* Ptr(int rank, const kernels::Region& r) const {
    return RegionPtr<T>(Area(rank), r);
  }
  /// Rank `rank`'s data area: its shm region's, or a masked rank's stand-in.
  uint8_t* Area(int rank) const {
    return rank_masked()[rank] ? masked_areas_[rank]->area.data() : endpoint(rank)->shm_data();
  }
  /// Rank `rank`'s private routing state (a masked rank's stand-in's).
  RankRouting& Private(int rank) const {
    if (rank_masked()[rank]) return masked_areas_[rank]->routing;
    return static_cast<HostRank&>(*op_endpoint(rank)->backend).routing;
  }
  /// The checked copy of rank `rank`'s topk_idx, with the pairs of masked ranks' experts
  /// dropped (counted in `*dropped`).
  absl::StatusOr<const int64_t*> TakeTopkIdx(int rank, int32_t num_tokens, int32_t* dropped) const {
    absl::StatusOr<const int64_t*> idx =
        epd::TakeTopkIdx(shape(), layout(), Area(rank), Private(rank), rank, num_tokens);
    if (idx.ok() && any_masked_) {
      *dropped = kernels::host::DropMaskedExperts(shape(), rank_masked(), num_tokens,
                                                  Private(rank).topk_idx.data());
    }
    return idx;
  }
  void Publish(int rank, const std::vector<int32_t>& src, int64_t rows, int64_t row_elems,
               const kernels::Region& dst) const {
    PublishRouting(Area(rank), src, rows, row_elems, dst);
  }

  /// Adds the tokens rank `rank` received per local expert in a normal dispatch to the
  /// group's metrics: from its recv_topk_idx [rows, K] (local ids, -1 elsewhere; an id
  /// twice in a row counts once). Allocates nothing (expert_scratch_).
  void CountExpertTokens(int32_t rank, const int64_t* recv_topk_idx, int32_t rows) {
    const int32_t El = shape().num_local_experts();
    const int32_t K = shape().num_topk;
    std::fill(expert_scratch_.begin(), expert_scratch_.end(), 0);
    for (int32_t i = 0; i < rows; ++i) {
      const int64_t* row = recv_topk_idx + static_cast<int64_t>(i) * K;
      for (int32_t k = 0; k < K; ++k) {
        const int64_t e = row[k];
        if (e < 0 || e >= El) continue;
        bool seen = false;
        for (int32_t j = 0; j < k && !seen; ++j) seen = row[j] == e;
        if (!seen) ++expert_scratch_[e];
      }
    }
    for (int32_t e = 0; e < El; ++e) {
      if (expert_scratch_[e] != 0) metrics().AddExpertTokens(rank * El + e, expert_scratch_[e]);
    }
  }

  HostDataPlaneImpl* plane_;
  /// [R] each masked rank's stand-in (RankMaskChanged); null for the others.
  std::vector<std::unique_ptr<MaskedRankArea>> masked_areas_;
  bool any_masked_ = false;  ///< Execute: whether the running op masks any rank.
  std::vector<uint64_t> expert_scratch_ =
      std::vector<uint64_t>(shape().num_local_experts());  ///< [El] CountExpertTokens's.
  std::unique_ptr<NodeExchange> exchange_;                 ///< A spanning group's; null otherwise.
  absl::Status stand_in_error_;                            ///< MakeStandIns' last failure.
  const OpPlan* span_plan_ = nullptr;                      ///< The running spanning op.
  const std::vector<abi::RequestSlot>* span_slots_ = nullptr;
  std::vector<kernels::Region> spans_ =
      std::vector<kernels::Region>(kernels::kMaxAreaSpans);  ///< stage_through_mirror's.
  /// gather_rows: the running op's windows (each local rank's mirror onto its shm area),
  /// whether its token rows stay out of the mirrors, and the packs not yet run.
  std::vector<kernels::GatherWindow> windows_;
  bool rows_on_backend_ = false;
  mutable std::vector<std::pair<int32_t, kernels::RowGather>> pending_packs_;
  // Each op kind's kernel arguments, [R], filled in per op (sized once: README "Hot path").
  std::vector<kernels::host::DispatchRankArgs> dispatch_args_;
  std::vector<kernels::host::CombineRankArgs> combine_args_;
  std::vector<kernels::host::LowLatencyDispatchRankArgs> ll_dispatch_args_;
  std::vector<kernels::host::LowLatencyCombineRankArgs> ll_combine_args_;
  // kernels/host's temporaries for this group's ops (one op at a time: the engine thread).
  kernels::host::HostScratch kernel_scratch_;
};

// ---------------------------------------------------------------------------------------

HostDataPlaneImpl::HostDataPlaneImpl(const HostDataPlaneOptions& options)
    : options_(options), kernel_pool_(options.on_kernel_thread_start) {}

absl::Status HostDataPlaneImpl::Init() {
  return engine_.Start(options_.engine_idle_us, options_.on_engine_start);
}

absl::StatusOr<std::unique_ptr<DataPlaneGroup>> HostDataPlaneImpl::CreateGroup(
    const v1::GroupSpec& spec, const GroupCreateOptions& options) {
  if (shut_down_.load()) return absl::UnavailableError("epd is shutting down");
  EPD_ASSIGN_OR_RETURN(SpanTransport span_transport,
                       TransportForSpan(spec, options_.peer_mesh, options_.transports));
  // Join checked GroupPrivateBytes against free memory; memory taken by others since then
  // can still make the reservation fail, which must not cross gRPC as an exception.
  std::unique_ptr<HostGroup> group;
  try {
    group = std::make_unique<HostGroup>(this, spec);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "group \"", spec.name(), "\": out of host memory reserving its ", GroupPrivateBytes(spec),
        " bytes of kernel scratch and routing state; lower num_ranks or max_tokens_per_rank, "
        "or free memory"));
  }
  if (spec.nodes_size() >= 2) {
    group->MakeExchange(options_.peer_mesh->JoinSecretDigest(spec.name(), options.join_secret),
                        std::move(span_transport));
  }
  engine_.Add(group.get());
  return std::unique_ptr<DataPlaneGroup>(std::move(group));
}

void HostDataPlaneImpl::Shutdown() {
  if (shut_down_.exchange(true)) return;
  engine_.Stop();
  engine_.ForEach([](HostGroup* g) { g->FailAll(absl::UnavailableError("epd is shutting down")); });
}

// ---------------------------------------------------------------------------------------

absl::StatusOr<std::shared_ptr<RankResources>> HostGroup::PrepareRank(
    int32_t /*rank*/, const std::string& /*gpu_uuid*/, v1::LaunchMode launch_mode,
    v1::EndpointInfo* info) {
  if (launch_mode == v1::LAUNCH_MODE_CLIENT) {
    return absl::FailedPreconditionError(
        "launch_mode LAUNCH_MODE_CLIENT: client-launched mode needs the CUDA backend; the host "
        "backend runs every op in the daemon (use LAUNCH_MODE_DAEMON or leave it unspecified)");
  }
  info->set_backend("host");
  info->set_launch_mode(v1::LAUNCH_MODE_DAEMON);
  auto rank = std::make_shared<HostRank>(shape());
  if (spanning() && plane_->options().stage_through_mirror) {
    rank->mirror.assign(layout().total_bytes, 0xA5);
    if (plane_->options().gather_rows) {
      rank->row_sources.assign(static_cast<size_t>(kernels::RowSourceRows(shape())),
                               kernels::RowSource{});
      rank->reduce_terms.assign(static_cast<size_t>(kernels::ReduceTableRows(shape())) *
                                    kernels::ReduceTermsPerRow(shape()),
                                kernels::ReduceTerm{});
    }
  }
  return std::shared_ptr<RankResources>(std::move(rank));
}

void HostGroup::Execute(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots,
                        std::span<RankOutcome> out) {
  const int R = static_cast<int>(slots.size());
  const abi::OpKind op = plan.op;
  const rules::RequestOptions flags = rules::DecodeFlags(plan.flags);  // Agreed by every rank.
  const kernels::GroupShape& gs = shape();
  const kernels::host::HostExecution exec = Execution();
  auto fail_all = [&](const absl::Status& st) {
    for (int r = 0; r < R; ++r) {
      if (!rank_masked()[r]) out[r].status = st;
    }
  };
  const EndpointLayout& L = layout();
  any_masked_ =
      std::any_of(rank_masked().begin(), rank_masked().end(), [](uint8_t m) { return m != 0; });
  if (!MakeStandIns()) return fail_all(stand_in_error_);
  switch (op) {
    case abi::OpKind::kGetDispatchLayout: {
      for (int r = 0; r < R; ++r) {
        if (rank_masked()[r]) continue;
        out[r].status = RunLayoutOp(gs, L, Area(r), Private(r), r, slots[r], exec,
                                    &plane_->options().on_kernels);
      }
      return;
    }
    case abi::OpKind::kDispatch: {
      const bool cached = flags.cached_handle;
      const bool fp8 = flags.use_fp8;
      std::vector<kernels::host::DispatchRankArgs>& args = dispatch_args_;
      for (int r = 0; r < R; ++r) {
        auto& a = args[r];
        a = {};
        const bool masked = rank_masked()[r] != 0;
        a.num_tokens = slots[r].num_tokens;
        a.x = Ptr<const void>(r, L.in_x);
        a.x_scales = fp8 ? Ptr<const float>(r, L.in_scales) : nullptr;
        a.topk_weights = flags.dispatch_weights ? Ptr<const float>(r, L.in_topk_weights) : nullptr;
        RankRouting& hr = Private(r);
        if (cached) {
          a.cached_send_pos = hr.send_pos.data();  // Rewritten in place (memmove).
          a.cached_num_recv_tokens = masked ? 0 : endpoint(r)->handles.num_recv_tokens();
          if (any_masked_) {
            out[r].dropped_pairs = kernels::host::DropMaskedRoutes(gs, rank_masked(), a.num_tokens,
                                                                   hr.send_pos.data());
          }
        } else {
          absl::StatusOr<const int64_t*> idx = TakeTopkIdx(r, a.num_tokens, &out[r].dropped_pairs);
          if (!idx.ok()) return fail_all(idx.status());
          a.topk_idx = *idx;
        }
        a.recv_capacity = gs.max_recv_tokens();
        a.recv_x = Ptr<void>(r, L.recv_x);
        a.recv_scales = fp8 ? Ptr<float>(r, L.recv_scales) : nullptr;
        a.recv_topk_idx = Ptr<int64_t>(r, L.recv_topk_idx);
        a.recv_topk_weights = Ptr<float>(r, L.recv_topk_weights);  // zeros without weights
        a.recv_tokens_per_expert = Ptr<int32_t>(r, L.recv_tokens_per_expert);
        a.recv_src_info = Ptr<int32_t>(r, L.recv_src_info);
        a.send_pos = hr.send_pos.data();
        a.rank_prefix = Ptr<int32_t>(r, L.rank_prefix);
      }
      kernels::host::DispatchOptions opt;
      opt.fp8 = fp8;
      opt.expert_alignment = slots[0].expert_alignment;
      absl::Status st;
      {
        KernelScope k(&plane_->options().on_kernels);
        st = kernels::host::Dispatch(gs, opt, args, exec);
      }
      if (!st.ok()) return fail_all(st);
      for (int r = 0; r < R; ++r) {
        CountExpertTokens(r, Ptr<const int64_t>(r, L.recv_topk_idx), args[r].num_recv_tokens);
        *Ptr<int32_t>(r, L.recv_count) = args[r].num_recv_tokens;
        out[r].num_recv_tokens = args[r].num_recv_tokens;
        Publish(r, Private(r).send_pos, args[r].num_tokens, R, L.send_pos);
      }
      return;
    }
    case abi::OpKind::kCombine: {
      const bool weights = flags.combine_weights;
      std::vector<kernels::host::CombineRankArgs>& args = combine_args_;
      for (int r = 0; r < R; ++r) {
        auto& a = args[r];
        a = {};
        const LockstepEndpoint* ep = rank_masked()[r] ? nullptr : endpoint(r);
        a.num_tokens = ep ? ep->handles.routing_tokens() : 0;
        a.send_pos = Private(r).send_pos.data();
        a.num_recv_tokens = ep ? ep->handles.num_recv_tokens() : 0;
        if (any_masked_) {
          out[r].dropped_pairs = kernels::host::DropMaskedRoutes(gs, rank_masked(), a.num_tokens,
                                                                 Private(r).send_pos.data());
        }
        a.x = Ptr<const kernels::bf16_bits>(r, L.in_combine_x);
        a.topk_weights = weights ? Ptr<const float>(r, L.in_combine_weights) : nullptr;
        a.combined_x = Ptr<kernels::bf16_bits>(r, L.combined_x);
        a.combined_topk_weights = weights ? Ptr<float>(r, L.combined_topk_weights) : nullptr;
      }
      absl::Status st;
      {
        KernelScope k(&plane_->options().on_kernels);
        st = kernels::host::Combine(gs, args, exec);
      }
      if (!st.ok()) return fail_all(st);
      return;
    }
    case abi::OpKind::kLowLatencyDispatch: {
      const int b = plan.ll_buffer;
      std::vector<kernels::host::LowLatencyDispatchRankArgs>& args = ll_dispatch_args_;
      for (int r = 0; r < R; ++r) {
        auto& a = args[r];
        a = {};
        a.num_tokens = slots[r].num_tokens;
        a.x = Ptr<const kernels::bf16_bits>(r, L.in_x);
        a.recv_x = Ptr<void>(r, L.ll_recv_x[b]);
        a.recv_scales = flags.use_fp8 ? Ptr<void>(r, L.ll_recv_scales[b]) : nullptr;
        a.recv_count = Ptr<int32_t>(r, L.ll_recv_count[b]);
        a.recv_src_info = Ptr<int32_t>(r, L.ll_recv_src_info[b]);
        a.handle_pos = Private(r).ll_handle_pos[b].data();
        absl::StatusOr<const int64_t*> idx = TakeTopkIdx(r, a.num_tokens, &out[r].dropped_pairs);
        if (!idx.ok()) return fail_all(idx.status());
        a.topk_idx = *idx;
      }
      kernels::host::LowLatencyDispatchOptions opt;
      opt.use_fp8 = flags.use_fp8;
      opt.round_scale = flags.round_scale;
      opt.use_ue8m0 = flags.use_ue8m0;
      absl::Status st;
      {
        KernelScope k(&plane_->options().on_kernels);
        st = kernels::host::LowLatencyDispatch(gs, opt, args, exec);
      }
      if (!st.ok()) return fail_all(st);
      const uint64_t H = static_cast<uint64_t>(gs.hidden);
      const uint64_t row = flags.use_fp8 ? H + static_cast<uint64_t>(gs.num_scales()) * 4 : H * 2;
      for (int r = 0; r < R; ++r) {
        Publish(r, Private(r).ll_handle_pos[b], args[r].num_tokens, gs.num_topk,
                L.ll_handle_pos[b]);
        // recv_count [El] as the kernels wrote it (DeepEP's cumulative expert stats).
        const int32_t* recv_count = Ptr<const int32_t>(r, L.ll_recv_count[b]);
        const int32_t El = gs.num_local_experts();
        uint64_t rows = 0;
        for (int32_t e = 0; e < El; ++e) {
          const uint64_t n = static_cast<uint64_t>(std::max(recv_count[e], 0));
          metrics().AddExpertTokens(r * El + e, n);
          rows += n;
        }
        metrics().AddOpBytes(static_cast<uint32_t>(op), rows * row);
      }
      return;
    }
    case abi::OpKind::kLowLatencyCombine: {
      const int hb = plan.ll_handle_buffer;
      const int ob = plan.ll_out_buffer;
      std::vector<kernels::host::LowLatencyCombineRankArgs>& args = ll_combine_args_;
      for (int r = 0; r < R; ++r) {
        auto& a = args[r];
        a = {};
        a.num_tokens = slots[r].num_tokens;
        a.topk_weights = Ptr<const float>(r, L.in_topk_weights);
        a.handle_pos = Private(r).ll_handle_pos[hb].data();
        a.x = Ptr<const kernels::bf16_bits>(r, L.in_ll_combine_x);
        a.combined_x = Ptr<kernels::bf16_bits>(r, L.ll_combined_x[ob]);
        absl::StatusOr<const int64_t*> idx = TakeTopkIdx(r, a.num_tokens, &out[r].dropped_pairs);
        if (!idx.ok()) return fail_all(idx.status());
        a.topk_idx = *idx;
      }
      absl::Status st;
      {
        KernelScope k(&plane_->options().on_kernels);
        st = kernels::host::LowLatencyCombine(gs, args, exec);
      }
      if (!st.ok()) return fail_all(st);
      return;
    }
    default:
      return fail_all(absl::InternalError(absl::StrCat(
          "host backend: op kind ", OpName(static_cast<uint32_t>(op)), " is not run by StartOp")));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataPlane>> MakeHostDataPlane(const HostDataPlaneOptions& options) {
  auto plane = std::make_unique<HostDataPlaneImpl>(options);
  EPD_RETURN_IF_ERROR(plane->Init());
  return std::unique_ptr<DataPlane>(std::move(plane));
}

}  // namespace epd
