// A group on the CUDA backend (see cuda_group.h): rank attach, lockstep launch on every
// rank's stream, start/poll, the stream-release protocol, and the graph-mode program's owner.
// Rank masking and the masked ranks' stand-ins: cuda_group_mask.cc; spanning groups:
// cuda_span.cc.
#include "daemon/dataplane/cuda/cuda_group.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "common/cuda/device_alloc.h"
#include "common/cuda/stream_memops.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "daemon/dataplane/exchange/span_commands.h"
#include "daemon/dataplane/gpu_drain.h"
#include "epd/kernels/cuda_normal.h"
#include "epd/kernels/cuda_program.h"
#include "epd/kernels/layout.h"
#include "epd/kernels/op_rules.h"
#include "epd/kernels/rank_context.h"
#include "proto/abi/shm_abi.h"

namespace epd {
namespace {

namespace kc = kernels::cuda;
using kernels::EndpointLayout;

/// Extra time the engine gives the GPU past op_timeout before it gives up on an op whose
/// kernels (themselves bounded by op_timeout) have not finished.
constexpr auto kGpuGrace = std::chrono::seconds(5);

}  // namespace

bool CudaTimingEvents::Record(void* event, void* stream) {
  const cudaError_t err =
      cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) cudaGetLastError();
  return err == cudaSuccess;
}

TimingEvents::State CudaTimingEvents::Query(void* event) {
  const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (err == cudaSuccess) return State::kComplete;
  cudaGetLastError();
  return err == cudaErrorNotReady ? State::kPending : State::kFailed;
}

bool CudaTimingEvents::ElapsedMs(void* begin, void* end, float* ms) {
  const cudaError_t err =
      cudaEventElapsedTime(ms, static_cast<cudaEvent_t>(begin), static_cast<cudaEvent_t>(end));
  if (err != cudaSuccess) cudaGetLastError();
  return err == cudaSuccess;
}

CudaGroup::CudaGroup(CudaDataPlaneImpl* plane, const v1::GroupSpec& spec)
    : LockstepGroup(spec, LockstepOptionsOf(plane->options())),
      plane_(plane),
      ranks_(spec.num_ranks()),
      standins_(spec.num_ranks()),
      masked_areas_(spec.num_ranks()),
      spare_masked_areas_(spec.num_ranks()),
      host_bases_(spec.num_ranks(), nullptr),
      event_errors_(spec.num_ranks(), cudaSuccess),
      gpu_timer_(&timing_events_, spec.num_ranks()),
      span_outcomes_(spec.num_ranks()) {
  if (spanning()) {
    answer_spans_.resize(kernels::kMaxAreaSpans);
    answer_copies_.resize(abi::kMaxSpanCopies);
  } else {
    // The exchange of a spanning group runs on the host: its kernels count nothing.
    expert_tally_ =
        std::make_shared<metrics::ExpertTokenTally>(spec.num_ranks(), shape().num_local_experts());
    metrics().SetExpertTokenTally(expert_tally_);
  }
  devices_.reserve(spec.num_ranks());
  op_graphs_.reserve(kMaxOpGraphVariants);
  if (OpTraceEnabled()) trace_ = std::make_unique<OpLaunchTrace>();
  SizeOp(spare_);
}

void CudaGroup::MakeExchange(std::string join_secret_digest, SpanTransport span_transport) {
  const int threads = plane_->options().host_threads;
  kernel_scratch_.Reserve(shape(), threads);
  plane_->kernel_pool().Start(threads);
  NodeExchangeOptions o;
  o.op_timeout_ms = plane_->options().op_timeout_ms;
  o.exec = {threads, &plane_->kernel_pool(), &kernel_scratch_};
  o.peer_mesh = plane_->options().peer_mesh;
  o.transport = span_transport.transport;
  o.transport_name = std::move(span_transport.name);
  o.wake = [this] { WakeEngine(); };
  o.join_secret_digest = std::move(join_secret_digest);
  NodeExchangeHost* host = this;
  exchange_ = std::make_unique<NodeExchange>(spec(), shape(), layout(), host, std::move(o));
}

void CudaGroup::WakeEngine() {
  GpuEngine* e = engine_.load();
  if (e != nullptr) e->host.Wake();
}

absl::StatusOr<ScopedFd> CudaGroup::DoorbellFd(int32_t rank) const {
  GpuEngine* e = engine_.load();
  if (e == nullptr) {
    return absl::InternalError(absl::StrCat("rank ", rank, ": the group has no engine yet"));
  }
  return e->host.doorbell().DupFd();
}

void CudaGroup::SizeOp(GpuOp& op) const {
  const size_t R = ranks_.size();
  op.ranks.resize(R);
  op.launch.resize(R);
  op.stream_ordered.resize(R);
  op.ready_wait.resize(R);
  op.lead.resize(R, -1);
  op.max_dropped.resize(R);
  op.left_unstaged.resize(R);
  op.done_written.resize(R);
  op.graph_streams.reserve(R);
}

bool CudaGroup::KernelHandsOff(const GpuOp& op, size_t r) {
  return op.stream_ordered[r] && rules::IsLowLatency(op.op);
}

void CudaGroup::RecycleOp(std::optional<GpuOp>& op) {
  spare_ = std::move(*op);
  op.reset();
  DropOpRanks(spare_);
}

void CudaGroup::DropOpRanks(GpuOp& op) {
  // A rank that left during the op may lose its last reference here: that hands it to the
  // plane's DeferredRelease (CreateCudaRank), nothing is freed on this thread.
  for (std::shared_ptr<CudaRank>& r : op.ranks) r.reset();
}

bool CudaGroup::Quiescent() {
  // Not waited for: a control thread may hold mu_ across a GPU wait that only another
  // engine's round can end, and every round is held off while this runs.
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  if (abandoned_) {
    // An op given up on leaves the GPU on its own; recycled here too, not only when the
    // group's next op starts, so an idle group does not hold back every release.
    if (GraphStreamsBusy(*abandoned_)) return false;
    for (const auto& r : abandoned_->ranks) {
      if (r && cudaEventQuery(r->done.get()) == cudaErrorNotReady) return false;
    }
    cudaGetLastError();
    RecycleOp(abandoned_);
    if (!gpu_op_ && !program_tail_) plane_->ReleaseGpus(this);
    needs_sync_reset_ = true;
  }
  return !gpu_op_ && !program_ && !program_tail_;
}

CudaGroup::~CudaGroup() {
  // Out of its engine's list, its work is invisible to AllEnginesQuiescent until the ops
  // below are drained: no release meanwhile.
  CudaDataPlaneImpl::GroupEnding ending(*plane_);
  if (GpuEngine* e = engine_.load()) e->host.Remove(this);
  // Ops still on the GPU end (their waits are bounded) before any memory of the group is
  // freed: the peer arrays below, the ranks' areas with the endpoints.
  std::lock_guard<std::mutex> lock(mu_);
  DisarmProgram(absl::UnavailableError("the group is being destroyed"));
  // Bounded: a client can hold a stream memory wait on its ready word by lowering the word
  // again after the host's release; such a stream is logged and left.
  const absl::Time deadline =
      absl::Now() + absl::Milliseconds(plane_->options().op_timeout_ms) + absl::Seconds(1);
  for (const std::optional<GpuOp>* op : {&gpu_op_, &abandoned_, &program_tail_}) {
    if (!op->has_value()) continue;
    ReleaseReadyWaits(**op);  // A client that never wrote ready_seq must not hang us.
    for (const auto& r : (*op)->ranks) {
      if (!r) continue;
      cudaSetDevice(r->device);
      if (!PollUntil([&] { return cudaStreamQuery(r->stream.get()) != cudaErrorNotReady; },
                     deadline)) {
        EngineLog()->error(
            "group {} rank {}: its stream still has work at the group's end (a client holds "
            "its ready wait); left",
            spec().name(), r->rank);
      }
    }
  }
  cudaGetLastError();
  gpu_op_.reset();
  abandoned_.reset();
  program_tail_.reset();
  plane_->ReleaseGpus(this);
  // The group's own device arrays go the ranks' way (CreateCudaRank): freed between engine
  // rounds, never here beside another group's half-launched op.
  struct Arrays {
    std::map<int, DeviceMemory> peer_bases, mask_arrays;
    std::vector<OpGraphSet> op_graphs;  // Destroyed first: they name the arrays above.
  };
  auto arrays = std::make_shared<Arrays>();
  arrays->op_graphs.swap(op_graphs_);
  arrays->peer_bases.swap(peer_bases_);
  arrays->mask_arrays.swap(mask_arrays_);
  plane_->deferred_release().Add(std::move(arrays));
  // The exchange's host memory registered with CUDA is unregistered the same way (an
  // unregister waits for the device as a free does); its link is gone first.
  if (exchange_) {
    std::shared_ptr<void> mapped = exchange_->TakeMappedMemory();
    exchange_.reset();
    plane_->deferred_release().Add(std::move(mapped));
  }
}

void CudaGroup::AdoptEngine(int device) {
  std::lock_guard<std::mutex> lock(engine_mu_);
  if (engine_.load() != nullptr) return;
  GpuEngine* e = plane_->EngineOf(device);
  e->host.Add(this);
  engine_.store(e);
}

absl::StatusOr<std::shared_ptr<RankResources>> CudaGroup::PrepareRank(int32_t rank,
                                                                      const std::string& gpu_uuid,
                                                                      v1::LaunchMode launch_mode,
                                                                      v1::EndpointInfo* info) {
  // On the control path without the lock (LockstepGroup::AttachRank), as the allocations
  // below: the earlier rejoins' stand-ins are freed here.
  EPD_ASSIGN_OR_RETURN(int device, plane_->DeviceOf(gpu_uuid));
  if (masking() && launch_mode == v1::LAUNCH_MODE_CLIENT) {
    return errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            "launch_mode: LAUNCH_MODE_CLIENT with spec.on_rank_failure = "
            "RANK_FAILURE_POLICY_MASK (group ",
            spec().name(),
            "): a masked rank's kernels must still run, and no one launches a dead client's; "
            "use LAUNCH_MODE_DAEMON")),
        errors::Reason::kUnsupported);
  }
  // Client-launched endpoints get the same (zeroed) area and IPC handle; the engine
  // refuses their ring slots (AcceptsRequests).
  EPD_ASSIGN_OR_RETURN(std::shared_ptr<CudaRank> r,
                       CreateCudaRank(device, rank, layout(), launch_mode == v1::LAUNCH_MODE_CLIENT,
                                      &plane_->deferred_release()));
  if (spanning()) EPD_RETURN_IF_ERROR(AddCudaRankMirror(*r, shape(), layout()));
  if (!r->client_launched) {  // The client's own launches count nothing here.
    EPD_RETURN_IF_ERROR(AddCudaRankExpertStats(*r, shape().num_local_experts(), expert_tally_));
  }
  AdoptEngine(device);
  info->set_backend("cuda");
  info->set_gpu_uuid(plane_->UuidOf(device));
  info->set_cuda_ipc_handle(r->ipc_handle);
  info->set_launch_mode(r->client_launched ? v1::LAUNCH_MODE_CLIENT : v1::LAUNCH_MODE_DAEMON);
  // Under MPS the client's staging kernel of a low-latency op waits for done itself (one
  // block of one SM per rank, which LaunchRank's grids leave free).
  // A spanning op's done comes after the exchange (milliseconds): a stream wait then.
  info->set_kernel_done_wait(!r->client_launched && !spanning() && plane_->kernel_ready_wait());
  // The same for a graph-mode program step's done wait: its instances' grids leave that SM
  // too (ProgramRankContext).
  info->set_program_kernel_done_wait(info->kernel_done_wait());
  // A client-launched spanning rank's mirror and command block are in its endpoint region
  // (ShmDataBytes); its client finds them at the region's data offset (span_abi.h).
  return std::shared_ptr<RankResources>(std::move(r));
}

void CudaGroup::UpdateDevices() {
  devices_.clear();
  for (size_t i = 0; i < ranks_.size(); ++i) {
    const std::shared_ptr<CudaRank>& r = OpRank(static_cast<int32_t>(i));
    if (!r) continue;
    auto it = std::lower_bound(devices_.begin(), devices_.end(), r->device);
    if (it == devices_.end() || *it != r->device) devices_.insert(it, r->device);
  }
}

absl::Status CudaGroup::RankAttached(int32_t rank, const std::shared_ptr<RankResources>& res) {
  auto r = std::static_pointer_cast<CudaRank>(res);
  for (int d : devices_) {
    if (!plane_->PeerAccess(r->device, d) || !plane_->PeerAccess(d, r->device)) {
      return errors::WithReason(
          absl::FailedPreconditionError(
              absl::StrCat("rank ", rank, " on GPU ", plane_->UuidOf(r->device),
                           " cannot reach GPU ", plane_->UuidOf(d), " of another rank of group ",
                           spec().name(), " (no peer access between them)")),
          errors::Reason::kCudaIpcFailed);
    }
  }
  std::vector<uint8_t*> bases = host_bases_;
  bases[rank] = r->area.get();
  if (standins_[rank]) {
    // A rejoin into a masked slot: the rank's masked part may still run on the stand-in's
    // area, which the peers' kernels address through the peer arrays. They get the new
    // area before the next op's launches, the group's GPUs idle (UploadPeerBases); the
    // stand-in lives until then.
    bases_dirty_ = true;
  } else {
    EPD_RETURN_IF_ERROR(CopyPeerBases(bases, r.get()));
  }
  host_bases_ = std::move(bases);
  ranks_[rank] = std::move(r);
  ++ranks_generation_;  // The op graphs name the ranks' areas, streams and events.
  UpdateDevices();
  mask_dirty_ = true;  // Its GPU may have no mask array yet.
  // The new area's sync state is zero, the others' counters are not: zero them all
  // before the next op.
  needs_sync_reset_ = true;
  PublishJoined(rank, true);
  return absl::OkStatus();
}

void CudaGroup::PublishJoined(int32_t changed, bool joined) {
  if (!spanning() || !exchange_ || !exchange_->ready()) return;
  std::vector<bool> bits(local_count());
  for (int32_t i = 0; i < local_count(); ++i) {
    const int32_t r = local_first() + i;
    bits[i] = r == changed ? joined : ranks_[r] != nullptr;
  }
  exchange_->SetLocalRanksJoined(bits);
}

void CudaGroup::RankDetached(int32_t rank) {
  if (program_) {
    DisarmProgram(absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, " left group ", spec().name(),
                     ": its graph-mode program was disarmed; rejoin and register it again")));
  }
  if (masking()) {
    KeepAsStandIn(rank);
    return;
  }
  ranks_[rank].reset();  // A last reference hands it to DeferredRelease: not freed here.
  ++ranks_generation_;
  host_bases_[rank] = nullptr;
  UpdateDevices();
  PublishJoined(rank, false);
}

absl::Status CudaGroup::CopyPeerBases(const std::vector<uint8_t*>& bases, const CudaRank* fresh) {
  std::set<int> devices(devices_.begin(), devices_.end());
  if (fresh != nullptr) devices.insert(fresh->device);
  // Every GPU of the group gets the new [R] array of bases, copied on a stream of that GPU
  // (the new rank's, or an attached rank's) and waited for, so no kernel sees a stale array.
  for (int d : devices) {
    cudaStream_t stream = fresh != nullptr && fresh->device == d ? fresh->stream.get() : nullptr;
    for (const auto& other : ranks_) {
      if (stream == nullptr && other && other->device == d) stream = other->stream.get();
    }
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(d)));
    auto it = peer_bases_.find(d);
    if (it == peer_bases_.end()) {
      EPD_ASSIGN_OR_RETURN(DeviceMemory p,
                           AllocateDevice(sizeof(uint8_t*) * bases.size(), DeviceZero::kNo));
      it = peer_bases_.emplace(d, std::move(p)).first;
    }
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaMemcpyAsync(it->second.get(), bases.data(),
                                                        sizeof(uint8_t*) * bases.size(),
                                                        cudaMemcpyHostToDevice, stream)));
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaStreamSynchronize(stream)));
  }
  return absl::OkStatus();
}

kc::CudaRankContext CudaGroup::Context(int32_t r, int32_t num_sms) const {
  const CudaRank& cr = *OpRank(r);
  kc::RankPlacement at;
  at.rank = r;
  at.peer_bases = reinterpret_cast<uint8_t* const*>(peer_bases_.at(cr.device).get());
  at.own_base = cr.area.get();
  for (size_t i = 0; i < ranks_.size(); ++i) {
    const std::shared_ptr<CudaRank>& other = OpRank(static_cast<int32_t>(i));
    at.ranks_on_device += other && other->device == cr.device;
  }
  at.op_timeout_ms = options().op_timeout_ms;
  kc::CudaRankContext ctx = kc::MakeRankContext(shape(), layout(), at, num_sms);
  // Raised by the plane's Shutdown: every spin of the op's kernels then ends.
  ctx.abort_flag = plane_->shutdown_word();
  if (any_masked_) {
    auto it = mask_arrays_.find(cr.device);
    if (it != mask_arrays_.end()) ctx.rank_masked = it->second.get();
  }
  return ctx;
}

bool CudaGroup::ReadyToStart() {
  if (program_tail_ && !ProgramTailDone()) return false;
  if (abandoned_) {
    if (GraphStreamsBusy(*abandoned_)) return false;
    for (const auto& r : abandoned_->ranks) {
      if (r && cudaEventQuery(r->done.get()) == cudaErrorNotReady) return false;
    }
    cudaGetLastError();
    RecycleOp(abandoned_);
    plane_->ReleaseGpus(this);
    needs_sync_reset_ = true;
  }
  // A spanning op's kernels are copies that wait for nothing on the GPU: no claim.
  if (spanning()) return exchange_->ReadyToStart();
  return plane_->TryClaimGpus(devices_, this);
}

absl::Status CudaGroup::ResetSync() {
  for (size_t r = 0; r < ranks_.size(); ++r) {
    const CudaRank& cr = *OpRank(static_cast<int32_t>(r));
    kc::CudaRankContext ctx = Context(static_cast<int32_t>(r), 0);
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(cr.device)));
    cudaStream_t s = cr.stream.get();
    if (shape().ll_max_tokens_per_rank > 0) EPD_RETURN_IF_ERROR(kc::ResetLowLatencySync(ctx, s));
    if (shape().num_ranks <= kc::kNormalMaxRanks) {  // Else normal ops are refused anyway.
      EPD_RETURN_IF_ERROR(kc::ResetNormalSync(ctx, s));
    }
    EPD_RETURN_IF_ERROR(kc::EnqueueStatusReadback(ctx, s, &cr.readback->status));
  }
  // Every rank's reset must be complete before any rank's next kernel writes a peer's flags.
  for (size_t r = 0; r < ranks_.size(); ++r) {
    EPD_RETURN_IF_ERROR(
        EPD_CUDA_STATUS(cudaStreamSynchronize(OpRank(static_cast<int32_t>(r))->stream.get())));
  }
  needs_sync_reset_ = false;
  return absl::OkStatus();
}

absl::Status CudaGroup::LaunchRank(const OpPlan& plan, const abi::RequestSlot& slot, int32_t r,
                                   bool* ready_wait, bool captured) {
  const CudaRank& cr = *OpRank(r);
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(cr.device)));
  cudaStream_t s = cr.stream.get();
  const bool low_latency = rules::IsLowLatency(plan.op);
  // The op's flags (agreed by every rank) and this rank's stream ordering, decoded once. A
  // masked rank's part (rank_masked(): T = 0, a copy of another rank's slot) is the
  // daemon's alone: no client stream waits for it, nor does it wait for a client.
  const bool masked = rank_masked()[r] != 0;
  const rules::RequestOptions op_flags = rules::DecodeFlags(plan.flags);
  const bool stream_ordered = !masked && rules::DecodeFlags(slot.flags).stream_ordered;
  // A client's SM budget applies to normal ops only: low-latency kernels spin on each
  // other, so their grids keep the default that makes every rank resident.
  const int32_t num_sms = low_latency
                              ? plane_->options().num_sms
                              : (slot.num_sms > 0 ? slot.num_sms : plane_->options().num_sms);
  kc::CudaRankContext ctx = Context(r, num_sms);
  // Its clients' staging kernels wait for done on the GPU (EndpointInfo kernel_done_wait):
  // one SM per rank of the GPU stays outside the low-latency grids for them.
  if (low_latency && plane_->kernel_ready_wait()) ctx.sms_left_per_rank = 1;
  // Daemon-launched low-latency ops hand off inside kernels (cuda_ops.h "stream-ordered
  // hand-off inside kernels"): a one-warp WaitFlagAsync for staging_seq or ready_seq, the
  // op's kernel launched programmatically behind it (it waits for ready_seq itself and
  // writes done_seq).
  // Its bound outlasts the engine's give-up (op_timeout + kGpuGrace), after which
  // ReleaseReadyWaits writes ready_seq from the host.
  // Without MPS (plane_->kernel_ready_wait() false) the client's and the daemon's contexts
  // time-slice the GPU, and a spinning wait would hold the slice the client's staging kernel
  // needs (DESIGN.md §3.2): the ready wait is then cuStreamWaitValue64, and the kernel
  // still checks ready_seq and writes done_seq.
  kc::KernelHandoff handoff;
  const bool kernel_handoff = stream_ordered && low_latency;
  // Captured into an op graph: the seq comes from the rank's Readback word, written by the
  // engine before each launch of the graph (LaunchOpGraphs).
  const uint64_t* seq_word = captured ? &cr.readback->op_seq : nullptr;
  if (kernel_handoff) handoff = HandoffFor(slot, r, seq_word);
  // The op's begin event: recorded now, or a node of the graph being captured.
  auto begin = [&]() -> absl::Status {
    if (!captured) {
      gpu_timer_.Begin(r, cr.op_begin.get(), s);
      return absl::OkStatus();
    }
    return EPD_CUDA_STATUS(cudaEventRecordWithFlags(cr.op_begin.get(), s, cudaEventRecordExternal));
  };
  if (kernel_handoff && plane_->kernel_ready_wait()) {
    // The wait passes once the client's staging kernel has started (staging_seq, layout.h)
    // or, from a client that does not write staging_seq, once it is done (ready_seq): the
    // op's kernel is then launched while the inputs are still being copied (the
    // programmatic launch overlaps the staging), and its blocks wait for ready_seq
    // themselves. staging_seq comes only once every block of the staging kernel is
    // resident, so that kernel ends whatever SMs the op's grid then takes
    // (docs/CUDA_BACKEND.md "Launch modes").
    // The op's GPU time starts before the wait: nothing may come between the wait kernel
    // and the programmatic launch behind it (it would end their overlap). It then includes
    // the wait for the client's staging kernel to start (docs/OPERATIONS.md).
    EPD_RETURN_IF_ERROR(begin());
    EPD_RETURN_IF_ERROR(kc::WaitFlagAsync(reinterpret_cast<const uint64_t*>(cr.staging_flag()),
                                          slot.seq, ReadyWaitBoundNs(), &cr.readback->ready_seen, s,
                                          reinterpret_cast<const uint64_t*>(cr.ready_flag()),
                                          seq_word, plane_->shutdown_word()));
    handoff.programmatic = true;
  } else if (captured) {
    // Only the hand-off above reads its seq from memory (OpGraphVariant).
    return absl::InternalError("an op graph captured a launch without the kernel hand-off");
  } else if (stream_ordered) {
    // The client's stream writes ready_seq = seq once it has staged the inputs; this
    // stream waits for it on the GPU (the CPU never does).
    EPD_RETURN_IF_ERROR(StreamWaitValue64Geq(s, cr.ready_flag(), slot.seq));
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaEventRecord(cr.waited.get(), s)));
    *ready_wait = true;
    gpu_timer_.Begin(r, cr.op_begin.get(), s);  // After the wait: the op's kernels only.
  } else {
    gpu_timer_.Begin(r, cr.op_begin.get(), s);
  }
  switch (plan.op) {
    case abi::OpKind::kGetDispatchLayout:
      EPD_RETURN_IF_ERROR(kc::SetNormalNumTokensAsync(ctx, slot.num_tokens, s));
      EPD_RETURN_IF_ERROR(kc::GetDispatchLayout(ctx, kc::GetDispatchLayoutArgs{}, s));
      break;
    case abi::OpKind::kDispatch: {
      kc::NormalDispatchArgs a;
      a.fp8 = op_flags.use_fp8;
      a.expert_alignment = slot.expert_alignment;
      a.with_weights = op_flags.dispatch_weights;
      a.cached = op_flags.cached_handle;
      a.recv_count_out = &cr.readback->recv_count;  // Mapped: the kernel writes N there.
      a.expert_stats = cr.expert_stats();
      EPD_RETURN_IF_ERROR(kc::SetNormalNumTokensAsync(ctx, slot.num_tokens, s));
      EPD_RETURN_IF_ERROR(kc::NormalDispatch(ctx, a, s));
      break;
    }
    case abi::OpKind::kCombine: {
      kc::NormalCombineArgs a;
      a.with_weights = op_flags.combine_weights;
      // The handle's T (validated equal to the routing dispatch's T).
      EPD_RETURN_IF_ERROR(kc::SetNormalNumTokensAsync(ctx, slot.num_tokens, s));
      EPD_RETURN_IF_ERROR(kc::NormalCombine(ctx, a, s));
      break;
    }
    case abi::OpKind::kLowLatencyDispatch:
      EPD_RETURN_IF_ERROR(
          kc::LowLatencyDispatch(ctx, DispatchArgsFor(plan, slot, r, handoff, captured), s));
      break;
    case abi::OpKind::kLowLatencyCombine:
      EPD_RETURN_IF_ERROR(kc::LowLatencyCombine(ctx, CombineArgsFor(plan, r, handoff), s));
      break;
    default:
      return absl::InternalError(absl::StrCat("unreachable op kind ", static_cast<int>(plan.op)));
  }
  return absl::OkStatus();
}

int64_t CudaGroup::ReadyWaitBoundNs() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::milliseconds(options().op_timeout_ms) + 2 * kGpuGrace)
      .count();
}

kc::KernelHandoff CudaGroup::HandoffFor(const abi::RequestSlot& slot, int32_t r,
                                        const uint64_t* seq_word) const {
  const CudaRank& cr = *OpRank(r);
  kc::KernelHandoff handoff;
  handoff.ready_flag = reinterpret_cast<const uint64_t*>(cr.ready_flag());
  handoff.ready_value = slot.seq;
  handoff.done_flag = reinterpret_cast<uint64_t*>(cr.done_flag());
  handoff.done_value = slot.seq;
  handoff.seq_word = seq_word;
  handoff.status_out = &cr.readback->status;  // No read-back kernel behind it (StartOpInto).
  return handoff;
}

kc::LowLatencyDispatchArgs CudaGroup::DispatchArgsFor(const OpPlan& plan,
                                                      const abi::RequestSlot& slot, int32_t r,
                                                      const kc::KernelHandoff& handoff,
                                                      bool captured) const {
  const CudaRank& cr = *OpRank(r);
  const rules::RequestOptions op_flags = rules::DecodeFlags(plan.flags);
  kc::LowLatencyDispatchArgs a;
  a.buffer = plan.ll_buffer;
  a.use_fp8 = op_flags.use_fp8;
  a.round_scale = op_flags.round_scale;
  a.use_ue8m0 = op_flags.use_ue8m0;
  a.num_tokens_value = slot.num_tokens;  // By value: no slot write to enqueue.
  if (captured) {  // From the rank's Readback word (host-mapped), per launch of the graph.
    a.num_tokens_value = -1;
    a.num_tokens = &cr.readback->op_num_tokens;
  }
  a.handoff = handoff;
  a.expert_stats = cr.expert_stats();
  return a;
}

kc::LowLatencyCombineArgs CudaGroup::CombineArgsFor(const OpPlan& plan, int32_t r,
                                                    const kc::KernelHandoff& handoff) const {
  const CudaRank& cr = *OpRank(r);
  kc::LowLatencyCombineArgs a;
  a.buffer = plan.ll_handle_buffer;
  a.combined_x = reinterpret_cast<kernels::bf16_bits*>(
      cr.area.get() + layout().ll_combined_x[plan.ll_out_buffer].offset);
  a.handoff = handoff;
  if (rank_masked()[r] != 0) a.num_tokens_value = 0;  // Its dispatch's tokens are not combined.
  return a;
}

bool CudaGroup::StartOpInto(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots,
                            std::span<RankOutcome> outcomes) {
  if (spanning()) return StartSpanning(plan, slots);
  const int R = static_cast<int>(slots.size());
  if (trace_) {
    trace_op_ = OpLaunchTrace::Op{};
    trace_op_.first_arrival = plan.first_arrival;
    trace_op_.last_arrival = plan.last_arrival;
    trace_op_.start = Clock::now();
  }
  // A failure before any launch: no kernel runs, so the clients' streams are released.
  auto fail_unlaunched = [&](const char* what, const absl::Status& st) {
    EngineLog()->error("group {}: {} failed: {}", spec().name(), what, st.ToString());
    plane_->ReleaseGpus(this);
    for (int r = 0; r < R; ++r) {
      if (rank_masked()[r]) continue;  // Its outcome stays OK; its slot is another's copy.
      outcomes[r].status = st;
      OpEndedWithoutLaunch(r, slots[r]);
    }
    return true;
  };
  if (absl::Status st = UploadPeerBases(); !st.ok()) {
    return fail_unlaunched("copying the ranks' areas to the GPUs' peer arrays", st);
  }
  // Not while a program is armed: the ranks' streams are held by its waits (the only op
  // then is UnregisterProgram, whose disarm sets the reset for the op after it).
  if (needs_sync_reset_ && !program_) {
    if (absl::Status st = ResetSync(); !st.ok()) {
      return fail_unlaunched("resetting the kernels' sync state", st);
    }
  }
  if (absl::Status st = UploadMask(); !st.ok()) {
    return fail_unlaunched("copying the rank mask to the GPUs", st);
  }
  if (plan.op == abi::OpKind::kRegisterProgram || plan.op == abi::OpKind::kUnregisterProgram) {
    ProgramOp(plan, outcomes);
    return true;
  }
  // The op's state: spare_'s vectors (R entries each; SizeOp allocates only if an earlier
  // path had not given them back, which none does), filled in place.
  GpuOp& op = spare_;
  SizeOp(op);
  op.op = plan.op;
  op.seq = plan.seq;
  op.started = Clock::now();
  op.graph_streams.clear();  // Keeps its capacity: no allocation.
  // The most a rank's op can drop: its pairs (T * K), or its routes (T * R) when the op
  // drops send_pos entries (normal combine, cached normal dispatch).
  const bool drops_routes =
      plan.op == abi::OpKind::kCombine ||
      (plan.op == abi::OpKind::kDispatch && rules::DecodeFlags(plan.flags).cached_handle);
  const int64_t per_token = drops_routes ? shape().num_ranks : shape().num_topk;
  gpu_timer_.Start();
  for (int r = 0; r < R; ++r) {
    op.ranks[r] = OpRank(r);
    op.launch[r] = absl::OkStatus();
    op.stream_ordered[r] = !rank_masked()[r] && rules::DecodeFlags(slots[r].flags).stream_ordered;
    op.ready_wait[r] = false;
    op.left_unstaged[r] = false;
    op.done_written[r] = false;
    op.lead[r] = -1;
    op.max_dropped[r] = int64_t{std::max(slots[r].num_tokens, 0)} * per_token;
  }
  // One launch per GPU when an op graph covers the op (cuda_group_graphs.cc).
  if (std::optional<OpGraphKey> key = OpGraphVariant(plan, slots)) {
    if (const OpGraphSet* set = OpGraphsFor(*key, plan, slots)) {
      LaunchOpGraphs(*set, plan, slots, op);
      if (trace_) {
        trace_op_.launched = Clock::now();
        trace_op_.launch_calls = static_cast<int32_t>(set->devices.size());
        trace_op_.graph = true;
      }
      gpu_op_.emplace(std::move(spare_));  // The vectors move: no allocation.
      return false;
    }
  }
  // One wait and one kernel per GPU when a fused launch covers the op (cuda_group_fused.cc).
  if (FusedLaunchCovers(plan, slots)) {
    LaunchFused(plan, slots, op);
    if (trace_) {
      trace_op_.launched = Clock::now();
      // Per GPU: the begin event, the wait, the kernel, the done event.
      trace_op_.launch_calls = static_cast<int32_t>(4 * fused_devices_.size());
    }
    gpu_op_.emplace(std::move(spare_));  // The vectors move: no allocation.
    return false;
  }
  // Every rank's kernel is enqueued before any is waited for; a launch error on one rank
  // still launches the others, whose waits then end at the kernel timeout.
  for (int r = 0; r < R; ++r) {
    bool ready_wait = false;
    op.launch[r] = LaunchRank(plan, slots[r], r, &ready_wait);
    op.ready_wait[r] = ready_wait;
  }
  for (int r = 0; r < R; ++r) {
    const CudaRank& cr = *OpRank(r);
    cudaSetDevice(cr.device);
    // A launched low-latency kernel that hands off wrote done and its status itself
    // (KernelHandoff::status_out); every other path gets the read-back kernel and, when
    // stream-ordered, done_seq = seq after it, so the client's stream is released on every
    // path.
    const bool kernel_wrote_all = KernelHandsOff(op, r) && op.launch[r].ok();
    absl::Status st = kernel_wrote_all ? absl::OkStatus()
                                       : kc::EnqueueStatusReadback(Context(r, 0), cr.stream.get(),
                                                                   &cr.readback->status);
    if (op.stream_ordered[r] && !kernel_wrote_all) {
      absl::Status done = WriteDone(cr, plan.seq);
      if (st.ok()) st = done;
    }
    absl::Status recorded = EPD_CUDA_STATUS(cudaEventRecord(cr.done.get(), cr.stream.get()));
    if (recorded.ok()) gpu_timer_.SetEnd(r, cr.done.get());
    if (st.ok()) st = recorded;
    if (!st.ok() && op.launch[r].ok()) op.launch[r] = st;
  }
  // Every rank's stream now orders this op behind whatever was on it.
  streams_touched_ = false;
  if (trace_) {
    trace_op_.launched = Clock::now();
    trace_op_.launch_calls = PerRankLaunchCalls(plan, op);
  }
  gpu_op_.emplace(std::move(spare_));  // The vectors move: no allocation.
  return false;
}

int32_t CudaGroup::PerRankLaunchCalls(const OpPlan& plan, const GpuOp& op) const {
  // As LaunchRank and StartOpInto enqueue them (the count EPD_OP_TRACE reports).
  int32_t calls = 0;
  const bool low_latency = rules::IsLowLatency(plan.op);
  for (size_t r = 0; r < op.ranks.size(); ++r) {
    calls += 2;                    // The begin event, the done event.
    calls += low_latency ? 1 : 2;  // The kernel; a normal op's T before it.
    if (SpinsForReady(op, r)) {
      calls += 1;  // WaitFlagAsync.
    } else if (op.stream_ordered[r]) {
      calls += 2;  // The stream wait and its `waited` event.
    }
    if (!KernelHandsOff(op, r)) calls += op.stream_ordered[r] ? 2 : 1;  // Read-back, done_seq.
  }
  return calls;
}

absl::Status CudaGroup::CheckRequest(int32_t rank, const abi::RequestSlot& slot) const {
  // The command behind the slot (PopBackendRequest took it just before).
  if (ClientSpanRank(rank)) return CheckSpanCommand(ranks_[rank]->mirror->command);
  if (rules::DecodeFlags(slot.flags).stream_ordered) {
    absl::Status mem = StreamMemOpsAvailable();
    if (!mem.ok()) {
      return errors::WithReason(
          absl::FailedPreconditionError(
              absl::StrCat(OpName(slot.op),
                           ": kFlagStreamOrdered cannot be served by this epd: ", mem.message())),
          errors::Reason::kUnsupported);
    }
  }
  return absl::OkStatus();
}

absl::Status CudaGroup::AcceptsRequests(int32_t rank) const {
  const std::shared_ptr<CudaRank>& cr = ranks_[rank];
  if (cr && cr->client_launched && !ClientSpanRank(rank)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " of group ", spec().name(),
        " is client-launched (LAUNCH_MODE_CLIENT): the daemon runs no op for it and refuses "
        "its ring slots; its client launches the kernels itself"));
  }
  return absl::OkStatus();
}

absl::Status CudaGroup::WriteDone(const CudaRank& cr, uint64_t seq) const {
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(cr.device)));
  return StreamWriteValue64(cr.stream.get(), cr.done_flag(), seq);
}

void CudaGroup::OpEndedWithoutLaunch(int32_t rank, const abi::RequestSlot& slot) {
  if (!rules::DecodeFlags(slot.flags).stream_ordered) return;
  streams_touched_ = true;  // A done_seq write on the rank's stream (below) outside an op.
  const std::shared_ptr<CudaRank>& cr = ranks_[rank];
  if (!cr) return;
  // Failed by the plane's Shutdown: the client's staging kernel of this request may not have
  // run yet; it writes into this area, so the drain waits for it (StagingsLanded).
  if (stopping_) pending_stagings_.push_back({cr, rank, slot.seq, false});
  if (program_ && program_->HoldsRank(rank, cr.get())) {
    // The rank's stream is held by the program's waits: write done_seq from the host (no
    // ring op of the group runs while a program is armed, so nothing else writes it).
    // A stream memory write on the engine's aux stream (no copy: see DisarmProgram).
    cudaSetDevice(cr->device);
    cudaStream_t aux = plane_->EngineOf(cr->device)->aux.get();
    absl::Status st = StreamWriteValue64(aux, cr->done_flag(), slot.seq);
    if (st.ok()) st = EPD_CUDA_STATUS(cudaStreamSynchronize(aux));
    if (!st.ok()) {
      EngineLog()->error("group {} rank {}: releasing the client's stream for op {} failed: {}",
                         spec().name(), rank, slot.seq, st.ToString());
    }
    return;
  }
  OrderAfterFusedOp(rank);
  absl::Status st = WriteDone(*cr, slot.seq);
  if (!st.ok()) {
    EngineLog()->error("group {} rank {}: releasing the client's stream for op {} failed: {}",
                       spec().name(), rank, slot.seq, st.ToString());
  }
}

void CudaGroup::ReleaseReadyWaits(const GpuOp& op) const {
  for (size_t r = 0; r < op.ranks.size() && r < op.ready_wait.size(); ++r) ReleaseReadyWait(op, r);
  cudaGetLastError();
}

bool CudaGroup::ReleaseReadyWait(const GpuOp& op, size_t r) const {
  const bool spins = SpinsForReady(op, r);
  if (!(op.ready_wait[r] || spins) || !op.ranks[r]) return false;
  if (r < op.done_written.size() && op.done_written[r]) return false;
  const CudaRank& cr = *op.ranks[r];
  cudaSetDevice(cr.device);
  if (spins) {
    // Written by the rank's WaitFlagAsync once its wait passed (pinned host memory).
    const uint64_t seen = *reinterpret_cast<const volatile uint64_t*>(&cr.readback->ready_seen);
    if (seen >= op.seq) return false;
  } else if (cudaEventQuery(cr.waited.get()) != cudaErrorNotReady) {
    return false;
  }
  // The stream is still at the ready wait, so its client has not written ready_seq =
  // seq (nor anything later): writing seq cannot hide a newer value.
  const uint64_t seq = op.seq;
  cudaError_t err = cudaMemcpy(reinterpret_cast<void*>(cr.ready_flag()), &seq, sizeof(seq),
                               cudaMemcpyHostToDevice);
  LogRankCaused(static_cast<int32_t>(r), spdlog::level::warn,
                "group {} rank {}: its client never wrote ready_seq = {}; released the stream "
                "from the host ({})",
                spec().name(), r, seq, cudaGetErrorString(err));
  return true;
}

void CudaGroup::TraceOpDone(std::optional<uint64_t> gpu_ns) {
  trace_op_.done_seen = Clock::now();
  trace_op_.gpu_ns = gpu_ns;
  trace_->Record(trace_op_);
  if (std::optional<std::string> line = trace_->MaybeSummary(trace_op_.done_seen)) {
    EngineLog()->warn("op trace: group {}: {}", spec().name(), *line);
  }
}

bool CudaGroup::PollOpInto(std::span<RankOutcome> outcomes) {
  if (spanning()) return PollSpanning(outcomes);
  GpuOp& op = *gpu_op_;
  const int R = static_cast<int>(op.ranks.size());
  bool all_done = !GraphStreamsBusy(op);
  for (int r = 0; r < R; ++r) {
    const cudaError_t err = cudaEventQuery(op.ranks[r]->done.get());
    event_errors_[r] = err;
    if (err == cudaErrorNotReady) {
      all_done = false;
    } else if (err != cudaSuccess) {
      cudaGetLastError();  // Clear a non-sticky error: it is reported below, not later.
    }
  }
  if (!all_done) {
    if (Clock::now() - op.started <
        std::chrono::milliseconds(options().op_timeout_ms) + kGpuGrace) {
      return false;
    }
    // The kernels bound their own waits by op_timeout; past that and a grace period the
    // op is given up on. Its resources stay held until the GPU is done with them, and the
    // group's next op waits for that (ReadyToStart, which recycles it into spare_).
    absl::Status st = errors::WithReason(
        absl::DeadlineExceededError(absl::StrCat(
            OpName(static_cast<uint32_t>(op.op)), " of group ", spec().name(),
            ": the GPU did not finish the op within op_timeout ", options().op_timeout_ms,
            " ms + 5 s; check the GPU (nvidia-smi) and the daemon log")),
        errors::Reason::kGpuTimeout);
    LogClientCaused(spdlog::level::err, "{}", st.message());
    for (int r = 0; r < R; ++r) {
      if (!rank_masked()[r]) outcomes[r].status = st;  // A masked rank's stays OK.
    }
    ReleaseReadyWaits(op);
    abandoned_ = std::move(gpu_op_);
    gpu_op_.reset();
    return true;
  }
  const char* name = OpName(static_cast<uint32_t>(op.op));
  const bool low_latency = rules::IsLowLatency(op.op);
  bool all_ok = true;
  for (int r = 0; r < R; ++r) {
    const Readback& rb = *op.ranks[r]->readback;
    RankOutcome& out = outcomes[r];
    const bool event_failed = event_errors_[r] != cudaSuccess;
    if (!op.launch[r].ok()) {
      out.status = op.launch[r];
    } else if (event_failed) {
      out.status = CudaErrorToStatus(event_errors_[r], "cudaEventQuery(the op's done event)",
                                     __FILE__, __LINE__);
    } else {
      // OK allocates nothing (a DeviceStatus without findings).
      out.status = kc::StatusFromDevice(rb.status, shape(), r, name, low_latency);
      // Read back from the rank's area (client-writable): checked before use.
      const uint32_t dropped = rb.status.dropped_pairs;
      if (dropped <= op.max_dropped[r]) {
        out.dropped_pairs = static_cast<int32_t>(dropped);
      } else if (out.status.ok()) {
        out.status = absl::InvalidArgumentError(absl::StrCat(
            name, ": rank ", r, ": the dropped-pairs count read back from the endpoint's memory, ",
            dropped, ", is above the op's ", op.max_dropped[r],
            ": the endpoint's memory was overwritten during the op"));
      }
      if (op.op == abi::OpKind::kDispatch) {
        // Read back from the rank's area, which its client can write: checked before use.
        const int32_t n = rb.recv_count;
        if (n >= 0 && n <= shape().max_recv_tokens()) {
          out.num_recv_tokens = n;
        } else if (out.status.ok()) {
          out.status = absl::InvalidArgumentError(absl::StrCat(
              name, ": rank ", r, ": the received count read back from the endpoint's memory, ", n,
              ", is outside [0, num_ranks * max_tokens_per_rank = ", shape().max_recv_tokens(),
              "]: the endpoint's memory was overwritten during the op"));
        }
      }
    }
    // A device-side timeout or a launch error leaves the ranks' sequence counters out of
    // step: zero the sync state before the next op.
    if (out.status.code() == absl::StatusCode::kDeadlineExceeded || !op.launch[r].ok() ||
        event_failed) {
      needs_sync_reset_ = true;
    }
    // A masked rank's part is the daemon's: its outcome stays OK (LockstepGroup), whatever
    // its kernels found (a timeout of theirs is the survivors' too, and reset above).
    if (rank_masked()[r]) {
      out.status = absl::OkStatus();
      out.num_recv_tokens = 0;
      out.dropped_pairs = 0;
    }
  }
  for (int q = 0; q < R; ++q) {
    if (!op.left_unstaged[q]) continue;
    const absl::Status st = errors::WithReason(
        absl::DeadlineExceededError(
            absl::StrCat(OpName(static_cast<uint32_t>(op.op)), " (op ", op.seq, ") of group ",
                         spec().name(), ": rank ", q,
                         " left during the op before its inputs were staged (it is masked from "
                         "the next op on)")),
        errors::Reason::kRankLeft);
    for (int r = 0; r < R; ++r) {
      if (!rank_masked()[r]) outcomes[r].status = st;
    }
    needs_sync_reset_ = true;  // Its kernels ran on a released wait: start the next op clean.
    break;
  }
  for (int r = 0; r < R; ++r) all_ok = all_ok && outcomes[r].status.ok();
  // Every done event is complete (seen above): reading the times waits for nothing.
  std::optional<uint64_t> gpu_ns;
  if (all_ok) {
    gpu_ns = gpu_timer_.Finish();
    if (gpu_ns) metrics().RecordGpuTime(static_cast<uint32_t>(op.op), *gpu_ns);
  }
  if (trace_) TraceOpDone(gpu_ns);
  RecycleOp(gpu_op_);
  plane_->ReleaseGpus(this);
  return true;
}

// ---- graph mode -------------------------------------------------------------------------

absl::Status CudaGroup::CheckProgram(int32_t rank) const {
  const std::vector<uint8_t>& masked = rank_masked();
  if (masking() && std::any_of(masked.begin(), masked.end(), [](uint8_t m) { return m != 0; })) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", spec().name(),
        " has masked ranks (Endpoint::QueryRankMask): a graph-mode program needs every rank; "
        "rejoin or unmask them first"));
  }
  if (spanning()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", spec().name(), " spans ", spec().nodes_size(),
        " nodes: graph-mode programs are not available across nodes yet; run its ops from the "
        "ring"));
  }
  const std::shared_ptr<CudaRank>& cr = ranks_[rank];
  if (cr && cr->client_launched) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " of group ", spec().name(),
        " is client-launched: its ops are captured in CUDA graphs natively; graph-mode "
        "programs are for daemon-launched endpoints"));
  }
  absl::Status mem = StreamMemOpsAvailable();
  if (!mem.ok()) {
    return errors::WithReason(
        absl::FailedPreconditionError(
            absl::StrCat("graph-mode programs need stream memory operations: ", mem.message())),
        errors::Reason::kUnsupported);
  }
  return absl::OkStatus();
}

kc::CudaRankContext CudaGroup::ProgramRankContext(int32_t r, int32_t num_sms) const {
  kc::CudaRankContext ctx = Context(r, num_sms);
  // Under MPS a program step's client waits for done in its staging kernel (EndpointInfo
  // program_kernel_done_wait, client/endpoint/graph_program.cc): one SM per rank of the GPU
  // stays outside the step's grid for that block, as for the group's low-latency ops
  // (LaunchRank).
  if (plane_->kernel_ready_wait()) ctx.sms_left_per_rank = 1;
  return ctx;
}

void CudaGroup::ProgramOp(const OpPlan& plan, std::span<RankOutcome> outcomes) {
  absl::Status st;
  if (plan.op == abi::OpKind::kRegisterProgram) {
    auto armed = GraphProgram::Arm(this, shape(), plan.program, ranks_, plane_->options().num_sms);
    st = armed.status();
    if (armed.ok()) program_ = *std::move(armed);
    if (!st.ok()) {
      plane_->ReleaseGpus(this);
      EngineLog()->error("group {}: arming the program failed: {}", spec().name(), st.ToString());
    } else {
      std::string steps;
      for (const ProgramStepPlan& p : plan.program) {
        absl::StrAppend(&steps, steps.empty() ? "" : ", ", ProgramStepName(p));
      }
      EngineLog()->info("group {}: graph-mode program armed: [{}]", spec().name(), steps);
    }
  } else {
    DisarmProgram(absl::OkStatus());
    if (!program_tail_) plane_->ReleaseGpus(this);
  }
  for (RankOutcome& o : outcomes) o.status = st;
}
bool CudaGroup::ProgramTailDone() {
  if (!program_tail_) return true;
  for (const auto& r : program_tail_->ranks) {
    if (!r) continue;
    cudaSetDevice(r->device);
    if (cudaEventQuery(r->done.get()) == cudaErrorNotReady) return false;
  }
  cudaGetLastError();
  DropOpRanks(*program_tail_);
  program_tail_.reset();
  if (!gpu_op_ && !abandoned_) plane_->ReleaseGpus(this);
  return true;
}

cudaStream_t CudaGroup::ProgramAuxStream(int device) const {
  return plane_->EngineOf(device)->aux.get();
}

abi::EndpointShmHeader* CudaGroup::ProgramHeader(int32_t r) const {
  LockstepEndpoint* ep = endpoint(r);
  return ep != nullptr ? ep->header : nullptr;
}

void CudaGroup::ProgramWarning(const std::string& message) {
  LogClientCaused(spdlog::level::warn, "{}", message);
}

void CudaGroup::DisarmProgram(const absl::Status& why, bool stopping) {
  if (!program_) return;
  program_->Disarm(why, stopping);
  GpuOp tail;
  SizeOp(tail);  // ranks[r] set below; no ready waits (ReleaseReadyWaits reads ready_wait).
  tail.seq = 0;
  tail.started = Clock::now();
  for (size_t r = 0; r < program_->num_ranks(); ++r) tail.ranks[r] = program_->rank(r);
  // Its pinned read-back is still written by the released instances (program_tail_), and a
  // free here could fall between another op's launches: freed between engine rounds once
  // no group has work on the GPU (DeferredRelease).
  plane_->deferred_release().Add(std::shared_ptr<GraphProgram>(std::move(program_)));
  program_armed_ = false;
  program_tail_ = std::move(tail);
  // The released instances ran on stale inputs, possibly without a rank that left.
  needs_sync_reset_ = true;
}

bool CudaGroup::PollBackground() {
  if (spanning()) {
    const bool worked = exchange_ && exchange_->ready() && exchange_->PollBackground();
    return worked || ClientCommandsHot();
  }
  bool worked = false;
  if (program_tail_ && ProgramTailDone()) worked = true;
  if (!program_) return worked;
  absl::Status disarm = program_->Poll();
  if (!disarm.ok()) DisarmProgram(disarm);
  // Keep the engine polling while a program is armed: the client never touches the ring,
  // so only polling sees instances complete and enqueues the next ones.
  return true;
}

}  // namespace epd
