// FakeDataPlane: a DataPlane for control-plane tests (registry, daemon). It allocates no
// buffers (TakeEndpointFds hands out two small sealed regions); it records
// attaches/detaches and group lifetimes, and its sizes and failures are set by the test.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/gpu/gpu_inventory.h"
#include "tests/common/specs.h"

namespace epd::testing {

struct FakeDataPlaneState {
  std::mutex mu;
  std::string backend = "host";
  uint64_t bytes_per_rank = 1 << 20;
  uint64_t free_bytes = 1ull << 34;
  uint64_t group_private_bytes = 0;  ///< GroupPrivateBytes of every spec.
  absl::Status attach_error;         ///< Returned by every AttachRank when not OK.
  int groups_created = 0;
  std::string last_join_secret;  ///< GroupCreateOptions.join_secret of the last group created.
  int groups_destroyed = 0;
  std::set<std::pair<std::string, int>> attached;   ///< (group, rank) currently attached.
  std::set<std::pair<std::string, int>> fds_taken;  ///< Attached ranks whose fds were taken.
  uint64_t next_endpoint_id = 0;
  std::map<std::string, std::string> last_gpu;    ///< "group/rank" → gpu_uuid given.
  std::map<std::string, RankClient> last_client;  ///< "group/rank" → RankClient given.
  bool shut_down = false;
  /// (group, rank) whose client has not mapped its endpoint (RankMapped false); every
  /// other attached rank counts as mapped.
  std::set<std::pair<std::string, int>> unmapped;
  /// DefaultLaunchMode's answer; UNSPECIFIED = the base class's (daemon-launched).
  v1::LaunchMode default_launch_mode = v1::LAUNCH_MODE_UNSPECIFIED;
};

class FakeDataPlaneGroup : public DataPlaneGroup {
 public:
  FakeDataPlaneGroup(std::shared_ptr<FakeDataPlaneState> state, std::string name)
      : state_(std::move(state)), name_(std::move(name)) {}
  ~FakeDataPlaneGroup() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    ++state_->groups_destroyed;
  }
  absl::Status AttachRank(int32_t rank, const std::string& gpu_uuid, v1::LaunchMode,
                          const RankClient& client, v1::EndpointInfo* info) override {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->attach_error.ok()) return state_->attach_error;
    state_->attached.emplace(name_, rank);
    state_->last_gpu[absl::StrCat(name_, "/", rank)] = gpu_uuid;
    state_->last_client[absl::StrCat(name_, "/", rank)] = client;
    info->set_group(name_);
    info->set_rank(rank);
    info->set_backend(state_->backend);
    info->set_gpu_uuid(gpu_uuid);
    info->set_endpoint_id(endpoint_ids_[rank] = ++state_->next_endpoint_id);
    info->set_shm_bytes(4096);
    return absl::OkStatus();
  }
  absl::StatusOr<EndpointFds> TakeEndpointFds(int32_t rank) override {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->attached.count({name_, rank}) == 0) return absl::NotFoundError("not attached");
    if (!state_->fds_taken.insert({name_, rank}).second) {
      return absl::FailedPreconditionError("already handed out");
    }
    EndpointFds fds;
    for (ScopedFd* fd : {&fds.region, &fds.doorbell}) {
      absl::StatusOr<ShmRegion> region = ShmRegion::Create("epd-fake", 4096);
      if (!region.ok()) return region.status();
      *fd = region->TakeFd();
    }
    fds.endpoint_id = endpoint_ids_[rank];
    return fds;
  }
  void DetachRank(int32_t rank) override {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->attached.erase({name_, rank});
    state_->fds_taken.erase({name_, rank});
  }
  bool RankMapped(int32_t rank) const override {
    std::lock_guard<std::mutex> lock(state_->mu);
    return state_->attached.count({name_, rank}) != 0 && state_->unmapped.count({name_, rank}) == 0;
  }
  uint64_t ops_completed() const override { return 7; }
  uint64_t ops_failed() const override { return 1; }
  uint64_t rank_ops_completed(int32_t rank) const override { return 100 + rank; }

 private:
  std::shared_ptr<FakeDataPlaneState> state_;
  std::string name_;
  std::map<int32_t, uint64_t> endpoint_ids_;  ///< Guarded by state_->mu.
};

class FakeDataPlane : public DataPlane {
 public:
  explicit FakeDataPlane(std::shared_ptr<FakeDataPlaneState> state) : state_(std::move(state)) {}
  std::string backend_name() const override { return state_->backend; }
  v1::LaunchMode DefaultLaunchMode(const v1::GroupSpec& spec) const override {
    return state_->default_launch_mode == v1::LAUNCH_MODE_UNSPECIFIED
               ? DataPlane::DefaultLaunchMode(spec)
               : state_->default_launch_mode;
  }
  uint64_t BytesPerRank(const v1::GroupSpec&) const override { return state_->bytes_per_rank; }
  uint64_t GroupPrivateBytes(const v1::GroupSpec&) const override {
    return state_->group_private_bytes;
  }
  absl::StatusOr<uint64_t> FreeBytes(const std::string&) const override {
    return state_->free_bytes;
  }
  absl::StatusOr<std::unique_ptr<DataPlaneGroup>> CreateGroup(const v1::GroupSpec& spec) override {
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      ++state_->groups_created;
    }
    return std::unique_ptr<DataPlaneGroup>(new FakeDataPlaneGroup(state_, spec.name()));
  }
  absl::StatusOr<std::unique_ptr<DataPlaneGroup>> CreateGroup(
      const v1::GroupSpec& spec, const GroupCreateOptions& options) override {
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      state_->last_join_secret = std::string(options.join_secret);
    }
    return CreateGroup(spec);
  }
  void Shutdown() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->shut_down = true;
  }

 private:
  std::shared_ptr<FakeDataPlaneState> state_;
};

// SmallSpec (2 ranks, 8 experts, hidden 256, top-2, 16 tokens per rank): tests/common/specs.h.

/// UUID of the one fake GPU of OneGpu().
inline constexpr char kGpuA[] = "GPU-aaaaaaaa-0000-0000-0000-000000000000";

/// An inventory of one fake GPU (kGpuA, ordinal 0), for registry tests without a GPU.
inline GpuInventory OneGpu() {
  v1::GpuInfo gpu;
  gpu.set_ordinal(0);
  gpu.set_uuid(kGpuA);
  gpu.set_pci_bus_id("00000000:3B:00.0");
  gpu.set_name("Fake H200");
  return GpuInventory::FromList({gpu}, "1 GPU(s): Fake H200 x1");
}

}  // namespace epd::testing
