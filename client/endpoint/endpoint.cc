// Endpoint: the client side of the data plane (DESIGN.md §3.2–§3.3). Each public op reads
// validate → plan → run: its arguments are checked (tensor_checks.h), described as an
// OpPlan (its inputs and staging regions, the request flags and values), and run by the
// endpoint's OpRunner: DaemonLaunch (the ring; on CUDA the stream-ordered hand-off) or
// ClientLaunch (the client launches the kernels). The views of its outputs are built here
// and by PendingOp::Wait (result_views.cc).
#include <array>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/endpoint/endpoint_state.h"
#include "client/endpoint/tensor_checks.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "epd/kernels/op_rules.h"

namespace epd {

using internal::CheckTensor;
using internal::kBf16;
using internal::kE4m3;
using internal::kF32;
using internal::kI32;
using internal::kI64;
using internal::OpPlan;
using internal::SameType;

Endpoint::Impl::~Impl() {
  if (session != nullptr && session_hook != 0) session->RemoveHook(session_hook);
  // A stream still waiting for an op of this endpoint would wait on memory about to be
  // unmapped: release it first (best effort; callers should Wait before destroying).
  if (runner != nullptr) runner->ReleaseStreams();
}

absl::Status Endpoint::Impl::CheckUsable() const {
  if (left) {
    return errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat("endpoint of group ", spec.name(), " rank ",
                                                   info.rank(), " has left its group")),
        errors::Reason::kEndpointClosed);
  }
  EPD_RETURN_IF_ERROR(ring.ClosedStatus(""));
  if (session != nullptr && session->lost()) {
    return errors::WithReason(
        absl::UnavailableError(
            "the Session with epd ended (the daemon died or restarted): this endpoint is gone"),
        errors::Reason::kDaemonUnavailable);
  }
  return absl::OkStatus();
}

absl::Status Endpoint::Impl::CheckNoProgram() const {
  if (program.empty()) return absl::OkStatus();
  return errors::WithReason(
      absl::FailedPreconditionError(
          absl::StrCat("endpoint of group ", spec.name(), " rank ", info.rank(),
                       " has a graph-mode program armed, which alone runs on its buffers; use "
                       "RunProgramDispatch/RunProgramCombine, or UnregisterProgram first")),
      errors::Reason::kHandleInvalid);
}

absl::StatusOr<internal::OpPlan> Endpoint::Impl::BeginOp(abi::OpKind op, const char* name,
                                                         void* stream) {
  EPD_RETURN_IF_ERROR(CheckUsable());
  EPD_RETURN_IF_ERROR(CheckNoProgram());
  OpPlan p;
  p.op = op;
  p.name = name;
  EPD_ASSIGN_OR_RETURN(p.stream, OpStream(stream));
  return p;
}

abi::RequestSlot Endpoint::Impl::MakeRequest(abi::OpKind op, uint64_t seq, uint32_t flags,
                                             int32_t num_tokens, int32_t expert_alignment,
                                             uint64_t handle_seq, int32_t num_sms,
                                             const abi::RequestSlot& program) {
  abi::RequestSlot slot{};
  slot.magic = abi::kRequestMagic;
  slot.op = static_cast<uint32_t>(op);
  slot.seq = seq;
  slot.flags = flags;
  slot.num_tokens = num_tokens;
  slot.expert_alignment = expert_alignment;
  slot.num_sms = num_sms;
  slot.handle_seq = handle_seq;
  slot.program_num_steps = program.program_num_steps;
  for (size_t i = 0; i < std::size(slot.program_steps); ++i) {
    slot.program_steps[i] = program.program_steps[i];
  }
  return slot;
}

absl::StatusOr<uint64_t> Endpoint::Impl::SubmitUnordered(abi::OpKind op,
                                                         const abi::RequestSlot& program) {
  EPD_RETURN_IF_ERROR(ring.WaitForSpace());
  const uint64_t seq = next_seq++;
  ring.Publish(MakeRequest(op, seq, 0, 0, 1, 0, 0, program));
  return seq;
}

void Endpoint::Impl::Retire() {
  retired = true;
  left = true;
  joined.reset();
  if (session != nullptr && session_hook != 0) session->RemoveHook(session_hook);
  session_hook = 0;
  if (runner != nullptr) runner->ReleaseStreams();
  runner.reset();
  program.clear();
#if EPD_HAVE_CUDA
  mapping.reset();
#endif
}

absl::Status Endpoint::Impl::CheckNotRetired(const char* what, uint64_t seq) const {
  if (!retired) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      what, ": op ", seq, " of group ", spec.name(), " rank ", info.rank(),
      " was submitted to an epd that is gone (Client::Reconnect has re-bound the endpoint): "
      "the op is lost; submit it again"));
}

Endpoint::Endpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Endpoint::~Endpoint() {
  if (impl_ != nullptr) (void)Leave();
}

void Endpoint::Rebind(Endpoint& fresh) {
  std::shared_ptr<Impl> old = std::move(impl_);
  impl_ = std::move(fresh.impl_);
  impl_->joined = old->joined;
  old->Retire();
  impl_->previous = std::move(old);
}
const v1::EndpointInfo& Endpoint::info() const { return impl_->info; }
const v1::GroupSpec& Endpoint::spec() const { return impl_->spec; }
int32_t Endpoint::rank() const { return impl_->info.rank(); }

namespace {

RankMask FromProto(const v1::RankMask& m) {
  RankMask mask;
  mask.epoch = m.epoch();
  mask.masked_ranks.assign(m.masked_ranks().begin(), m.masked_ranks().end());
  return mask;
}

}  // namespace

absl::StatusOr<RankMask> Endpoint::Impl::CallRankMask(const v1::UpdateRankMaskRequest* update) {
  if (left) {
    return absl::FailedPreconditionError(absl::StrCat("endpoint of group ", spec.name(), " rank ",
                                                      info.rank(), " has left its group"));
  }
  if (!rank_mask) {
    return absl::FailedPreconditionError(
        absl::StrCat("endpoint of group ", spec.name(), " rank ", info.rank(),
                     " was opened without a control channel: it cannot ask for the rank mask"));
  }
  EPD_ASSIGN_OR_RETURN(v1::RankMask mask, rank_mask(update));
  return FromProto(mask);
}

absl::StatusOr<RankMask> Endpoint::UpdateRankMask(const std::vector<int32_t>& mask,
                                                  const std::vector<int32_t>& unmask) {
  v1::UpdateRankMaskRequest update;
  update.mutable_mask()->Add(mask.begin(), mask.end());
  update.mutable_unmask()->Add(unmask.begin(), unmask.end());
  return impl_->CallRankMask(&update);
}

absl::StatusOr<RankMask> Endpoint::QueryRankMask() { return impl_->CallRankMask(nullptr); }

absl::StatusOr<RankMask> Endpoint::CleanRankMask() {
  v1::UpdateRankMaskRequest update;
  update.set_clean(true);
  return impl_->CallRankMask(&update);
}

absl::Status Endpoint::Leave() {
  if (impl_->joined != nullptr) {
    impl_->joined->Remove(this);  // Not rejoined by a later Client::Reconnect.
    impl_->joined.reset();
  }
  if (impl_->left) return absl::OkStatus();
  impl_->left = true;
  return impl_->leave ? impl_->leave() : absl::OkStatus();
}

TensorView Endpoint::LowLatencyCombineInput() const {
  const Impl& m = *impl_;
  if (m.shape.ll_max_tokens_per_rank == 0) return TensorView();
  return m.View(m.layout.in_ll_combine_x, kBf16,
                {m.shape.num_local_experts(), m.shape.ll_rows_per_expert(), m.shape.hidden});
}

TensorView Endpoint::LowLatencyDispatchInput() const {
  const Impl& m = *impl_;
  if (m.shape.ll_max_tokens_per_rank == 0) return TensorView();
  return m.View(m.layout.in_x, kBf16, {m.shape.ll_max_tokens_per_rank, m.shape.hidden});
}

// ---- ops: validate → plan → run -------------------------------------------------------

absl::StatusOr<PendingOp<LayoutResult>> Endpoint::GetDispatchLayout(const DLTensor& topk_idx,
                                                                    void* caller_stream) {
  Impl& m = *impl_;
  EPD_ASSIGN_OR_RETURN(
      OpPlan p, m.BeginOp(abi::OpKind::kGetDispatchLayout, "GetDispatchLayout", caller_stream));
  std::array<int64_t, 2> shape{-1, m.shape.num_topk};
  p.status = CheckTensor(m.cuda, p.name, "topk_idx", &topk_idx, {kI64}, shape);
  if (p.status.ok() && shape[0] > m.shape.max_tokens_per_rank) {
    p.status = errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                      p.name, ": num_tokens ", shape[0], " > max_tokens_per_rank ",
                                      m.shape.max_tokens_per_rank)),
                                  errors::Reason::kTokensOverCapacity);
  }
  p.num_tokens = p.status.ok() ? static_cast<int32_t>(shape[0]) : 0;
  p.Add("topk_idx", &topk_idx, m.layout.in_topk_idx, /*by_pointer=*/true, alignof(int64_t));
  EPD_ASSIGN_OR_RETURN(const uint64_t seq, m.runner->Run(p));
  m.NoteStream(seq, caller_stream);
  LayoutResult r;
  m.LayoutViews(r, p.num_tokens);
  return PendingOp<LayoutResult>(impl_, seq, std::move(r));
}

absl::StatusOr<PendingOp<DispatchResult>> Endpoint::Dispatch(const DispatchArgs& args) {
  Impl& m = *impl_;
  EPD_ASSIGN_OR_RETURN(OpPlan p, m.BeginOp(abi::OpKind::kDispatch, "Dispatch", args.stream));
  const char* const kOp = p.name;
  const int H = m.shape.hidden, K = m.shape.num_topk;
  absl::Status& st = p.status;
  std::array<int64_t, 2> xs{-1, H};
  st = CheckTensor(m.cuda, kOp, "x", args.x, {kBf16, kE4m3}, xs);
  const bool fp8 = st.ok() && SameType(args.x->dtype, kE4m3);
  const int64_t T = st.ok() ? xs[0] : 0;
  if (st.ok() && T > m.shape.max_tokens_per_rank) {
    st = errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(
            kOp, ": x has ", T, " tokens > max_tokens_per_rank ", m.shape.max_tokens_per_rank)),
        errors::Reason::kTokensOverCapacity);
  }
  if (st.ok() && fp8 && !rules::Fp8Allowed(p.op, m.shape)) {
    st = errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(kOp, ": x is float8_e4m3fn but group ",
                                                m.spec.name(), " has use_fp8 = false")),
        errors::Reason::kOpInputInvalid);
  }
  if (st.ok() && fp8) {
    std::array<int64_t, 2> ss{T, m.shape.num_scales()};
    st = CheckTensor(m.cuda, kOp, "x_scales", args.x_scales, {kF32}, ss);
  }
  if (st.ok() && args.expert_alignment < 1) {
    st =
        errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                               kOp, ": expert_alignment ", args.expert_alignment, " must be >= 1")),
                           errors::Reason::kOpInputInvalid);
  }
  const Handle* cached = args.cached ? &*args.cached : nullptr;
  if (st.ok() && cached) {
    if (cached->endpoint_id != m.info.endpoint_id() || cached->low_latency) {
      st = errors::WithReason(
          absl::FailedPreconditionError(absl::StrCat(
              kOp, ": cached handle comes from another endpoint or from a low-latency dispatch")),
          errors::Reason::kHandleInvalid);
    } else if (cached->num_tokens != T) {
      st = errors::WithReason(
          absl::InvalidArgumentError(absl::StrCat(kOp, ": x has ", T,
                                                  " tokens but the cached handle's dispatch had ",
                                                  cached->num_tokens)),
          errors::Reason::kOpInputInvalid);
    } else if (cached->num_recv_tokens < 0) {
      st = errors::WithReason(
          absl::FailedPreconditionError(absl::StrCat(
              kOp,
              ": the cached handle comes from Enqueued() of a Dispatch, whose N is known only on "
              "the device; Wait for that Dispatch and use the handle Wait returns")),
          errors::Reason::kHandleInvalid);
    }
  }
  if (st.ok() && !cached) {
    std::array<int64_t, 2> ts{T, K};
    st = CheckTensor(m.cuda, kOp, "topk_idx", args.topk_idx, {kI64}, ts);
  }
  const bool weights = !cached && args.topk_weights != nullptr;
  if (st.ok() && weights) {
    std::array<int64_t, 2> ws{T, K};
    st = CheckTensor(m.cuda, kOp, "topk_weights", args.topk_weights, {kF32}, ws);
  }
  p.flags = rules::EncodeFlags(
      {.use_fp8 = fp8, .cached_handle = cached != nullptr, .dispatch_weights = weights});
  p.num_tokens = static_cast<int32_t>(T);
  p.expert_alignment = args.expert_alignment;
  p.handle_seq = cached ? cached->seq : 0;
  p.num_sms = args.num_sms;
  p.Add("x", args.x, m.layout.in_x);
  if (fp8) p.Add("x_scales", args.x_scales, m.layout.in_scales);
  if (!cached) p.Add("topk_idx", args.topk_idx, m.layout.in_topk_idx);
  if (weights) p.Add("topk_weights", args.topk_weights, m.layout.in_topk_weights);
  EPD_ASSIGN_OR_RETURN(const uint64_t seq, m.runner->Run(p));
  m.NoteStream(seq, args.stream);
  DispatchResult r;
  r.handle.endpoint_id = m.info.endpoint_id();
  r.handle.seq = seq;
  r.handle.num_tokens = static_cast<int32_t>(T);
  r.handle.use_fp8 = fp8;
  r.handle.low_latency = false;
  // N is known now only for a cached re-dispatch; otherwise Wait fills the views in.
  if (cached) m.DispatchViews(r, cached->num_recv_tokens);
  return PendingOp<DispatchResult>(impl_, seq, std::move(r));
}

absl::StatusOr<PendingOp<CombineResult>> Endpoint::Combine(const CombineArgs& args) {
  Impl& m = *impl_;
  EPD_ASSIGN_OR_RETURN(OpPlan p, m.BeginOp(abi::OpKind::kCombine, "Combine", args.stream));
  const char* const kOp = p.name;
  absl::Status& st = p.status;
  if (args.handle == nullptr) {
    st = errors::WithReason(absl::InvalidArgumentError(absl::StrCat(kOp, ": handle is required")),
                            errors::Reason::kOpInputInvalid);
  } else if (args.handle->endpoint_id != m.info.endpoint_id() || args.handle->low_latency) {
    st = errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            kOp,
            ": the handle comes from another endpoint (group or rank) or from a low-latency "
            "dispatch")),
        errors::Reason::kHandleInvalid);
  } else if (args.handle->num_recv_tokens < 0) {
    st = errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            kOp,
            ": the handle comes from Enqueued() of a Dispatch, whose N is known only on the "
            "device; Wait for that Dispatch and use the handle Wait returns")),
        errors::Reason::kHandleInvalid);
  }
  const int64_t N = args.handle ? args.handle->num_recv_tokens : 0;
  if (st.ok()) {
    std::array<int64_t, 2> xs{N, m.shape.hidden};
    st = CheckTensor(m.cuda, kOp, "x", args.x, {kBf16}, xs);
  }
  const bool weights = args.topk_weights != nullptr;
  if (st.ok() && weights) {
    std::array<int64_t, 2> ws{N, m.shape.num_topk};
    st = CheckTensor(m.cuda, kOp, "topk_weights", args.topk_weights, {kF32}, ws);
  }
  const int32_t T = args.handle ? args.handle->num_tokens : 0;
  p.flags = rules::EncodeFlags({.combine_weights = weights});
  p.num_tokens = T;
  p.handle_seq = args.handle ? args.handle->seq : 0;
  p.num_sms = args.num_sms;
  p.Add("x", args.x, m.layout.in_combine_x);
  if (weights) p.Add("topk_weights", args.topk_weights, m.layout.in_combine_weights);
  EPD_ASSIGN_OR_RETURN(const uint64_t seq, m.runner->Run(p));
  m.NoteStream(seq, args.stream);
  CombineResult r;
  r.combined_x = m.View(m.layout.combined_x, kBf16, {T, m.shape.hidden});
  if (weights) {
    r.combined_topk_weights = m.View(m.layout.combined_topk_weights, kF32, {T, m.shape.num_topk});
  }
  return PendingOp<CombineResult>(impl_, seq, std::move(r));
}

absl::StatusOr<PendingOp<LowLatencyDispatchResult>> Endpoint::LowLatencyDispatch(
    const LowLatencyDispatchArgs& args) {
  Impl& m = *impl_;
  EPD_ASSIGN_OR_RETURN(
      OpPlan p, m.BeginOp(abi::OpKind::kLowLatencyDispatch, "LowLatencyDispatch", args.stream));
  const char* const kOp = p.name;
  const int32_t Mll = m.shape.ll_max_tokens_per_rank;
  absl::Status& st = p.status;
  if (Mll == 0) {
    st = errors::WithReason(absl::FailedPreconditionError(absl::StrCat(
                                kOp, ": group ", m.spec.name(),
                                " has ll_max_tokens_per_rank = 0 (low-latency disabled)")),
                            errors::Reason::kSpecInvalid);
  } else if (args.max_dispatch_tokens_per_rank != 0 && args.max_dispatch_tokens_per_rank != Mll) {
    st = errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(kOp, ": max_dispatch_tokens_per_rank ",
                                                args.max_dispatch_tokens_per_rank,
                                                " != the group's ll_max_tokens_per_rank ", Mll)),
        errors::Reason::kOpInputInvalid);
  }
  std::array<int64_t, 2> xs{-1, m.shape.hidden};
  if (st.ok()) st = CheckTensor(m.cuda, kOp, "x", args.x, {kBf16}, xs);
  // T, or with a device num_tokens the capacity of x and topk_idx (the kernel reads T).
  const int64_t T = st.ok() ? xs[0] : 0;
  if (st.ok() && T > Mll) {
    st =
        errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                               kOp, ": x has ", T, " tokens > max_dispatch_tokens_per_rank ", Mll)),
                           errors::Reason::kTokensOverCapacity);
  }
  const bool use_fp8 = args.use_fp8;
  if (st.ok()) {
    st = rules::CheckScaleFormat(kOp, use_fp8, args.round_scale, args.use_ue8m0, m.shape);
  }
  if (st.ok() && use_fp8) st = rules::CheckFp8(p.op, kOp, m.shape, m.spec.name());
  if (st.ok()) {
    std::array<int64_t, 2> ts{T, m.shape.num_topk};
    st = CheckTensor(m.cuda, kOp, "topk_idx", args.topk_idx, {kI64}, ts);
  }
  if (st.ok() && args.num_tokens != nullptr) {
    std::array<int64_t, 1> ns{1};
    if (!m.client_launched) {
      st = errors::WithReason(
          absl::InvalidArgumentError(absl::StrCat(
              kOp,
              ": num_tokens (T on the device) needs a client-launched endpoint; pass x with T "
              "rows instead")),
          errors::Reason::kOpInputInvalid);
    } else {
      st = CheckTensor(m.cuda, kOp, "num_tokens", args.num_tokens, {kI32}, ns);
    }
#if EPD_HAVE_CUDA
    if (st.ok() &&
        !internal::ReadableInPlace(args.num_tokens, m.mapping->device(), alignof(int32_t))) {
      st = errors::WithReason(
          absl::InvalidArgumentError(absl::StrCat(
              kOp,
              ": num_tokens must be a 4-byte aligned int32 in the memory of the endpoint's GPU "
              "(kDLCUDA device ",
              m.mapping->device(), ")")),
          errors::Reason::kOpInputInvalid);
    }
#endif
  }
  p.flags = rules::EncodeFlags(
      {.use_fp8 = use_fp8, .round_scale = args.round_scale, .use_ue8m0 = args.use_ue8m0});
  p.num_tokens = static_cast<int32_t>(T);
  p.device_num_tokens = args.num_tokens;
  p.buffer = m.parity.DispatchBuffer();
  // x is read by the kernel in 16-byte vectors.
  p.Add("x", args.x, m.layout.in_x, /*by_pointer=*/true, 16);
  p.Add("topk_idx", args.topk_idx, m.layout.in_topk_idx, /*by_pointer=*/true, alignof(int64_t));
  EPD_ASSIGN_OR_RETURN(const uint64_t seq, m.runner->Run(p));
  m.NoteStream(seq, args.stream);
  LowLatencyDispatchResult r;
  r.handle.endpoint_id = m.info.endpoint_id();
  r.handle.seq = seq;
  r.handle.low_latency = true;
  r.handle.num_tokens = static_cast<int32_t>(T);
  r.handle.use_fp8 = use_fp8;
  r.handle.use_ue8m0 = use_fp8 && args.use_ue8m0;
  m.LowLatencyDispatchViews(r, p.buffer);
  return PendingOp<LowLatencyDispatchResult>(impl_, seq, std::move(r));
}

absl::StatusOr<PendingOp<LowLatencyCombineResult>> Endpoint::LowLatencyCombine(
    const LowLatencyCombineArgs& args) {
  Impl& m = *impl_;
  EPD_ASSIGN_OR_RETURN(
      OpPlan p, m.BeginOp(abi::OpKind::kLowLatencyCombine, "LowLatencyCombine", args.stream));
  const char* const kOp = p.name;
  const int64_t El = m.shape.num_local_experts();
  const int64_t rows = m.shape.ll_rows_per_expert();
  absl::Status& st = p.status;
  if (args.handle == nullptr) {
    st = errors::WithReason(absl::InvalidArgumentError(absl::StrCat(kOp, ": handle is required")),
                            errors::Reason::kOpInputInvalid);
  } else if (args.handle->endpoint_id != m.info.endpoint_id() || !args.handle->low_latency) {
    st = errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            kOp,
            ": the handle comes from another endpoint (group or rank) or from a normal "
            "dispatch")),
        errors::Reason::kHandleInvalid);
  }
  const int64_t T = args.handle ? args.handle->num_tokens : 0;
  if (st.ok()) {
    std::array<int64_t, 3> xs{El, rows, m.shape.hidden};
    st = CheckTensor(m.cuda, kOp, "x", args.x, {kBf16}, xs);
  }
  if (st.ok()) {
    std::array<int64_t, 2> ts{T, m.shape.num_topk};
    st = CheckTensor(m.cuda, kOp, "topk_idx", args.topk_idx, {kI64}, ts);
  }
  if (st.ok()) {
    std::array<int64_t, 2> ws{T, m.shape.num_topk};
    st = CheckTensor(m.cuda, kOp, "topk_weights", args.topk_weights, {kF32}, ws);
  }
  p.num_tokens = static_cast<int32_t>(T);
  p.handle_seq = args.handle ? args.handle->seq : 0;
  p.out_buffer = m.parity.CombineOutBuffer();
  // x is read by every rank at the same offset of each area: in_ll_combine_x (staged
  // unless the caller wrote it there: LowLatencyCombineInput()).
  p.Add("x", args.x, m.layout.in_ll_combine_x);
  p.Add("topk_idx", args.topk_idx, m.layout.in_topk_idx, /*by_pointer=*/true, alignof(int64_t));
  p.Add("topk_weights", args.topk_weights, m.layout.in_topk_weights, /*by_pointer=*/true,
        alignof(float));
  EPD_ASSIGN_OR_RETURN(const uint64_t seq, m.runner->Run(p));
  m.NoteStream(seq, args.stream);
  LowLatencyCombineResult r;
  r.combined_x = m.View(m.layout.ll_combined_x[p.out_buffer], kBf16, {T, m.shape.hidden});
  return PendingOp<LowLatencyCombineResult>(impl_, seq, std::move(r));
}

}  // namespace epd
