// The handle table: which dispatches' routing and low-latency buffers are current.
#include "absl/strings/str_cat.h"
#include "common/errors/reason.h"
#include "epd/kernels/op_rules.h"

namespace epd::rules {

bool HandleTable::UsesRouting(abi::OpKind op, uint32_t flags) {
  return op == abi::OpKind::kCombine ||
         (op == abi::OpKind::kDispatch && (flags & abi::kFlagCachedHandle));
}

absl::Status HandleTable::Check(abi::OpKind op, uint32_t flags, uint64_t handle_seq,
                                int32_t num_tokens) const {
  const char* name = Describe(op).name;
  if (UsesRouting(op, flags)) {
    if (routing_seq_ == 0 || handle_seq < routing_seq_ || handle_seq > last_dispatch_seq_) {
      return errors::WithReason(
          absl::FailedPreconditionError(absl::StrCat(
              name, ": handle of op ", handle_seq,
              " is not the current dispatch routing of this endpoint (valid: ops ", routing_seq_,
              "..", last_dispatch_seq_, "); a handle is invalidated by the next Dispatch")),
          errors::Reason::kHandleInvalid);
    }
    if (num_tokens != routing_tokens_) {
      return errors::WithReason(
          absl::InvalidArgumentError(absl::StrCat(name, ": num_tokens ", num_tokens,
                                                  " != the handle's ", routing_tokens_)),
          errors::Reason::kOpInputInvalid);
    }
  }
  if (op == abi::OpKind::kLowLatencyCombine) {
    const int b = LowLatencyBufferOf(handle_seq);
    if (b < 0) {
      return errors::WithReason(
          absl::FailedPreconditionError(absl::StrCat(
              "LowLatencyCombine: handle of op ", handle_seq,
              " is not one of this endpoint's last two low-latency dispatches (its buffers were "
              "reused, or it comes from another endpoint)")),
          errors::Reason::kHandleInvalid);
    }
    if (num_tokens != ll_tokens_[b]) {
      return errors::WithReason(
          absl::InvalidArgumentError(absl::StrCat("LowLatencyCombine: num_tokens ", num_tokens,
                                                  " != the handle's ", ll_tokens_[b])),
          errors::Reason::kOpInputInvalid);
    }
  }
  return absl::OkStatus();
}

int HandleTable::LowLatencyBufferOf(uint64_t handle_seq) const {
  for (int b = 0; b < kernels::kLowLatencyBuffers; ++b) {
    if (ll_seq_[b] != 0 && ll_seq_[b] == handle_seq) return b;
  }
  return -1;
}

void HandleTable::DispatchDone(uint64_t seq, bool cached, int32_t num_tokens,
                               int32_t num_recv_tokens, bool fp8) {
  if (!cached) {
    routing_seq_ = seq;
    routing_tokens_ = num_tokens;
    num_recv_tokens_ = num_recv_tokens;
    routing_fp8_ = fp8;
  }
  last_dispatch_seq_ = seq;
}

void HandleTable::LowLatencyDispatchEnded(uint64_t seq, int buffer, int32_t num_tokens, bool ok) {
  if (buffer < 0 || buffer >= kernels::kLowLatencyBuffers) return;
  ll_seq_[buffer] = ok ? seq : 0;
  ll_tokens_[buffer] = ok ? num_tokens : 0;
}

void HandleTable::ClearLowLatency() {
  for (int b = 0; b < kernels::kLowLatencyBuffers; ++b) {
    ll_seq_[b] = 0;
    ll_tokens_[b] = 0;
  }
}

void HandleTable::Forget(uint64_t seq) {
  if (seq == 0) return;
  for (int b = 0; b < kernels::kLowLatencyBuffers; ++b) {
    if (ll_seq_[b] == seq) ll_seq_[b] = 0;
  }
  if (routing_seq_ == seq) routing_seq_ = 0;
}

}  // namespace epd::rules
