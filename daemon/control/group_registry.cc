#include "daemon/control/group_registry.h"

#include <algorithm>
#include <mutex>
#include <random>
#include <span>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "daemon/control/spec_validation.h"
#include "daemon/core/fd_limits.h"
#include "daemon/core/logging.h"
#include "daemon/peer/grpc_peer_mesh.h"
#include "daemon/transport/transport_set.h"

namespace epd {
namespace {

/// 128 bits from the kernel's CSPRNG (std::random_device reads /dev/urandom on Linux): a
/// session id is a capability (Join and Leave in that session's name), so it must not be
/// predictable from others.
std::string NewSessionId() {
  static std::mutex mu;
  static std::random_device device;
  std::lock_guard<std::mutex> lock(mu);
  return absl::StrFormat("%08x%08x%08x%08x", device(), device(), device(), device());
}

/// The answer about a group that does not exist or that `uid` may not see: the same for
/// both, so that it tells nothing about other users' groups.
absl::Status NoSuchGroup(const std::string& group, uint32_t uid) {
  return errors::WithReason(
      absl::NotFoundError(absl::StrCat("group: \"", EscapeClientText(group),
                                       "\" does not exist among the groups uid ", uid,
                                       " may see (its own and those it holds a rank of)")),
      errors::Reason::kGroupNotFound);
}

/// UNAVAILABLE while epd shuts down.
absl::Status Draining(absl::string_view message) {
  return errors::WithReason(absl::UnavailableError(message), errors::Reason::kDaemonDraining);
}

absl::Status NotAnOpenSession(const std::string& session_id) {
  return errors::WithReason(
      absl::FailedPreconditionError(absl::StrCat("session_id: \"", EscapeClientText(session_id),
                                                 "\" is not an open session of this daemon")),
      errors::Reason::kSessionInvalid);
}

}  // namespace

GroupRegistry::GroupRegistry(DataPlane* data_plane, GpuInventory inventory, Options options)
    : data_plane_(data_plane),
      inventory_(std::move(inventory)),
      options_(options),
      quotas_{options.max_groups, options.max_groups_per_uid, options.max_endpoints_per_uid,
              options.max_endpoint_bytes_per_uid, options.max_sessions_per_uid} {}

GroupRegistry::~GroupRegistry() {
  ReleaseAll();
  std::list<EndpointsWaiter> left;
  {
    absl::MutexLock lock(&mu_);
    stop_waiters_ = true;
    waiters_changed_.SignalAll();
  }
  if (waiter_thread_.joinable()) waiter_thread_.join();
  {
    absl::MutexLock lock(&mu_);
    left.swap(waiters_);
  }
  for (EndpointsWaiter& w : left) w.done(Draining("epd is shutting down"));
}

absl::StatusOr<std::string> GroupRegistry::OpenSession(const PeerCredentials& peer,
                                                       const std::string& client_name) {
  absl::MutexLock lock(&mu_);
  if (draining_) return Draining("epd is shutting down; no new sessions");
  if (quotas_.max_sessions_per_uid != 0) {
    const Usage usage = UsageOfLocked(peer.uid);
    if (usage.sessions >= quotas_.max_sessions_per_uid) {
      return errors::WithReason(
          absl::ResourceExhaustedError(absl::StrCat(
              "max_sessions_per_uid: uid ", peer.uid, " has ", usage.sessions,
              " open sessions, the quota is ", quotas_.max_sessions_per_uid,
              "; a new session would be one more (end other sessions of this uid first, or raise "
              "the quota in the DaemonConfig)")),
          errors::Reason::kQuotaExceeded);
    }
  }
  std::string id = NewSessionId();
  Session& session = sessions_[id];
  session.peer = peer;
  // Kept only for log lines: escaped and capped once (a client may send any bytes, up to
  // max_request_bytes of them).
  session.client_name = EscapeClientText(client_name);
  session.opened = absl::Now();
  LogLimited(*GetLogger(kLogRegistry), spdlog::level::info, *ControlLogBudgetLocked(peer.uid),
             "its sessions", "session {} opened ({}, name \"{}\")", id, DescribeCredentials(peer),
             session.client_name);
  return id;
}

absl::StatusOr<PeerCredentials> GroupRegistry::SessionCredentials(
    const std::string& session_id) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return NotAnOpenSession(session_id);
  return it->second.peer;
}

absl::Status GroupRegistry::CheckSessionCaller(const std::string& session_id,
                                               const PeerCredentials& caller) const {
  absl::MutexLock lock(&mu_);
  return CheckSessionCallerLocked(session_id, caller);
}

absl::Status GroupRegistry::CheckSessionCallerLocked(const std::string& session_id,
                                                     const PeerCredentials& caller) const {
  auto session = sessions_.find(session_id);
  if (session == sessions_.end()) return NotAnOpenSession(session_id);
  if (session->second.peer.uid != caller.uid) {
    return errors::WithReason(
        absl::PermissionDeniedError(
            absl::StrCat("session_id: session ", RedactSessionId(session_id), " was opened by uid ",
                         session->second.peer.uid, ", not by the caller's uid ", caller.uid,
                         " (a session acts only for the user that opened it)")),
        errors::Reason::kNotGroupOwner);
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> GroupRegistry::AuthorizeEndpoint(const std::string& session_id,
                                                          const std::string& group, int32_t rank,
                                                          const PeerCredentials& peer) const {
  absl::MutexLock lock(&mu_);
  EPD_RETURN_IF_ERROR(CheckSessionCallerLocked(session_id, peer));
  auto group_it = groups_.find(group);
  if (group_it != groups_.end()) {
    auto slot = group_it->second.ranks.find(rank);
    if (slot != group_it->second.ranks.end() && slot->second.session_id == session_id) {
      return slot->second.endpoint_id;
    }
  }
  return errors::WithReason(absl::PermissionDeniedError(absl::StrCat(
                                "session ", RedactSessionId(session_id), " does not hold rank ",
                                rank, " of group \"", EscapeClientText(group), "\"")),
                            errors::Reason::kNotGroupOwner);
}

absl::StatusOr<EndpointFds> GroupRegistry::TakeEndpointFds(const std::string& session_id,
                                                           const std::string& group, int32_t rank,
                                                           const PeerCredentials& peer) {
  EPD_ASSIGN_OR_RETURN(const uint64_t endpoint_id,
                       AuthorizeEndpoint(session_id, group, rank, peer));
  absl::MutexLock lock(&mu_);
  if (draining_) return Draining("epd is shutting down");
  // The rank may have been released, or released and joined again, since the check.
  auto group_it = groups_.find(group);
  RankSlot* slot = nullptr;
  if (group_it != groups_.end()) {
    auto it = group_it->second.ranks.find(rank);
    if (it != group_it->second.ranks.end()) slot = &it->second;
  }
  if (slot == nullptr || slot->session_id != session_id || slot->endpoint_id != endpoint_id) {
    return errors::WithReason(
        absl::NotFoundError(absl::StrCat("rank ", rank, " of group \"", EscapeClientText(group),
                                         "\" was released while its descriptors were asked for")),
        errors::Reason::kGroupNotFound);
  }
  EPD_ASSIGN_OR_RETURN(EndpointFds fds, group_it->second.data->TakeEndpointFds(rank));
  if (fds.endpoint_id != endpoint_id) {
    return absl::InternalError(absl::StrCat("rank ", rank, " of group \"", group,
                                            "\": the data plane handed endpoint ", fds.endpoint_id,
                                            " for endpoint ", endpoint_id));
  }
  slot->mapped = true;
  return fds;
}

int GroupRegistry::CloseSession(const std::string& session_id, absl::string_view why) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return 0;
  std::set<std::pair<std::string, int32_t>> endpoints = it->second.endpoints;
  std::vector<std::string> released;
  for (const auto& [group, rank] : endpoints) {
    ReleaseRankLocked(group, rank, why);
    released.push_back(absl::StrCat(group, "/", rank));
  }
  LogLimited(
      *GetLogger(kLogRegistry), spdlog::level::info, *ControlLogBudgetLocked(it->second.peer.uid),
      "its sessions",
      "session {} ({}, name \"{}\") ended ({}) after {}: released {} endpoint(s){}{}", session_id,
      DescribeCredentials(it->second.peer), it->second.client_name, why,
      absl::FormatDuration(absl::Trunc(absl::Now() - it->second.opened, absl::Milliseconds(1))),
      released.size(), released.empty() ? "" : ": ", absl::StrJoin(released, ", "));
  sessions_.erase(session_id);
  NotifyWaitersLocked();
  return static_cast<int>(released.size());
}

absl::StatusOr<std::string> GroupRegistry::ResolveGpu(const std::string& gpu_uuid) const {
  if (gpu_uuid.empty()) {
    if (data_plane_->backend_name() == "host") return std::string();
    return errors::WithReason(
        absl::InvalidArgumentError(
            absl::StrCat("gpu_uuid: \"\" but the ", data_plane_->backend_name(),
                         " backend needs the GPU's UUID or PCI bus id (e.g. from nvidia-smi -L)")),
        errors::Reason::kGpuNotFound);
  }
  // The inventory's error echoes the id: refuse one that is no id at all first, with the
  // id escaped and capped (UUIDs are 40 bytes, MIG UUIDs about 60, PCI bus ids 16).
  if (gpu_uuid.size() > kMaxEchoedClientBytes ||
      !std::all_of(gpu_uuid.begin(), gpu_uuid.end(),
                   [](char c) { return c > ' ' && c < 0x7f && c != '"' && c != '\\'; })) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(
            "gpu_uuid: \"", EscapeClientText(gpu_uuid), "\" (", gpu_uuid.size(),
            " bytes) is not a GPU UUID or PCI bus id (e.g. GPU-<uuid> from nvidia-smi -L)")),
        errors::Reason::kGpuNotFound);
  }
  EPD_ASSIGN_OR_RETURN(v1::GpuInfo gpu, inventory_.Find(gpu_uuid));
  return gpu.uuid();
}

namespace {

/// a + b, or the largest uint64_t when that overflows.
uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  return a > ~uint64_t{0} - b ? ~uint64_t{0} : a + b;
}

}  // namespace

absl::Status GroupRegistry::CheckRankIsOnThisNode(const v1::GroupSpec& spec, int32_t rank) const {
  if (!SpansNodes(spec)) return absl::OkStatus();
  if (options_.peer_mesh == nullptr) {
    return errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            "group \"", spec.name(), "\" spans ", spec.nodes_size(),
            " nodes, but this epd has no Peer listener (peer_listen is not set): start every "
            "node's epd with --peer_listen=host:port and --peer_secret_file (docs/MULTINODE.md)")),
        errors::Reason::kNodesInvalid);
  }
  EPD_RETURN_IF_ERROR(ValidateRank(spec, rank));
  int32_t first = 0;
  const int32_t node = NodeOfRank(spec, rank, &first);
  const std::string self = options_.peer_mesh->advertised_address();
  const std::string& address = spec.nodes(node).peer_address();
  if (address != self) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(
            "rank ", rank, " of group \"", spec.name(), "\" lives on node ", node, " (", address,
            ", ", peer::RankRangeText(first, spec.nodes(node).num_ranks()),
            "), not on this daemon (", self,
            "): join it at that node's epd, or fix spec.nodes (each node's peer_address as its "
            "epd advertises it, GetStats.peer_address)")),
        errors::Reason::kRankInvalid);
  }
  if (options_.transports != nullptr) {
    EPD_RETURN_IF_ERROR(options_.transports->Find(spec.transport(), spec.name()).status());
  }
  return absl::OkStatus();
}

v1::GroupSpec GroupRegistry::SpecAsLive(const v1::GroupSpec& live,
                                        const v1::GroupSpec& requested) const {
  // The transport is compared as this daemon resolves it (as the nodes compare it): ""
  // and this daemon's default name the same one.
  if (options_.transports == nullptr || live.transport() == requested.transport() ||
      options_.transports->Resolve(live.transport()) !=
          options_.transports->Resolve(requested.transport())) {
    return requested;
  }
  v1::GroupSpec same = requested;
  same.set_transport(live.transport());
  return same;
}

absl::StatusOr<v1::EndpointInfo> GroupRegistry::Join(const v1::JoinGroupRequest& request) {
  const v1::GroupSpec& spec = request.spec();
  const int32_t rank = request.rank();
  EPD_RETURN_IF_ERROR(ValidateGroupSpec(spec));
  EPD_RETURN_IF_ERROR(ValidateGroupSpecForBackend(spec, data_plane_->backend_name()));
  // The launch mode's part of the policy check follows, once the group's mode is known.
  EPD_RETURN_IF_ERROR(CheckRankFailurePolicy(spec, data_plane_->backend_name()));
  EPD_RETURN_IF_ERROR(CheckRankIsOnThisNode(spec, rank));
  if (!v1::LaunchMode_IsValid(request.launch_mode())) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  "launch_mode: ", request.launch_mode(), " is not a LaunchMode")),
                              errors::Reason::kInvalidArgument);
  }
  if (request.session_id().empty()) {
    return absl::InvalidArgumentError(
        "session_id: \"\"; open a Session first and pass its id (Client::Connect does)");
  }
  if (request.join_secret().size() > kMaxJoinSecretBytes) {
    return absl::InvalidArgumentError(absl::StrCat("join_secret: ", request.join_secret().size(),
                                                   " bytes; at most ", kMaxJoinSecretBytes));
  }
  EPD_ASSIGN_OR_RETURN(std::string gpu_uuid, ResolveGpu(request.gpu_uuid()));
  // An endpoint holds descriptors until its client maps it: refuse joins before the
  // listener and gRPC run short of them.
  EPD_RETURN_IF_ERROR(CheckFreeFds(options_.min_free_fds, "JoinGroup"));

  absl::MutexLock lock(&mu_);
  if (draining_) return Draining("epd is shutting down; joins are refused");
  auto session = sessions_.find(request.session_id());
  if (session == sessions_.end()) {
    return NotAnOpenSession(request.session_id());
  }
  const PeerCredentials& joiner = session->second.peer;
  auto group_it = groups_.find(spec.name());
  if (group_it != groups_.end()) {
    // Before anything of the group is compared or reported: a joiner that may not join
    // learns nothing of its spec, launch mode or ranks.
    EPD_RETURN_IF_ERROR(AuthorizeJoin(group_it->second, rank, joiner, request.join_secret()));
    EPD_RETURN_IF_ERROR(
        CheckSameSpec(group_it->second.spec, SpecAsLive(group_it->second.spec, spec)));
  }
  EPD_RETURN_IF_ERROR(ValidateRank(spec, rank));
  // The group's launch mode: fixed by its first joiner (UNSPECIFIED = the data plane's
  // default for the spec).
  const v1::LaunchMode requested = request.launch_mode();
  v1::LaunchMode mode =
      requested == v1::LAUNCH_MODE_UNSPECIFIED ? data_plane_->DefaultLaunchMode(spec) : requested;
  if (group_it != groups_.end()) {
    const v1::LaunchMode live = group_it->second.launch_mode;
    if (requested != v1::LAUNCH_MODE_UNSPECIFIED && requested != live) {
      return errors::WithReason(
          absl::FailedPreconditionError(absl::StrCat(
              "launch_mode: rank ", rank, " asks for ", v1::LaunchMode_Name(requested),
              " but group \"", spec.name(), "\" runs ", v1::LaunchMode_Name(live),
              " (fixed by its first joiner; every rank of a group uses the same launch mode)")),
          errors::Reason::kSpecMismatch);
    }
    mode = live;
  }
  EPD_RETURN_IF_ERROR(CheckRankFailurePolicy(spec, data_plane_->backend_name(), mode));
  if (mode == v1::LAUNCH_MODE_CLIENT && data_plane_->backend_name() == "host") {
    return errors::WithReason(
        absl::FailedPreconditionError(
            "launch_mode: LAUNCH_MODE_CLIENT: client-launched mode needs the CUDA backend; this "
            "epd runs the host backend (use LAUNCH_MODE_DAEMON or leave it unspecified)"),
        errors::Reason::kUnsupported);
  }
  if (group_it != groups_.end()) {
    auto held = group_it->second.ranks.find(rank);
    if (held != group_it->second.ranks.end()) {
      return errors::WithReason(
          absl::AlreadyExistsError(absl::StrCat(
              "rank ", rank, " of group \"", spec.name(), "\" is held by session ",
              RedactSessionId(held->second.session_id), " (pid ", held->second.peer.pid, ")")),
          errors::Reason::kRankTaken);
    }
  }
  const bool creates = group_it == groups_.end();
  if (creates && drained_) {
    return errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            "group: \"", EscapeClientText(spec.name()),
            "\" would be a new group, and this epd is drained (`epctl drain`): it serves its "
            "live groups but creates none; start the group on another node, or wait for "
            "`epctl undrain`")),
        errors::Reason::kDaemonDrained);
  }
  const uint64_t bytes_needed = data_plane_->BytesPerRank(spec);
  // A join that creates the group is charged the group's private memory too.
  const uint64_t group_bytes = creates ? data_plane_->GroupPrivateBytes(spec) : 0;
  EPD_RETURN_IF_ERROR(CheckQuotasLocked(joiner.uid, spec.name(), rank, creates,
                                        SaturatingAdd(bytes_needed, group_bytes)));
  if (creates && groups_.size() >= quotas_.max_groups) {
    return errors::WithReason(absl::ResourceExhaustedError(absl::StrCat(
                                  "max_groups: ", quotas_.max_groups, " groups are live; group \"",
                                  spec.name(), "\" cannot be created")),
                              errors::Reason::kQuotaExceeded);
  }

  EPD_ASSIGN_OR_RETURN(uint64_t bytes_free, data_plane_->FreeBytes(gpu_uuid));
  if (group_bytes > bytes_free || bytes_needed > bytes_free - group_bytes) {
    return errors::WithReason(
        absl::ResourceExhaustedError(absl::StrFormat(
            "group \"%s\" needs %d bytes of epd's private memory (kernel scratch and routing "
            "state for %d ranks) plus %d bytes for rank %d's endpoint, but %s has %d bytes free; "
            "lower num_ranks, max_tokens_per_rank, ll_max_tokens_per_rank or hidden, or free "
            "memory",
            spec.name(), group_bytes, spec.num_ranks(), bytes_needed, rank,
            gpu_uuid.empty() ? std::string("host memory (host backend)") : gpu_uuid, bytes_free)),
        errors::Reason::kGpuOutOfMemory);
  }
  EPD_RETURN_IF_ERROR(
      CheckBuffersFit(spec, bytes_needed, bytes_free,
                      gpu_uuid.empty() ? std::string("host memory (host backend)") : gpu_uuid));

  bool created = false;
  if (creates) {
    EPD_ASSIGN_OR_RETURN(std::unique_ptr<DataPlaneGroup> data,
                         data_plane_->CreateGroup(spec, GroupCreateOptions{request.join_secret()}));
    group_it = groups_.try_emplace(spec.name()).first;
    Group& group = group_it->second;
    group.spec = spec;
    group.data = std::move(data);
    group.bytes_per_rank = bytes_needed;
    group.private_bytes = group_bytes;
    group.launch_mode = mode;
    group.owner_uid = joiner.uid;
    group.join_secret.Set(request.join_secret());
    created = true;
    GetLogger(kLogRegistry)
        ->info("group created: {} ({} bytes per rank), owner uid {}, {}", SpecSummary(spec),
               bytes_needed, joiner.uid,
               group.join_secret.set() ? "with a join secret"
                                       : "no join secret (only its owner's uid may join)");
  }
  v1::EndpointInfo info;
  absl::Status attached = group_it->second.data->AttachRank(
      rank, gpu_uuid, mode, RankClient{joiner.uid, LogBudgetLocked(joiner.uid)}, &info);
  if (!attached.ok()) {
    if (created) {
      groups_.erase(group_it);
      GetLogger(kLogRegistry)->info("group \"{}\" destroyed: its first join failed", spec.name());
    }
    return attached;
  }
  RankSlot& slot = group_it->second.ranks[rank];
  slot.gpu_uuid = gpu_uuid;
  slot.session_id = request.session_id();
  slot.peer = session->second.peer;
  slot.endpoint_id = info.endpoint_id();
  slot.cuda_ipc_handle = info.cuda_ipc_handle();
  slot.joined = absl::Now();
  info.set_launch_mode(mode);
  if (created) {
    Audit(options_.audit_log,
          {audit::kGroupCreate, joiner, spec.name(), -1, absl::OkStatus(),
           absl::StrCat(SpecSummary(spec), ", ", bytes_needed, " bytes per rank",
                        group_it->second.join_secret.set() ? ", join secret set" : "")});
  }
  session->second.endpoints.emplace(spec.name(), rank);
  NotifyWaitersLocked();
  LogLimited(*GetLogger(kLogRegistry), spdlog::level::info, *ControlLogBudgetLocked(slot.peer.uid),
             "its joins", "rank {} of group \"{}\" joined by session {} ({}){}{}", rank,
             spec.name(), request.session_id(), DescribeCredentials(slot.peer),
             gpu_uuid.empty() ? "" : " on ", gpu_uuid);
  return info;
}

absl::Status GroupRegistry::Leave(const v1::LeaveGroupRequest& request) {
  absl::MutexLock lock(&mu_);
  auto session = sessions_.find(request.session_id());
  if (session == sessions_.end()) return NotAnOpenSession(request.session_id());
  const uint32_t uid = session->second.peer.uid;
  auto group_it = groups_.find(request.group());
  if (group_it == groups_.end() || !VisibleLocked(group_it->second, uid)) {
    return NoSuchGroup(request.group(), uid);
  }
  auto slot = group_it->second.ranks.find(request.rank());
  if (slot == group_it->second.ranks.end()) {
    return errors::WithReason(
        absl::NotFoundError(absl::StrCat("rank: ", request.rank(), " of group \"", request.group(),
                                         "\" is not joined")),
        errors::Reason::kGroupNotFound);
  }
  if (slot->second.session_id != request.session_id()) {
    return errors::WithReason(
        absl::PermissionDeniedError(
            absl::StrCat("session_id: \"", EscapeClientText(request.session_id()),
                         "\" does not hold rank ", request.rank(), " of group \"", request.group(),
                         "\" (session ", RedactSessionId(slot->second.session_id), " does)")),
        errors::Reason::kNotGroupOwner);
  }
  session->second.endpoints.erase({request.group(), request.rank()});
  ReleaseRankLocked(request.group(), request.rank(), "LeaveGroup");
  NotifyWaitersLocked();
  return absl::OkStatus();
}

absl::StatusOr<DataPlaneGroup*> GroupRegistry::HeldGroupLocked(const std::string& session_id,
                                                               const std::string& group,
                                                               int32_t rank) const {
  auto session = sessions_.find(session_id);
  if (session == sessions_.end()) return NotAnOpenSession(session_id);
  const uint32_t uid = session->second.peer.uid;
  auto group_it = groups_.find(group);
  if (group_it == groups_.end() || !VisibleLocked(group_it->second, uid)) {
    return NoSuchGroup(group, uid);
  }
  auto slot = group_it->second.ranks.find(rank);
  if (slot == group_it->second.ranks.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank: ", rank, " of group \"", group, "\" is not joined"));
  }
  if (slot->second.session_id != session_id) {
    return absl::PermissionDeniedError(absl::StrCat(
        "session_id: \"", EscapeClientText(session_id), "\" does not hold rank ", rank,
        " of group \"", group, "\" (session ", RedactSessionId(slot->second.session_id), " does)"));
  }
  return group_it->second.data.get();
}

absl::StatusOr<v1::RankMask> GroupRegistry::UpdateRankMask(
    const v1::UpdateRankMaskRequest& request) {
  absl::MutexLock lock(&mu_);
  EPD_ASSIGN_OR_RETURN(DataPlaneGroup * group,
                       HeldGroupLocked(request.session_id(), request.group(), request.rank()));
  return group->UpdateRankMask(
      std::span<const int32_t>(request.mask().data(), static_cast<size_t>(request.mask_size())),
      std::span<const int32_t>(request.unmask().data(), static_cast<size_t>(request.unmask_size())),
      request.clean());
}

absl::StatusOr<v1::RankMask> GroupRegistry::GetRankMask(const v1::GetRankMaskRequest& request) {
  absl::MutexLock lock(&mu_);
  EPD_ASSIGN_OR_RETURN(DataPlaneGroup * group,
                       HeldGroupLocked(request.session_id(), request.group(), request.rank()));
  return group->GetRankMask();
}

void GroupRegistry::ReleaseRankLocked(const std::string& group_name, int32_t rank,
                                      absl::string_view why, bool log_release) {
  auto group_it = groups_.find(group_name);
  if (group_it == groups_.end()) return;
  Group& group = group_it->second;
  auto slot = group.ranks.find(rank);
  if (slot == group.ranks.end()) return;
  auto session = sessions_.find(slot->second.session_id);
  if (session != sessions_.end()) session->second.endpoints.erase({group_name, rank});
  group.data->DetachRank(rank);
  const uint32_t holder_uid = slot->second.peer.uid;
  const PeerCredentials holder = slot->second.peer;
  group.ranks.erase(slot);
  if (log_release) {
    LogLimited(*GetLogger(kLogRegistry), spdlog::level::info, *ControlLogBudgetLocked(holder_uid),
               "its releases", "rank {} of group \"{}\" released ({})", rank, group_name, why);
  }
  if (group.ranks.empty()) {
    retired_ops_completed_ += group.data->ops_completed();
    retired_ops_failed_ += group.data->ops_failed();
    uint64_t bytes = group.bytes_per_rank;
    groups_.erase(group_it);  // Destroys the DataPlaneGroup: its memory is freed.
    Audit(options_.audit_log, {audit::kGroupDestroy, holder, group_name, -1, absl::OkStatus(),
                               absl::StrCat("no members left (last rank ", rank, ": ", why, ")")});
    GetLogger(kLogRegistry)
        ->info("group \"{}\" destroyed: no members left (freed its buffers, {} bytes per rank)",
               group_name, bytes);
  }
}

int GroupRegistry::ExpireUnmappedEndpoints(absl::Time now) {
  constexpr size_t kNamedInLog = 8;
  constexpr absl::Duration kLogInterval = absl::Seconds(5);
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<std::string, int32_t>> expired;
  for (auto& [name, group] : groups_) {
    for (auto& [rank, slot] : group.ranks) {
      if (slot.mapped) continue;
      slot.mapped = group.data->RankMapped(rank);
      if (!slot.mapped && now - slot.joined >= options_.unmapped_endpoint_timeout) {
        expired.emplace_back(name, rank);
      }
    }
  }
  const std::string why =
      absl::StrCat("not mapped by its client within unmapped_endpoint_timeout_ms = ",
                   absl::ToInt64Milliseconds(options_.unmapped_endpoint_timeout));
  for (const auto& [name, rank] : expired) {
    if (expiry_log_.named.size() < kNamedInLog) {
      const RankSlot& slot = groups_.at(name).ranks.at(rank);
      expiry_log_.named.push_back(absl::StrCat(name, "/", rank, " (session ",
                                               RedactSessionId(slot.session_id), ", pid ",
                                               slot.peer.pid, ")"));
    }
    ++expiry_log_.count;
    ReleaseRankLocked(name, rank, why, /*log_release=*/false);
  }
  // One line per kLogInterval at most, however many expire.
  if (expiry_log_.count > 0 && now - expiry_log_.last >= kLogInterval) {
    GetLogger(kLogRegistry)
        ->warn(
            "expired {} endpoint(s) {}: {}{}; a client must map the endpoints it joins "
            "(Client::Join does) or leave them",
            expiry_log_.count, why, absl::StrJoin(expiry_log_.named, ", "),
            expiry_log_.count > expiry_log_.named.size()
                ? absl::StrCat(" and ", expiry_log_.count - expiry_log_.named.size(), " more")
                : "");
    expiry_log_ = ExpiryLog{.last = now};
  }
  if (!expired.empty()) NotifyWaitersLocked();
  return static_cast<int>(expired.size());
}

v1::ListGroupsResponse GroupRegistry::ListGroups(const PeerCredentials& viewer) const {
  v1::ListGroupsResponse response;
  absl::MutexLock lock(&mu_);
  for (const auto& [name, group] : groups_) {
    if (!VisibleLocked(group, viewer.uid)) continue;
    v1::GroupInfo* info = response.add_groups();
    *info->mutable_spec() = group.spec;
    info->set_buffer_bytes_per_rank(group.bytes_per_rank);
    info->set_launch_mode(group.launch_mode);
    info->set_owner_uid(group.owner_uid);
    info->set_join_secret_set(group.join_secret.set());
    info->set_ops_completed(group.data->ops_completed());
    info->set_ops_failed(group.data->ops_failed());
    if (group.spec.on_rank_failure() == v1::RANK_FAILURE_POLICY_MASK) {
      if (absl::StatusOr<v1::RankMask> mask = group.data->GetRankMask(); mask.ok()) {
        *info->mutable_rank_mask() = *std::move(mask);
      }
    }
    if (options_.peer_mesh != nullptr && SpansNodes(group.spec)) {
      for (v1::GroupNodeInfo& node : options_.peer_mesh->NodeStatuses(name)) {
        *info->add_nodes() = std::move(node);
      }
    }
    for (const auto& [rank, slot] : group.ranks) {
      v1::RankInfo* r = info->add_ranks();
      r->set_rank(rank);
      r->set_gpu_uuid(slot.gpu_uuid);
      // Only a prefix: a session id is the capability to leave or join in that session's
      // name, and ListGroups is readable by every client of the socket.
      r->set_session_id(RedactSessionId(slot.session_id));
      r->set_client_pid(slot.peer.pid);
      r->set_uid(slot.peer.uid);
      r->set_ops_completed(group.data->rank_ops_completed(rank));
    }
  }
  return response;
}

bool GroupRegistry::VisibleLocked(const Group& group, uint32_t uid) const {
  if (uid == 0 || uid == options_.operator_uid || uid == group.owner_uid) return true;
  return std::any_of(group.ranks.begin(), group.ranks.end(),
                     [uid](const auto& rank) { return rank.second.peer.uid == uid; });
}

absl::Status GroupRegistry::AuthorizeJoin(const Group& group, int32_t rank,
                                          const PeerCredentials& joiner,
                                          const std::string& secret) {
  const std::string& name = group.spec.name();
  if (group.join_secret.set()) {
    if (group.join_secret.Matches(secret)) return absl::OkStatus();
    return errors::WithReason(
        absl::PermissionDeniedError(absl::StrCat(
            "join_secret: rank ", rank, " of group \"", name, "\" (uid ", joiner.uid,
            "): ", secret.empty() ? "none presented" : "the one presented is not the group's",
            "; every rank presents the join secret its first joiner set "
            "(JoinOptions.join_secret, e.g. from EPD_JOIN_SECRET)")),
        errors::Reason::kJoinSecretMismatch);
  }
  if (!secret.empty()) {
    return errors::WithReason(
        absl::PermissionDeniedError(absl::StrCat(
            "join_secret: rank ", rank, " of group \"", name, "\" (uid ", joiner.uid,
            "): a secret is presented but the group was created without one (its first joiner "
            "presented none); every rank presents the same join secret, or none")),
        errors::Reason::kJoinSecretMismatch);
  }
  if (joiner.uid != group.owner_uid) {
    return errors::WithReason(
        absl::PermissionDeniedError(absl::StrCat(
            "rank ", rank, " of group \"", name, "\": uid ", joiner.uid,
            " may not join: the group has no join secret, so only its owner's uid (",
            group.owner_uid,
            ") may join it (ranks of several uids need a join secret set by the first joiner: "
            "JoinOptions.join_secret)")),
        errors::Reason::kNotGroupOwner);
  }
  return absl::OkStatus();
}

GroupRegistry::Usage GroupRegistry::UsageOfLocked(uint32_t uid) const {
  Usage usage;
  for (const auto& [id, session] : sessions_) {
    if (session.peer.uid == uid) ++usage.sessions;
  }
  for (const auto& [name, group] : groups_) {
    if (group.owner_uid == uid) {
      ++usage.groups_owned;
      usage.endpoint_bytes += group.private_bytes;
    }
    for (const auto& [rank, slot] : group.ranks) {
      if (slot.peer.uid != uid) continue;
      ++usage.endpoints;
      usage.endpoint_bytes += group.bytes_per_rank;
    }
  }
  return usage;
}

GroupRegistry::Usage GroupRegistry::UsageOf(uint32_t uid) const {
  absl::MutexLock lock(&mu_);
  return UsageOfLocked(uid);
}

absl::Status GroupRegistry::CheckQuotasLocked(uint32_t uid, const std::string& group, int32_t rank,
                                              bool creates, uint64_t bytes) const {
  const Usage usage = UsageOfLocked(uid);
  const std::string what = absl::StrCat("rank ", rank, " of group \"", group, "\"");
  const char* next = " (leave ranks or groups first, or raise the quota in the DaemonConfig)";
  if (creates && quotas_.max_groups_per_uid != 0 &&
      usage.groups_owned >= quotas_.max_groups_per_uid) {
    return errors::WithReason(
        absl::ResourceExhaustedError(absl::StrCat(
            "max_groups_per_uid: uid ", uid, " owns ", usage.groups_owned, " groups, the quota is ",
            quotas_.max_groups_per_uid, "; ", what, " would create another", next)),
        errors::Reason::kQuotaExceeded);
  }
  if (quotas_.max_endpoints_per_uid != 0 && usage.endpoints >= quotas_.max_endpoints_per_uid) {
    return errors::WithReason(absl::ResourceExhaustedError(absl::StrCat(
                                  "max_endpoints_per_uid: uid ", uid, " holds ", usage.endpoints,
                                  " endpoints, the quota is ", quotas_.max_endpoints_per_uid, "; ",
                                  what, " would be one more", next)),
                              errors::Reason::kQuotaExceeded);
  }
  if (quotas_.max_endpoint_bytes_per_uid != 0 &&
      (bytes > quotas_.max_endpoint_bytes_per_uid ||
       usage.endpoint_bytes > quotas_.max_endpoint_bytes_per_uid - bytes)) {
    return errors::WithReason(
        absl::ResourceExhaustedError(absl::StrCat(
            "max_endpoint_bytes_per_uid: uid ", uid, " holds ", usage.endpoint_bytes,
            " bytes of endpoint buffers and group memory, the quota is ",
            quotas_.max_endpoint_bytes_per_uid, "; ", what, " needs ", bytes, " more", next)),
        errors::Reason::kQuotaExceeded);
  }
  return absl::OkStatus();
}

GroupRegistry::Counters GroupRegistry::counters() const {
  Counters c;
  absl::MutexLock lock(&mu_);
  c.num_groups = static_cast<int32_t>(groups_.size());
  c.num_sessions = static_cast<int32_t>(sessions_.size());
  c.ops_completed = retired_ops_completed_;
  c.ops_failed = retired_ops_failed_;
  for (const auto& [name, group] : groups_) {
    c.ops_completed += group.data->ops_completed();
    c.ops_failed += group.data->ops_failed();
    c.num_endpoints += static_cast<int32_t>(group.ranks.size());
  }
  return c;
}

void GroupRegistry::SetDraining() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  NotifyWaitersLocked();
}

bool GroupRegistry::SetDrained(bool drained) {
  absl::MutexLock lock(&mu_);
  const bool before = drained_;
  drained_ = drained;
  return before;
}

bool GroupRegistry::drained() const {
  absl::MutexLock lock(&mu_);
  return drained_;
}

void GroupRegistry::SetQuotas(const Quotas& quotas) {
  absl::MutexLock lock(&mu_);
  quotas_ = quotas;
}

GroupRegistry::Quotas GroupRegistry::quotas() const {
  absl::MutexLock lock(&mu_);
  return quotas_;
}

void GroupRegistry::ReleaseAll() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  std::vector<std::pair<std::string, int32_t>> all;
  for (const auto& [name, group] : groups_) {
    for (const auto& [rank, slot] : group.ranks) all.emplace_back(name, rank);
  }
  for (const auto& [name, rank] : all) ReleaseRankLocked(name, rank, "daemon shutdown");
  groups_.clear();
  sessions_.clear();
  auto log = GetLogger(kLogEngine);
  for (auto& [uid, budget] : log_budgets_) {
    LogSuppressedReport(*log, spdlog::level::warn, *budget, budget->Flush());
  }
  NotifyWaitersLocked();
}

std::shared_ptr<LogRateLimiter> GroupRegistry::LogBudgetLocked(uint32_t uid) {
  std::shared_ptr<LogRateLimiter>& budget = log_budgets_[uid];
  if (!budget) {
    budget =
        std::make_shared<LogRateLimiter>(LogRateLimiter::kDefaultPerSecond,
                                         LogRateLimiter::kDefaultBurst, absl::StrCat("uid ", uid));
  }
  return budget;
}

void GroupRegistry::ReportSuppressedLogLines() {
  absl::MutexLock lock(&mu_);
  auto log = GetLogger(kLogEngine);
  for (auto& [uid, budget] : log_budgets_) LogSuppressed(*log, spdlog::level::warn, *budget);
  auto registry_log = GetLogger(kLogRegistry);
  for (auto& [uid, budget] : control_log_budgets_) {
    LogSuppressed(*registry_log, spdlog::level::info, *budget);
  }
}

std::shared_ptr<LogRateLimiter> GroupRegistry::ControlLogBudget(uint32_t uid) {
  absl::MutexLock lock(&mu_);
  return ControlLogBudgetLocked(uid);
}

std::shared_ptr<LogRateLimiter> GroupRegistry::ControlLogBudgetLocked(uint32_t uid) {
  std::shared_ptr<LogRateLimiter>& budget = control_log_budgets_[uid];
  if (!budget) {
    budget = std::make_shared<LogRateLimiter>(kControlLogPerSecond, kControlLogBurst,
                                              absl::StrCat("uid ", uid));
  }
  return budget;
}

void GroupRegistry::NotifyWaitersLocked() {
  if (!waiters_.empty()) waiters_changed_.SignalAll();
}

std::optional<absl::StatusOr<v1::GetGroupEndpointsResponse>> GroupRegistry::EvaluateEndpointsLocked(
    const EndpointsWaiter& waiter, absl::Time now) const {
  const v1::GetGroupEndpointsRequest& request = waiter.request;
  if (draining_) return Draining("epd is shutting down");
  auto session = sessions_.find(request.session_id());
  if (session == sessions_.end()) return NotAnOpenSession(request.session_id());
  const uint32_t uid = session->second.peer.uid;
  auto group_it = groups_.find(request.group());
  if (group_it == groups_.end() || !VisibleLocked(group_it->second, uid)) {
    return NoSuchGroup(request.group(), uid);
  }
  const Group& group = group_it->second;
  auto held = group.ranks.find(request.rank());
  if (held == group.ranks.end()) {
    return errors::WithReason(absl::FailedPreconditionError(absl::StrCat(
                                  "rank: ", request.rank(), " of group \"", request.group(),
                                  "\" is not joined; JoinGroup it before GetGroupEndpoints")),
                              errors::Reason::kGroupNotFound);
  }
  if (held->second.session_id != request.session_id()) {
    return errors::WithReason(
        absl::PermissionDeniedError(
            absl::StrCat("session_id: \"", EscapeClientText(request.session_id()),
                         "\" does not hold rank ", request.rank(), " of group \"", request.group(),
                         "\" (session ", RedactSessionId(held->second.session_id), " does)")),
        errors::Reason::kNotGroupOwner);
  }
  std::vector<int32_t> missing;
  for (int32_t r = 0; r < group.spec.num_ranks(); ++r) {
    if (group.ranks.find(r) == group.ranks.end()) missing.push_back(r);
  }
  if (!missing.empty()) {
    if (now < waiter.deadline) return std::nullopt;
    return errors::WithReason(absl::DeadlineExceededError(absl::StrCat(
                                  "GetGroupEndpoints: group \"", request.group(), "\": rank(s) ",
                                  absl::StrJoin(missing, ", "), " of ", group.spec.num_ranks(),
                                  " have not joined within wait_ms = ", waiter.wait_ms, " ms")),
                              errors::Reason::kOpTimeout);
  }
  v1::GetGroupEndpointsResponse response;
  for (const auto& [rank, slot] : group.ranks) {  // std::map: ordered by rank.
    v1::GroupEndpoint* e = response.add_endpoints();
    e->set_rank(rank);
    e->set_endpoint_id(slot.endpoint_id);
    e->set_gpu_uuid(slot.gpu_uuid);
    e->set_cuda_ipc_handle(slot.cuda_ipc_handle);
    e->set_launch_mode(group.launch_mode);
  }
  return response;
}

std::optional<absl::Status> GroupRegistry::CheckWaitersLocked(const std::string& session_id) const {
  const uint32_t total = options_.max_endpoints_waiters;
  if (total != 0 && waiters_.size() >= total) {
    return errors::WithReason(absl::ResourceExhaustedError(absl::StrCat(
                                  "GetGroupEndpoints: ", waiters_.size(),
                                  " calls are already waiting for ranks, epd's limit is ", total,
                                  "; retry later, or call with wait_ms = 0")),
                              errors::Reason::kQuotaExceeded);
  }
  const uint32_t per_session = options_.max_endpoints_waiters_per_session;
  if (per_session == 0) return std::nullopt;
  const size_t mine = std::count_if(waiters_.begin(), waiters_.end(), [&](const auto& w) {
    return w.request.session_id() == session_id;
  });
  if (mine < per_session) return std::nullopt;
  return errors::WithReason(absl::ResourceExhaustedError(
                                absl::StrCat("GetGroupEndpoints: this session already has ", mine,
                                             " calls waiting for ranks, the limit per session is ",
                                             per_session, "; wait for one to return first")),
                            errors::Reason::kQuotaExceeded);
}

void GroupRegistry::GetGroupEndpoints(const v1::GetGroupEndpointsRequest& request,
                                      EndpointsCallback done) {
  EndpointsWaiter waiter;
  waiter.request = request;
  waiter.wait_ms = std::min(request.wait_ms(), options_.max_endpoints_wait_ms);
  waiter.deadline = absl::Now() + absl::Milliseconds(waiter.wait_ms);
  std::optional<absl::StatusOr<v1::GetGroupEndpointsResponse>> answer;
  {
    absl::MutexLock lock(&mu_);
    answer = EvaluateEndpointsLocked(waiter, absl::Now());
    if (!answer) {
      if (std::optional<absl::Status> refused = CheckWaitersLocked(request.session_id())) {
        answer = *std::move(refused);
      }
    }
    if (!answer) {
      waiter.done = std::move(done);
      waiters_.push_back(std::move(waiter));
      if (!waiter_thread_.joinable() && !stop_waiters_) {
        waiter_thread_ = std::thread([this] { ServeEndpointsWaiters(); });
      }
      waiters_changed_.SignalAll();
      return;
    }
  }
  done(*std::move(answer));
}

absl::StatusOr<v1::GetGroupEndpointsResponse> GroupRegistry::GetGroupEndpoints(
    const v1::GetGroupEndpointsRequest& request) {
  absl::Notification answered;
  absl::StatusOr<v1::GetGroupEndpointsResponse> result;
  GetGroupEndpoints(request, [&](absl::StatusOr<v1::GetGroupEndpointsResponse> r) {
    result = std::move(r);
    answered.Notify();
  });
  answered.WaitForNotification();
  return result;
}

void GroupRegistry::ServeEndpointsWaiters() {
  absl::MutexLock lock(&mu_);
  while (!stop_waiters_) {
    std::vector<std::pair<EndpointsCallback, absl::StatusOr<v1::GetGroupEndpointsResponse>>>
        answers;
    absl::Time next = absl::InfiniteFuture();
    const absl::Time now = absl::Now();
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      auto answer = EvaluateEndpointsLocked(*it, now);
      if (!answer) {
        next = std::min(next, it->deadline);
        ++it;
        continue;
      }
      answers.emplace_back(std::move(it->done), *std::move(answer));
      it = waiters_.erase(it);
    }
    if (answers.empty()) {
      waiters_changed_.WaitWithDeadline(&mu_, next);
      continue;
    }
    mu_.Unlock();  // Answer without the lock: a callback may call back into gRPC.
    for (auto& [done, answer] : answers) done(std::move(answer));
    mu_.Lock();
  }
}

}  // namespace epd
