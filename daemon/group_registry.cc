#include "daemon/group_registry.h"

#include <mutex>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "daemon/logging.h"
#include "daemon/spec_validation.h"
#include "epd/common/status_macros.h"

namespace epd {
namespace {

std::string NewSessionId() {
  static std::mutex mu;
  static std::random_device device;
  static std::mt19937_64 rng((static_cast<uint64_t>(device()) << 32) ^ device() ^
                             static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())));
  std::lock_guard<std::mutex> lock(mu);
  return absl::StrFormat("%016x%016x", rng() ^ device(), rng());
}

}  // namespace

GroupRegistry::GroupRegistry(DataPlane* data_plane, GpuInventory inventory, Options options)
    : data_plane_(data_plane), inventory_(std::move(inventory)), options_(options) {}

GroupRegistry::~GroupRegistry() { ReleaseAll(); }

absl::StatusOr<std::string> GroupRegistry::OpenSession(int64_t client_pid,
                                                       const std::string& client_name) {
  absl::MutexLock lock(&mu_);
  if (draining_) return absl::UnavailableError("epd is shutting down; no new sessions");
  std::string id = NewSessionId();
  Session& session = sessions_[id];
  session.client_pid = client_pid;
  session.client_name = client_name;
  session.opened = absl::Now();
  GetLogger(kLogRegistry)
      ->info("session {} opened (pid {}, name \"{}\")", id, client_pid, client_name);
  return id;
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
  GetLogger(kLogRegistry)
      ->info(
          "session {} (pid {}, name \"{}\") ended ({}) after {}: released {} endpoint(s){}{}",
          session_id, it->second.client_pid, it->second.client_name, why,
          absl::FormatDuration(absl::Trunc(absl::Now() - it->second.opened, absl::Milliseconds(1))),
          released.size(), released.empty() ? "" : ": ", absl::StrJoin(released, ", "));
  sessions_.erase(session_id);
  return static_cast<int>(released.size());
}

absl::StatusOr<std::string> GroupRegistry::ResolveGpu(const std::string& gpu_uuid) const {
  if (gpu_uuid.empty()) {
    if (data_plane_->backend_name() == "host") return std::string();
    return absl::InvalidArgumentError(
        absl::StrCat("gpu_uuid: \"\" but the ", data_plane_->backend_name(),
                     " backend needs the GPU's UUID or PCI bus id (e.g. from nvidia-smi -L)"));
  }
  EPD_ASSIGN_OR_RETURN(v1::GpuInfo gpu, inventory_.Find(gpu_uuid));
  return gpu.uuid();
}

absl::StatusOr<v1::EndpointInfo> GroupRegistry::Join(const v1::JoinGroupRequest& request) {
  const v1::GroupSpec& spec = request.spec();
  const int32_t rank = request.rank();
  EPD_RETURN_IF_ERROR(ValidateGroupSpec(spec));
  if (!v1::LaunchMode_IsValid(request.launch_mode())) {
    return absl::InvalidArgumentError(
        absl::StrCat("launch_mode: ", request.launch_mode(), " is not a LaunchMode"));
  }
  if (request.session_id().empty()) {
    return absl::InvalidArgumentError(
        "session_id: \"\"; open a Session first and pass its id (Client::Connect does)");
  }
  EPD_ASSIGN_OR_RETURN(std::string gpu_uuid, ResolveGpu(request.gpu_uuid()));

  absl::MutexLock lock(&mu_);
  if (draining_) return absl::UnavailableError("epd is shutting down; joins are refused");
  auto session = sessions_.find(request.session_id());
  if (session == sessions_.end()) {
    return absl::FailedPreconditionError(absl::StrCat("session_id: \"", request.session_id(),
                                                      "\" is not an open session of this daemon"));
  }
  auto group_it = groups_.find(spec.name());
  if (group_it != groups_.end()) {
    EPD_RETURN_IF_ERROR(CheckSameSpec(group_it->second.spec, spec));
  }
  EPD_RETURN_IF_ERROR(ValidateRank(spec, rank));
  if (group_it != groups_.end()) {
    auto held = group_it->second.ranks.find(rank);
    if (held != group_it->second.ranks.end()) {
      return absl::AlreadyExistsError(
          absl::StrCat("rank ", rank, " of group \"", spec.name(), "\" is held by session ",
                       held->second.session_id, " (pid ", held->second.client_pid, ")"));
    }
  } else if (groups_.size() >= options_.max_groups) {
    return absl::ResourceExhaustedError(absl::StrCat("max_groups: ", options_.max_groups,
                                                     " groups are live; group \"", spec.name(),
                                                     "\" cannot be created"));
  }

  const uint64_t bytes_needed = data_plane_->BytesPerRank(spec);
  EPD_ASSIGN_OR_RETURN(uint64_t bytes_free, data_plane_->FreeBytes(gpu_uuid));
  EPD_RETURN_IF_ERROR(
      CheckBuffersFit(spec, bytes_needed, bytes_free,
                      gpu_uuid.empty() ? std::string("/dev/shm (host backend)") : gpu_uuid));

  bool created = false;
  if (group_it == groups_.end()) {
    EPD_ASSIGN_OR_RETURN(std::unique_ptr<DataPlaneGroup> data, data_plane_->CreateGroup(spec));
    Group group;
    group.spec = spec;
    group.data = std::move(data);
    group.bytes_per_rank = bytes_needed;
    group_it = groups_.emplace(spec.name(), std::move(group)).first;
    created = true;
    GetLogger(kLogRegistry)
        ->info("group created: {} ({} bytes per rank)", SpecSummary(spec), bytes_needed);
  }
  v1::EndpointInfo info;
  absl::Status attached =
      group_it->second.data->AttachRank(rank, gpu_uuid, request.launch_mode(), &info);
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
  slot.client_pid = session->second.client_pid;
  session->second.endpoints.emplace(spec.name(), rank);
  GetLogger(kLogRegistry)
      ->info("rank {} of group \"{}\" joined by session {} (pid {}){}{}", rank, spec.name(),
             request.session_id(), slot.client_pid, gpu_uuid.empty() ? "" : " on ", gpu_uuid);
  return info;
}

absl::Status GroupRegistry::Leave(const v1::LeaveGroupRequest& request) {
  absl::MutexLock lock(&mu_);
  auto group_it = groups_.find(request.group());
  if (group_it == groups_.end()) {
    return absl::NotFoundError(absl::StrCat("group: \"", request.group(), "\" does not exist"));
  }
  auto slot = group_it->second.ranks.find(request.rank());
  if (slot == group_it->second.ranks.end()) {
    return absl::NotFoundError(absl::StrCat("rank: ", request.rank(), " of group \"",
                                            request.group(), "\" is not joined"));
  }
  if (slot->second.session_id != request.session_id()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "session_id: \"", request.session_id(), "\" does not hold rank ", request.rank(),
        " of group \"", request.group(), "\" (session ", slot->second.session_id, " does)"));
  }
  auto session = sessions_.find(request.session_id());
  if (session != sessions_.end())
    session->second.endpoints.erase({request.group(), request.rank()});
  ReleaseRankLocked(request.group(), request.rank(), "LeaveGroup");
  return absl::OkStatus();
}

void GroupRegistry::ReleaseRankLocked(const std::string& group_name, int32_t rank,
                                      absl::string_view why) {
  auto group_it = groups_.find(group_name);
  if (group_it == groups_.end()) return;
  Group& group = group_it->second;
  auto slot = group.ranks.find(rank);
  if (slot == group.ranks.end()) return;
  auto session = sessions_.find(slot->second.session_id);
  if (session != sessions_.end()) session->second.endpoints.erase({group_name, rank});
  group.data->DetachRank(rank);
  group.ranks.erase(slot);
  GetLogger(kLogRegistry)->info("rank {} of group \"{}\" released ({})", rank, group_name, why);
  if (group.ranks.empty()) {
    retired_ops_completed_ += group.data->ops_completed();
    retired_ops_failed_ += group.data->ops_failed();
    uint64_t bytes = group.bytes_per_rank;
    groups_.erase(group_it);  // Destroys the DataPlaneGroup: its memory is freed.
    GetLogger(kLogRegistry)
        ->info("group \"{}\" destroyed: no members left (freed its buffers, {} bytes per rank)",
               group_name, bytes);
  }
}

v1::ListGroupsResponse GroupRegistry::ListGroups() const {
  v1::ListGroupsResponse response;
  absl::MutexLock lock(&mu_);
  for (const auto& [name, group] : groups_) {
    v1::GroupInfo* info = response.add_groups();
    *info->mutable_spec() = group.spec;
    info->set_buffer_bytes_per_rank(group.bytes_per_rank);
    info->set_ops_completed(group.data->ops_completed());
    info->set_ops_failed(group.data->ops_failed());
    for (const auto& [rank, slot] : group.ranks) {
      v1::RankInfo* r = info->add_ranks();
      r->set_rank(rank);
      r->set_gpu_uuid(slot.gpu_uuid);
      r->set_session_id(slot.session_id);
      r->set_client_pid(slot.client_pid);
      r->set_ops_completed(group.data->rank_ops_completed(rank));
    }
  }
  return response;
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
  }
  return c;
}

void GroupRegistry::SetDraining() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
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
}

}  // namespace epd
