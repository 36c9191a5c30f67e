// The views of an op's outputs in the endpoint's regions, and PendingOp (Wait, Enqueued).
#include <type_traits>

#include "client/endpoint/endpoint_state.h"
#include "client/endpoint/tensor_checks.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"

namespace epd {

using internal::kBf16;
using internal::kBool;
using internal::kE4m3;
using internal::kF32;
using internal::kI32;
using internal::kI64;

TensorView Endpoint::Impl::View(const kernels::Region& r, DLDataType dtype,
                                TensorShape shape) const {
  return TensorView(At(r), dtype, device, std::move(shape));
}

void Endpoint::Impl::LayoutViews(LayoutResult& r, int64_t T) const {
  r.num_tokens_per_rank = View(layout.layout_tokens_per_rank, kI32, {shape.num_ranks});
  r.num_tokens_per_expert = View(layout.layout_tokens_per_expert, kI32, {shape.num_experts});
  r.is_token_in_rank = View(layout.layout_is_token_in_rank, kBool, {T, shape.num_ranks});
}

void Endpoint::Impl::DispatchViews(DispatchResult& r, int32_t N) const {
  const int64_t H = shape.hidden, K = shape.num_topk;
  const bool fp8 = r.handle.use_fp8;
  r.num_recv_tokens = N;
  r.handle.num_recv_tokens = N;
  r.recv_x = View(layout.recv_x, fp8 ? kE4m3 : kBf16, {N, H});
  if (fp8) r.recv_scales = View(layout.recv_scales, kF32, {N, shape.num_scales()});
  r.recv_topk_idx = View(layout.recv_topk_idx, kI64, {N, K});
  r.recv_topk_weights = View(layout.recv_topk_weights, kF32, {N, K});
  r.num_recv_tokens_per_expert =
      View(layout.recv_tokens_per_expert, kI32, {shape.num_local_experts()});
  r.recv_src_info = View(layout.recv_src_info, kI32, {N});
  r.recv_count = View(layout.recv_count, kI32, {1});
}

void Endpoint::Impl::LowLatencyDispatchViews(LowLatencyDispatchResult& r, int b) const {
  const int64_t El = shape.num_local_experts(), rows = shape.ll_rows_per_expert();
  const bool fp8 = r.handle.use_fp8;
  r.handle.buffer = b;
  r.recv_x = View(layout.ll_recv_x[b], fp8 ? kE4m3 : kBf16, {El, rows, shape.hidden});
  r.recv_scales = TensorView();
  if (fp8) {
    // Stored [El, cols, rows] (token fastest, layout.h LowLatencyScaleOffset), seen as
    // [El, rows, cols]: f32 scales, or int32 words of four UE8M0 bytes.
    const bool ue8m0 = r.handle.use_ue8m0;
    const int64_t cols =
        ue8m0 ? shape.num_scales() / kernels::kUe8m0BlocksPerWord : shape.num_scales();
    r.recv_scales = TensorView(At(layout.ll_recv_scales[b]), ue8m0 ? kI32 : kF32, device,
                               {El, rows, cols}, {cols * rows, 1, rows});
  }
  r.recv_count = View(layout.ll_recv_count[b], kI32, {El});
  r.recv_src_info = View(layout.ll_recv_src_info[b], kI32, {El, rows});
}

namespace {

/// The op kind whose result type is `Result`.
template <typename Result>
constexpr abi::OpKind OpKindOf() {
  if constexpr (std::is_same_v<Result, LayoutResult>) return abi::OpKind::kGetDispatchLayout;
  if constexpr (std::is_same_v<Result, DispatchResult>) return abi::OpKind::kDispatch;
  if constexpr (std::is_same_v<Result, CombineResult>) return abi::OpKind::kCombine;
  if constexpr (std::is_same_v<Result, LowLatencyDispatchResult>) {
    return abi::OpKind::kLowLatencyDispatch;
  }
  return abi::OpKind::kLowLatencyCombine;
}

/// FAILED_PRECONDITION for an op whose Endpoint was destroyed (`what`: "Wait", "Enqueued").
absl::Status EndpointDestroyed(const char* what, uint64_t seq) {
  return errors::WithReason(
      absl::FailedPreconditionError(absl::StrCat(
          what, ": op ", seq,
          ": endpoint destroyed (its buffers, which held the op's outputs, are unmapped); Wait for "
          "an op before destroying its Endpoint")),
      errors::Reason::kFailedPrecondition);
}

}  // namespace

template <typename Result>
absl::StatusOr<Result> PendingOp<Result>::Wait(absl::Duration timeout) {
  const std::shared_ptr<Endpoint::Impl> endpoint = endpoint_.lock();
  if (endpoint == nullptr) return EndpointDestroyed("Wait", seq_);
  Endpoint::Impl& m = *endpoint;
  EPD_RETURN_IF_ERROR(m.CheckNotRetired("Wait", seq_));
  constexpr abi::OpKind kOp = OpKindOf<Result>();
  Result r = partial_;
  EPD_ASSIGN_OR_RETURN(const internal::OpOutcome o, m.runner->Wait(seq_, kOp, timeout));
  if constexpr (requires { r.mask; }) r.mask = o.mask;
  if constexpr (std::is_same_v<Result, DispatchResult>) {
    // N is known now (the views of a cached re-dispatch were built by the op).
    if (o.replaces_views || r.recv_x.data() == nullptr) m.DispatchViews(r, o.num_recv_tokens);
  } else if constexpr (std::is_same_v<Result, LowLatencyDispatchResult>) {
    if (o.buffer >= 0) m.LowLatencyDispatchViews(r, o.buffer);
  } else if constexpr (std::is_same_v<Result, LowLatencyCombineResult>) {
    if (o.buffer >= 0) {
      r.combined_x = m.View(m.layout.ll_combined_x[o.buffer], kBf16,
                            {static_cast<int64_t>(o.num_recv_tokens), m.shape.hidden});
    }
  }
  return r;
}

template <typename Result>
absl::StatusOr<Result> PendingOp<Result>::Enqueued() const {
  const std::shared_ptr<const Endpoint::Impl> endpoint = endpoint_.lock();
  if (endpoint == nullptr) return EndpointDestroyed("Enqueued", seq_);
  const Endpoint::Impl& m = *endpoint;
  EPD_RETURN_IF_ERROR(m.CheckNotRetired("Enqueued", seq_));
  if (!m.cuda) {
    return errors::WithReason(
        absl::FailedPreconditionError(
            "Enqueued: ops of the host backend are not stream-ordered; use Wait"),
        errors::Reason::kFailedPrecondition);
  }
  if (m.unordered_ops[seq_ % m.unordered_ops.size()] == seq_) {
    return errors::WithReason(
        absl::FailedPreconditionError(
            "Enqueued: the op was given no stream (its args' stream is null), so it is ordered "
            "before no work of the caller; its results are valid once Wait returns"),
        errors::Reason::kFailedPrecondition);
  }
  if constexpr (std::is_same_v<Result, DispatchResult>) {
    if (partial_.recv_x.data() == nullptr) {
      // N is on the device only: views of the capacity R*M rows, N in recv_count.
      DispatchResult r = partial_;
      m.DispatchViews(r, static_cast<int32_t>(m.shape.max_recv_tokens()));
      r.num_recv_tokens = -1;
      r.handle.num_recv_tokens = -1;
      return r;
    }
  }
  return partial_;
}

template class PendingOp<LayoutResult>;
template class PendingOp<DispatchResult>;
template class PendingOp<CombineResult>;
template class PendingOp<LowLatencyDispatchResult>;
template class PendingOp<LowLatencyCombineResult>;

}  // namespace epd
