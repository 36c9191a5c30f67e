#include "daemon/control/control_service.h"

#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "common/client_text.h"
#include "common/errors/grpc_status.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "daemon/control/spec_validation.h"
#include "daemon/core/logging.h"
#include "daemon/metrics/exposition.h"
#include "daemon/metrics/metrics.h"
#include "daemon/server/peer_credentials.h"

namespace epd {

grpc::Status ToGrpcStatus(const absl::Status& status) { return errors::ToGrpcStatus(status); }

namespace {

/// UNAUTHENTICATED for a call that did not come through epd's own unix listener, which
/// alone records a connection's SO_PEERCRED: epd knows a client by nothing else.
absl::Status NoCredentials(const std::string& peer) {
  return errors::WithReason(
      absl::UnauthenticatedError(absl::StrCat(
          "epd knows a client by the kernel's credentials of its connection to epd's unix "
          "socket (SO_PEERCRED), and this call (peer \"",
          EscapeClientText(peer), "\") has none; connect to the unix socket")),
      errors::Reason::kNoCredentials);
}

/// The caller of a Control RPC as the kernel knows it: SO_PEERCRED of its connection to
/// epd's unix socket; UNAUTHENTICATED without one.
absl::StatusOr<PeerCredentials> Caller(const grpc::CallbackServerContext& context) {
  std::optional<PeerCredentials> creds = CallerCredentials(context);
  if (!creds) return NoCredentials(context.peer());
  return *creds;
}

/// PERMISSION_DENIED when `session_id` is an open session of another uid than the caller's
/// (a call acts in a session's name only for the user that opened it); the registry
/// answers every other problem of the id itself.
absl::Status CheckCallerMayUseSession(const GroupRegistry& registry, const std::string& session_id,
                                      const PeerCredentials& caller) {
  absl::Status status = registry.CheckSessionCaller(session_id, caller);
  return status.code() == absl::StatusCode::kPermissionDenied ? status : absl::OkStatus();
}

/// The daemon's version and the client versions it serves, in the "open" message.
void SetVersions(v1::SessionResponse* response) {
  response->set_daemon_version(kEpdVersion);
  if (absl::StatusOr<Version> version = ParseVersion(kEpdVersion); version.ok()) {
    response->set_compatible_client_versions(CompatibleClientVersions(*version));
  }
}

/// INVALID_ARGUMENT (REQUEST_MALFORMED): a Session stream that ended before its first
/// SessionRequest, or whose first message did not parse.
absl::Status NoSessionRequest() {
  return errors::WithReason(
      absl::InvalidArgumentError(
          "Session: the stream ended before a SessionRequest epd could read (none was sent, "
          "or it is not an epd.v1.SessionRequest); no session was opened"),
      errors::Reason::kRequestMalformed);
}

/// INVALID_ARGUMENT (REQUEST_MALFORMED) naming the field when a SessionRequest's
/// client_name or client_version is not UTF-8 (they are `bytes` on the wire so that such a
/// message still parses and gets this answer); the text is echoed escaped and cut.
absl::Status CheckSessionText(const v1::SessionRequest& request) {
  for (const auto& [field, text, shown] :
       {std::tuple<const char*, const std::string*, size_t>{"client_name", &request.client_name(),
                                                            kMaxEchoedClientBytes},
        {"client_version", &request.client_version(), kMaxEchoedVersionBytes}}) {
    if (const size_t valid = ValidUtf8Prefix(*text); valid != text->size()) {
      return errors::WithReason(
          absl::InvalidArgumentError(
              absl::StrCat("SessionRequest.", field, ": \"", EscapeClientText(*text, shown),
                           "\" is not valid UTF-8 (at byte ", valid, "); send UTF-8 text")),
          errors::Reason::kRequestMalformed);
    }
  }
  return absl::OkStatus();
}

/// The caller of an operator action `what` (Drain, ReloadConfig) when it may act as the
/// daemon's operator (GroupRegistry::IsOperator) and the action is `served`: else
/// UNAUTHENTICATED (Caller), PERMISSION_DENIED naming the action and the uid (audited as
/// `audit_action`), or UNIMPLEMENTED.
absl::StatusOr<PeerCredentials> OperatorCaller(const grpc::CallbackServerContext& context,
                                               const GroupRegistry& registry,
                                               absl::string_view what, const char* audit_action,
                                               bool served) {
  EPD_ASSIGN_OR_RETURN(PeerCredentials caller, Caller(context));
  if (!registry.IsOperator(caller.uid)) {
    absl::Status refused = errors::WithReason(
        absl::PermissionDeniedError(absl::StrCat(
            what, " is an operator action: uid ", caller.uid,
            " is neither root nor the uid epd runs as; run it as root (sudo) or as epd's user")),
        errors::Reason::kNotOperator);
    Audit(registry.audit_log(), {audit_action, caller, "", -1, refused, ""});
    return refused;
  }
  if (!served) return absl::UnimplementedError(absl::StrCat(what, " is not served here"));
  return caller;
}

/// Finishes `reactor` with `status` when it is an error; returns whether it did.
bool FinishIfError(grpc::ServerUnaryReactor* reactor, const absl::Status& status) {
  if (status.ok()) return false;
  reactor->Finish(ToGrpcStatus(status));
  return true;
}

}  // namespace

// One Session stream. Lives until OnDone. Reactions may run concurrently with OnCancel,
// so every state change happens under mu_. gRPC never runs a reaction inline from a
// Start*/Finish call of a user reactor (can_inline is false for them), so calling those
// under mu_ cannot re-enter it.
class ControlService::SessionReactor
    : public grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionResponse> {
 public:
  SessionReactor(ControlService* service, grpc::CallbackServerContext* context)
      : service_(service), peer_(context->peer()), credentials_(CallerCredentials(*context)) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    if (!ok) {
      // Before the first message: the client ended the stream without one, or its message
      // did not parse (gRPC gives a parse failure as the stream's end, which must not read
      // as an OK session).
      EndLocked("stream closed by the client",
                session_id_.empty() ? ToGrpcStatus(NoSessionRequest()) : grpc::Status::OK);
      return;
    }
    if (session_id_.empty()) {
      // The identity is the kernel's; the pid the client sent is only compared.
      if (!credentials_) {
        EndLocked("refused: no SO_PEERCRED", ToGrpcStatus(NoCredentials(peer_)));
        return;
      }
      const PeerCredentials& peer = *credentials_;
      if (request_.client_pid() != peer.pid) {
        GetLogger(kLogControl)
            ->debug(
                "Session from {} ({}): its SessionRequest.client_pid is not the kernel's "
                "pid; epd uses the kernel's",
                DescribeCredentials(peer), peer_);
      }
      absl::Status version = CheckSessionText(request_);
      if (version.ok()) version = CheckClientVersion(request_.client_version());
      if (!version.ok()) {
        // The message names the client's text escaped and cut (CheckSessionText,
        // CheckClientVersion); a client reconnecting in a loop spends its uid's budget, not
        // the log.
        LogLimited(*GetLogger(kLogControl), spdlog::level::info,
                   *service_->registry_->ControlLogBudget(peer.uid), "its refused sessions",
                   "Session from {} ({}) refused: {}", DescribeCredentials(peer), peer_,
                   version.message());
        Audit(service_->registry_->audit_log(),
              {audit::kSessionOpen, peer, "", -1, version,
               absl::StrCat("client_version ",
                            EscapeClientText(request_.client_version(), kMaxEchoedVersionBytes))});
        EndLocked("refused", ToGrpcStatus(version));
        return;
      }
      absl::StatusOr<std::string> id =
          service_->registry_->OpenSession(peer, request_.client_name());
      Audit(service_->registry_->audit_log(),
            {audit::kSessionOpen, peer, "", -1, id.status(),
             id.ok() ? absl::StrCat("session ", RedactSessionId(*id)) : std::string()});
      if (!id.ok()) {
        EndLocked("refused", ToGrpcStatus(id.status()));
        return;
      }
      session_id_ = *id;
      response_.set_session_id(session_id_);
      response_.set_event("open");
      SetVersions(&response_);
      writing_ = true;
      StartWrite(&response_);
    }
    // Later messages carry nothing; keep reading to learn when the stream ends.
    StartRead(&request_);
  }

  void OnWriteDone(bool /*ok*/) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (pending_finish_) {
      pending_finish_ = false;
      Finish(finish_status_);
    }
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    EndLocked("stream cancelled (client gone)", grpc::Status::CANCELLED);
  }

  void OnDone() override {
    {
      absl::MutexLock lock(&mu_);
      EndLocked("stream done", grpc::Status::OK);
    }
    service_->Forget(this);
    delete this;
  }

  /// Shutdown: tells the client and ends the stream with UNAVAILABLE.
  void Drain() {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    if (!session_id_.empty() && !writing_) {
      response_.set_session_id(session_id_);
      response_.set_event("draining");
      writing_ = true;
      StartWrite(&response_);
    }
    EndLocked("daemon shutting down",
              ToGrpcStatus(errors::WithReason(absl::UnavailableError("epd is shutting down"),
                                              errors::Reason::kDaemonDraining)));
  }

 private:
  /// Releases the session's endpoints (once) and finishes the stream (once).
  void EndLocked(absl::string_view why, const grpc::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!session_id_.empty() && !closed_) {
      closed_ = true;
      const int released =
          service_->registry_->CloseSession(session_id_, absl::StrCat(why, ", peer ", peer_));
      Audit(service_->registry_->audit_log(),
            {audit::kSessionClose, credentials_, "", -1, absl::OkStatus(),
             absl::StrCat("session ", RedactSessionId(session_id_), " ", why, ", released ",
                          released, " endpoint(s)")});
    }
    if (finished_) return;
    finished_ = true;
    if (writing_) {
      pending_finish_ = true;  // Finish after the write in flight completes.
      finish_status_ = status;
    } else {
      Finish(status);
    }
  }

  ControlService* const service_;
  const std::string peer_;
  const std::optional<PeerCredentials> credentials_;
  absl::Mutex mu_;
  v1::SessionRequest request_;
  v1::SessionResponse response_;
  std::string session_id_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool pending_finish_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status finish_status_ ABSL_GUARDED_BY(mu_);
};

ControlService::ControlService(GroupRegistry* registry, std::function<v1::GetStatsResponse()> stats,
                               OperatorActions actions)
    : registry_(registry), stats_(std::move(stats)), actions_(std::move(actions)) {}

ControlService::~ControlService() = default;

grpc::ServerUnaryReactor* ControlService::JoinGroup(grpc::CallbackServerContext* context,
                                                    const v1::JoinGroupRequest* request,
                                                    v1::JoinGroupResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<PeerCredentials> caller = Caller(*context);
  if (FinishIfError(reactor, caller.status())) return reactor;
  const absl::Status allowed = CheckCallerMayUseSession(*registry_, request->session_id(), *caller);
  absl::StatusOr<v1::EndpointInfo> endpoint =
      allowed.ok() ? registry_->Join(*request) : absl::StatusOr<v1::EndpointInfo>(allowed);
  if (endpoint.ok()) {
    *response->mutable_endpoint() = *std::move(endpoint);
  } else {
    // The name is the client's, unvalidated: escaped and capped (a '\n' would forge a line).
    // The join secret is never logged (nor is it in any error message).
    LogLimited(
        *GetLogger(kLogControl), spdlog::level::info, *registry_->ControlLogBudget(caller->uid),
        "its refused joins", "JoinGroup group \"{}\" rank {} from {} ({}) refused: {}",
        EscapeClientText(request->spec().name()), request->rank(), DescribeCredentials(*caller),
        context->peer(), errors::StatusText(endpoint.status()));
  }
  Audit(registry_->audit_log(), {audit::kJoin, *caller, request->spec().name(), request->rank(),
                                 endpoint.status(), request->gpu_uuid()});
  reactor->Finish(ToGrpcStatus(endpoint.status()));
  return reactor;
}

grpc::ServerUnaryReactor* ControlService::LeaveGroup(grpc::CallbackServerContext* context,
                                                     const v1::LeaveGroupRequest* request,
                                                     v1::LeaveGroupResponse* /*response*/) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<PeerCredentials> caller = Caller(*context);
  if (FinishIfError(reactor, caller.status())) return reactor;
  absl::Status left = CheckCallerMayUseSession(*registry_, request->session_id(), *caller);
  if (left.ok()) left = registry_->Leave(*request);
  Audit(registry_->audit_log(),
        {audit::kLeave, *caller, request->group(), request->rank(), left, ""});
  reactor->Finish(ToGrpcStatus(left));
  return reactor;
}

namespace {

/// A rank mask RPC: `call(registry, request)` in the name of the caller's session; a change
/// (`audited`) is written to the audit log with its outcome.
template <typename Request, typename Response, typename Call>
grpc::ServerUnaryReactor* AnswerRankMask(GroupRegistry& registry,
                                         grpc::CallbackServerContext* context,
                                         const Request* request, Response* response, Call call,
                                         bool audited) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<PeerCredentials> caller = Caller(*context);
  if (FinishIfError(reactor, caller.status())) return reactor;
  absl::Status allowed = CheckCallerMayUseSession(registry, request->session_id(), *caller);
  absl::StatusOr<v1::RankMask> mask =
      allowed.ok() ? call(registry, *request) : absl::StatusOr<v1::RankMask>(allowed);
  if constexpr (std::is_same_v<Request, v1::UpdateRankMaskRequest>) {
    if (audited) Audit(registry.audit_log(), RankMaskEvent(*caller, *request, mask.status()));
  }
  if (mask.ok()) *response->mutable_mask() = *std::move(mask);
  reactor->Finish(ToGrpcStatus(mask.status()));
  return reactor;
}

}  // namespace

grpc::ServerUnaryReactor* ControlService::UpdateRankMask(grpc::CallbackServerContext* context,
                                                         const v1::UpdateRankMaskRequest* request,
                                                         v1::UpdateRankMaskResponse* response) {
  return AnswerRankMask(
      *registry_, context, request, response,
      [](GroupRegistry& r, const v1::UpdateRankMaskRequest& q) { return r.UpdateRankMask(q); },
      /*audited=*/true);
}

grpc::ServerUnaryReactor* ControlService::GetRankMask(grpc::CallbackServerContext* context,
                                                      const v1::GetRankMaskRequest* request,
                                                      v1::GetRankMaskResponse* response) {
  return AnswerRankMask(
      *registry_, context, request, response,
      [](GroupRegistry& r, const v1::GetRankMaskRequest& q) { return r.GetRankMask(q); },
      /*audited=*/false);
}

grpc::ServerUnaryReactor* ControlService::GetGroupEndpoints(
    grpc::CallbackServerContext* context, const v1::GetGroupEndpointsRequest* request,
    v1::GetGroupEndpointsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<PeerCredentials> caller = Caller(*context);
  if (FinishIfError(reactor, caller.status())) return reactor;
  if (FinishIfError(reactor,
                    CheckCallerMayUseSession(*registry_, request->session_id(), *caller))) {
    return reactor;
  }
  // The reactor and `response` live until Finish; the callback runs exactly once.
  registry_->GetGroupEndpoints(
      *request, [reactor, response, group = EscapeClientText(request->group()),
                 rank = request->rank(), budget = registry_->ControlLogBudget(caller->uid)](
                    absl::StatusOr<v1::GetGroupEndpointsResponse> endpoints) {
        if (endpoints.ok()) {
          *response = *std::move(endpoints);
        } else {
          LogLimited(*GetLogger(kLogControl), spdlog::level::info, *budget,
                     "its GetGroupEndpoints calls", "GetGroupEndpoints group \"{}\" rank {}: {}",
                     group, rank, errors::StatusText(endpoints.status()));
        }
        reactor->Finish(ToGrpcStatus(endpoints.status()));
      });
  return reactor;
}

grpc::ServerUnaryReactor* ControlService::ListGroups(grpc::CallbackServerContext* context,
                                                     const v1::ListGroupsRequest* /*request*/,
                                                     v1::ListGroupsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<PeerCredentials> caller = Caller(*context);
  if (FinishIfError(reactor, caller.status())) return reactor;
  *response = registry_->ListGroups(*caller);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* ControlService::GetStats(grpc::CallbackServerContext* context,
                                                   const v1::GetStatsRequest* /*request*/,
                                                   v1::GetStatsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<PeerCredentials> caller = Caller(*context);
  if (FinishIfError(reactor, caller.status())) return reactor;
  // Whole-daemon counts, the GPUs and the config, but no group's name or spec: the same
  // for every caller. The metrics keep the series of the groups the caller may list.
  *response = stats_();
  *response->mutable_metrics() = metrics::Default().Collect();
  std::set<std::string> visible;
  const v1::ListGroupsResponse listed = registry_->ListGroups(*caller);
  for (const v1::GroupInfo& g : listed.groups()) visible.insert(g.spec().name());
  metrics::KeepGroups(response->mutable_metrics(), visible);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* ControlService::Drain(grpc::CallbackServerContext* context,
                                                const v1::DrainRequest* request,
                                                v1::DrainResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<PeerCredentials> caller =
      OperatorCaller(*context, *registry_, request->drain() ? "drain" : "undrain",
                     request->drain() ? audit::kDrain : audit::kUndrain, actions_.drain != nullptr);
  if (FinishIfError(reactor, caller.status())) return reactor;
  response->set_was_draining(actions_.drain(request->drain(), *caller));
  response->set_draining(registry_->drained());
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* ControlService::ReloadConfig(grpc::CallbackServerContext* context,
                                                       const v1::ReloadConfigRequest* /*request*/,
                                                       v1::ReloadConfigResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<PeerCredentials> caller = OperatorCaller(
      *context, *registry_, "reload", audit::kConfigReload, actions_.reload != nullptr);
  if (FinishIfError(reactor, caller.status())) return reactor;
  absl::StatusOr<v1::ReloadConfigResponse> reloaded = actions_.reload(*caller);
  if (reloaded.ok()) *response = *std::move(reloaded);
  reactor->Finish(ToGrpcStatus(reloaded.status()));
  return reactor;
}

grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionResponse>* ControlService::Session(
    grpc::CallbackServerContext* context) {
  auto* reactor = new SessionReactor(this, context);  // Deletes itself in OnDone.
  absl::MutexLock lock(&mu_);
  // While draining, the registry refuses the session (UNAVAILABLE) at its first message.
  sessions_.insert(reactor);
  return reactor;
}

void ControlService::Forget(SessionReactor* reactor) {
  absl::MutexLock lock(&mu_);
  sessions_.erase(reactor);
}

void ControlService::DrainSessions() {
  absl::MutexLock lock(&mu_);
  // A reactor removes itself (Forget) before it is deleted, and Forget needs mu_: every
  // reactor in the set is alive while we hold mu_.
  for (SessionReactor* reactor : sessions_) reactor->Drain();
}

}  // namespace epd
