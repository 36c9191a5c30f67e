// The lockstep core of a data-plane group (lockstep_group.h; docs/DESIGN.md §8.3). The ring
// requests: request_validation.cc; rank masking: lockstep_mask.cc.
#include "daemon/dataplane/lockstep_group.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/errors/reason.h"
#include "common/os/futex.h"
#include "common/status_macros.h"
#include "daemon/dataplane/completion.h"
#include "spdlog/spdlog.h"

namespace epd {
namespace {

/// The node of `rank` in a spanning spec (-1 if none), with its first rank and count.
int32_t NodeOfRank(const v1::GroupSpec& spec, int32_t rank, int32_t* first, int32_t* count) {
  int32_t begin = 0;
  for (int32_t n = 0; n < spec.nodes_size(); ++n) {
    const int32_t c = spec.nodes(n).num_ranks();
    if (rank >= begin && rank < begin + c) {
      if (first) *first = begin;
      if (count) *count = c;
      return n;
    }
    begin += c;
  }
  return -1;
}

using Clock = std::chrono::steady_clock;

std::atomic<uint64_t> g_next_endpoint_id{1};

}  // namespace

uint64_t NextEndpointId() { return g_next_endpoint_id.fetch_add(1); }

std::shared_ptr<spdlog::logger> EngineLog() { return GetLogger(kLogEngine); }

const char* OpName(uint32_t op) { return abi::OpKindName(op); }

bool LockstepGroup::SameOp(const abi::RequestSlot& a, const abi::RequestSlot& b) {
  return a.op == b.op && ((a.flags ^ b.flags) & rules::kAgreedFlags) == 0 &&
         (a.op != static_cast<uint32_t>(abi::OpKind::kDispatch) ||
          a.expert_alignment == b.expert_alignment);
}

LockstepGroup::LockstepGroup(const v1::GroupSpec& spec, LockstepOptions options)
    : spec_(spec),
      shape_(ShapeOf(spec)),
      layout_(kernels::EndpointLayout::Compute(shape_)),
      options_(std::move(options)),
      engine_log_(EngineLog()),
      log_name_(absl::StrCat("group ", spec.name())),
      log_limiter_(std::make_shared<LogRateLimiter>()),
      endpoints_(spec.num_ranks()),
      op_departed_(spec.num_ranks()),
      departed_(spec.num_ranks(), false),
      masking_(spec.on_rank_failure() == v1::RANK_FAILURE_POLICY_MASK),
      rank_masked_(spec.num_ranks(), 0),
      pending_unmask_(spec.num_ranks(), 0),
      pending_mask_(spec.num_ranks(), 0),
      rejoined_(spec.num_ranks(), 0),
      masked_at_seq_(spec.num_ranks(), 0),
      running_slots_(spec.num_ranks()),
      outcomes_(spec.num_ranks()),
      arrived_(spec.num_ranks()),
      metrics_(metrics::Default().AddGroup(spec.name(), spec.num_ranks(), spec.num_experts())) {
  missing_.reserve(spec.num_ranks());
  gone_.reserve(spec.num_ranks());
  mask_scratch_.reserve(spec.num_ranks());
  changed_scratch_.reserve(spec.num_ranks());
  spanning_ = spec.nodes_size() >= 2;
  self_node_ = spanning_ ? -1 : 0;
  local_count_ = spanning_ ? 0 : spec.num_ranks();
}

bool LockstepGroup::PollOpInto(std::span<RankOutcome> outcomes) {
  for (RankOutcome& o : outcomes) {
    o.status = errors::WithReason(
        absl::InternalError(
            "this backend left an op running but implements no LockstepGroup::PollOpInto"),
        errors::Reason::kInternal);
  }
  return true;
}

uint64_t LockstepGroup::rank_ops_completed(int32_t rank) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (rank < 0 || rank >= static_cast<int32_t>(endpoints_.size()) || !endpoints_[rank]) return 0;
  return endpoints_[rank]->ops_completed;
}

bool LockstepGroup::RankMapped(int32_t rank) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (rank < 0 || rank >= static_cast<int32_t>(endpoints_.size()) || !endpoints_[rank]) {
    return false;
  }
  return endpoints_[rank]->ClientMapped();
}

absl::Status LockstepGroup::AttachRank(int32_t rank, const std::string& gpu_uuid,
                                       v1::LaunchMode launch_mode, const RankClient& client,
                                       v1::EndpointInfo* info) {
  if (rank < 0 || rank >= static_cast<int32_t>(endpoints_.size())) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  "rank ", rank, " outside [0, ", endpoints_.size(), ")")),
                              errors::Reason::kRankInvalid);
  }
  int32_t node_first = 0, node_count = 0;
  const int32_t node = spanning_ ? NodeOfRank(spec_, rank, &node_first, &node_count) : 0;
  if (spanning_) {
    std::lock_guard<std::mutex> lock(mu_);
    if (node < 0 || (self_node_ >= 0 && node != self_node_)) {
      return errors::WithReason(
          absl::InvalidArgumentError(absl::StrCat(
              "group ", spec_.name(), ": rank ", rank, " lives on node ", node, " (",
              node >= 0 ? spec_.nodes(node).peer_address() : std::string("none"),
              "); this daemon is node ", self_node_, " of the group and hosts ranks ", local_first_,
              "-", local_first_ + local_count_ - 1, ": join that node's daemon")),
          errors::Reason::kRankInvalid);
    }
  }
  auto ep = std::make_unique<LockstepEndpoint>();
  ep->log_limiter = client.log_budget ? client.log_budget : std::make_shared<LogRateLimiter>();
  EPD_ASSIGN_OR_RETURN(ep->backend, PrepareRank(rank, gpu_uuid, launch_mode, info));
  // A backend with nothing per rank may return none: the hooks still get a (empty) one.
  if (!ep->backend) ep->backend = std::make_shared<RankResources>();
  const uint64_t shm_data_bytes = ShmDataBytes(*ep->backend);
  // The layout the daemon uses from here on (private; the header gets a copy for the client).
  const abi::EndpointShmLayout shm = abi::ComputeEndpointShmLayout(shm_data_bytes);
  ep->shm_layout = shm;
  EPD_ASSIGN_OR_RETURN(ep->region, ShmRegion::Create("epd-ep", shm.total_bytes));
  if (ep->region.size() < shm.total_bytes) {
    return errors::WithReason(
        absl::InternalError(absl::StrCat("endpoint region has ", ep->region.size(),
                                         " bytes, the layout needs ", shm.total_bytes)),
        errors::Reason::kInternal);
  }
  ep->header = reinterpret_cast<abi::EndpointShmHeader*>(ep->region.data());
  abi::EndpointShmHeader& h = *ep->header;
  h.size = sizeof(abi::EndpointShmHeader);
  h.magic = abi::kEndpointMagic;
  h.version = abi::kShmAbiVersion;
  h.ring_capacity = abi::kRingCapacity;
  h.completion_capacity = abi::kCompletionCapacity;
  ep->endpoint_id = NextEndpointId();
  h.endpoint_id = ep->endpoint_id;
  h.ring_offset = shm.ring_offset;
  h.completion_offset = shm.completion_offset;
  h.data_offset = shm_data_bytes > 0 ? shm.data_offset : 0;
  h.data_bytes = layout_.total_bytes;
  h.total_bytes = shm.total_bytes;

  std::lock_guard<std::mutex> lock(mu_);
  if (endpoints_[rank]) {
    return errors::WithReason(
        absl::AlreadyExistsError(absl::StrCat("rank ", rank, " is already attached")),
        errors::Reason::kRankTaken);
  }
  if (spanning_ && self_node_ < 0) {
    self_node_ = node;
    local_first_ = node_first;
    local_count_ = node_count;
    if (absl::Status st = NodeChosen(node); !st.ok()) {
      self_node_ = -1;
      local_first_ = local_count_ = 0;
      return st;
    }
  } else if (spanning_ && node != self_node_) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  "group ", spec_.name(), ": rank ", rank, " lives on node ", node,
                                  ", this daemon is node ", self_node_)),
                              errors::Reason::kRankInvalid);
  }
  // A rank rejoining while an op of the group still runs in the backend continues after it;
  // so does one rejoining a masked slot while an op is being collected (the op runs
  // without it; it is unmasked at the boundary after it, ApplyPendingMaskLocked).
  const bool into_masked = masking_ && rank_masked_[rank] != 0;
  const bool after_collected = into_masked && op_started_.has_value() && !running_;
  const uint64_t first_seq = current_seq_ + ((running_ || after_collected) ? 1 : 0);
  ep->next_seq = first_seq;
  // The ring's head/tail count slots; start them at the first seq - 1 so slot i holds
  // seq i (the client writes slot (head + 1) % capacity, see client/endpoint/ring_channel.cc).
  ep->ring_tail = first_seq - 1;
  h.ring_head = first_seq - 1;
  h.ring_tail = first_seq - 1;
  ep->log_name =
      absl::StrCat("group ", spec_.name(), " rank ", rank, " (endpoint ", ep->endpoint_id, ")");
  for (uint32_t i = 0; i < abi::kCompletionCapacity; ++i) ep->completions()[i].seq = 0;

  info->set_group(spec_.name());
  info->set_rank(rank);
  info->set_endpoint_id(ep->endpoint_id);
  info->set_shm_bytes(shm.total_bytes);
  info->set_data_offset(shm_data_bytes > 0 ? shm.data_offset : 0);
  info->set_data_bytes(layout_.total_bytes);
  info->clear_regions();
  layout_.ForEachRegion([&](const char* name, const kernels::Region& r) {
    v1::BufferRegion* br = info->add_regions();
    br->set_name(name);
    br->set_offset(r.offset);
    br->set_bytes(r.bytes);
  });
  info->set_abi_version(abi::kShmAbiVersion);
  info->set_op_timeout_ms(options_.op_timeout_ms);
  info->set_first_seq(first_seq);
  // The buffer rule's count at first_seq: a running op was counted when it started; one
  // being collected counts as the ranks that arrived submitted it (they agree, or it fails).
  rules::LowLatencyParity parity = parity_;
  if (after_collected) {
    for (const auto& other : endpoints_) {
      if (other && other->request) {
        parity.Advance(static_cast<abi::OpKind>(rules::Describe(other->request->op).op));
        break;
      }
    }
  }
  info->set_first_ll_dispatches(parity.dispatches);
  info->set_first_ll_combines(parity.combines);
  EPD_RETURN_IF_ERROR(RankRegionReady(rank, *ep->backend,
                                      shm_data_bytes > 0 ? ep->shm_data() : nullptr, first_seq));
  EPD_RETURN_IF_ERROR(RankAttached(rank, ep->backend));
  endpoints_[rank] = std::move(ep);
  departed_.resize(endpoints_.size(), false);
  departed_[rank] = false;
  if (into_masked) {
    // Hot re-attach: in step from first_seq on, unmasked at the first boundary it can
    // take part in (now, when no op is being collected).
    pending_unmask_[rank] = 1;
    if (!running_) ApplyPendingMaskLocked();
  }
  if (!log_limiter_is_owners_ && client.log_budget) {
    // What the group's ops cause is charged to its owner (the first joiner): a client
    // cannot multiply its budget by creating groups.
    log_limiter_ = client.log_budget;
    log_limiter_is_owners_ = true;
  }
  EngineLog()->info("group {}: rank {} attached (endpoint {}, uid {}, backend {}, {} bytes of shm)",
                    spec_.name(), rank, endpoints_[rank]->endpoint_id, client.uid, info->backend(),
                    shm.total_bytes);
  if (into_masked) {
    if (rank_masked_[rank]) {
      EngineLog()->info(
          "group {}: rank {} rejoined its masked slot; it will be unmasked at the next op "
          "boundary and takes part from op {} on",
          spec_.name(), rank, first_seq);
    } else {
      EngineLog()->info(
          "group {}: rank {} rejoined its masked slot and is unmasked (no op was running); it "
          "takes part from op {} on",
          spec_.name(), rank, first_seq);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<EndpointFds> LockstepGroup::TakeEndpointFds(int32_t rank) {
  std::lock_guard<std::mutex> lock(mu_);
  if (rank < 0 || rank >= static_cast<int32_t>(endpoints_.size()) || !endpoints_[rank]) {
    return errors::WithReason(absl::NotFoundError(absl::StrCat("group ", spec_.name(), ": rank ",
                                                               rank, " has no endpoint")),
                              errors::Reason::kGroupNotFound);
  }
  LockstepEndpoint& ep = *endpoints_[rank];
  if (ep.region.fd() < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", spec_.name(), " rank ", rank, ": the descriptors of endpoint ", ep.endpoint_id,
        " were already handed out (once per join; leave and join again for a new endpoint)"));
  }
  EndpointFds fds;
  EPD_ASSIGN_OR_RETURN(fds.doorbell, DoorbellFd(rank));
  fds.region = ep.region.TakeFd();
  fds.endpoint_id = ep.endpoint_id;
  return fds;
}

void LockstepGroup::DetachRank(int32_t rank) {
  std::unique_ptr<LockstepEndpoint> ep;
  // What the lines below need of the endpoint, which may be kept for the running op.
  std::shared_ptr<LogRateLimiter> log_limiter;
  bool own_budget = false;
  uint64_t endpoint_id = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (rank < 0 || rank >= static_cast<int32_t>(endpoints_.size())) return;
    ep = std::move(endpoints_[rank]);
    if (!ep) return;
    // Its client, if alive (removed by another session's LeaveGroup), fails its waits at
    // once with FAILED_PRECONDITION instead of waiting for a completion that never comes.
    uint32_t open = 0;  // A shutdown's kClosedShutdown stays.
    abi::Atomic(ep->header->daemon_closed)
        .compare_exchange_strong(open, abi::kClosedRankRemoved, std::memory_order_seq_cst);
    FutexWakeAll(&ep->header->completion_futex);
    departed_.resize(endpoints_.size(), false);
    // A rank that already arrived at a running op stays part of it (its resources live
    // on in the backend's running op); one that never arrived fails the op. Otherwise the
    // group's next op that waits for it fails at once (departed_).
    const bool in_op = running_ && ep->request && ep->request->seq == running_->seq;
    if (masking_) {
      // Masked instead: the op being collected and later ones run without it.
      pending_unmask_[rank] = 0;
      if (in_op) {
        pending_mask_[rank] = 1;  // Part of the running op: masked at its end.
      } else {
        const int32_t ranks[1] = {rank};
        // Info: every rank of a job that ends leaves so (a crash is the same event here).
        MaskRanksLocked(ranks, "it left the group (LeaveGroup, or its client's Session ended)",
                        spdlog::level::info);
      }
    } else if (op_started_ && !running_ && !ep->request.has_value()) {
      FailOp(errors::WithReason(absl::DeadlineExceededError(absl::StrCat(
                                    "op ", current_seq_, " of group ", spec_.name(), ": rank ",
                                    rank, " left the group before arriving")),
                                errors::Reason::kRankLeft));
    } else {
      departed_[rank] = true;
    }
    const bool in_running_op = in_op;
    if (ep->request && !in_running_op) {
      OpEndedWithoutLaunch(rank, *ep->request);  // Its client is gone: no completion.
    }
    RankDetached(rank);
    own_budget = ep->log_limiter.use_count() == 1;
    log_limiter = ep->log_limiter;
    endpoint_id = ep->endpoint_id;
    // The running op may still read and write its data area (a spanning op runs on
    // asynchronously, and the transport may send from it): kept until the op finished.
    if (in_running_op) op_departed_[rank] = std::move(ep);
  }
  // A budget of the endpoint's own reports what it holds now; a shared one (its uid's)
  // reports once it has a token, through its other sources or GroupRegistry.
  if (own_budget) {
    LogSuppressedReport(*engine_log_, spdlog::level::warn, *log_limiter, log_limiter->Flush());
  } else {
    LogSuppressed(*engine_log_, spdlog::level::warn, *log_limiter);
  }
  EngineLog()->info("group {}: rank {} detached (endpoint {})", spec_.name(), rank, endpoint_id);
  WakeEngine();
  // ep's shm is unmapped and unlinked here, outside the lock (and its backend resources
  // freed, unless an op or the backend still holds them).
}

int32_t LockstepGroup::FailAll(const absl::Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  int32_t failed = 0;
  for (int32_t r = 0; r < static_cast<int32_t>(endpoints_.size()); ++r) {
    LockstepEndpoint* ep = endpoints_[r].get();
    if (!ep) continue;
    uint64_t head = abi::Atomic(ep->header->ring_head).load(std::memory_order_acquire);
    // Complete everything already submitted so no client waits on a dead daemon.
    if (ep->request) {
      if (running_ && ep->request->seq == running_->seq) {
        WriteCompletion(*ep, ep->request->seq, {status});  // Launched: the backend ends it.
        RankOpEnded(r, *ep->request, {status}, nullptr);
      } else {
        CompleteUnrun(r, *ep, *ep->request, status);
      }
      ep->request.reset();
      ++failed;
    }
    for (uint64_t s = ep->next_seq; s <= head && s < ep->next_seq + abi::kRingCapacity; ++s) {
      ++failed;
      abi::RequestSlot slot;
      std::memcpy(&slot, &ep->ring()[s % abi::kRingCapacity], sizeof(slot));
      if (slot.magic == abi::kRequestMagic && slot.seq == s) {
        CompleteUnrun(r, *ep, slot, status);
      } else {
        WriteCompletion(*ep, s, {status});
      }
    }
    // Later submits and waits of this endpoint's client fail at once (shm_abi.h).
    abi::Atomic(ep->header->daemon_closed).store(abi::kClosedShutdown, std::memory_order_seq_cst);
    abi::Atomic(ep->header->completion_futex).fetch_add(1, std::memory_order_seq_cst);
    FutexWakeAll(&ep->header->completion_futex);
  }
  return failed;
}

void LockstepGroup::CountOp(uint32_t op) {
  const auto kind = static_cast<abi::OpKind>(rules::Describe(op).op);
  if (kind == abi::OpKind::kLowLatencyDispatch) {
    const int b = parity_.DispatchBuffer();
    ll_dispatch_seq_[b] = 0;  // Its dispatch, if it succeeds, owns it (FinishOp).
    for (const auto& ep : endpoints_) {
      if (ep) ep->handles.LowLatencyDispatchEnded(current_seq_, b, 0, /*ok=*/false);
    }
  }
  parity_.Advance(kind);
}

void LockstepGroup::RecordOpMetrics(uint32_t op, absl::StatusCode code, uint32_t flags,
                                    const std::vector<abi::RequestSlot>* slots,
                                    const std::vector<RankOutcome>* outcomes) {
  uint64_t latency_ns = 0;
  uint64_t bytes = 0;
  if (code == absl::StatusCode::kOk && op_started_) {
    latency_ns = static_cast<uint64_t>(std::max<int64_t>(
        0,
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - *op_started_).count()));
  }
  if (code == absl::StatusCode::kOk && slots != nullptr && outcomes != nullptr) {
    const uint64_t hidden = static_cast<uint64_t>(shape_.hidden);
    const bool fp8 = (flags & abi::kFlagFp8) != 0;
    // A row as the op moves it: bf16, or e4m3 with an f32 scale per 128 channels.
    const uint64_t row = fp8 ? hidden + (hidden + 127) / 128 * 4 : hidden * 2;
    for (int32_t r = local_first_; r < local_first_ + local_count_; ++r) {
      switch (static_cast<abi::OpKind>(op)) {
        case abi::OpKind::kDispatch:
          bytes += static_cast<uint64_t>(std::max((*outcomes)[r].num_recv_tokens, 0)) * row;
          break;
        case abi::OpKind::kCombine:
        case abi::OpKind::kLowLatencyCombine:
          bytes += static_cast<uint64_t>(std::max((*slots)[r].num_tokens, 0)) * hidden * 2;
          break;
        default:  // LowLatencyDispatch: the backend counts its rows (AddOpBytes).
          break;
      }
    }
  }
  metrics_->RecordOp(op, code, latency_ns, bytes);
}

void LockstepGroup::FailOp(const absl::Status& status) {
  ops_failed_.fetch_add(1);
  uint32_t op = 0;
  for (const auto& ep : endpoints_) {
    if (ep && ep->request) {
      op = ep->request->op;
      break;
    }
  }
  RecordOpMetrics(op, status.code(), 0, nullptr, nullptr);
  if (spanning_) OpFailedHere(current_seq_, op, status);
  // The op counts for the buffer rule as the ranks submitted it (they agree, or it fails).
  for (const auto& ep : endpoints_) {
    if (ep && ep->request) {
      CountOp(ep->request->op);
      break;
    }
  }
  for (int32_t r = 0; r < static_cast<int32_t>(endpoints_.size()); ++r) {
    LockstepEndpoint* ep = endpoints_[r].get();
    if (ep && ep->request) {
      CompleteUnrun(r, *ep, *ep->request, status);
      ep->request.reset();
      ep->slot_error.reset();
    }
  }
  failed_ops_[current_seq_] = status;
  while (failed_ops_.size() > 2 * abi::kRingCapacity) failed_ops_.erase(failed_ops_.begin());
  ++current_seq_;
  op_started_.reset();
  if (masking_) ApplyPendingMaskLocked();
}

bool LockstepGroup::Poll() {
  std::lock_guard<std::mutex> lock(mu_);
  bool worked = PollBackground();
  worked |= PopRequests();
  if (masking_ && SkipOpWhileAllMaskedLocked()) {
    ApplyPendingMaskLocked();  // A rank unmasked meanwhile takes part from the next op.
    worked = true;
  }
  if (running_) {
    // Keep the engine polling while it runs, unless its progress wakes the engine.
    if (!PollOpInto(outcomes_)) return RunningOpWakesEngine() ? worked : true;
    FinishOp();
    worked = true;
  }
  if (!op_started_) return worked;
  if (program_armed_) {
    // A ring op other than UnregisterProgram while a program is armed fails at once for
    // every rank (late ranks get the same error from failed_ops_).
    for (size_t r = 0; r < endpoints_.size(); ++r) {
      const LockstepEndpoint* ep = endpoints_[r].get();
      if (!ep || !ep->request ||
          ep->request->op == static_cast<uint32_t>(abi::OpKind::kUnregisterProgram)) {
        continue;
      }
      const absl::Status st = errors::WithReason(
          absl::FailedPreconditionError(
              absl::StrCat(OpName(ep->request->op), " (op ", current_seq_, ", rank ", r,
                           ") refused: group ", spec_.name(),
                           " has a graph-mode program armed, which alone runs on its buffers; call "
                           "UnregisterProgram on every rank first")),
          errors::Reason::kProgramInvalid);
      FailOp(st);
      return true;
    }
  }
  if (spanning_) {
    // The op a local rank already submitted (-1: none yet): a peer's failure of another op
    // is not this rank's error (PeerFailure says the nodes are not in step instead).
    int64_t local_op = -1;
    for (int32_t r = local_first_; r < local_first_ + local_count_ && local_op < 0; ++r) {
      if (endpoints_[r] && endpoints_[r]->request) local_op = endpoints_[r]->request->op;
    }
    if (absl::Status st = PeerFailure(current_seq_, local_op); !st.ok()) {
      LogClientCaused(spdlog::level::warn, "{}", st.message());
      FailOp(st);  // Told to the other nodes too: one still running it waits for us.
      return true;
    }
  }
  std::vector<int32_t>& missing = missing_;  // Capacity R: no allocation.
  missing.clear();
  bool any_arrived = false;
  for (size_t r = local_first_; r < static_cast<size_t>(local_first_ + local_count_); ++r) {
    if (rank_masked_[r]) continue;  // Not waited for.
    if (!endpoints_[r] || !endpoints_[r]->request) {
      missing.push_back(static_cast<int32_t>(r));
    } else {
      any_arrived = true;
    }
  }
  if (masking_ && !any_arrived) {
    // Every rank that had arrived was masked since: nothing is being collected.
    op_started_.reset();
    return worked;
  }
  // A rank that left or died since the last op cannot arrive unless it rejoins: fail the op
  // at once instead of after op_timeout (once per departure; see departed_).
  std::vector<int32_t>& gone = gone_;
  gone.clear();
  for (int32_t r : missing) {
    if (static_cast<size_t>(r) < departed_.size() && departed_[r]) gone.push_back(r);
  }
  if (!gone.empty()) {
    for (int32_t r : gone) departed_[r] = false;
    absl::Status st =
        errors::WithReason(absl::DeadlineExceededError(absl::StrCat(
                               "op ", current_seq_, " of group ", spec_.name(), ": rank(s) ",
                               absl::StrJoin(gone, ", "),
                               " left the group (their client left or died) and did not rejoin")),
                           errors::Reason::kRankLeft);
    LogClientCaused(spdlog::level::warn, "{}", st.message());
    FailOp(st);
    return true;
  }
  if (missing.empty()) {
    if (RunOp()) return true;
    worked = true;  // Waiting for the backend: keep polling.
  }
  auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - *op_started_);
  if (waited.count() >= options_.op_timeout_ms && masking_ && !missing.empty()) {
    // The ranks that did not arrive are masked; the op runs for the others.
    std::vector<int32_t>& late = mask_scratch_;
    late.assign(missing.begin(), missing.end());
    MaskRanksLocked(late, absl::StrCat("it did not submit op ", current_seq_, " within op_timeout ",
                                       options_.op_timeout_ms, " ms while other ranks did"));
    return true;  // The next Poll runs the op.
  }
  if (waited.count() >= options_.op_timeout_ms) {
    absl::Status st =
        missing.empty()
            ? errors::WithReason(absl::DeadlineExceededError(absl::StrCat(
                                     "op ", current_seq_, " of group ", spec_.name(),
                                     spec_.nodes_size() >= 2 ? ": every rank of this node arrived"
                                                             : ": every rank arrived",
                                     " but the backend could not start it within op_timeout ",
                                     options_.op_timeout_ms, " ms (", NotReadyReason(), ")")),
                                 errors::Reason::kOpTimeout)
            : errors::WithReason(
                  absl::DeadlineExceededError(absl::StrCat(
                      "op ", current_seq_, " of group ", spec_.name(), ": rank(s) ",
                      absl::StrJoin(missing, ", "), " did not arrive within op_timeout ",
                      options_.op_timeout_ms, " ms")),
                  errors::Reason::kOpTimeout);
    LogClientCaused(spdlog::level::warn, "{}", st.message());
    FailOp(st);
    return true;
  }
  return worked;
}

bool LockstepGroup::RunOp() {
  const int R = local_first_ + local_count_;  // Every rank, or this node's.
  const int first = LeadRank();  // The first rank taking part (local_first_ unless masked).
  std::vector<abi::RequestSlot>& slots = running_slots_;  // [R], reused.
  if (masking_ && ReMaskStrayRejoiners()) return true;
  // A rejected slot, or ranks disagreeing on the op, fail the op for every rank.
  for (int r = first; r < R; ++r) {
    if (rank_masked_[r]) continue;
    if (endpoints_[r]->slot_error) {
      const absl::Status& e = *endpoints_[r]->slot_error;
      FailOp(errors::CopyReason(
          e, absl::Status(e.code(), absl::StrCat("rank ", r, ": ", e.message()))));
      return true;
    }
    slots[r] = *endpoints_[r]->request;
  }
  // A masked rank takes part as one without tokens (rank_masked()).
  for (int r = local_first_; r < R; ++r) {
    if (!rank_masked_[r]) continue;
    slots[r] = slots[first];
    slots[r].num_tokens = 0;
  }
  for (int r = first + 1; r < R; ++r) {
    if (rank_masked_[r]) continue;
    if (!SameOp(slots[r], slots[first])) {
      // Name what differs: the op, the option flags set, or expert_alignment (short: a
      // completion's message holds abi::kCompletionMessageBytes).
      auto describe = [](const abi::RequestSlot& x) {
        std::vector<std::string> set;
        if (x.flags & abi::kFlagFp8) set.push_back("fp8");
        if (x.flags & abi::kFlagRoundScale) set.push_back("round_scale");
        if (x.flags & abi::kFlagUe8m0) set.push_back("use_ue8m0");
        if (x.flags & abi::kFlagCachedHandle) set.push_back("cached handle");
        if (x.flags & (abi::kFlagDispatchWeights | abi::kFlagCombineWeights)) {
          set.push_back("topk_weights");
        }
        if (x.op == static_cast<uint32_t>(abi::OpKind::kDispatch)) {
          set.push_back(absl::StrCat("expert_alignment ", x.expert_alignment));
        }
        return set.empty() ? std::string(OpName(x.op))
                           : absl::StrCat(OpName(x.op), " (", absl::StrJoin(set, ", "), ")");
      };
      FailOp(errors::WithReason(
          absl::InvalidArgumentError(absl::StrCat("op ", current_seq_, ": ranks disagree: rank ",
                                                  first, " submitted ", describe(slots[first]),
                                                  ", rank ", r, " submitted ", describe(slots[r]))),
          errors::Reason::kOpInputInvalid));
      return true;
    }
  }
  OpPlan plan;
  plan.seq = current_seq_;
  plan.op = static_cast<abi::OpKind>(slots[first].op);
  plan.flags = slots[first].flags;
  if (plan.op == abi::OpKind::kRegisterProgram) {
    if (program_armed_) {
      FailOp(errors::WithReason(absl::FailedPreconditionError(absl::StrCat(
                                    "RegisterProgram: group ", spec_.name(),
                                    " already has a program armed; UnregisterProgram first")),
                                errors::Reason::kProgramInvalid));
      return true;
    }
    // Validated at pop time, so every rank's program decodes.
    std::vector<std::vector<ProgramStepPlan>> programs(R);
    for (int r = first; r < R; ++r) programs[r] = *DecodeProgram(slots[r], shape_);
    for (int r = first + 1; r < R; ++r) {
      if (rank_masked_[r]) continue;
      const size_t n = std::max(programs[first].size(), programs[r].size());
      for (size_t i = 0; i < n; ++i) {
        auto name = [&](int rank) {
          return i < programs[rank].size() ? ProgramStepName(programs[rank][i])
                                           : std::string("(no step)");
        };
        if (name(first) != name(r)) {
          FailOp(errors::WithReason(
              absl::FailedPreconditionError(absl::StrCat(
                  "RegisterProgram: ranks disagree on the program of group ", spec_.name(),
                  ": step ", i, " is ", name(first), " at rank ", first, " but ", name(r),
                  " at rank ", r, " (every rank must register the same program)")),
              errors::Reason::kProgramInvalid));
          return true;
        }
      }
    }
    plan.program = std::move(programs[first]);
  }
  if (plan.op == abi::OpKind::kLowLatencyCombine) {
    for (int r = first + 1; r < R; ++r) {
      if (!rank_masked_[r] && slots[r].handle_seq != slots[first].handle_seq) {
        FailOp(errors::WithReason(
            absl::InvalidArgumentError(absl::StrCat(
                "LowLatencyCombine: ranks disagree on the dispatch: rank ", first, " uses op ",
                slots[first].handle_seq, ", rank ", r, " uses op ", slots[r].handle_seq)),
            errors::Reason::kHandleInvalid));
        return true;
      }
    }
    for (int b = 0; b < kernels::kLowLatencyBuffers; ++b) {
      if (ll_dispatch_seq_[b] == slots[first].handle_seq) plan.ll_handle_buffer = b;
    }
  }
  plan.ll_buffer = parity_.DispatchBuffer();
  plan.ll_out_buffer = parity_.CombineOutBuffer();
  if (!ReadyToStart()) return false;
  if (op_started_) {
    plan.first_arrival = *op_started_;
    plan.last_arrival = *op_started_;
    for (int r = first; r < R; ++r) {
      if (!rank_masked_[r]) plan.last_arrival = std::max(plan.last_arrival, arrived_[r]);
    }
  }
  if (R - first >= 2 && op_started_) {
    // Every local rank arrived: which one came last, and how long after the first.
    int32_t last = first;
    for (int r = first + 1; r < R; ++r) {
      if (arrived_[r] > arrived_[last]) last = r;
    }
    metrics_->RecordStraggler(
        last,
        static_cast<uint64_t>(std::max<int64_t>(
            0, std::chrono::duration_cast<std::chrono::nanoseconds>(arrived_[last] - *op_started_)
                   .count())));
  }
  CountOp(slots[first].op);
  running_ = std::move(plan);
  for (RankOutcome& o : outcomes_) o = RankOutcome{};
  for (RankOutcome& o : outcomes_) {
    o.mask_epoch = mask_epoch_;
    o.num_masked = num_masked_;
  }
  if (StartOpInto(*running_, running_slots_, outcomes_)) FinishOp();
  return true;
}

void LockstepGroup::FinishOp() {
  const OpPlan& plan = *running_;  // Reset at the end.
  const std::vector<abi::RequestSlot>& slots = running_slots_;
  std::vector<RankOutcome>& outcomes = outcomes_;
  const int R = static_cast<int>(slots.size());
  for (RankOutcome& o : outcomes) {
    if (BackendReportsOpMask()) break;  // The group's, across nodes.
    o.mask_epoch = mask_epoch_;
    o.num_masked = num_masked_;
  }
  // One rank's error (e.g. its bad expert ids) in an op that exchanges data makes every
  // rank's output undefined, so every rank gets it.
  if (rules::Describe(plan.op).exchanges_data) {
    int first_bad = -1;
    for (int r = 0; r < R && first_bad < 0; ++r) {
      if (!outcomes[r].status.ok() && !rank_masked_[r]) first_bad = r;
    }
    if (first_bad >= 0) {
      const absl::Status& e = outcomes[first_bad].status;
      for (int r = 0; r < R; ++r) {
        if (outcomes[r].status.ok()) {
          outcomes[r].status = errors::CopyReason(
              e, absl::Status(e.code(), absl::StrCat("rank ", first_bad, ": ", e.message())));
        }
      }
    }
  }
  bool all_ok = true;
  int first_ok_or_bad = local_first_;  // The rank whose outcome a late rank is told.
  for (int r = 0; r < R; ++r) {
    if (rank_masked_[r]) continue;
    all_ok &= outcomes[r].status.ok();
    if (r >= local_first_ && rank_masked_[first_ok_or_bad]) first_ok_or_bad = r;
  }
  if (all_ok) {
    switch (plan.op) {
      case abi::OpKind::kDispatch:
        for (int r = 0; r < R; ++r) {
          LockstepEndpoint* ep = endpoints_[r].get();
          if (!ep || rank_masked_[r]) continue;
          ep->handles.DispatchDone(slots[r].seq, plan.flags & abi::kFlagCachedHandle,
                                   slots[r].num_tokens, outcomes[r].num_recv_tokens,
                                   plan.flags & abi::kFlagFp8);
        }
        break;
      case abi::OpKind::kLowLatencyDispatch:
        ll_dispatch_seq_[plan.ll_buffer] = plan.seq;
        for (int r = 0; r < R; ++r) {
          outcomes[r].buffer = plan.ll_buffer;
          if (LockstepEndpoint* ep = rank_masked_[r] ? nullptr : endpoints_[r].get()) {
            ep->handles.LowLatencyDispatchEnded(slots[r].seq, plan.ll_buffer, slots[r].num_tokens,
                                                /*ok=*/true);
          }
        }
        break;
      case abi::OpKind::kLowLatencyCombine:
        for (int r = 0; r < R; ++r) {
          outcomes[r].buffer = plan.ll_out_buffer;
          outcomes[r].num_recv_tokens = slots[r].num_tokens;  // T, for the client's view.
        }
        break;
      case abi::OpKind::kRegisterProgram:
        // The program's instances overwrite the low-latency buffers: earlier handles die.
        program_armed_ = true;
        for (int b = 0; b < kernels::kLowLatencyBuffers; ++b) ll_dispatch_seq_[b] = 0;
        for (int r = 0; r < R; ++r) {
          if (LockstepEndpoint* ep = endpoints_[r].get()) ep->handles.ClearLowLatency();
        }
        break;
      case abi::OpKind::kUnregisterProgram:
        program_armed_ = false;
        break;
      default:
        break;
    }
  }
  for (int r = 0; r < R; ++r) {
    LockstepEndpoint* ep = endpoints_[r].get();
    if (!ep || !ep->request || ep->request->seq != slots[r].seq) continue;
    WriteCompletion(*ep, slots[r].seq, outcomes[r]);
    RankOpEnded(r, slots[r], outcomes[r], &plan);
    ep->request.reset();
  }
  if (!all_ok) {
    failed_ops_[plan.seq] = outcomes[first_ok_or_bad].status;
    while (failed_ops_.size() > 2 * abi::kRingCapacity) failed_ops_.erase(failed_ops_.begin());
  }
  if (all_ok) {
    for (int r = 0; r < R; ++r) {
      if (!rank_masked_[r]) rejoined_[r] = 0;  // In step: it took part in an op.
    }
  }
  RecordOpMetrics(static_cast<uint32_t>(plan.op),
                  all_ok ? absl::StatusCode::kOk : outcomes[local_first_].status.code(), plan.flags,
                  &slots, &outcomes);
  running_.reset();                              // `plan` dies here.
  for (auto& kept : op_departed_) kept.reset();  // Ranks that left during the op.
  (all_ok ? ops_completed_ : ops_failed_).fetch_add(1);
  ++current_seq_;
  op_started_.reset();
  if (masking_) ApplyPendingMaskLocked();
}

}  // namespace epd
