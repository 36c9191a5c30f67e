// ControlService: the gRPC `epd.v1.Control` service (proto/epd/v1/control.proto) on the
// callback API. It converts between RPCs and the GroupRegistry; absl::Status becomes
// grpc::Status only here, at the RPC edge (same codes, same messages).
#pragma once

#include <functional>
#include <set>

#include "absl/synchronization/mutex.h"
#include "daemon/control/group_registry.h"
#include "daemon/server/peer_credentials.h"
#include "epd/v1/control.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace epd {

/// absl::Status → grpc::Status (codes are numerically identical).
grpc::Status ToGrpcStatus(const absl::Status& status);

/// The daemon's side of the operator RPCs (Drain, ReloadConfig), called after the caller was
/// found to be an operator (GroupRegistry::IsOperator). A null one answers UNIMPLEMENTED.
struct OperatorActions {
  /// Drains (true) or undrains; returns the state before. Logs and audits.
  std::function<bool(bool drain, const PeerCredentials& caller)> drain;
  /// Reloads the configuration (Daemon::ReloadConfig). Logs and audits.
  std::function<absl::StatusOr<v1::ReloadConfigResponse>(const PeerCredentials& caller)> reload;
};

/// Every Control RPC acts for the caller's SO_PEERCRED (daemon/server/peer_credentials.h),
/// recorded by epd's unix listener; a call without it is refused with UNAUTHENTICATED. A
/// call that quotes a session id must come from the uid that opened that session
/// (PERMISSION_DENIED otherwise). ListGroups lists what the caller's uid may see.
class ControlService final : public v1::Control::CallbackService {
 public:
  /// `registry` must outlive the service; `stats` fills GetStats (called per RPC);
  /// `actions` answer Drain and ReloadConfig.
  ControlService(GroupRegistry* registry, std::function<v1::GetStatsResponse()> stats,
                 OperatorActions actions = {});
  ~ControlService() override;

  grpc::ServerUnaryReactor* JoinGroup(grpc::CallbackServerContext* context,
                                      const v1::JoinGroupRequest* request,
                                      v1::JoinGroupResponse* response) override;
  grpc::ServerUnaryReactor* LeaveGroup(grpc::CallbackServerContext* context,
                                       const v1::LeaveGroupRequest* request,
                                       v1::LeaveGroupResponse* response) override;
  /// Answered asynchronously (GroupRegistry::GetGroupEndpoints): a call waiting for
  /// ranks to join holds no gRPC thread.
  grpc::ServerUnaryReactor* GetGroupEndpoints(grpc::CallbackServerContext* context,
                                              const v1::GetGroupEndpointsRequest* request,
                                              v1::GetGroupEndpointsResponse* response) override;
  /// Rank masking (GroupRegistry::UpdateRankMask, GetRankMask): the caller's session must
  /// hold request.rank of the group.
  grpc::ServerUnaryReactor* UpdateRankMask(grpc::CallbackServerContext* context,
                                           const v1::UpdateRankMaskRequest* request,
                                           v1::UpdateRankMaskResponse* response) override;
  grpc::ServerUnaryReactor* GetRankMask(grpc::CallbackServerContext* context,
                                        const v1::GetRankMaskRequest* request,
                                        v1::GetRankMaskResponse* response) override;
  grpc::ServerUnaryReactor* ListGroups(grpc::CallbackServerContext* context,
                                       const v1::ListGroupsRequest* request,
                                       v1::ListGroupsResponse* response) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const v1::GetStatsRequest* request,
                                     v1::GetStatsResponse* response) override;
  /// The client's first message opens its session (registry.OpenSession, with the stream's
  /// SO_PEERCRED; SessionRequest.client_pid is never used) and is answered
  /// with {session_id, "open"}. When the stream ends for any reason (client exit or crash,
  /// cancellation, shutdown) the session is closed and its endpoints released.
  /// Operator actions: PERMISSION_DENIED (NOT_OPERATOR) unless the caller's uid is root or
  /// epd's own (GroupRegistry::IsOperator); a refused call is audited here, a granted one
  /// by the action.
  grpc::ServerUnaryReactor* Drain(grpc::CallbackServerContext* context,
                                  const v1::DrainRequest* request,
                                  v1::DrainResponse* response) override;
  grpc::ServerUnaryReactor* ReloadConfig(grpc::CallbackServerContext* context,
                                         const v1::ReloadConfigRequest* request,
                                         v1::ReloadConfigResponse* response) override;
  grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionResponse>* Session(
      grpc::CallbackServerContext* context) override;

  /// Shutdown: sends {event: "draining"} to every open Session stream and ends it with
  /// UNAVAILABLE, so the server's Shutdown need not wait for clients.
  void DrainSessions();

  class SessionReactor;

 private:
  friend class SessionReactor;
  void Forget(SessionReactor* reactor);

  GroupRegistry* const registry_;
  const std::function<v1::GetStatsResponse()> stats_;
  const OperatorActions actions_;
  absl::Mutex mu_;
  std::set<SessionReactor*> sessions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace epd
