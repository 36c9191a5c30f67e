// DataPlane: what the group registry (control plane) asks of a backend; implemented by
// HostDataPlane (daemon/dataplane/host/host_data_plane.h) and, with CUDA, the CUDA data
// plane (daemon/dataplane/cuda/). docs/DESIGN.md §8.1.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/os/fd_frame.h"
#include "epd/v1/control.pb.h"

namespace epd {

class LogRateLimiter;  // daemon/core/logging.h

/// The client that joins a rank, as the data plane needs it: whose budget the log lines
/// its endpoint (and, for a group's first rank, the group) can cause are charged to
/// (docs/SECURITY.md, "Client-caused log lines are rate-limited").
struct RankClient {
  uint32_t uid = 0;  ///< SO_PEERCRED uid of the session that joins the rank.
  /// The rate limit shared by every endpoint, group and session of `uid` (GroupRegistry
  /// keeps one per uid). Null: the endpoint gets a budget of its own (tests, tools).
  std::shared_ptr<LogRateLimiter> log_budget;
};

/// Per-group state a data plane keeps. Created on a group's first join, destroyed (and
/// its memory freed) when the last rank leaves.
class DataPlaneGroup {
 public:
  virtual ~DataPlaneGroup() = default;

  /// Allocates rank `rank`'s endpoint (data area, shm ring) and fills `info` with what
  /// the client needs to map it. Errors: RESOURCE_EXHAUSTED (memory), INTERNAL.
  /// `gpu_uuid` is already resolved to a known GPU by the registry ("" on host). The
  /// warnings the endpoint's client can cause are charged to `client.log_budget`; so are
  /// the group's own (op timeouts, ranks that left) when this is the group's first attach
  /// (its owner's).
  virtual absl::Status AttachRank(int32_t rank, const std::string& gpu_uuid,
                                  v1::LaunchMode launch_mode, const RankClient& client,
                                  v1::EndpointInfo* info) = 0;

  /// Releases rank `rank`'s endpoint. Ops in flight that wait for this rank fail with
  /// DEADLINE_EXCEEDED (or ABORTED) instead of hanging. Idempotent.
  virtual void DetachRank(int32_t rank) = 0;

  /// Hands out rank `rank`'s endpoint region and its engine's doorbell page (new
  /// descriptors, close-on-exec) for the fd channel, once per attach: the group keeps no
  /// descriptor of the region afterwards (its own mapping stays), and a second call is
  /// FAILED_PRECONDITION. NOT_FOUND when the rank is not attached; RESOURCE_EXHAUSTED when
  /// the process is out of descriptors (the region stays available then). The default, for
  /// data planes without shared regions, is UNIMPLEMENTED.
  virtual absl::StatusOr<EndpointFds> TakeEndpointFds(int32_t rank) {
    return absl::UnimplementedError(
        absl::StrCat("rank ", rank, ": this data plane has no shared regions to hand out"));
  }

  /// Whether rank `rank`'s client has taken up its endpoint (fetched its descriptors:
  /// TakeEndpointFds, which only the session holding the rank can). The registry
  /// expires a rank for which this stays false for unmapped_endpoint_timeout_ms after its
  /// join (GroupRegistry::ExpireUnmappedEndpoints). Default: true (never expires).
  virtual bool RankMapped(int32_t /*rank*/) const { return true; }

  /// Rank masking (GroupSpec.on_rank_failure = MASK, docs/RELIABILITY.md): masks the
  /// ranks in `mask` and unmasks those in `unmask` (every rank in [0, R); `clean` unmasks
  /// every joined rank), applied together between two ops of the group (mask epoch + 1 when
  /// anything changed); returns the mask as it is then. A joined rank that is unmasked after
  /// it already submitted the op being collected (it was refused as masked) is unmasked at
  /// the end of that op, as is every change asked while the backend runs an op: the mask
  /// returned does not show those yet. Errors:
  /// INVALID_ARGUMENT (a rank out of range, or in both lists, named), FAILED_PRECONDITION
  /// (unmask of a rank that is not joined: it is unmasked when it rejoins; a group whose
  /// policy is not MASK). Default: FAILED_PRECONDITION (a data plane without masking).
  virtual absl::StatusOr<v1::RankMask> UpdateRankMask(std::span<const int32_t> /*mask*/,
                                                      std::span<const int32_t> /*unmask*/,
                                                      bool /*clean*/) {
    return absl::FailedPreconditionError("this data plane does not mask ranks");
  }
  /// The group's current rank mask (epoch 0 and no ranks when never masked).
  virtual absl::StatusOr<v1::RankMask> GetRankMask() const {
    return absl::FailedPreconditionError("this data plane does not mask ranks");
  }

  /// Ops completed / failed by this group (for ListGroups and GetStats).
  virtual uint64_t ops_completed() const = 0;
  virtual uint64_t ops_failed() const = 0;
  virtual uint64_t rank_ops_completed(int32_t rank) const = 0;
};

/// A backend's data plane.
/// What a new group is created with besides its spec (DataPlane::CreateGroup).
struct GroupCreateOptions {
  /// The group's join secret (its first joiner's JoinGroupRequest.join_secret; empty =
  /// none), borrowed for the call only. A group that spans nodes keeps just its keyed digest
  /// (PeerMesh::JoinSecretDigest), which the nodes compare at rendezvous.
  std::string_view join_secret;
};

class DataPlane {
 public:
  virtual ~DataPlane() = default;

  /// "host" or "cuda".
  virtual std::string backend_name() const = 0;

  /// Bytes one rank's endpoint of `spec` needs (data area plus ring), for the
  /// RESOURCE_EXHAUSTED check at join.
  virtual uint64_t BytesPerRank(const v1::GroupSpec& spec) const = 0;

  /// Bytes of epd's private memory CreateGroup(spec) allocates for the whole group (kernel
  /// scratch, every rank's private routing state), taken from what FreeBytes counts; for
  /// the RESOURCE_EXHAUSTED check when a join creates the group. 0 by default.
  virtual uint64_t GroupPrivateBytes(const v1::GroupSpec& /*spec*/) const { return 0; }

  /// Bytes free where a rank on `gpu_uuid` would be allocated (GPU memory, or available
  /// host memory on the host backend).
  virtual absl::StatusOr<uint64_t> FreeBytes(const std::string& gpu_uuid) const = 0;

  /// The launch mode a new group gets when its first joiner leaves launch_mode unspecified
  /// (DESIGN.md §3.2; the numbers behind the choice are in docs/BENCHMARKS.md). The host
  /// backend: daemon-launched (it has no other).
  virtual v1::LaunchMode DefaultLaunchMode(const v1::GroupSpec& /*spec*/) const {
    return v1::LAUNCH_MODE_DAEMON;
  }

  /// Creates the state of a new group with a validated spec.
  virtual absl::StatusOr<std::unique_ptr<DataPlaneGroup>> CreateGroup(
      const v1::GroupSpec& spec) = 0;

  /// CreateGroup(spec) with what else the registry knows of the new group. By default the
  /// options are not used (a backend whose groups never span nodes needs none of them).
  virtual absl::StatusOr<std::unique_ptr<DataPlaneGroup>> CreateGroup(
      const v1::GroupSpec& spec, const GroupCreateOptions& options) {
    (void)options;
    return CreateGroup(spec);
  }

  /// Stops every engine; ops in flight complete with UNAVAILABLE. Idempotent.
  virtual void Shutdown() = 0;
};

}  // namespace epd
