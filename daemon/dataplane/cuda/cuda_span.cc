// A CUDA group that spans nodes (DESIGN.md §5.5): each op's inputs are copied by a kernel
// from every local rank's GPU data area into its pinned host-mapped mirror, the exchange
// (daemon/dataplane/exchange/) runs the op across nodes on the mirrors with kernels/host,
// and a kernel copies the outputs back into the GPU area before done is published. No
// device-to-host copy on the op path (docs/CUDA_BACKEND.md).
#include <algorithm>
#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "common/cuda/stream_memops.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "daemon/dataplane/cuda/cuda_group.h"
#include "daemon/dataplane/exchange/mirror_spans.h"
#include "daemon/dataplane/exchange/span_commands.h"
#include "epd/kernels/layout.h"
#include "epd/kernels/op_rules.h"

namespace epd {
namespace {

namespace kc = kernels::cuda;

/// Extra time past op_timeout the engine gives a spanning op's copies on the GPU (and a
/// stream-ordered op's wait for its client's ready_seq) before it gives up on the op.
constexpr auto kSpanGpuGrace = std::chrono::seconds(5);
/// How long after a client-launched rank's last command (or its join) the engine keeps
/// polling the command words instead of sleeping between doorbells.
constexpr auto kClientCommandsHot = std::chrono::seconds(1);

/// Host memory registered with CUDA (host-mapped, every device) until destroyed.
class CudaHostRegistration : public ExchangeHostMapping {
 public:
  explicit CudaHostRegistration(void* p) : p_(p) {}
  ~CudaHostRegistration() override {
    if (cudaHostUnregister(p_) != cudaSuccess) cudaGetLastError();
  }
  CudaHostRegistration(const CudaHostRegistration&) = delete;
  CudaHostRegistration& operator=(const CudaHostRegistration&) = delete;

 private:
  void* p_;
};

}  // namespace

// ---- rows on the GPU (DESIGN.md §5.5 "Rows on the GPU") ----

std::unique_ptr<ExchangeHostMapping> CudaGroup::ExchangeMapHostMemory(void* p,
                                                                      uint64_t bytes) const {
  cudaError_t err = cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
  if (err != cudaSuccess) {
    cudaGetLastError();
    EngineLog()->warn(
        "group {}: registering {} bytes of the exchange's host memory with CUDA failed ({}); "
        "the rows its daemon-launched ranks' kernels would read or write there (received, "
        "packed to send, or reduced) are copied by the CPU through the host mirrors (slower); "
        "raise the memlock limit (LimitMEMLOCK=infinity, ulimit -l) and recreate the group",
        spec().name(), bytes, cudaGetErrorString(err));
    return nullptr;
  }
  auto reg = std::make_unique<CudaHostRegistration>(p);
  // The gather reads the rows at their host addresses: the device must see the same ones.
  void* device = nullptr;
  err = cudaHostGetDevicePointer(&device, p, 0);
  if (err != cudaSuccess || device != p) {
    cudaGetLastError();
    EngineLog()->warn(
        "group {}: registered host memory has another address on the device (no unified "
        "addressing); its daemon-launched ranks' rows are copied by the CPU through the host "
        "mirrors (slower)",
        spec().name());
    return nullptr;
  }
  return reg;
}

int32_t CudaGroup::OpWindows(const OpPlan& plan, const CudaRank& cr) const {
  CudaRankMirror& m = *cr.mirror;
  if (m.windows_seq == plan.seq) return m.num_windows;
  // A local rank's inputs are read from its GPU area where it is on the same device (its
  // mirror holds the same bytes, across PCIe, or none of them: RowsOnBackend). Another
  // rank's area may be read after that rank's own outputs are back: its done_seq waits for
  // this rank's gather (StageOutAll), so its client cannot write the area before.
  int32_t windows = 0;
  for (int32_t s = local_first(); s < local_first() + local_count(); ++s) {
    const CudaRank* src = gpu_op_ && gpu_op_->ranks[s] ? gpu_op_->ranks[s].get() : nullptr;
    if (src == nullptr || src->client_launched || !src->mirror || src->device != cr.device) {
      continue;
    }
    if (windows == kc::kMaxGatherWindows) break;
    m.windows.get()[windows++] = {src->mirror->base, CudaRankMirror::MirrorBytes(layout()),
                                  src->area.get()};
    // Its tokens of this low-latency FP8 dispatch, quantized on the GPU: the device copy.
    const NodeExchange::QuantizedRows q = exchange_->QuantizedRowsOf(s);
    const CudaRankMirror& sm = *src->mirror;
    if (plan.op == abi::OpKind::kLowLatencyDispatch && q.x != nullptr && sm.quant_rows &&
        sm.quantized_seq == plan.seq && windows + 2 <= kc::kMaxGatherWindows) {
      const uint64_t Mll = shape().ll_max_tokens_per_rank;
      m.windows.get()[windows++] = {reinterpret_cast<const uint8_t*>(q.x), Mll * shape().hidden,
                                    reinterpret_cast<const uint8_t*>(sm.quant_x_copy())};
      m.windows.get()[windows++] = {
          reinterpret_cast<const uint8_t*>(q.scales), Mll * shape().num_scales() * sizeof(float),
          reinterpret_cast<const uint8_t*>(sm.quant_scales_copy(shape()))};
    }
  }
  m.windows_seq = plan.seq;
  m.num_windows = windows;
  return windows;
}

bool CudaGroup::RowsOnBackend(const OpPlan& plan) const {
  const bool ll_fp8 =
      plan.op == abi::OpKind::kLowLatencyDispatch && rules::DecodeFlags(plan.flags).use_fp8;
  const bool combine =
      plan.op == abi::OpKind::kCombine || plan.op == abi::OpKind::kLowLatencyCombine;
  if (!exchange_ || !exchange_->rows_on_backend() ||
      !(plan.op == abi::OpKind::kDispatch || plan.op == abi::OpKind::kLowLatencyDispatch ||
        combine)) {
    return false;
  }
  // A combine's rows from this node are read by the reduce (ExchangeReduceTable).
  if (combine && kernels::ReduceTermsPerRow(shape()) > kc::kMaxReduceTerms) return false;
  // Every local rank's rows must be readable through a window: daemon-launched, one GPU,
  // and not more windows than one gather takes (three a rank for the quantized tokens).
  if (local_count() * (ll_fp8 ? 3 : 1) > kc::kMaxGatherWindows) return false;
  if (plan.op == abi::OpKind::kLowLatencyDispatch &&
      shape().num_local_experts() > kc::kMaxGatherBlocks) {
    return false;  // Its rows are copied through the mirrors (ExchangeRowSources).
  }
  const CudaRank* first = nullptr;
  for (int32_t r = local_first(); r < local_first() + local_count(); ++r) {
    const CudaRank* cr = ranks_[r].get();
    if (cr == nullptr || cr->client_launched || !cr->mirror || !cr->mirror->windows ||
        (ll_fp8 && !cr->mirror->quant_rows) || (combine && !cr->mirror->reduce_terms)) {
      return false;
    }
    if (first != nullptr && cr->device != first->device) return false;
    first = cr;
  }
  return true;
}

bool CudaGroup::ClientLaunchedInOp() const {
  for (int32_t s = local_first(); s < local_first() + local_count(); ++s) {
    if (!gpu_op_ || gpu_op_->ranks[s] == nullptr || gpu_op_->ranks[s]->client_launched) {
      return true;
    }
  }
  return false;
}

absl::Status CudaGroup::ExchangePackRows(int32_t rank, const kernels::RowGather& g) const {
  const CudaRank& cr = SpanRank(rank);
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(cr.device)));
  const int32_t windows = OpWindows(*span_plan_, cr);
  EPD_RETURN_IF_ERROR(
      kc::GatherRowsAsync(shape(), g, cr.mirror->windows.get(), windows, cr.stream.get()));
  return EPD_CUDA_STATUS(cudaEventRecord(cr.mirror->packed.get(), cr.stream.get()));
}

absl::StatusOr<bool> CudaGroup::ExchangeRowsPacked(int32_t rank) const {
  const CudaRank& cr = SpanRank(rank);
  cudaSetDevice(cr.device);
  const cudaError_t err = cudaEventQuery(cr.mirror->packed.get());
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) return false;
  cudaGetLastError();
  return CudaErrorToStatus(err, "the pack of the rows to send (cudaEventQuery)", __FILE__,
                           __LINE__);
}

absl::Status CudaGroup::GatherRankRows(const OpPlan& plan, const CudaRank& cr) {
  CudaRankMirror& m = *cr.mirror;
  const int32_t windows = OpWindows(plan, cr);
  const kernels::RowGather g =
      DispatchRowGather(shape(), layout(), plan, cr.area.get(), m.base, m.row_sources.get());
  EPD_RETURN_IF_ERROR(kc::GatherRowsAsync(shape(), g, m.windows.get(), windows, cr.stream.get()));
  return RecordGathered(cr);
}

// ---- the combines' reduce on the GPU (DESIGN.md §5.5 "Rows on the GPU") ----

kernels::ReduceTable* CudaGroup::ExchangeReduceTable(int32_t rank) const {
  const CudaRank& cr = SpanRank(rank);
  // A client-launched local rank's rows are in its client's memory, which the daemon's
  // kernels cannot read (this rank's own included): then the exchange reduces.
  if (ClientLaunchedInOp() || !cr.mirror || !cr.mirror->reduce_terms ||
      kernels::ReduceTermsPerRow(shape()) > kc::kMaxReduceTerms) {
    return nullptr;
  }
  CudaRankMirror& m = *cr.mirror;
  m.reduce_pending = true;
  m.reduce.terms = m.reduce_terms.get();
  return &m.reduce;
}

absl::Status CudaGroup::ReduceRankRows(const OpPlan& plan, const CudaRank& cr) {
  CudaRankMirror& m = *cr.mirror;
  // Terms in a local rank's mirror are read from its GPU area through the op's windows, as
  // the gather reads; the peers' rows across PCIe, where they landed.
  const int32_t windows = OpWindows(plan, cr);
  EPD_RETURN_IF_ERROR(kc::ReduceRowsAsync(
      shape(), CombineRowReduce(shape(), layout(), plan, cr.area.get(), m.reduce), m.windows.get(),
      windows, cr.stream.get()));
  return RecordGathered(cr);
}

absl::Status CudaGroup::RecordGathered(const CudaRank& cr) {
  CudaRankMirror& m = *cr.mirror;
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaEventRecord(m.gathered.get(), cr.stream.get())));
  m.gathered_this_op = true;
  return absl::OkStatus();
}

// ---- client-launched ranks (DESIGN.md §5.5 "Client-launched") ----

uint64_t CudaGroup::ShmDataBytes(const RankResources& res) const {
  const auto& cr = static_cast<const CudaRank&>(res);
  if (!spanning() || !cr.client_launched) return 0;
  return abi::SpanDataBytes(CudaRankMirror::MirrorBytes(layout()));
}

absl::Status CudaGroup::RankRegionReady(int32_t rank, RankResources& res, uint8_t* shm_data,
                                        uint64_t first_seq) {
  auto& cr = static_cast<CudaRank&>(res);
  if (!spanning() || !cr.client_launched) return absl::OkStatus();
  if (shm_data == nullptr || !cr.mirror) {
    return absl::InternalError(absl::StrCat("group ", spec().name(), " rank ", rank,
                                            ": no endpoint region for its client-shared mirror"));
  }
  CudaRankMirror& m = *cr.mirror;
  m.base = shm_data;
  m.control = reinterpret_cast<abi::SpanControl*>(
      shm_data + abi::SpanControlOffset(CudaRankMirror::MirrorBytes(layout())));
  InitSpanControl(*m.control, first_seq);
  last_command_ = Clock::now();  // A first op right after the join is polled for.
  return absl::OkStatus();
}

bool CudaGroup::BackendRequestSource(int32_t rank) const { return ClientSpanRank(rank); }

bool CudaGroup::PopBackendRequest(int32_t rank, uint64_t next_seq, abi::RequestSlot* slot) {
  CudaRankMirror& m = *ranks_[rank]->mirror;
  if (m.control == nullptr ||
      !TakeSpanCommand(*m.control, next_seq, current_seq() + 1, &m.command, slot)) {
    return false;
  }
  last_command_ = Clock::now();
  return true;
}

bool CudaGroup::ClientCommandsHot() {
  bool any = false;
  for (int32_t r = local_first(); r < local_first() + local_count(); ++r) {
    if (!ClientSpanRank(r) || ranks_[r]->mirror->control == nullptr) continue;
    any = true;
    // A client that just enqueued an op says so (its kernel posts the command later).
    CudaRankMirror& m = *ranks_[r]->mirror;
    const uint64_t wakes = abi::Atomic(m.control->client_wakes).load(std::memory_order_relaxed);
    if (wakes != m.client_wakes) {
      m.client_wakes = wakes;
      last_command_ = Clock::now();
    }
  }
  return any && Clock::now() - last_command_ < kClientCommandsHot;
}

void CudaGroup::RankOpEnded(int32_t rank, const abi::RequestSlot& slot, const RankOutcome& outcome,
                            const OpPlan* plan) {
  if (!ClientSpanRank(rank) || ranks_[rank]->mirror->control == nullptr) return;
  CudaRankMirror& m = *ranks_[rank]->mirror;
  int32_t n = 0;
  if (outcome.status.ok() && plan != nullptr) {
    uint64_t total = 0;
    const int32_t spans = MirrorOutputSpans(shape(), layout(), *plan, slot, outcome, m.base,
                                            answer_spans_.data(), &total);
    n = SpanAnswerCopies(layout(), *plan, m.command.client_buffer, answer_spans_.data(), spans,
                         answer_copies_.data());
  }
  WriteSpanAnswer(*m.control, slot.seq, outcome.status, outcome.num_recv_tokens,
                  answer_copies_.data(), n);
}

absl::Status CudaGroup::NodeChosen(int32_t node) {
  return exchange_->Init(node, local_first(), local_count());
}

void CudaGroup::OpFailedHere(uint64_t seq, uint32_t op, const absl::Status& status) {
  if (exchange_ && exchange_->ready()) exchange_->OpFailedHere(seq, op, status);
}

absl::Status CudaGroup::PeerFailure(uint64_t seq, int64_t local_op) {
  return exchange_ && exchange_->ready() ? exchange_->PeerFailure(seq, local_op) : absl::OkStatus();
}

std::string CudaGroup::NotReadyReason() const {
  if (spanning()) return exchange_ && exchange_->ready() ? exchange_->NotReadyReason() : "";
  return "an earlier op is still running on the GPU";
}

absl::Status CudaGroup::StageIn(const OpPlan& plan, const abi::RequestSlot& slot, int32_t r,
                                bool* ready_wait) {
  const CudaRank& cr = *ranks_[r];
  if (cr.client_launched) return absl::OkStatus();  // Its kernel copied before the command.
  CudaRankMirror& m = *cr.mirror;
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(cr.device)));
  cudaStream_t s = cr.stream.get();
  if (rules::DecodeFlags(slot.flags).stream_ordered) {
    // The client's stream writes ready_seq = seq once it has staged the inputs.
    EPD_RETURN_IF_ERROR(StreamWaitValue64Geq(s, cr.ready_flag(), slot.seq));
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaEventRecord(cr.waited.get(), s)));
    *ready_wait = true;
  }
  // A low-latency FP8 dispatch's tokens are quantized here, on the GPU, into the rank's GPU
  // copy and the exchange's rows (mapped host memory), instead of crossing as BF16 to be
  // quantized by the CPU; into the GPU copy only when every reader of them goes through
  // the windows (RowsOnBackend: the pack and the gathers).
  const rules::RequestOptions flags = rules::DecodeFlags(slot.flags);
  const NodeExchange::QuantizedRows q = exchange_->QuantizedRowsOf(r);
  bool quantized = false;
  m.gathered_this_op = false;
  if (plan.op == abi::OpKind::kLowLatencyDispatch && flags.use_fp8 && q.x != nullptr) {
    const bool gpu_only = span_rows_on_backend_ && m.quant_rows;
    EPD_RETURN_IF_ERROR(kc::QuantizeRowsFp8Async(
        shape(), slot.num_tokens,
        reinterpret_cast<const kernels::bf16_bits*>(cr.area.get() + layout().in_x.offset),
        flags.round_scale, gpu_only ? m.quant_x_copy() : q.x,
        gpu_only ? m.quant_scales_copy(shape()) : q.scales, s,
        gpu_only ? nullptr : m.quant_x_copy(), gpu_only ? nullptr : m.quant_scales_copy(shape())));
    m.quantized_seq = plan.seq;
    quantized = true;
  }
  uint64_t total = 0;
  const int32_t n = MirrorInputSpans(
      shape(), layout(), plan, slot, r, endpoint(r)->handles.num_recv_tokens(),
      exchange_->LowLatencyCounts(plan.ll_handle_buffer), m.in_spans.get(), &total, quantized,
      BackendRows{span_rows_on_backend_, local_first(), local_count(),
                  &exchange_->DispatchCounts()});
  return kc::CopySpansAsync(m.base, cr.area.get(), m.in_spans.get(), n, total,
                            reinterpret_cast<uint32_t*>(m.counter.get()), m.staged.get(), plan.seq,
                            s);
}

absl::Status CudaGroup::StageOut(const OpPlan& plan, const abi::RequestSlot& slot, int32_t r,
                                 const RankOutcome& outcome) {
  const CudaRank& cr = SpanRank(r);                 // Alive with the op even if it detached since.
  if (cr.client_launched) return absl::OkStatus();  // Answered by RankOpEnded.
  CudaRankMirror& m = *cr.mirror;
  // Cleared on every path: a later dispatch whose rows were copied must not gather.
  const bool gather = m.rows_pending;
  m.rows_pending = false;
  const bool reduce = m.reduce_pending;  // Likewise for a combine's reduce.
  m.reduce_pending = false;
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(cr.device)));
  cudaStream_t s = cr.stream.get();
  absl::Status st = absl::OkStatus();
  if (outcome.status.ok()) {
    uint64_t total = 0;
    const int32_t n = MirrorOutputSpans(shape(), layout(), plan, slot, outcome, m.base,
                                        m.out_spans.get(), &total, gather || reduce);
    if (gather) st = GatherRankRows(plan, cr);
    if (reduce) st = ReduceRankRows(plan, cr);
    if (st.ok()) {
      st = kc::CopySpansAsync(cr.area.get(), m.base, m.out_spans.get(), n, total, nullptr, nullptr,
                              0, s);
    }
  }
  return st;
}

void CudaGroup::StageOutAll(GpuOp& op) {
  const int32_t first = local_first(), last = local_first() + local_count();
  for (int32_t r = first; r < last; ++r) {
    absl::Status st = StageOut(*span_plan_, (*span_slots_)[r], r, span_outcomes_[r]);
    if (!st.ok() && op.launch[r].ok()) op.launch[r] = st;
  }
  for (int32_t r = first; r < last; ++r) {
    const CudaRank& cr = *op.ranks[r];
    if (cr.client_launched) continue;  // Answered by RankOpEnded.
    cudaStream_t s = cr.stream.get();
    absl::Status st = EPD_CUDA_STATUS(cudaSetDevice(cr.device));
    // done_seq on every path, so that the client's stream is released; once the other
    // ranks' gathers, which may read this rank's area (OpWindows), are done.
    if (st.ok() && (*span_slots_)[r].flags & abi::kFlagStreamOrdered) {
      for (int32_t q = first; q < last && st.ok(); ++q) {
        const CudaRank& other = *op.ranks[q];
        if (q == r || other.client_launched || other.device != cr.device ||
            !other.mirror->gathered_this_op) {
          continue;
        }
        st = EPD_CUDA_STATUS(cudaStreamWaitEvent(s, other.mirror->gathered.get(), 0));
        // Never release the client while another rank may still read its area: wait here
        // instead (the gather and reduce kernels are bounded).
        if (!st.ok()) cudaEventSynchronize(other.mirror->gathered.get());
      }
      absl::Status done = WriteDone(cr, (*span_slots_)[r].seq);
      if (st.ok()) st = done;
    }
    absl::Status recorded = EPD_CUDA_STATUS(cudaEventRecord(cr.done.get(), s));
    if (st.ok()) st = recorded;
    if (!st.ok() && op.launch[r].ok()) op.launch[r] = st;
  }
}

bool CudaGroup::StartSpanning(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots) {
  GpuOp& op = spare_;
  SizeOp(op);
  op.op = plan.op;
  op.seq = plan.seq;
  op.started = Clock::now();
  for (size_t r = 0; r < op.ranks.size(); ++r) {
    op.ranks[r] = ranks_[r];  // Null for another node's rank.
    op.launch[r] = absl::OkStatus();
    op.stream_ordered[r] = false;
    op.ready_wait[r] = false;
    span_outcomes_[r] = RankOutcome{};
  }
  span_rows_on_backend_ = RowsOnBackend(plan);
  for (int32_t r = local_first(); r < local_first() + local_count(); ++r) {
    op.stream_ordered[r] = rules::DecodeFlags(slots[r].flags).stream_ordered;
    bool ready_wait = false;
    op.launch[r] = StageIn(plan, slots[r], r, &ready_wait);
    op.ready_wait[r] = ready_wait;
  }
  span_plan_ = &plan;
  span_slots_ = &slots;
  span_phase_ = SpanPhase::kStagingIn;
  if (trace_) span_trace_ = SpanTrace{op.started};
  gpu_op_.emplace(std::move(spare_));  // The vectors move: no allocation.
  return false;
}

void CudaGroup::FailSpanning(const absl::Status& status) {
  GpuOp& op = *gpu_op_;
  OpFailedHere(op.seq, static_cast<uint32_t>(op.op), status);
  for (RankOutcome& o : span_outcomes_) o.status = status;
}

bool CudaGroup::PollSpanning(std::span<RankOutcome> outcomes) {
  GpuOp& op = *gpu_op_;
  const int32_t first = local_first(), last = local_first() + local_count();
  const auto waited = Clock::now() - op.started;
  const auto bound = std::chrono::milliseconds(options().op_timeout_ms) + kSpanGpuGrace;
  if (span_phase_ == SpanPhase::kStagingIn) {
    absl::Status failed = absl::OkStatus();
    bool all = true;
    for (int32_t r = first; r < last && failed.ok(); ++r) {
      if (!op.launch[r].ok()) {
        failed = op.launch[r];
        continue;
      }
      const CudaRank& cr = *op.ranks[r];
      if (cr.client_launched) continue;  // Its command came after its kernel's copies.
      // Stored by the copy kernel's last block (release at system scope).
      const uint64_t staged = __atomic_load_n(cr.mirror->staged.get(), __ATOMIC_ACQUIRE);
      if (staged == op.seq) continue;
      all = false;
      cudaSetDevice(cr.device);
      const cudaError_t err = cudaStreamQuery(cr.stream.get());
      if (err != cudaSuccess && err != cudaErrorNotReady) {
        cudaGetLastError();
        failed =
            CudaErrorToStatus(err, "the copy of the op's inputs to the host", __FILE__, __LINE__);
      }
    }
    if (failed.ok() && !all) {
      if (waited < bound) return false;
      failed = errors::WithReason(
          absl::DeadlineExceededError(absl::StrCat(
              OpName(static_cast<uint32_t>(op.op)), " (op ", op.seq, ") of group ", spec().name(),
              ": the inputs of its local ranks were not copied to the host within op_timeout ",
              options().op_timeout_ms,
              " ms + 5 s (a stream-ordered client that never wrote ready_seq, or a stuck GPU)")),
          errors::Reason::kGpuTimeout);
      LogClientCaused(spdlog::level::err, "{}", failed.message());
    }
    if (!failed.ok()) {
      FailSpanning(failed);
    } else {
      std::lock_guard<std::mutex> pool(plane_->pool_mu());
      if (trace_) span_trace_.staged = Clock::now();
      exchange_->Start(*span_plan_, *span_slots_);
      if (trace_) span_trace_.sent = Clock::now();
    }
    span_phase_ = failed.ok() ? SpanPhase::kExchanging : SpanPhase::kStagingOut;
    if (!failed.ok()) {
      ReleaseReadyWaits(op);  // A client that never wrote ready_seq must not hang us.
      StageOutAll(op);
    }
  }
  if (span_phase_ == SpanPhase::kExchanging) {
    {
      std::lock_guard<std::mutex> pool(plane_->pool_mu());
      const Clock::time_point poll_begin = trace_ ? Clock::now() : Clock::time_point{};
      if (!exchange_->Poll(span_outcomes_)) return false;
      if (trace_) {
        span_trace_.finish_begin = poll_begin;
        span_trace_.finished = Clock::now();
      }
    }
    StageOutAll(op);
    span_phase_ = SpanPhase::kStagingOut;
  }
  // kStagingOut: every local rank's outputs back on the GPU (and done_seq written).
  for (int32_t r = first; r < last; ++r) {
    const CudaRank& cr = *op.ranks[r];
    if (cr.client_launched) continue;  // No copy of the daemon's on its stream.
    cudaSetDevice(cr.device);
    const cudaError_t err = cudaEventQuery(cr.done.get());
    if (err == cudaErrorNotReady) {
      if (waited < 2 * bound) return false;
      absl::Status st = errors::WithReason(
          absl::DeadlineExceededError(
              absl::StrCat(OpName(static_cast<uint32_t>(op.op)), " of group ", spec().name(),
                           ": the GPU did not take the op's outputs back within 2 * (op_timeout ",
                           options().op_timeout_ms,
                           " ms + 5 s); check the GPU (nvidia-smi) and the daemon log")),
          errors::Reason::kGpuTimeout);
      LogClientCaused(spdlog::level::err, "{}", st.message());
      for (int32_t q = first; q < last; ++q) outcomes[q].status = st;
      ReleaseReadyWaits(op);
      abandoned_ = std::move(gpu_op_);
      gpu_op_.reset();
      span_phase_ = SpanPhase::kIdle;
      return true;
    }
    if (err != cudaSuccess) {
      cudaGetLastError();
      if (op.launch[r].ok()) {
        op.launch[r] =
            CudaErrorToStatus(err, "cudaEventQuery(the op's done event)", __FILE__, __LINE__);
      }
    }
  }
  for (int32_t r = first; r < last; ++r) {
    outcomes[r] = span_outcomes_[r];
    if (!op.launch[r].ok() && outcomes[r].status.ok()) outcomes[r].status = op.launch[r];
  }
  if (trace_) LogSpanTrace();
  RecycleOp(gpu_op_);
  span_phase_ = SpanPhase::kIdle;
  return true;
}

void CudaGroup::LogSpanTrace() {
  SpanTrace& t = span_trace_;
  t.done = Clock::now();
  auto us = [](Clock::time_point a, Clock::time_point b) {
    return a == Clock::time_point{} || b == Clock::time_point{}
               ? -1.0
               : std::chrono::duration<double, std::micro>(b - a).count();
  };
  EngineLog()->warn(
      "span trace: group {} {} (op {}): stage-in {:.0f} us, pack+post {:.0f} us, wait {:.0f} "
      "us, finish {:.0f} us, stage-out {:.0f} us, total {:.0f} us",
      spec().name(), OpName(static_cast<uint32_t>(gpu_op_->op)), gpu_op_->seq,
      us(t.start, t.staged), us(t.staged, t.sent), us(t.sent, t.finish_begin),
      us(t.finish_begin, t.finished), us(t.finished, t.done), us(t.start, t.done));
}

}  // namespace epd
