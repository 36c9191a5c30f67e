// The host backend's data plane: shm endpoints, one engine, group ops by kernels/host.
//
// Ops of a group run in lockstep: every rank's n-th op has sequence number n (a
// rejoining rank continues at the group's next op, EndpointInfo.first_seq). The engine
// collects each rank's request for the group's current op; when all R are there it
// validates them together, runs the op for the whole group and completes it for every
// rank. When the op's first request is older than op_timeout and some rank is missing,
// or a rank leaves, the op fails with DEADLINE_EXCEEDED for every rank, naming the
// missing ranks; a late request for a failed op completes at once with the same error.
#include "daemon/host_data_plane.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/engine.h"
#include "epd/common/status_macros.h"
#include "epd/kernels/host_ops.h"
#include "epd/kernels/layout.h"
#include "shm_abi.h"
#include "shm_region.h"
#include "spdlog/spdlog.h"

namespace epd {
namespace {

using Clock = std::chrono::steady_clock;
using kernels::EndpointLayout;
using kernels::GroupShape;

std::shared_ptr<spdlog::logger> EngineLog() {
  auto l = spdlog::get("epd.engine");
  return l ? l : spdlog::default_logger();
}

GroupShape ShapeOf(const v1::GroupSpec& spec) {
  GroupShape s;
  s.num_ranks = spec.num_ranks();
  s.num_experts = spec.num_experts();
  s.hidden = spec.hidden();
  s.num_topk = spec.num_topk();
  s.max_tokens_per_rank = spec.max_tokens_per_rank();
  s.ll_max_tokens_per_rank = spec.ll_max_tokens_per_rank();
  s.use_fp8 = spec.use_fp8();
  return s;
}

const char* OpName(uint32_t op) {
  switch (static_cast<abi::OpKind>(op)) {
    case abi::OpKind::kGetDispatchLayout: return "GetDispatchLayout";
    case abi::OpKind::kDispatch: return "Dispatch";
    case abi::OpKind::kCombine: return "Combine";
    case abi::OpKind::kLowLatencyDispatch: return "LowLatencyDispatch";
    case abi::OpKind::kLowLatencyCombine: return "LowLatencyCombine";
    default: return "Invalid";
  }
}

/// One attached rank: its shm region and the daemon's view of its ring and handles.
struct HostEndpoint {
  ShmRegion region;
  abi::EndpointShmHeader* header = nullptr;
  uint64_t endpoint_id = 0;
  uint64_t next_seq = 0;                  ///< Seq the next ring slot must carry.
  std::optional<abi::RequestSlot> request;///< Popped, waiting for the group's op.
  std::optional<absl::Status> slot_error; ///< Why `request` was rejected, if it was.
  uint64_t ops_completed = 0;
  // Normal-mode handle state.
  uint64_t routing_seq = 0;               ///< Seq of the dispatch that wrote send_pos.
  uint64_t last_dispatch_seq = 0;         ///< Latest dispatch (cached or not).
  int32_t routing_tokens = 0;             ///< T of the routing dispatch.
  int32_t num_recv_tokens = 0;            ///< N of the routing dispatch.
  bool routing_fp8 = false;
  // Low-latency handle state, per buffer set.
  uint64_t ll_seq[kernels::kLowLatencyBuffers] = {0, 0};
  int32_t ll_tokens[kernels::kLowLatencyBuffers] = {0, 0};

  uint8_t* data() const { return region.data() + header->data_offset; }
  abi::RequestSlot* ring() const {
    return reinterpret_cast<abi::RequestSlot*>(region.data() + header->ring_offset);
  }
  abi::Completion* completions() const {
    return reinterpret_cast<abi::Completion*>(region.data() + header->completion_offset);
  }
};

/// Result of one rank's part of an op.
struct RankOutcome {
  absl::Status status;
  int32_t num_recv_tokens = 0;
  int32_t buffer = 0;
};

void WriteCompletion(HostEndpoint& ep, uint64_t seq, const RankOutcome& outcome) {
  abi::Completion& c = ep.completions()[seq % abi::kCompletionCapacity];
  c.status_code = static_cast<int32_t>(outcome.status.code());
  c.num_recv_tokens = outcome.num_recv_tokens;
  c.buffer = outcome.buffer;
  c.reserved = 0;
  std::string msg(outcome.status.message());
  size_t n = std::min(msg.size(), static_cast<size_t>(abi::kMessageBytes - 1));
  std::memcpy(c.message, msg.data(), n);
  c.message[n] = '\0';
  abi::Atomic(c.seq).store(seq, std::memory_order_release);
  abi::Atomic(ep.header->completion_futex).fetch_add(1, std::memory_order_seq_cst);
  if (abi::Atomic(ep.header->client_waiting).load(std::memory_order_seq_cst) != 0) {
    FutexWakeAll(&ep.header->completion_futex);
  }
  if (outcome.status.ok()) ++ep.ops_completed;
}

class HostGroup;

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
  absl::StatusOr<uint64_t> FreeBytes(const std::string&) const override { return ShmFreeBytes(); }
  absl::StatusOr<std::unique_ptr<DataPlaneGroup>> CreateGroup(const v1::GroupSpec& spec) override;
  void Shutdown() override;

  const HostDataPlaneOptions& options() const { return options_; }
  const std::string& doorbell_name() const { return doorbell_.name(); }
  uint64_t NextEndpointId() { return next_endpoint_id_.fetch_add(1); }
  void Wake() {
    if (engine_) engine_->Wake();
  }
  void Unregister(HostGroup* group);

 private:
  bool PollAll();

  HostDataPlaneOptions options_;
  ShmRegion doorbell_;
  std::unique_ptr<Engine> engine_;
  std::mutex mu_;                         // Guards groups_.
  std::vector<HostGroup*> groups_;
  std::atomic<uint64_t> next_endpoint_id_{1};
  std::atomic<bool> shut_down_{false};
};

class HostGroup : public DataPlaneGroup {
 public:
  HostGroup(HostDataPlaneImpl* plane, const v1::GroupSpec& spec)
      : plane_(plane),
        spec_(spec),
        shape_(ShapeOf(spec)),
        layout_(EndpointLayout::Compute(shape_)),
        endpoints_(spec.num_ranks()) {}
  ~HostGroup() override { plane_->Unregister(this); }

  absl::Status AttachRank(int32_t rank, const std::string& gpu_uuid, v1::LaunchMode launch_mode,
                          v1::EndpointInfo* info) override;
  void DetachRank(int32_t rank) override;
  uint64_t ops_completed() const override { return ops_completed_.load(); }
  uint64_t ops_failed() const override { return ops_failed_.load(); }
  uint64_t rank_ops_completed(int32_t rank) const override {
    std::lock_guard<std::mutex> lock(mu_);
    if (rank < 0 || rank >= static_cast<int32_t>(endpoints_.size()) || !endpoints_[rank]) return 0;
    return endpoints_[rank]->ops_completed;
  }

  /// Engine thread: pops requests, runs or times out the current op. True if it did work.
  bool Poll();
  /// Completes everything pending with `status` (shutdown).
  void FailAll(const absl::Status& status);

 private:
  bool PopRequests();
  void FailOp(const absl::Status& status);
  void RunOp();
  absl::Status ValidateSlot(const HostEndpoint& ep, const abi::RequestSlot& slot) const;
  absl::Status ValidateHandle(const HostEndpoint& ep, const abi::RequestSlot& slot) const;
  std::vector<RankOutcome> Execute(const std::vector<abi::RequestSlot>& slots);
  template <typename T>
  T* Ptr(int rank, const kernels::Region& r) const {
    return reinterpret_cast<T*>(endpoints_[rank]->data() + r.offset);
  }

  HostDataPlaneImpl* plane_;
  v1::GroupSpec spec_;
  GroupShape shape_;
  EndpointLayout layout_;
  mutable std::mutex mu_;  // Guards everything below (engine thread vs control plane).
  std::vector<std::unique_ptr<HostEndpoint>> endpoints_;
  uint64_t current_seq_ = 1;              ///< The group op being collected.
  std::optional<Clock::time_point> op_started_;
  std::map<uint64_t, absl::Status> failed_ops_;  ///< Recent failed ops, for late ranks.
  uint64_t ll_dispatches_ = 0;            ///< Low-latency dispatches so far (buffer parity).
  uint64_t ll_combines_ = 0;
  uint64_t ll_dispatch_seq_[kernels::kLowLatencyBuffers] = {0, 0};
  std::atomic<uint64_t> ops_completed_{0};
  std::atomic<uint64_t> ops_failed_{0};
};

// ---------------------------------------------------------------------------------------

HostDataPlaneImpl::HostDataPlaneImpl(const HostDataPlaneOptions& options) : options_(options) {}

absl::Status HostDataPlaneImpl::Init() {
  EPD_ASSIGN_OR_RETURN(doorbell_, ShmRegion::Create("epd-doorbell", sizeof(abi::DoorbellPage),
                                                    options_.shm_mode, options_.shm_group));
  auto* page = reinterpret_cast<abi::DoorbellPage*>(doorbell_.data());
  page->size = sizeof(abi::DoorbellPage);
  page->magic = abi::kDoorbellMagic;
  page->version = abi::kShmAbiVersion;
  // Wake at least every 20 ms to enforce op timeouts while asleep.
  engine_ = std::make_unique<Engine>(page, options_.engine_idle_us, 20000, [this] { return PollAll(); });
  engine_->Start();
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DataPlaneGroup>> HostDataPlaneImpl::CreateGroup(
    const v1::GroupSpec& spec) {
  if (shut_down_.load()) return absl::UnavailableError("epd is shutting down");
  auto group = std::make_unique<HostGroup>(this, spec);
  {
    std::lock_guard<std::mutex> lock(mu_);
    groups_.push_back(group.get());
  }
  return std::unique_ptr<DataPlaneGroup>(std::move(group));
}

void HostDataPlaneImpl::Unregister(HostGroup* group) {
  std::lock_guard<std::mutex> lock(mu_);
  groups_.erase(std::remove(groups_.begin(), groups_.end(), group), groups_.end());
}

bool HostDataPlaneImpl::PollAll() {
  std::lock_guard<std::mutex> lock(mu_);
  bool worked = false;
  for (HostGroup* g : groups_) worked |= g->Poll();
  return worked;
}

void HostDataPlaneImpl::Shutdown() {
  if (shut_down_.exchange(true)) return;
  if (engine_) engine_->Stop();
  std::lock_guard<std::mutex> lock(mu_);
  for (HostGroup* g : groups_) g->FailAll(absl::UnavailableError("epd is shutting down"));
}

// ---------------------------------------------------------------------------------------

absl::Status HostGroup::AttachRank(int32_t rank, const std::string& /*gpu_uuid*/,
                                   v1::LaunchMode launch_mode, v1::EndpointInfo* info) {
  if (launch_mode == v1::LAUNCH_MODE_CLIENT) {
    return absl::InvalidArgumentError(
        "launch_mode LAUNCH_MODE_CLIENT needs the CUDA backend; the host backend runs every "
        "op in the daemon (use LAUNCH_MODE_DAEMON or leave it unspecified)");
  }
  auto ep = std::make_unique<HostEndpoint>();
  abi::EndpointShmLayout shm = abi::ComputeEndpointShmLayout(layout_.total_bytes);
  EPD_ASSIGN_OR_RETURN(ep->region,
                       ShmRegion::Create("epd-ep", shm.total_bytes, plane_->options().shm_mode,
                                         plane_->options().shm_group));
  ep->header = reinterpret_cast<abi::EndpointShmHeader*>(ep->region.data());
  abi::EndpointShmHeader& h = *ep->header;
  h.size = sizeof(abi::EndpointShmHeader);
  h.magic = abi::kEndpointMagic;
  h.version = abi::kShmAbiVersion;
  h.ring_capacity = abi::kRingCapacity;
  h.completion_capacity = abi::kCompletionCapacity;
  ep->endpoint_id = plane_->NextEndpointId();
  h.endpoint_id = ep->endpoint_id;
  h.ring_offset = shm.ring_offset;
  h.completion_offset = shm.completion_offset;
  h.data_offset = shm.data_offset;
  h.data_bytes = layout_.total_bytes;
  h.total_bytes = shm.total_bytes;

  std::lock_guard<std::mutex> lock(mu_);
  if (endpoints_[rank]) {
    return absl::AlreadyExistsError(absl::StrCat("rank ", rank, " is already attached"));
  }
  ep->next_seq = current_seq_;
  // The ring's head/tail count slots; start them at the first seq - 1 so slot i holds
  // seq i (the client writes slot (head + 1) % capacity... see client/endpoint.cc).
  h.ring_head = current_seq_ - 1;
  h.ring_tail = current_seq_ - 1;
  for (uint32_t i = 0; i < abi::kCompletionCapacity; ++i) ep->completions()[i].seq = 0;

  info->set_group(spec_.name());
  info->set_rank(rank);
  info->set_endpoint_id(ep->endpoint_id);
  info->set_backend("host");
  info->set_shm_name(ep->region.name());
  info->set_shm_bytes(shm.total_bytes);
  info->set_data_offset(shm.data_offset);
  info->set_data_bytes(layout_.total_bytes);
  info->clear_regions();
  layout_.ForEachRegion([&](const char* name, const kernels::Region& r) {
    v1::BufferRegion* br = info->add_regions();
    br->set_name(name);
    br->set_offset(r.offset);
    br->set_bytes(r.bytes);
  });
  info->set_doorbell_shm_name(plane_->doorbell_name());
  info->set_abi_version(abi::kShmAbiVersion);
  info->set_op_timeout_ms(plane_->options().op_timeout_ms);
  info->set_launch_mode(v1::LAUNCH_MODE_DAEMON);
  info->set_first_seq(current_seq_);
  endpoints_[rank] = std::move(ep);
  EngineLog()->info("group {}: rank {} attached (endpoint {}, {} bytes of shm)", spec_.name(),
                    rank, endpoints_[rank]->endpoint_id, shm.total_bytes);
  return absl::OkStatus();
}

void HostGroup::DetachRank(int32_t rank) {
  std::unique_ptr<HostEndpoint> ep;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (rank < 0 || rank >= static_cast<int32_t>(endpoints_.size())) return;
    ep = std::move(endpoints_[rank]);
    if (ep && op_started_) {
      bool arrived = ep->request.has_value();
      if (!arrived) {
        // The op can never complete now: fail it for every rank that is waiting.
        FailOp(absl::DeadlineExceededError(absl::StrCat(
            "op ", current_seq_, " of group ", spec_.name(), ": rank ", rank,
            " left the group before arriving")));
      }
    }
  }
  if (ep) {
    EngineLog()->info("group {}: rank {} detached (endpoint {})", spec_.name(), rank,
                      ep->endpoint_id);
  }
  // ep's shm is unmapped and unlinked here, outside the lock.
}

void HostGroup::FailAll(const absl::Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& ep : endpoints_) {
    if (!ep) continue;
    uint64_t head = abi::Atomic(ep->header->ring_head).load(std::memory_order_acquire);
    // Complete everything already submitted so no client waits on a dead daemon.
    if (ep->request) {
      WriteCompletion(*ep, ep->request->seq, {status});
      ep->request.reset();
    }
    for (uint64_t s = ep->next_seq; s <= head && s < ep->next_seq + abi::kRingCapacity; ++s) {
      WriteCompletion(*ep, s, {status});
    }
  }
}

absl::Status HostGroup::ValidateSlot(const HostEndpoint& ep, const abi::RequestSlot& slot) const {
  // magic and seq were checked when the slot was popped.
  if (slot.op == 0 || slot.op > abi::kMaxOpKind) {
    return absl::InvalidArgumentError(absl::StrCat("malformed request slot: op ", slot.op));
  }
  if ((slot.flags & ~abi::kAllRequestFlags) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed request slot: flags 0x", absl::Hex(slot.flags)));
  }
  if (slot.flags & abi::kFlagClientError) {
    return absl::InvalidArgumentError("the client rejected its own inputs for this op");
  }
  const auto op = static_cast<abi::OpKind>(slot.op);
  const bool ll = op == abi::OpKind::kLowLatencyDispatch || op == abi::OpKind::kLowLatencyCombine;
  const int32_t max_tokens = ll ? shape_.ll_max_tokens_per_rank : shape_.max_tokens_per_rank;
  if (ll && shape_.ll_max_tokens_per_rank == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        OpName(slot.op), " needs spec.ll_max_tokens_per_rank > 0 (group ", spec_.name(), ")"));
  }
  if (slot.num_tokens < 0 || slot.num_tokens > max_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat(OpName(slot.op), ": num_tokens ", slot.num_tokens, " outside [0, ",
                     max_tokens, "] (", ll ? "ll_" : "", "max_tokens_per_rank)"));
  }
  if (op == abi::OpKind::kDispatch) {
    if (slot.expert_alignment < 1 || slot.expert_alignment > (1 << 20)) {
      return absl::InvalidArgumentError(
          absl::StrCat("Dispatch: expert_alignment ", slot.expert_alignment, " outside [1, 2^20]"));
    }
    if ((slot.flags & abi::kFlagFp8) && !shape_.use_fp8) {
      return absl::InvalidArgumentError(
          absl::StrCat("Dispatch: FP8 input but group ", spec_.name(), " has use_fp8 = false"));
    }
  }
  if (op == abi::OpKind::kLowLatencyDispatch && (slot.flags & abi::kFlagFp8) &&
      shape_.hidden % kernels::kFp8BlockChannels != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("LowLatencyDispatch: use_fp8 needs hidden % 128 == 0, hidden = ", shape_.hidden));
  }
  if ((op == abi::OpKind::kLowLatencyDispatch && (slot.flags & abi::kFlagFp8) && !shape_.use_fp8)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LowLatencyDispatch: use_fp8 but group ", spec_.name(), " has use_fp8 = false"));
  }
  return ValidateHandle(ep, slot);
}

absl::Status HostGroup::ValidateHandle(const HostEndpoint& ep, const abi::RequestSlot& slot) const {
  const auto op = static_cast<abi::OpKind>(slot.op);
  const bool uses_routing = op == abi::OpKind::kCombine ||
                            (op == abi::OpKind::kDispatch && (slot.flags & abi::kFlagCachedHandle));
  if (uses_routing) {
    if (ep.routing_seq == 0 || slot.handle_seq < ep.routing_seq ||
        slot.handle_seq > ep.last_dispatch_seq) {
      return absl::FailedPreconditionError(absl::StrCat(
          OpName(slot.op), ": handle of op ", slot.handle_seq,
          " is not the current dispatch routing of this endpoint (valid: ops ", ep.routing_seq,
          "..", ep.last_dispatch_seq, "); a handle is invalidated by the next Dispatch"));
    }
    if (slot.num_tokens != ep.routing_tokens) {
      return absl::InvalidArgumentError(absl::StrCat(OpName(slot.op), ": num_tokens ",
                                                     slot.num_tokens, " != the handle's ",
                                                     ep.routing_tokens));
    }
  }
  if (op == abi::OpKind::kLowLatencyCombine) {
    int found = -1;
    for (int b = 0; b < kernels::kLowLatencyBuffers; ++b) {
      if (ep.ll_seq[b] != 0 && ep.ll_seq[b] == slot.handle_seq) found = b;
    }
    if (found < 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "LowLatencyCombine: handle of op ", slot.handle_seq,
          " is not one of this endpoint's last two low-latency dispatches (its buffers were "
          "reused, or it comes from another endpoint)"));
    }
    if (slot.num_tokens != ep.ll_tokens[found]) {
      return absl::InvalidArgumentError(absl::StrCat("LowLatencyCombine: num_tokens ",
                                                     slot.num_tokens, " != the handle's ",
                                                     ep.ll_tokens[found]));
    }
  }
  return absl::OkStatus();
}

bool HostGroup::PopRequests() {
  bool worked = false;
  for (size_t r = 0; r < endpoints_.size(); ++r) {
    HostEndpoint* ep = endpoints_[r].get();
    if (!ep) continue;
    if (ep->region.linked() &&
        abi::Atomic(ep->header->client_mapped).load(std::memory_order_acquire) != 0) {
      ep->region.Unlink();  // Both sides have it mapped: the name is no longer needed.
    }
    while (!ep->request && ep->next_seq <= current_seq_) {
      uint64_t head = abi::Atomic(ep->header->ring_head).load(std::memory_order_seq_cst);
      uint64_t tail = ep->header->ring_tail;
      if (head == tail) break;
      if (head - tail > abi::kRingCapacity) {
        // Garbage head: treat as one malformed slot so the ring stays usable.
        head = tail + 1;
      }
      abi::RequestSlot slot;
      std::memcpy(&slot, &ep->ring()[(tail + 1) % abi::kRingCapacity], sizeof(slot));
      abi::Atomic(ep->header->ring_tail).store(tail + 1, std::memory_order_release);
      worked = true;
      if (slot.magic != abi::kRequestMagic || slot.seq != ep->next_seq) {
        // Not a request of this endpoint's client (garbage, or a replayed slot): it cannot
        // be attributed to an op, so it is dropped, counted and reported, never executed.
        abi::Atomic(ep->header->rejected_requests).fetch_add(1);
        EngineLog()->warn(
            "group {} rank {}: dropped a malformed ring slot (magic 0x{:x}, seq {}, expected "
            "seq {}); {} dropped so far",
            spec_.name(), r, slot.magic, slot.seq, ep->next_seq,
            abi::Atomic(ep->header->rejected_requests).load());
        continue;
      }
      absl::Status valid = ValidateSlot(*ep, slot);
      uint64_t seq = ep->next_seq++;
      if (!valid.ok()) {
        abi::Atomic(ep->header->rejected_requests).fetch_add(1);
        if (slot.op == 0 || slot.op > abi::kMaxOpKind) slot.op = 0;
        if (!(slot.flags & abi::kFlagClientError)) {
          EngineLog()->warn("group {} rank {}: rejected request {}: {}", spec_.name(), r, seq,
                            std::string(valid.message()));
        }
      }
      if (seq < current_seq_) {
        // This op already failed (timeout) before the rank arrived.
        auto it = failed_ops_.find(seq);
        absl::Status st = it != failed_ops_.end()
                              ? it->second
                              : absl::DeadlineExceededError(absl::StrCat(
                                    "op ", seq, " of group ", spec_.name(),
                                    " failed before this rank arrived"));
        WriteCompletion(*ep, seq, {st});
        continue;
      }
      ep->request = slot;
      if (!valid.ok()) ep->slot_error = valid;
      if (!op_started_) op_started_ = Clock::now();
    }
  }
  return worked;
}

void HostGroup::FailOp(const absl::Status& status) {
  ops_failed_.fetch_add(1);
  for (auto& ep : endpoints_) {
    if (ep && ep->request) {
      WriteCompletion(*ep, ep->request->seq, {status});
      ep->request.reset();
      ep->slot_error.reset();
    }
  }
  failed_ops_[current_seq_] = status;
  while (failed_ops_.size() > 2 * abi::kRingCapacity) failed_ops_.erase(failed_ops_.begin());
  ++current_seq_;
  op_started_.reset();
}

bool HostGroup::Poll() {
  std::lock_guard<std::mutex> lock(mu_);
  bool worked = PopRequests();
  if (!op_started_) return worked;
  std::vector<int32_t> missing;
  for (size_t r = 0; r < endpoints_.size(); ++r) {
    if (!endpoints_[r] || !endpoints_[r]->request) missing.push_back(static_cast<int32_t>(r));
  }
  if (missing.empty()) {
    RunOp();
    return true;
  }
  auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - *op_started_);
  if (waited.count() >= plane_->options().op_timeout_ms) {
    absl::Status st = absl::DeadlineExceededError(
        absl::StrCat("op ", current_seq_, " of group ", spec_.name(), ": rank(s) ",
                     absl::StrJoin(missing, ", "), " did not arrive within op_timeout ",
                     plane_->options().op_timeout_ms, " ms"));
    EngineLog()->warn("{}", std::string(st.message()));
    FailOp(st);
    return true;
  }
  return worked;
}

void HostGroup::RunOp() {
  const int R = static_cast<int>(endpoints_.size());
  std::vector<abi::RequestSlot> slots(R);
  // A rejected slot, or ranks disagreeing on the op, fail the op for every rank.
  for (int r = 0; r < R; ++r) {
    if (endpoints_[r]->slot_error) {
      const absl::Status& e = *endpoints_[r]->slot_error;
      FailOp(absl::Status(e.code(), absl::StrCat("rank ", r, ": ", e.message())));
      return;
    }
    slots[r] = *endpoints_[r]->request;
  }
  for (int r = 1; r < R; ++r) {
    bool same_flags = ((slots[r].flags ^ slots[0].flags) &
                       (abi::kFlagFp8 | abi::kFlagCachedHandle | abi::kFlagCombineWeights |
                        abi::kFlagDispatchWeights | abi::kFlagRoundScale)) == 0;
    if (slots[r].op != slots[0].op || !same_flags ||
        (slots[0].op == static_cast<uint32_t>(abi::OpKind::kDispatch) &&
         slots[r].expert_alignment != slots[0].expert_alignment)) {
      FailOp(absl::InvalidArgumentError(absl::StrCat(
          "op ", current_seq_, " of group ", spec_.name(), ": ranks disagree: rank 0 submitted ",
          OpName(slots[0].op), " (flags 0x", absl::Hex(slots[0].flags), "), rank ", r,
          " submitted ", OpName(slots[r].op), " (flags 0x", absl::Hex(slots[r].flags), ")")));
      return;
    }
  }
  std::vector<RankOutcome> outcomes = Execute(slots);
  bool all_ok = true;
  for (int r = 0; r < R; ++r) {
    WriteCompletion(*endpoints_[r], slots[r].seq, outcomes[r]);
    endpoints_[r]->request.reset();
    all_ok &= outcomes[r].status.ok();
  }
  (all_ok ? ops_completed_ : ops_failed_).fetch_add(1);
  ++current_seq_;
  op_started_.reset();
}

std::vector<RankOutcome> HostGroup::Execute(const std::vector<abi::RequestSlot>& slots) {
  const int R = static_cast<int>(slots.size());
  const auto op = static_cast<abi::OpKind>(slots[0].op);
  const uint32_t flags = slots[0].flags;
  kernels::host::HostExecution exec{plane_->options().host_threads};
  std::vector<RankOutcome> out(R);
  auto fail_all = [&](const absl::Status& st) {
    for (auto& o : out) o.status = st;
    return out;
  };
  const EndpointLayout& L = layout_;
  switch (op) {
    case abi::OpKind::kGetDispatchLayout: {
      for (int r = 0; r < R; ++r) {
        kernels::host::LayoutRankArgs a;
        a.num_tokens = slots[r].num_tokens;
        a.topk_idx = Ptr<const int64_t>(r, L.in_topk_idx);
        a.num_tokens_per_rank = Ptr<int32_t>(r, L.layout_tokens_per_rank);
        a.num_tokens_per_expert = Ptr<int32_t>(r, L.layout_tokens_per_expert);
        a.is_token_in_rank = Ptr<uint8_t>(r, L.layout_is_token_in_rank);
        out[r].status = kernels::host::CheckTopkIdx(shape_, r, a.num_tokens, a.topk_idx);
        if (out[r].status.ok()) out[r].status = kernels::host::GetDispatchLayout(shape_, a);
      }
      return out;
    }
    case abi::OpKind::kDispatch: {
      const bool cached = flags & abi::kFlagCachedHandle;
      const bool fp8 = flags & abi::kFlagFp8;
      std::vector<kernels::host::DispatchRankArgs> args(R);
      for (int r = 0; r < R; ++r) {
        auto& a = args[r];
        HostEndpoint& ep = *endpoints_[r];
        a.num_tokens = slots[r].num_tokens;
        a.x = Ptr<const void>(r, L.in_x);
        a.x_scales = fp8 ? Ptr<const float>(r, L.in_scales) : nullptr;
        a.topk_idx = cached ? nullptr : Ptr<const int64_t>(r, L.in_topk_idx);
        a.topk_weights =
            (flags & abi::kFlagDispatchWeights) ? Ptr<const float>(r, L.in_topk_weights) : nullptr;
        if (cached) {
          a.cached_send_pos = Ptr<const int32_t>(r, L.send_pos);
          a.cached_num_recv_tokens = ep.num_recv_tokens;
        }
        a.recv_capacity = shape_.max_recv_tokens();
        a.recv_x = Ptr<void>(r, L.recv_x);
        a.recv_scales = fp8 ? Ptr<float>(r, L.recv_scales) : nullptr;
        a.recv_topk_idx = Ptr<int64_t>(r, L.recv_topk_idx);
        a.recv_topk_weights = a.topk_weights ? Ptr<float>(r, L.recv_topk_weights) : nullptr;
        a.recv_tokens_per_expert = Ptr<int32_t>(r, L.recv_tokens_per_expert);
        a.recv_src_info = Ptr<int32_t>(r, L.recv_src_info);
        a.send_pos = Ptr<int32_t>(r, L.send_pos);
        a.rank_prefix = Ptr<int32_t>(r, L.rank_prefix);
        if (!cached) {
          absl::Status st = kernels::host::CheckTopkIdx(shape_, r, a.num_tokens, a.topk_idx);
          if (!st.ok()) return fail_all(st);
        }
      }
      kernels::host::DispatchOptions opt;
      opt.fp8 = fp8;
      opt.expert_alignment = slots[0].expert_alignment;
      absl::Status st = kernels::host::Dispatch(shape_, opt, args, exec);
      if (!st.ok()) return fail_all(st);
      for (int r = 0; r < R; ++r) {
        HostEndpoint& ep = *endpoints_[r];
        *Ptr<int32_t>(r, L.recv_count) = args[r].num_recv_tokens;
        if (!cached) {
          ep.routing_seq = slots[r].seq;
          ep.routing_tokens = slots[r].num_tokens;
          ep.num_recv_tokens = args[r].num_recv_tokens;
          ep.routing_fp8 = fp8;
        }
        ep.last_dispatch_seq = slots[r].seq;
        out[r].num_recv_tokens = args[r].num_recv_tokens;
      }
      return out;
    }
    case abi::OpKind::kCombine: {
      const bool weights = flags & abi::kFlagCombineWeights;
      std::vector<kernels::host::CombineRankArgs> args(R);
      for (int r = 0; r < R; ++r) {
        auto& a = args[r];
        HostEndpoint& ep = *endpoints_[r];
        a.num_tokens = ep.routing_tokens;
        a.send_pos = Ptr<const int32_t>(r, L.send_pos);
        a.num_recv_tokens = ep.num_recv_tokens;
        a.x = Ptr<const kernels::bf16_bits>(r, L.in_combine_x);
        a.topk_weights = weights ? Ptr<const float>(r, L.in_combine_weights) : nullptr;
        a.combined_x = Ptr<kernels::bf16_bits>(r, L.combined_x);
        a.combined_topk_weights = weights ? Ptr<float>(r, L.combined_topk_weights) : nullptr;
      }
      absl::Status st = kernels::host::Combine(shape_, args, exec);
      if (!st.ok()) return fail_all(st);
      return out;
    }
    case abi::OpKind::kLowLatencyDispatch: {
      const int b = static_cast<int>(ll_dispatches_ % kernels::kLowLatencyBuffers);
      std::vector<kernels::host::LowLatencyDispatchRankArgs> args(R);
      for (int r = 0; r < R; ++r) {
        auto& a = args[r];
        a.num_tokens = slots[r].num_tokens;
        a.x = Ptr<const kernels::bf16_bits>(r, L.in_x);
        a.topk_idx = Ptr<const int64_t>(r, L.in_topk_idx);
        a.recv_x = Ptr<void>(r, L.ll_recv_x[b]);
        a.recv_scales = (flags & abi::kFlagFp8) ? Ptr<float>(r, L.ll_recv_scales[b]) : nullptr;
        a.recv_count = Ptr<int32_t>(r, L.ll_recv_count[b]);
        a.recv_src_info = Ptr<int32_t>(r, L.ll_recv_src_info[b]);
        a.handle_pos = Ptr<int32_t>(r, L.ll_handle_pos[b]);
        absl::Status st = kernels::host::CheckTopkIdx(shape_, r, a.num_tokens, a.topk_idx);
        if (!st.ok()) return fail_all(st);
      }
      kernels::host::LowLatencyDispatchOptions opt;
      opt.use_fp8 = flags & abi::kFlagFp8;
      opt.round_scale = flags & abi::kFlagRoundScale;
      absl::Status st = kernels::host::LowLatencyDispatch(shape_, opt, args, exec);
      if (!st.ok()) return fail_all(st);
      ll_dispatch_seq_[b] = slots[0].seq;
      for (int r = 0; r < R; ++r) {
        endpoints_[r]->ll_seq[b] = slots[r].seq;
        endpoints_[r]->ll_tokens[b] = slots[r].num_tokens;
      }
      ++ll_dispatches_;
      for (auto& o : out) o.buffer = b;
      return out;
    }
    case abi::OpKind::kLowLatencyCombine: {
      int hb = 0;
      for (int b = 0; b < kernels::kLowLatencyBuffers; ++b) {
        if (ll_dispatch_seq_[b] == slots[0].handle_seq) hb = b;
      }
      const int ob = static_cast<int>(ll_combines_ % kernels::kLowLatencyBuffers);
      std::vector<kernels::host::LowLatencyCombineRankArgs> args(R);
      for (int r = 0; r < R; ++r) {
        if (slots[r].handle_seq != slots[0].handle_seq) {
          return fail_all(absl::InvalidArgumentError(absl::StrCat(
              "LowLatencyCombine: ranks disagree on the dispatch: rank 0 uses op ",
              slots[0].handle_seq, ", rank ", r, " uses op ", slots[r].handle_seq)));
        }
        auto& a = args[r];
        a.num_tokens = slots[r].num_tokens;
        a.topk_idx = Ptr<const int64_t>(r, L.in_topk_idx);
        a.topk_weights = Ptr<const float>(r, L.in_topk_weights);
        a.handle_pos = Ptr<const int32_t>(r, L.ll_handle_pos[hb]);
        a.x = Ptr<const kernels::bf16_bits>(r, L.in_ll_combine_x);
        a.combined_x = Ptr<kernels::bf16_bits>(r, L.ll_combined_x[ob]);
        absl::Status st = kernels::host::CheckTopkIdx(shape_, r, a.num_tokens, a.topk_idx);
        if (!st.ok()) return fail_all(st);
      }
      absl::Status st = kernels::host::LowLatencyCombine(shape_, args, exec);
      if (!st.ok()) return fail_all(st);
      ++ll_combines_;
      for (int r = 0; r < R; ++r) {
        out[r].buffer = ob;
        out[r].num_recv_tokens = slots[r].num_tokens;  // T, for the client's view shape.
      }
      return out;
    }
    default:
      return fail_all(absl::InternalError("unreachable op kind"));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataPlane>> MakeHostDataPlane(
    const HostDataPlaneOptions& options) {
  auto plane = std::make_unique<HostDataPlaneImpl>(options);
  EPD_RETURN_IF_ERROR(plane->Init());
  return std::unique_ptr<DataPlane>(std::move(plane));
}

}  // namespace epd
