// GroupRegistry: the control plane's state (DESIGN.md §1): sessions (one per client
// process, tied to its Session stream, with the kernel's credentials of that process),
// groups (created on their first join, destroyed with their memory when their last rank
// leaves) and ranks (each held by one session). The registry validates every JoinGroup
// (spec_validation.h), enforces who may join and see a group and the per-uid quotas
// (docs/SECURITY.md "Groups, owners, secrets, quotas"), and asks the DataPlane for the
// memory; it never touches buffers itself. Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/control/audit_log.h"
#include "daemon/control/join_secret.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/gpu/gpu_inventory.h"
#include "daemon/server/peer_credentials.h"
#include "epd/v1/control.pb.h"

namespace epd {
namespace peer {
class PeerMesh;
}  // namespace peer
namespace transport {
class TransportSet;
}  // namespace transport

class GroupRegistry {
 public:
  struct Options {
    uint32_t max_groups = 64;  ///< DaemonConfig.max_groups.
    /// Cap on GetGroupEndpointsRequest.wait_ms (the daemon uses op_timeout_ms + 5 s).
    uint32_t max_endpoints_wait_ms = 15000;
    /// Per-uid quotas (DaemonConfig.max_groups_per_uid, max_endpoints_per_uid,
    /// max_endpoint_bytes_per_uid); 0 = no limit. Every uid is counted, root included.
    uint32_t max_groups_per_uid = 64;
    uint32_t max_endpoints_per_uid = 256;
    uint64_t max_endpoint_bytes_per_uid = 0;
    /// DaemonConfig.max_sessions_per_uid: open sessions per uid (root included); 0 = no
    /// limit. OpenSession beyond it is RESOURCE_EXHAUSTED.
    uint32_t max_sessions_per_uid = 256;
    /// GetGroupEndpoints calls that may wait for ranks at a time, per session and in all;
    /// one more is RESOURCE_EXHAUSTED (0 = no limit).
    uint32_t max_endpoints_waiters_per_session = 4;
    uint32_t max_endpoints_waiters = 1024;
    /// Besides root (uid 0), the uid that sees every group in ListGroups: epd's own
    /// (the daemon passes its effective uid).
    uint32_t operator_uid = 0;
    /// DaemonConfig.min_free_fds: Join is refused (RESOURCE_EXHAUSTED) while fewer
    /// descriptors are free (CheckFreeFds). 0 = never.
    uint32_t min_free_fds = 0;
    /// DaemonConfig.unmapped_endpoint_timeout_ms: ExpireUnmappedEndpoints detaches a rank
    /// whose client has not mapped its endpoint (DataPlaneGroup::RankMapped) this long
    /// after its join.
    absl::Duration unmapped_endpoint_timeout = absl::Seconds(30);
    /// The daemon's Peer mesh (DaemonConfig.peer_listen), null when the Peer listener is
    /// off: a join of a group that spans nodes then fails. Must outlive the registry.
    peer::PeerMesh* peer_mesh = nullptr;
    /// The transports this daemon runs (with peer_mesh): a join of a spanning group whose
    /// spec.transport (or the default) is not among them is FAILED_PRECONDITION. Null =
    /// not checked here. Must outlive the registry.
    const transport::TransportSet* transports = nullptr;
    /// Where group_create / group_destroy lines go (daemon/control/audit_log.h); null = no
    /// audit log. Must outlive the registry.
    AuditLog* audit_log = nullptr;
  };

  /// `data_plane` must outlive the registry (ReleaseAll() before destroying it).
  /// `inventory` resolves the gpu_uuid of joins (UUID or PCI bus id).
  GroupRegistry(DataPlane* data_plane, GpuInventory inventory, Options options);
  ~GroupRegistry();
  GroupRegistry(const GroupRegistry&) = delete;
  GroupRegistry& operator=(const GroupRegistry&) = delete;

  /// Opens a session for a client (its Session stream's first message) and returns its
  /// id (32 hex characters, unguessable). `peer` is the kernel's identity of the client
  /// (SO_PEERCRED of its connection, daemon/server/peer_credentials.h), never a value the client
  /// sent; it is what ListGroups and the logs show and what every authorization of the
  /// session compares. UNAVAILABLE while draining; RESOURCE_EXHAUSTED when peer.uid already
  /// holds max_sessions_per_uid open sessions (naming the quota, the uid and its usage).
  absl::StatusOr<std::string> OpenSession(const PeerCredentials& peer,
                                          const std::string& client_name);

  /// The credentials `session_id` was opened with. FAILED_PRECONDITION when it is not an
  /// open session.
  absl::StatusOr<PeerCredentials> SessionCredentials(const std::string& session_id) const;

  /// OK when `session_id` is an open session opened by caller.uid: a call quoting a
  /// session id acts in that session's name only for the user that opened it.
  /// FAILED_PRECONDITION (no such open session), PERMISSION_DENIED (another uid's).
  absl::Status CheckSessionCaller(const std::string& session_id,
                                  const PeerCredentials& caller) const;

  /// Whether `peer` may have the memory of rank `rank` of group `group` in the name of
  /// `session_id` (the fd channel): the session is open, was opened by peer.uid, and holds
  /// that rank. Returns the rank's endpoint_id. Errors: FAILED_PRECONDITION (no such open
  /// session), PERMISSION_DENIED (another uid's session, or the session does not hold the
  /// rank; the message does not say whether the group exists).
  absl::StatusOr<uint64_t> AuthorizeEndpoint(const std::string& session_id,
                                             const std::string& group, int32_t rank,
                                             const PeerCredentials& peer) const;

  /// The fd channel's answer (daemon/server/fd_channel.h): the descriptors of rank `rank` of group
  /// `group` (its endpoint region and its engine's doorbell page) for `peer`, in the name
  /// of `session_id`, authorized as AuthorizeEndpoint does (the session is open, was opened
  /// by peer.uid, and holds the rank). Handed out once per join
  /// (DataPlaneGroup::TakeEndpointFds); from then on the endpoint counts as mapped (its
  /// RankSlot's `mapped`). Errors: AuthorizeEndpoint's; NOT_FOUND when the rank was released
  /// meanwhile; FAILED_PRECONDITION when the descriptors were already handed out;
  /// RESOURCE_EXHAUSTED when epd is out of descriptors; UNAVAILABLE while draining.
  absl::StatusOr<EndpointFds> TakeEndpointFds(const std::string& session_id,
                                              const std::string& group, int32_t rank,
                                              const PeerCredentials& peer);

  /// Ends a session (its stream ended: exit, crash, or daemon shutdown) and releases every
  /// endpoint it held; groups left empty are destroyed. Logs what was released and `why`.
  /// Unknown ids are ignored. Returns the number of endpoints released.
  int CloseSession(const std::string& session_id, absl::string_view why);

  /// JoinGroup, in the name of the session's credentials. Who may join (checked before
  /// anything of a live group is compared or reported, so that a refused joiner learns
  /// nothing of its spec or ranks): the first joiner of a group becomes its owner (its
  /// uid) and sets its join secret (request.join_secret, empty = none); a later joiner
  /// must present the same secret, and when there is none, must also be of the owner's
  /// uid. Root is not exempt. Errors, each naming the field and the value (never the
  /// secret):
  ///   UNAVAILABLE          draining (SIGTERM);
  ///   FAILED_PRECONDITION  drained by the operator (SetDrained) and the join would
  ///                        create the group;
  ///   INVALID_ARGUMENT     a spec field (ValidateGroupSpec), rank out of range, empty
  ///                        session_id, bad launch_mode, gpu_uuid "" on the cuda backend,
  ///                        join_secret longer than kMaxJoinSecretBytes;
  ///   PERMISSION_DENIED    the group exists and the join secret differs from the group's,
  ///                        or the group has none and the session's uid is not the owner's;
  ///   FAILED_PRECONDITION  spec differs from the live group's (every differing field),
  ///                        session_id is not an open session, launch_mode explicitly
  ///                        differs from the group's (naming both), or LAUNCH_MODE_CLIENT on
  ///                        the host backend;
  ///   ALREADY_EXISTS       the rank is held by a live session;
  ///   NOT_FOUND            unknown GPU;
  ///   RESOURCE_EXHAUSTED   buffers do not fit (bytes needed and free), max_groups, a
  ///                        per-uid quota (naming it, the uid, its usage and the limit), or
  ///                        fewer than min_free_fds descriptors free (CheckFreeFds).
  ///
  /// Launch mode (DESIGN.md §3.2): a group's mode is fixed by its first joiner
  /// (LAUNCH_MODE_UNSPECIFIED = DataPlane::DefaultLaunchMode(spec)); a later joiner asking
  /// for UNSPECIFIED gets the group's mode. EndpointInfo.launch_mode is the mode granted.
  absl::StatusOr<v1::EndpointInfo> Join(const v1::JoinGroupRequest& request);

  /// The answer to a GetGroupEndpoints call: every rank's endpoint, or the error.
  using EndpointsCallback =
      std::function<void(absl::StatusOr<v1::GetGroupEndpointsResponse> endpoints)>;

  /// GetGroupEndpoints (client-launched mode: a client maps every rank's data area).
  /// Answers through `done`, called exactly once, without the registry's lock held: at
  /// once when every rank of the group is attached (or on an error), else from the
  /// registry's waiter thread as soon as the last rank joins, or when the wait ends, so
  /// that a waiting call blocks no other RPC. The wait is min(request.wait_ms,
  /// Options.max_endpoints_wait_ms). The response lists every rank ordered by rank:
  /// endpoint_id, gpu_uuid, cuda_ipc_handle ("" on the host backend) and launch_mode.
  /// Errors (checked again whenever the group changes during the wait):
  ///   NOT_FOUND            no group request.group that the session's uid may see
  ///                        (ListGroups), the same answer whether it exists or not;
  ///   FAILED_PRECONDITION  session_id is not an open session, or rank request.rank of
  ///                        the group is not joined (or left during the wait);
  ///   PERMISSION_DENIED    the rank is held by another session;
  ///   DEADLINE_EXCEEDED    the wait ended with ranks missing (named);
  ///   RESOURCE_EXHAUSTED   it would have to wait while the session already has
  ///                        max_endpoints_waiters_per_session calls waiting, or
  ///                        max_endpoints_waiters calls wait in all;
  ///   UNAVAILABLE          the daemon is shutting down.
  void GetGroupEndpoints(const v1::GetGroupEndpointsRequest& request, EndpointsCallback done);
  /// The same, blocking the caller until the answer (tests, tools).
  absl::StatusOr<v1::GetGroupEndpointsResponse> GetGroupEndpoints(
      const v1::GetGroupEndpointsRequest& request);

  /// LeaveGroup: releases one rank. NOT_FOUND (no such group that the session's uid may
  /// see, or rank not joined), PERMISSION_DENIED (the rank belongs to another session).
  absl::Status Leave(const v1::LeaveGroupRequest& request);

  /// UpdateRankMask / GetRankMask (DataPlaneGroup::UpdateRankMask, GetRankMask) of the
  /// group rank request.rank of which the session holds. Errors besides the data plane's:
  /// FAILED_PRECONDITION (not an open session, or the rank is not joined), NOT_FOUND (no
  /// such group that the session's uid may see), PERMISSION_DENIED (another session holds
  /// the rank).
  absl::StatusOr<v1::RankMask> UpdateRankMask(const v1::UpdateRankMaskRequest& request);
  absl::StatusOr<v1::RankMask> GetRankMask(const v1::GetRankMaskRequest& request);

  /// Detaches every rank whose endpoint its client has not mapped
  /// (DataPlaneGroup::RankMapped) within Options::unmapped_endpoint_timeout of its join, as
  /// if its session had left it; groups left empty are destroyed. Logs what expired (how
  /// many, the first few by name) at most once every 5 s. Returns how many it detached.
  /// The daemon's health updater calls it periodically.
  int ExpireUnmappedEndpoints(absl::Time now);

  /// The live groups `viewer` may see, with their joined ranks: those its uid owns or holds
  /// a rank of; every group for root and Options::operator_uid. Never a join secret.
  v1::ListGroupsResponse ListGroups(const PeerCredentials& viewer) const;

  /// What one uid holds, as the per-uid quotas count it.
  struct Usage {
    uint32_t groups_owned = 0;
    uint32_t endpoints = 0;
    uint64_t endpoint_bytes = 0;
    uint32_t sessions = 0;  ///< Open sessions.
  };
  Usage UsageOf(uint32_t uid) const;

  /// Counters for GetStats.
  struct Counters {
    int32_t num_groups = 0;
    int32_t num_sessions = 0;
    int32_t num_endpoints = 0;   ///< Ranks joined, over every live group.
    uint64_t ops_completed = 0;  ///< Live groups plus groups already destroyed.
    uint64_t ops_failed = 0;
  };
  Counters counters() const;

  /// Reports the client-caused warnings each uid's log budget suppressed (RankClient), for
  /// the budgets that have a token again: a uid whose endpoints are all gone would
  /// otherwise keep its count until its next warning. The daemon calls it periodically.
  void ReportSuppressedLogLines();

  /// The budget of the control-plane lines `uid`'s clients cause (sessions opened and
  /// ended, joins, releases, refused calls): larger than the data plane's (a job of many
  /// ranks starts with a few lines per rank), but a client cannot multiply it by opening
  /// sessions or rejoining (docs/SECURITY.md "Client-caused log lines are rate-limited").
  std::shared_ptr<LogRateLimiter> ControlLogBudget(uint32_t uid) ABSL_LOCKS_EXCLUDED(mu_);
  /// Lines a second and burst of ControlLogBudget.
  static constexpr double kControlLogPerSecond = 20;
  static constexpr double kControlLogBurst = 200;

  /// The audit log of Options (null when off), for the Control service's lines.
  AuditLog* audit_log() const { return options_.audit_log; }

  /// From now on OpenSession and Join return UNAVAILABLE (shutdown). Idempotent.
  void SetDraining();

  /// The operator's drain (`epctl drain`, Control.Drain): while set, a Join that would
  /// create a group is refused with FAILED_PRECONDITION (reason DAEMON_DRAINED); joins of
  /// a live group's ranks, sessions and every call on existing groups go on. Returns the
  /// previous value.
  bool SetDrained(bool drained);
  bool drained() const;

  /// The quotas a config reload may change (the DaemonConfig fields of the same names;
  /// 0 = no limit, except max_groups, at least 1).
  struct Quotas {
    uint32_t max_groups = 64;
    uint32_t max_groups_per_uid = 64;
    uint32_t max_endpoints_per_uid = 256;
    uint64_t max_endpoint_bytes_per_uid = 0;
    uint32_t max_sessions_per_uid = 256;
  };
  /// Replaces the quotas (Options' values at construction). What is held already stays
  /// held; the new values apply to the next OpenSession and Join.
  void SetQuotas(const Quotas& quotas);
  Quotas quotas() const;

  /// Whether `uid` is an operator of this daemon: root or Options::operator_uid (epd's
  /// own uid). Operators see every group and may drain and reload the daemon.
  bool IsOperator(uint32_t uid) const { return uid == 0 || uid == options_.operator_uid; }

  /// Releases every endpoint and group and forgets every session, and reports what the
  /// log budgets still hold (shutdown). Idempotent.
  void ReleaseAll();

 private:
  struct RankSlot {
    std::string gpu_uuid;
    std::string session_id;
    PeerCredentials peer;  ///< The holding session's.
    uint64_t endpoint_id = 0;
    std::string cuda_ipc_handle;
    absl::Time joined;    ///< For ExpireUnmappedEndpoints.
    bool mapped = false;  ///< The client mapped the endpoint (once seen, never asked again).
  };
  /// Built in place in groups_ and never moved (JoinSecret is not copyable).
  struct Group {
    v1::GroupSpec spec;
    v1::LaunchMode launch_mode = v1::LAUNCH_MODE_DAEMON;  ///< Fixed by the first joiner.
    uint32_t owner_uid = 0;                               ///< The first joiner's uid.
    JoinSecret join_secret;                               ///< Set by the first joiner.
    std::unique_ptr<DataPlaneGroup> data;
    std::map<int32_t, RankSlot> ranks;
    uint64_t bytes_per_rank = 0;
    uint64_t private_bytes = 0;  ///< DataPlane::GroupPrivateBytes, charged to its owner.
  };
  struct Session {
    PeerCredentials peer;
    std::string client_name;
    absl::Time opened;
    std::set<std::pair<std::string, int32_t>> endpoints;  ///< (group, rank).
  };

  /// A GetGroupEndpoints call still waiting for ranks.
  struct EndpointsWaiter {
    v1::GetGroupEndpointsRequest request;
    absl::Time deadline;
    uint32_t wait_ms = 0;  ///< The effective wait (for the error message).
    EndpointsCallback done;
  };

  absl::StatusOr<std::string> ResolveGpu(const std::string& gpu_uuid) const;
  /// Whether `uid` may see `group` (ListGroups): root, the operator uid, its owner, or a
  /// holder of one of its ranks.
  bool VisibleLocked(const Group& group, uint32_t uid) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// A spanning spec's rank must live on this daemon's node (its peer_address is this
  /// mesh's advertised address); FAILED_PRECONDITION without a Peer listener.
  absl::Status CheckRankIsOnThisNode(const v1::GroupSpec& spec, int32_t rank) const;
  /// `requested` as the live group's spec would read it where both name the same transport
  /// ("" = this daemon's default), else `requested` unchanged: what CheckSameSpec compares.
  v1::GroupSpec SpecAsLive(const v1::GroupSpec& live, const v1::GroupSpec& requested) const;
  /// OK when `joiner` may join rank `rank` of the live `group` with `secret`.
  static absl::Status AuthorizeJoin(const Group& group, int32_t rank, const PeerCredentials& joiner,
                                    const std::string& secret);
  /// OK when a join by `uid` that creates a group (`creates`) and holds `bytes` more
  /// stays within the per-uid quotas.
  absl::Status CheckQuotasLocked(uint32_t uid, const std::string& group, int32_t rank, bool creates,
                                 uint64_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Usage UsageOfLocked(uint32_t uid) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// The log budget of `uid`'s clients (created on first use, then kept).
  std::shared_ptr<LogRateLimiter> LogBudgetLocked(uint32_t uid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::shared_ptr<LogRateLimiter> ControlLogBudgetLocked(uint32_t uid)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckSessionCallerLocked(const std::string& session_id,
                                        const PeerCredentials& caller) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// The answer to `waiter` now; nullopt while ranks are missing and its deadline is
  /// ahead of `now`.
  std::optional<absl::StatusOr<v1::GetGroupEndpointsResponse>> EvaluateEndpointsLocked(
      const EndpointsWaiter& waiter, absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// The waiter thread: answers waiters as the groups change or their deadlines pass.
  void ServeEndpointsWaiters();
  /// RESOURCE_EXHAUSTED when `session_id` may not park another GetGroupEndpoints waiter
  /// (max_endpoints_waiters_per_session, max_endpoints_waiters); nullopt when it may.
  std::optional<absl::Status> CheckWaitersLocked(const std::string& session_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Wakes the waiter thread after a change of the groups, sessions or draining.
  void NotifyWaitersLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// The data plane group of `group` whose rank `rank` `session_id` holds (the checks of
  /// UpdateRankMask).
  absl::StatusOr<DataPlaneGroup*> HeldGroupLocked(const std::string& session_id,
                                                  const std::string& group, int32_t rank) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Detaches `rank` of `group_name` (which must be held) and destroys the group when
  /// it becomes empty.
  /// `log_release` = false: the caller logs a summary instead of a line per rank.
  void ReleaseRankLocked(const std::string& group_name, int32_t rank, absl::string_view why,
                         bool log_release = true) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  DataPlane* const data_plane_;
  const GpuInventory inventory_;
  const Options options_;

  mutable absl::Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool drained_ ABSL_GUARDED_BY(mu_) = false;
  Quotas quotas_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Group> groups_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);
  uint64_t retired_ops_completed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t retired_ops_failed_ ABSL_GUARDED_BY(mu_) = 0;
  std::list<EndpointsWaiter> waiters_ ABSL_GUARDED_BY(mu_);
  /// One log budget per uid that ever joined (docs/SECURITY.md, "Client-caused log lines
  /// are rate-limited"): per uid, not per session or group, which a client opens for free;
  /// kept when the uid has nothing left, so that leaving and joining again starts no fresh
  /// burst. A few hundred bytes per uid.
  std::map<uint32_t, std::shared_ptr<LogRateLimiter>> log_budgets_ ABSL_GUARDED_BY(mu_);
  std::map<uint32_t, std::shared_ptr<LogRateLimiter>> control_log_budgets_ ABSL_GUARDED_BY(mu_);
  absl::CondVar waiters_changed_;
  bool stop_waiters_ ABSL_GUARDED_BY(mu_) = false;
  std::thread waiter_thread_;  ///< Started with the first waiting call; joined at destruction.
  /// Endpoints expired since ExpireUnmappedEndpoints last logged (it logs at most every
  /// few seconds).
  struct ExpiryLog {
    absl::Time last = absl::InfinitePast();
    uint64_t count = 0;
    std::vector<std::string> named;  ///< The first few, "group/rank (session, pid)".
  };
  ExpiryLog expiry_log_ ABSL_GUARDED_BY(mu_);
};

}  // namespace epd
