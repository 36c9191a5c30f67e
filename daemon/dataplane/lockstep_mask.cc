// Rank masking of a lockstep group (lockstep_group.h; docs/RELIABILITY.md): which ranks an op
// runs without, changes applied between two ops (a rank that left, one that did not arrive
// within op_timeout, a client's UpdateRankMask, a rejoin into a masked slot), the mask epoch,
// and a just-unmasked rank that disagrees with the group masked again.
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/dataplane/completion.h"
#include "daemon/dataplane/lockstep_group.h"
#include "spdlog/spdlog.h"

namespace epd {

namespace {

/// The policy as a message names it: unspecified is FAIL, and says so.
std::string PolicyName(v1::RankFailurePolicy p) {
  return p == v1::RANK_FAILURE_POLICY_UNSPECIFIED
             ? "RANK_FAILURE_POLICY_UNSPECIFIED (= RANK_FAILURE_POLICY_FAIL)"
             : v1::RankFailurePolicy_Name(p);
}

/// Ranks a mask change's log line names; the rest are counted ("and N more").
constexpr size_t kMaxRanksLogged = 4;

}  // namespace

int32_t LockstepGroup::LeadRank() const {
  int32_t r = local_first_;
  while (r < local_first_ + local_count_ && rank_masked_[r]) ++r;
  return r;
}

bool LockstepGroup::ReMaskStrayRejoiners() {
  const int32_t end = local_first_ + local_count_;
  int32_t ref = -1;  // The first rank taking part that is in step.
  for (int32_t r = local_first_; r < end && ref < 0; ++r) {
    if (!rank_masked_[r] && !rejoined_[r] && !endpoints_[r]->slot_error) ref = r;
  }
  std::vector<int32_t>& stray = mask_scratch_;
  stray.clear();
  for (int32_t r = local_first_; r < end; ++r) {
    if (rank_masked_[r] || !rejoined_[r]) continue;
    const LockstepEndpoint& ep = *endpoints_[r];
    if (ep.slot_error || (ref >= 0 && !SameOp(*ep.request, *endpoints_[ref]->request))) {
      stray.push_back(r);
    }
  }
  if (stray.empty()) return false;
  for (int32_t r : stray) {
    const LockstepEndpoint& ep = *endpoints_[r];
    LogRankCaused(r, spdlog::level::warn,
                  "group {}: rank {} (just unmasked) submitted {} for op {}{}; it is masked again "
                  "and unmasked at the next op",
                  spec_.name(), r, OpName(ep.request->op), current_seq_,
                  ep.slot_error ? absl::StrCat(", which was rejected: ", ep.slot_error->message())
                  : ref >= 0    ? absl::StrCat(", where rank ", ref, " submitted ",
                                               OpName(endpoints_[ref]->request->op))
                                : std::string());
  }
  std::vector<int32_t> ranks(stray.begin(), stray.end());  // Off the steady state: may allocate.
  MaskRanksLocked(ranks, "its first op after being unmasked differs from the group's",
                  spdlog::level::warn, /*unmask_at_next_op=*/true);
  return true;
}

absl::Status LockstepGroup::MaskedError(int32_t rank, uint64_t seq) const {
  if (AllRanksMaskedLocked()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "op ", seq, " of group ", spec_.name(), " runs without rank ", rank,
        ": every rank of group ", spec_.name(), " is masked (mask epoch ", mask_epoch_,
        "), so no op runs; unmask a rank (UpdateRankMask, CleanRankMask) or rejoin a slot from a "
        "new process"));
  }
  if (pending_unmask_[rank]) {
    return absl::FailedPreconditionError(
        absl::StrCat("op ", seq, " of group ", spec_.name(), " runs without rank ", rank,
                     ": the rank is masked for this op only (mask epoch ", mask_epoch_,
                     ") and will be unmasked at the next op boundary; submit the group's next op"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "op ", seq, " of group ", spec_.name(), " runs without rank ", rank,
      ": the rank is masked (mask epoch ", mask_epoch_,
      "); unmask it (UpdateRankMask, CleanRankMask) or rejoin its slot from a new process"));
}

v1::RankMask LockstepGroup::MaskMessageLocked() const {
  v1::RankMask m;
  m.set_epoch(mask_epoch_);
  const std::vector<uint8_t>* masked = &rank_masked_;
  std::vector<uint8_t> group;  // An RPC's answer, not an op: may allocate.
  if (BackendReportsOpMask()) {
    // Across nodes: every node's ranks, in the numbering of epochs every node shares.
    group.assign(rank_masked_.size(), 0);
    m.set_epoch(BackendRankMask(&group));
    masked = &group;
  }
  for (size_t r = 0; r < masked->size(); ++r) {
    if ((*masked)[r]) m.add_masked_ranks(static_cast<int32_t>(r));
  }
  return m;
}

void LockstepGroup::MaskRanksLocked(std::span<const int32_t> ranks, const std::string& why,
                                    spdlog::level::level_enum level, bool unmask_at_next_op) {
  std::vector<int32_t>& masked = changed_scratch_;
  masked.clear();
  for (int32_t r : ranks) {
    pending_mask_[r] = 0;
    pending_unmask_[r] = unmask_at_next_op ? 1 : 0;
    if (rank_masked_[r]) continue;
    if (masked.empty()) ++mask_epoch_;
    masked.push_back(r);
    rank_masked_[r] = 1;
    masked_at_seq_[r] = current_seq_;
    ++num_masked_;
    RankMaskChanged(r, true);
    metrics_->SetRankMasked(r, true);
    LockstepEndpoint* ep = endpoints_[r].get();
    if (ep && ep->request) {
      // It had arrived at the op being collected, which now runs without it.
      CompleteUnrun(r, *ep, *ep->request, MaskedError(r, ep->request->seq));
      ep->request.reset();
      ep->slot_error.reset();
    }
  }
  if (masked.empty()) return;
  // Clients cause every mask change (an UpdateRankMask, a rank late or gone): charged to the
  // group's log budget, so that a client asking for changes without end cannot flood the log.
  LogClientCaused(level,
                  "group {}: {} {} masked (mask epoch {}, {} of {} ranks masked): {}; the "
                  "group's ops run without {} {}",
                  spec_.name(), masked.size() == 1 ? "rank" : "ranks",
                  BoundedRankList(masked, kMaxRanksLogged), mask_epoch_, num_masked_,
                  rank_masked_.size(), why, masked.size() == 1 ? "it" : "them",
                  unmask_at_next_op    ? "for this op only: unmasked at the next op boundary"
                  : masked.size() == 1 ? "until it rejoins or is unmasked"
                                       : "until each rejoins or is unmasked");
}

bool LockstepGroup::AllRanksMaskedLocked() const {
  return masking_ && !spanning_ && num_masked_ == rank_masked_.size();
}

bool LockstepGroup::SkipOpWhileAllMaskedLocked() {
  if (running_ || !AllRanksMaskedLocked()) return false;
  // A rank's requests are popped up to current_seq_, so one past it is at current_seq_ + 1:
  // at most one op to move past.
  bool refused = false;
  for (size_t r = 0; r < endpoints_.size(); ++r) {
    const LockstepEndpoint* ep = endpoints_[r].get();
    if (!ep) continue;
    // A rank being unmasked in step with the op takes part in it instead.
    if (pending_unmask_[r] && ep->next_seq == current_seq_) return false;
    refused |= ep->next_seq > current_seq_;
  }
  if (!refused) return false;
  if (all_masked_op_ != 0) CountOp(all_masked_op_);  // As the clients counted it.
  all_masked_op_ = 0;
  failed_ops_[current_seq_] = absl::FailedPreconditionError(
      absl::StrCat("every rank of group ", spec_.name(), " is masked (mask epoch ", mask_epoch_,
                   "): op ", current_seq_, " ran on no rank"));
  while (failed_ops_.size() > 2 * abi::kRingCapacity) failed_ops_.erase(failed_ops_.begin());
  ++current_seq_;
  op_started_.reset();
  return true;
}

void LockstepGroup::ApplyPendingMaskLocked() {
  std::vector<int32_t>& to_mask = mask_scratch_;
  to_mask.clear();
  for (size_t r = 0; r < pending_mask_.size(); ++r) {
    if (pending_mask_[r]) to_mask.push_back(static_cast<int32_t>(r));
  }
  if (!to_mask.empty()) MaskRanksLocked(to_mask, "asked while an op ran (UpdateRankMask or left)");
  // With every rank masked no op is in progress: an unmask finds a rank that was refused
  // for the op being collected at the group's next op.
  SkipOpWhileAllMaskedLocked();
  std::vector<int32_t>& unmasked = changed_scratch_;
  unmasked.clear();
  for (size_t r = 0; r < pending_unmask_.size(); ++r) {
    if (!pending_unmask_[r]) continue;
    const LockstepEndpoint* ep = endpoints_[r].get();
    if (!ep) {
      pending_unmask_[r] = 0;  // Detached: unmasked when it rejoins.
      continue;
    }
    if (!rank_masked_[r]) {
      pending_unmask_[r] = 0;
      continue;
    }
    // It takes part from the op being collected on only if its next request is for that op
    // and no rank has arrived at it yet: the mask changes only between two ops, never while
    // ranks are collected for one. One whose request for that op comes while it is collected
    // is refused as masked and unmasked at the boundary after it (its next request is then
    // the group's next op); one still behind (ops ran without it) stays masked, its stale
    // requests refused at once, until it has caught up (PopRequests); else the others would
    // wait op_timeout for it.
    if (ep->next_seq != current_seq_ || op_started_) continue;
    pending_unmask_[r] = 0;
    if (unmasked.empty()) ++mask_epoch_;
    unmasked.push_back(static_cast<int32_t>(r));
    rank_masked_[r] = 0;
    rejoined_[r] = 1;
    --num_masked_;
    // Ops ran without it: its handles (routing, low-latency buffers) are not the group's.
    if (current_seq_ > masked_at_seq_[r]) endpoints_[r]->handles = rules::HandleTable();
    RankMaskChanged(static_cast<int32_t>(r), false);
    metrics_->SetRankMasked(static_cast<int32_t>(r), false);
  }
  if (unmasked.empty()) return;
  LogClientCaused(
      spdlog::level::info,
      "group {}: {} {} unmasked (mask epoch {}, {} ranks masked): {} part from op {} on",
      spec_.name(), unmasked.size() == 1 ? "rank" : "ranks",
      BoundedRankList(unmasked, kMaxRanksLogged), mask_epoch_, num_masked_,
      unmasked.size() == 1 ? "it takes" : "they take", current_seq_);
}

absl::StatusOr<v1::RankMask> LockstepGroup::UpdateRankMask(std::span<const int32_t> mask,
                                                           std::span<const int32_t> unmask,
                                                           bool clean) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!masking_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", spec_.name(), ": on_rank_failure is ", PolicyName(spec_.on_rank_failure()),
        ", not RANK_FAILURE_POLICY_MASK: its ranks cannot be masked (the policy is part of the "
        "spec every rank joins with)"));
  }
  const int32_t R = static_cast<int32_t>(rank_masked_.size());
  // Each rank at most once in both lists together, so neither may be longer than R; then
  // one pass over each with a bitmap (the caller holds the registry's lock).
  for (const auto& [field, list] : {std::pair{"mask", mask}, std::pair{"unmask", unmask}}) {
    if (list.size() > static_cast<size_t>(R)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": ", list.size(),
                                                     " ranks listed, more than the ", R,
                                                     " ranks of group ", spec_.name()));
    }
  }
  std::vector<uint8_t> listed(static_cast<size_t>(R), 0);  // 1 = in mask, 2 = in unmask.
  for (int32_t r : mask) {
    if (r < 0 || r >= R) {
      return absl::InvalidArgumentError(
          absl::StrCat("mask: rank ", r, " is outside [0, ", R, ") of group ", spec_.name()));
    }
    if (listed[r] != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mask: rank ", r, " is listed twice; name each rank of group ", spec_.name(), " once"));
    }
    listed[r] = 1;
  }
  if (spanning_) {
    // Across nodes each node masks its own ranks (the others learn it from its exchange
    // header): a rank of another node is masked or unmasked at that node's daemon.
    for (const auto& [field, list] : {std::pair{"mask", mask}, std::pair{"unmask", unmask}}) {
      for (int32_t r : list) {
        if (r < local_first_ || r >= local_first_ + local_count_) {
          return absl::FailedPreconditionError(
              absl::StrCat(field, ": rank ", r, " of group ", spec_.name(),
                           " lives on another node; this daemon hosts ranks ", local_first_, "-",
                           local_first_ + local_count_ - 1,
                           ": mask or unmask it through an endpoint of its own node's daemon"));
        }
      }
    }
  }
  for (int32_t r : unmask) {
    if (r < 0 || r >= R) {
      return absl::InvalidArgumentError(
          absl::StrCat("unmask: rank ", r, " is outside [0, ", R, ") of group ", spec_.name()));
    }
    if (listed[r] != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("unmask: rank ", r, listed[r] == 1 ? " is also in mask" : " is listed twice",
                       "; name each rank of group ", spec_.name(), " once"));
    }
    listed[r] = 2;
    if (!endpoints_[r] && rank_masked_[r]) {
      return absl::FailedPreconditionError(
          absl::StrCat("unmask: rank ", r, " of group ", spec_.name(),
                       " is not joined; it is unmasked when a process joins its slot"));
    }
  }
  if (running_) {
    // Between ops: after the one the backend runs (FinishOp applies it).
    for (int32_t r : mask) pending_mask_[r] = 1;
  } else {
    std::vector<int32_t> ranks(mask.begin(), mask.end());  // An RPC, not an op: may allocate.
    MaskRanksLocked(ranks, "masked by a client (UpdateRankMask)");
  }
  for (int32_t r : unmask) pending_unmask_[r] = 1;
  if (clean) {
    for (int32_t r = 0; r < R; ++r) {
      if (endpoints_[r]) pending_unmask_[r] = 1;
    }
  }
  if (!running_) ApplyPendingMaskLocked();
  WakeEngine();
  return MaskMessageLocked();
}

absl::StatusOr<v1::RankMask> LockstepGroup::GetRankMask() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!masking_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", spec_.name(), ": on_rank_failure is ", PolicyName(spec_.on_rank_failure()),
        ", not RANK_FAILURE_POLICY_MASK: the group masks no ranks"));
  }
  return MaskMessageLocked();
}

}  // namespace epd
