// Where ring requests are validated: LockstepGroup's side of an endpoint's request ring.
// Each slot is copied into daemon memory before anything reads it, then checked (magic, seq,
// op, flags, the op rules of epd/kernels/op_rules.h, the handle table) and queued for the
// lockstep op, or refused with a completion naming why. docs/SECURITY.md, DESIGN.md §8.3.
#include <chrono>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "daemon/dataplane/completion.h"
#include "daemon/dataplane/lockstep_group.h"
#include "spdlog/spdlog.h"

namespace epd {

using Clock = std::chrono::steady_clock;

void LockstepGroup::CompleteUnrun(int32_t rank, LockstepEndpoint& ep, const abi::RequestSlot& slot,
                                  const absl::Status& status) {
  RankOutcome outcome{status};
  outcome.mask_epoch = mask_epoch_;
  outcome.num_masked = num_masked_;
  WriteCompletion(ep, slot.seq, outcome);
  OpEndedWithoutLaunch(rank, slot);
  RankOpEnded(rank, slot, {status}, nullptr);
}

absl::Status LockstepGroup::ValidateSlot(int32_t rank, const LockstepEndpoint& ep,
                                         const abi::RequestSlot& slot) const {
  // magic and seq were checked when the slot was popped.
  if (slot.op == 0 || slot.op > abi::kMaxOpKind) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat("malformed request slot: op ", slot.op)),
        errors::Reason::kRequestMalformed);
  }
  if ((slot.flags & ~abi::kAllRequestFlags) != 0) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  "malformed request slot: flags 0x", absl::Hex(slot.flags))),
                              errors::Reason::kRequestMalformed);
  }
  EPD_RETURN_IF_ERROR(CheckRequest(rank, slot));
  if (slot.flags & abi::kFlagClientError) {
    return errors::WithReason(
        absl::InvalidArgumentError("the client rejected its own inputs for this op"),
        errors::Reason::kOpInputInvalid);
  }
  const auto op = static_cast<abi::OpKind>(slot.op);
  if (op == abi::OpKind::kRegisterProgram || op == abi::OpKind::kUnregisterProgram) {
    EPD_RETURN_IF_ERROR(CheckProgram(rank));
    if (op == abi::OpKind::kRegisterProgram) return DecodeProgram(slot, shape_).status();
    return absl::OkStatus();
  }
  EPD_RETURN_IF_ERROR(rules::CheckRequestShape(op, rules::DecodeFlags(slot.flags), slot.num_tokens,
                                               slot.num_sms, slot.expert_alignment, shape_,
                                               spec_.name()));
  return ep.handles.Check(op, slot.flags, slot.handle_seq, slot.num_tokens);
}

bool LockstepGroup::PopSlot(LockstepEndpoint& ep, abi::RequestSlot* slot) {
  // ring_head is the only ring word read back from the client-writable header, once per
  // slot, and only compared with the daemon's own tail.
  const uint64_t head = abi::Atomic(ep.header->ring_head).load(std::memory_order_seq_cst);
  const uint64_t tail = ep.ring_tail;
  if (head == tail) return false;
  if (head - tail > abi::kRingCapacity) {
    // More than a ring ahead (or behind): no client publishes so (it waits for room), so
    // these are not requests. Skipped whole and counted once, instead of draining up to
    // 2^64 slots of garbage one by one.
    ep.ring_tail = head;
    abi::Atomic(ep.header->ring_tail).store(ep.ring_tail, std::memory_order_release);
    CountRejected(ep);
    LogLimited(*engine_log_, spdlog::level::warn, *ep.log_limiter, ep.log_name,
               "{}: ring_head {} is more than the ring's {} slots past the tail {}; the ring "
               "was skipped to it (its client wrote the header)",
               ep.log_name, head, abi::kRingCapacity, tail);
    return false;
  }
  std::memcpy(slot, &ep.ring()[(tail + 1) % abi::kRingCapacity], sizeof(*slot));
  ep.ring_tail = tail + 1;
  abi::Atomic(ep.header->ring_tail).store(ep.ring_tail, std::memory_order_release);
  return true;
}

void LockstepGroup::CountRejected(LockstepEndpoint& ep) {
  abi::Atomic(ep.header->rejected_requests)
      .store(++ep.rejected_requests, std::memory_order_relaxed);
}

bool LockstepGroup::RefuseRequests(int32_t rank, LockstepEndpoint& ep, const absl::Status& why) {
  bool worked = false;
  // At most one ring's worth per poll: a client advancing ring_head without end cannot
  // hold the engine here.
  abi::RequestSlot slot;
  for (uint32_t n = 0; n < abi::kRingCapacity && PopSlot(ep, &slot); ++n) {
    worked = true;
    CountRejected(ep);
    if (slot.magic != abi::kRequestMagic) continue;  // Not attributable to a request.
    LogLimited(*engine_log_, spdlog::level::warn, *ep.log_limiter, ep.log_name,
               "group {} rank {}: refused request {}: {}", spec_.name(), rank, slot.seq,
               why.message());
    CompleteUnrun(rank, ep, slot, why);
  }
  return worked;
}

bool LockstepGroup::UpdateCatchUpLocked() {
  if (!catch_up_until_) return false;
  const int32_t r = catch_up_rank_;
  const LockstepEndpoint* ep = endpoints_[r].get();
  if (ep && pending_unmask_[r] && rank_masked_[r] && ep->next_seq < current_seq_) {
    if (Clock::now() < *catch_up_until_) return true;
    pending_unmask_[r] = 0;
    LogRankCaused(r, spdlog::level::warn,
                  "group {}: rank {} did not catch up within op_timeout {} ms ({} ops behind); "
                  "it stays masked: unmask it again, or leave and join again to take part from "
                  "the group's next op",
                  spec_.name(), r, options_.op_timeout_ms, current_seq_ - ep->next_seq);
  }
  catch_up_until_.reset();
  catch_up_rank_ = -1;
  return false;
}

bool LockstepGroup::PopRequests() {
  bool worked = false;
  std::optional<Clock::time_point> popped_at;
  // A rank catching up is waited for: the ranks in step do not start the next op meanwhile
  // (the engine keeps polling, to see the deadline).
  const bool catching_up = UpdateCatchUpLocked();
  worked |= catching_up;
  for (size_t r = 0; r < endpoints_.size(); ++r) {
    LockstepEndpoint* ep = endpoints_[r].get();
    if (!ep) continue;
    if (catching_up && static_cast<int32_t>(r) != catch_up_rank_ && ep->next_seq >= current_seq_) {
      continue;
    }
    LogSuppressed(*engine_log_, spdlog::level::warn, *ep->log_limiter);
    const int32_t rank = static_cast<int32_t>(r);
    if (absl::Status refused = AcceptsRequests(rank); !refused.ok()) {
      worked |= RefuseRequests(rank, *ep, refused);
      continue;
    }
    // At most one ring's worth of slots per poll (see RefuseRequests).
    const bool from_backend = BackendRequestSource(rank);
    abi::RequestSlot slot;
    for (uint32_t n = 0;
         n < abi::kRingCapacity && !ep->request && ep->next_seq <= current_seq_ &&
         (from_backend ? PopBackendRequest(rank, ep->next_seq, &slot) : PopSlot(*ep, &slot));
         ++n) {
      worked = true;
      if (slot.magic != abi::kRequestMagic || slot.seq != ep->next_seq) {
        // Not a request of this endpoint's client (garbage, or a replayed slot): it cannot
        // be attributed to an op, so it is dropped, counted and reported, never executed.
        CountRejected(*ep);
        LogLimited(*engine_log_, spdlog::level::warn, *ep->log_limiter, ep->log_name,
                   "group {} rank {}: dropped a malformed ring slot (magic 0x{:x}, seq {}, "
                   "expected seq {}); {} dropped so far",
                   spec_.name(), r, slot.magic, slot.seq, ep->next_seq, ep->rejected_requests);
        continue;
      }
      absl::Status valid = ValidateSlot(rank, *ep, slot);
      uint64_t seq = ep->next_seq++;
      if (!valid.ok()) {
        CountRejected(*ep);
        if (slot.op == 0 || slot.op > abi::kMaxOpKind) slot.op = 0;
        if (!(slot.flags & abi::kFlagClientError)) {
          LogLimited(*engine_log_, spdlog::level::warn, *ep->log_limiter, ep->log_name,
                     "group {} rank {}: rejected request {}: {}", spec_.name(), r, seq,
                     valid.message());
        }
      }
      if (seq < current_seq_) {
        // This op already failed (timeout) before the rank arrived, or, under masking, ran
        // without it.
        auto it = failed_ops_.find(seq);
        absl::Status st =
            it != failed_ops_.end()
                ? errors::WithReason(absl::Status(it->second.code(),
                                                  absl::StrCat("rank ", rank, " arrived after op ",
                                                               seq, " had failed for the group: ",
                                                               it->second.message())),
                                     errors::ReasonOf(it->second))
            // Under masking a rank is unmasked only once its next request is the group's,
            // so one whose request is stale is masked.
            : masking_ ? absl::FailedPreconditionError(absl::StrCat(
                             "op ", seq, " of group ", spec_.name(), " ran without rank ", rank,
                             ", which was masked (mask epoch ", mask_epoch_,
                             ") before it arrived; the group is at op ", current_seq_, ", ",
                             current_seq_ - seq, " op(s) ahead of this request"))
                       : errors::WithReason(absl::DeadlineExceededError(
                                                absl::StrCat("op ", seq, " of group ", spec_.name(),
                                                             " failed before this rank arrived")),
                                            errors::Reason::kOpTimeout);
        CompleteUnrun(rank, *ep, slot, st);
        if (pending_unmask_[r] && ep->next_seq == current_seq_ && !running_ && !op_started_) {
          ApplyPendingMaskLocked();  // Caught up before the next op's collection: unmasked.
        } else if (pending_unmask_[r] && rank_masked_[r] && ep->next_seq < current_seq_ &&
                   !spanning_ && !catch_up_until_) {
          // Behind and submitting: from the next boundary on, the others wait for it (at
          // most op_timeout) instead of running away from it, so that a client whose refused
          // steps take as long as its good ones still catches up.
          catch_up_until_ = Clock::now() + std::chrono::milliseconds(options_.op_timeout_ms);
          catch_up_rank_ = rank;
        }
        continue;
      }
      if (rank_masked_[r]) {
        // Masked: the op is not waited for nor run with this rank. Unmasking it waits for
        // the next op (ApplyPendingMaskLocked).
        if (seq == current_seq_ && valid.ok() && all_masked_op_ == 0 && AllRanksMaskedLocked()) {
          all_masked_op_ = slot.op;
        }
        CompleteUnrun(rank, *ep, slot, MaskedError(rank, seq));
        continue;
      }
      ep->request = slot;
      if (!valid.ok()) ep->slot_error = valid;
      // One clock read per poll that takes requests: ranks picked up in one poll arrived
      // together (the straggler's resolution is one engine poll).
      if (!popped_at) popped_at = Clock::now();
      arrived_[r] = *popped_at;
      if (!op_started_) op_started_ = *popped_at;
    }
  }
  LogSuppressed(*engine_log_, spdlog::level::warn, *log_limiter_);
  return worked;
}

}  // namespace epd
