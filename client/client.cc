// Client: the connection to the local epd (client/include/epd/client.h). Connect opens
// the Session stream and a background thread keeps reading it for the client's lifetime;
// the daemon treats the stream's end as this process's death and releases its endpoints.
// Reconnect opens a new Session after a daemon restart and rejoins the endpoints Join
// recorded (JoinedEndpoints), re-binding each Endpoint object to its new endpoint.
#include "epd/client.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/control_channel.h"
#include "client/endpoint/endpoint_internal.h"
#include "client/endpoint/endpoint_state.h"
#include "client/endpoint/joined_endpoints.h"
#include "client/fd_channel.h"
#include "client/request_text.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "epd/v1/control.grpc.pb.h"

namespace epd {
namespace {

/// Deadlines of the control RPCs. A join may allocate and zero gigabytes on a GPU; the
/// others are cheap, so a stuck daemon costs a client seconds, not minutes, on its way out.
constexpr auto kJoinTimeout = std::chrono::seconds(30);
constexpr auto kRpcTimeout = std::chrono::seconds(10);
constexpr auto kLeaveTimeout = std::chrono::seconds(5);
/// Bound on fetching an endpoint's descriptors on the fd channel (a local exchange).
constexpr absl::Duration kFdChannelTimeout = absl::Seconds(10);

/// The process's name (/proc/self/comm: any bytes a process chose), as UTF-8.
std::string DefaultClientName() {
  std::ifstream comm("/proc/self/comm");
  std::string name;
  std::getline(comm, name);
  return internal::SanitizeUtf8(name.substr(0, internal::kMaxClientNameBytes));
}

/// What an endpoint's leave function needs; shared so an Endpoint may outlive its Client.
struct ControlHandle {
  std::string target;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Control::Stub> stub;
};

std::shared_ptr<ControlHandle> MakeControlHandle(const std::string& socket_path) {
  auto control = std::make_shared<ControlHandle>();
  control->target = internal::ChannelTarget(socket_path);
  control->channel = internal::MakeControlChannel(control->target);
  control->stub = v1::Control::NewStub(control->channel);
  return control;
}

/// One Session with the daemon: the stream, the thread that keeps reading it, and what it
/// learnt. The daemon treats the stream's end as this process's death.
struct Session {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>> stream;
  std::thread reader;
  std::string target;  ///< For errors.

  absl::Mutex mu;
  std::string session_id ABSL_GUARDED_BY(mu);
  bool ended ABSL_GUARDED_BY(mu) = false;
  absl::Status end_status ABSL_GUARDED_BY(mu);
  std::string last_event ABSL_GUARDED_BY(mu);
  std::string id;  ///< Set once Open succeeds; read without the lock.
  /// Marked lost when the stream ends: endpoints stop waiting for completions then, and
  /// release CUDA streams left waiting for the daemon.
  std::shared_ptr<internal::SessionWatch> watch = std::make_shared<internal::SessionWatch>();

  /// Reader thread: records the session id and later events until the stream ends.
  void Read() {
    v1::SessionResponse response;
    while (stream->Read(&response)) {
      absl::MutexLock lock(&mu);
      if (session_id.empty()) session_id = response.session_id();
      last_event = response.event();
    }
    grpc::Status status = stream->Finish();
    watch->MarkLost();
    absl::MutexLock lock(&mu);
    ended = true;
    end_status = status.ok() ? errors::WithReason(absl::UnavailableError("epd ended the session"),
                                                  errors::Reason::kDaemonUnavailable)
                             : internal::FromGrpcStatus(status);
  }

  bool Ended() {
    absl::MutexLock lock(&mu);
    return ended;
  }

  absl::Status Alive() {
    absl::MutexLock lock(&mu);
    if (!ended) return absl::OkStatus();
    return errors::WithReason(
        absl::UnavailableError(absl::StrCat("the session with epd on ", target,
                                            " ended: ", end_status.message(),
                                            " (after a daemon restart: Client::Reconnect)")),
        errors::Reason::kDaemonUnavailable);
  }

  ~Session() {
    context.TryCancel();
    if (reader.joinable()) reader.join();
  }
};

/// Opens a Session on `control` as `client_name` (waiting for the channel and the daemon's
/// answer until `deadline`; `timeout` names the wait in errors).
absl::StatusOr<std::shared_ptr<Session>> OpenSession(ControlHandle& control,
                                                     const std::string& client_name,
                                                     absl::Time deadline, absl::Duration timeout) {
  if (!control.channel->WaitForConnected(absl::ToChronoTime(deadline))) {
    return errors::WithReason(
        absl::UnavailableError(absl::StrCat("no epd daemon answers on ", control.target, " within ",
                                            absl::FormatDuration(timeout),
                                            " (is epd running on that socket?)")),
        errors::Reason::kDaemonUnavailable);
  }
  auto session = std::make_shared<Session>();
  session->target = control.target;
  session->stream = control.stub->Session(&session->context);
  v1::SessionRequest hello;
  hello.set_client_pid(::getpid());
  hello.set_client_name(client_name);
  hello.set_client_version(kEpdVersion);
  if (!session->stream->Write(hello)) {
    // The server may refuse before the first write lands (e.g. UNIMPLEMENTED from epd's
    // TCP health listener): explained as when the refusal comes after it.
    grpc::Status status = session->stream->Finish();
    return internal::ExplainControlError(
        status.ok() ? errors::WithReason(absl::UnavailableError("Session stream closed"),
                                         errors::Reason::kDaemonUnavailable)
                    : internal::FromGrpcStatus(status),
        control.target);
  }
  Session* raw = session.get();
  session->reader = std::thread([raw] { raw->Read(); });
  absl::MutexLock lock(&session->mu);
  auto answered = [raw]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(raw->mu) {
    return !raw->session_id.empty() || raw->ended;
  };
  if (!session->mu.AwaitWithDeadline(absl::Condition(&answered), deadline)) {
    session->context.TryCancel();  // The reader ends; ~Session joins it.
    return errors::WithReason(absl::UnavailableError(absl::StrCat("epd on ", control.target,
                                                                  " did not open a Session within ",
                                                                  absl::FormatDuration(timeout))),
                              errors::Reason::kDaemonUnavailable);
  }
  if (session->session_id.empty()) {
    return internal::ExplainControlError(session->end_status, control.target);
  }
  session->id = session->session_id;
  return session;
}

/// How long Reconnect waits between attempts while the daemon restarts, and the most one
/// attempt to open a Session may take.
constexpr absl::Duration kReconnectRetry = absl::Milliseconds(50);
constexpr absl::Duration kReconnectAttempt = absl::Seconds(2);

}  // namespace

struct Client::Impl {
  ClientOptions options;
  std::string client_name;  ///< options.client_name or the process's name.

  absl::Mutex mu;
  std::shared_ptr<ControlHandle> control ABSL_GUARDED_BY(mu);
  std::shared_ptr<Session> session ABSL_GUARDED_BY(mu);
  /// Counts the Sessions this client opened (JoinedEndpoints' generations).
  uint64_t generation ABSL_GUARDED_BY(mu) = 1;
  std::string session_id_copy;  ///< Changed only by Reconnect; read without the lock.

  absl::Mutex reconnect_mu;  ///< One Reconnect at a time.
  std::shared_ptr<internal::JoinedEndpoints> joined = std::make_shared<internal::JoinedEndpoints>();

  /// The current control channel, Session and its generation.
  struct Current {
    std::shared_ptr<ControlHandle> control;
    std::shared_ptr<Session> session;
    uint64_t generation = 0;
  };
  Current Get() {
    absl::MutexLock lock(&mu);
    return {control, session, generation};
  }

  /// Joins as `options` through `now`'s channel and Session (not recorded in `joined`).
  absl::StatusOr<std::unique_ptr<Endpoint>> JoinOnce(const JoinOptions& options,
                                                     const Current& now);
  /// Opens a new Session (with a new channel) on the same socket, retrying while no daemon
  /// answers, until `deadline`.
  absl::Status OpenNewSession(absl::Time deadline, absl::Duration timeout);
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  EPD_RETURN_IF_ERROR(internal::CheckRequestText("ClientOptions::client_name", options.client_name,
                                                 internal::kMaxClientNameBytes));
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->client_name = options.client_name.empty() ? DefaultClientName() : options.client_name;
  std::shared_ptr<ControlHandle> control = MakeControlHandle(options.socket_path);
  // A path where nothing can answer fails at once instead of after connect_timeout.
  EPD_RETURN_IF_ERROR(internal::CheckUnixSocket(control->target, "ClientOptions::socket_path"));
  const absl::Time deadline = absl::Now() + options.connect_timeout;
  EPD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       OpenSession(*control, impl->client_name, deadline, options.connect_timeout));
  impl->session_id_copy = session->id;
  {
    absl::MutexLock lock(&impl->mu);
    impl->control = std::move(control);
    impl->session = std::move(session);
  }
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

const std::string& Client::session_id() const { return impl_->session_id_copy; }

absl::StatusOr<std::unique_ptr<Endpoint>> Client::Join(const JoinOptions& options) {
  const Impl::Current now = impl_->Get();
  EPD_ASSIGN_OR_RETURN(std::unique_ptr<Endpoint> endpoint, impl_->JoinOnce(options, now));
  // Recorded for Reconnect (and removed by the endpoint's Leave).
  endpoint->impl().joined = impl_->joined;
  impl_->joined->Add(endpoint.get(), options, now.generation);
  return endpoint;
}

absl::StatusOr<std::unique_ptr<Endpoint>> Client::Impl::JoinOnce(const JoinOptions& options,
                                                                 const Current& now) {
  EPD_RETURN_IF_ERROR(now.session->Alive());
  // Every string field of the spec and the request: protobuf sends only UTF-8. The daemon
  // checks the rest (the group name's characters and length, the GPU's existence).
  EPD_RETURN_IF_ERROR(internal::CheckRequestText("JoinOptions::spec.name", options.spec.name(),
                                                 std::numeric_limits<size_t>::max()));
  EPD_RETURN_IF_ERROR(internal::CheckRequestText("JoinOptions::gpu_uuid", options.gpu_uuid,
                                                 internal::kMaxGpuUuidBytes));
  for (int i = 0; i < options.spec.nodes_size(); ++i) {
    EPD_RETURN_IF_ERROR(internal::CheckRequestText(
        absl::StrCat("JoinOptions::spec.nodes[", i, "].peer_address"),
        options.spec.nodes(i).peer_address(), internal::kMaxPeerAddressBytes));
  }
  if (options.join_secret.size() > internal::kMaxJoinSecretBytes) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  "JoinOptions::join_secret is ", options.join_secret.size(),
                                  " bytes; at most ", internal::kMaxJoinSecretBytes, " are taken")),
                              errors::Reason::kInvalidArgument);
  }
  std::shared_ptr<ControlHandle> control = now.control;
  const std::string session_id = now.session->id;
  v1::JoinGroupRequest request;
  *request.mutable_spec() = options.spec;
  request.set_rank(options.rank);
  request.set_gpu_uuid(options.gpu_uuid);
  request.set_session_id(session_id);
  request.set_launch_mode(options.launch_mode);
  request.set_join_secret(options.join_secret);
  v1::JoinGroupResponse response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kJoinTimeout);
  EPD_RETURN_IF_ERROR(internal::AnnotateUnavailable(
      internal::FromGrpcStatus(control->stub->JoinGroup(&context, request, &response)),
      control->target));

  const std::string group = options.spec.name();
  const int32_t rank = options.rank;
  auto leave = [control, group, rank, session_id]() -> absl::Status {
    v1::LeaveGroupRequest leave_request;
    leave_request.set_group(group);
    leave_request.set_rank(rank);
    leave_request.set_session_id(session_id);
    v1::LeaveGroupResponse leave_response;
    grpc::ClientContext leave_context;
    leave_context.set_deadline(std::chrono::system_clock::now() + kLeaveTimeout);
    absl::Status status = internal::FromGrpcStatus(
        control->stub->LeaveGroup(&leave_context, leave_request, &leave_response));
    // Already released (the session ended, or the daemon restarted): leaving is done.
    if (status.code() == absl::StatusCode::kNotFound ||
        status.code() == absl::StatusCode::kUnavailable) {
      return absl::OkStatus();
    }
    return status;
  };
  // Client-launched mode: every rank's data area, asked once before the endpoint's first op.
  auto group_endpoints = [control, group, rank, session_id](
                             uint32_t wait_ms) -> absl::StatusOr<v1::GetGroupEndpointsResponse> {
    v1::GetGroupEndpointsRequest request;
    request.set_group(group);
    request.set_rank(rank);
    request.set_session_id(session_id);
    request.set_wait_ms(wait_ms);
    v1::GetGroupEndpointsResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + kRpcTimeout +
                         std::chrono::milliseconds(wait_ms));
    EPD_RETURN_IF_ERROR(internal::AnnotateUnavailable(
        internal::FromGrpcStatus(control->stub->GetGroupEndpoints(&context, request, &response)),
        control->target));
    return response;
  };
  // Rank masking: UpdateRankMask / GetRankMask of this rank's group.
  auto rank_mask = [control, group, rank, session_id](
                       const v1::UpdateRankMaskRequest* update) -> absl::StatusOr<v1::RankMask> {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
    auto call = [&](auto request, auto response, auto rpc) -> absl::StatusOr<v1::RankMask> {
      request.set_group(group);
      request.set_rank(rank);
      request.set_session_id(session_id);
      EPD_RETURN_IF_ERROR(internal::AnnotateUnavailable(
          internal::FromGrpcStatus(((*control->stub).*rpc)(&context, request, &response)),
          control->target));
      return response.mask();
    };
    using Stub = v1::Control::Stub;
    if (update == nullptr) {
      return call(
          v1::GetRankMaskRequest(), v1::GetRankMaskResponse(),
          static_cast<grpc::Status (Stub::*)(grpc::ClientContext*, const v1::GetRankMaskRequest&,
                                             v1::GetRankMaskResponse*)>(&Stub::GetRankMask));
    }
    return call(
        *update, v1::UpdateRankMaskResponse(),
        static_cast<grpc::Status (Stub::*)(grpc::ClientContext*, const v1::UpdateRankMaskRequest&,
                                           v1::UpdateRankMaskResponse*)>(&Stub::UpdateRankMask));
  };
  // The endpoint's memory: sealed memfds handed over on the fd channel, once per join.
  absl::StatusOr<std::unique_ptr<Endpoint>> endpoint =
      [&]() -> absl::StatusOr<std::unique_ptr<Endpoint>> {
    EPD_ASSIGN_OR_RETURN(std::string socket_path, internal::UnixSocketPathOf(control->target));
    EPD_ASSIGN_OR_RETURN(EndpointFds fds, internal::FetchEndpointFds(socket_path, session_id, group,
                                                                     rank, kFdChannelTimeout));
    return internal::OpenEndpoint(response.endpoint(), options.spec, std::move(fds), leave,
                                  now.session->watch, group_endpoints, rank_mask);
  }();
  if (!endpoint.ok()) {
    leave().IgnoreError();  // Give the rank back: this process cannot use it.
    return endpoint.status();
  }
  return endpoint;
}

absl::Status Client::Impl::OpenNewSession(absl::Time deadline, absl::Duration timeout) {
  absl::Status last;
  while (true) {
    std::shared_ptr<ControlHandle> fresh = MakeControlHandle(options.socket_path);
    last = internal::CheckUnixSocket(fresh->target, "ClientOptions::socket_path");
    if (last.ok()) {
      const absl::Time attempt = std::min(deadline, absl::Now() + kReconnectAttempt);
      absl::StatusOr<std::shared_ptr<Session>> session =
          OpenSession(*fresh, client_name, attempt, kReconnectAttempt);
      if (session.ok()) {
        absl::MutexLock lock(&mu);
        control = std::move(fresh);
        // The old Session (ended) is released here or by the last endpoint holding it.
        this->session = std::move(*session);
        session_id_copy = this->session->id;
        ++generation;
        return absl::OkStatus();
      }
      last = session.status();
    }
    // A daemon restarting: its socket missing, refusing, or not serving yet.
    if (!absl::IsUnavailable(last)) return last;
    if (absl::Now() + kReconnectRetry >= deadline) {
      return absl::UnavailableError(
          absl::StrCat("Reconnect: no epd daemon opened a Session on ", fresh->target, " within ",
                       absl::FormatDuration(timeout), "; the last attempt: ", last.message()));
    }
    absl::SleepFor(kReconnectRetry);
  }
}

absl::Status Client::Reconnect(absl::Duration timeout) {
  absl::MutexLock serial(&impl_->reconnect_mu);
  const absl::Time deadline = absl::Now() + timeout;
  if (impl_->Get().session->Ended()) {
    EPD_RETURN_IF_ERROR(impl_->OpenNewSession(deadline, timeout));
  }
  const Impl::Current now = impl_->Get();
  absl::Status first_error;
  impl_->joined->ForEachStale(now.generation, [&](Endpoint& endpoint, const JoinOptions& options) {
    absl::StatusOr<std::unique_ptr<Endpoint>> fresh = impl_->JoinOnce(options, now);
    if (!fresh.ok()) {
      if (first_error.ok()) {
        first_error =
            absl::Status(fresh.status().code(),
                         absl::StrCat("Reconnect: rejoining group ", options.spec.name(), " rank ",
                                      options.rank, ": ", fresh.status().message()));
      }
      return false;
    }
    endpoint.Rebind(**fresh);
    return true;
  });
  return first_error;
}

absl::StatusOr<v1::GetStatsResponse> Client::GetStats() {
  const std::shared_ptr<ControlHandle> control = impl_->Get().control;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
  v1::GetStatsResponse response;
  EPD_RETURN_IF_ERROR(internal::AnnotateUnavailable(
      internal::FromGrpcStatus(control->stub->GetStats(&context, v1::GetStatsRequest(), &response)),
      control->target));
  return response;
}

absl::StatusOr<std::string> Client::PeerAddress() {
  EPD_ASSIGN_OR_RETURN(v1::GetStatsResponse stats, GetStats());
  return stats.peer_address();
}

void SetNodes(v1::GroupSpec* spec, const std::vector<GroupNode>& nodes) {
  spec->clear_nodes();
  if (nodes.empty()) return;
  int64_t total = 0;
  for (const GroupNode& node : nodes) {
    v1::NodeSpec* n = spec->add_nodes();
    n->set_peer_address(node.peer_address);
    n->set_num_ranks(node.num_ranks);
    total += node.num_ranks;
  }
  spec->set_num_ranks(static_cast<int32_t>(std::clamp<int64_t>(
      total, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max())));
}

absl::StatusOr<std::vector<GroupNode>> NodesFromRankAddresses(
    const std::vector<std::string>& rank_peer_addresses) {
  std::vector<GroupNode> nodes;
  for (size_t r = 0; r < rank_peer_addresses.size(); ++r) {
    const std::string& address = rank_peer_addresses[r];
    if (!nodes.empty() && nodes.back().peer_address == address) {
      ++nodes.back().num_ranks;
      continue;
    }
    for (const GroupNode& node : nodes) {
      if (node.peer_address == address) {
        return errors::WithReason(
            absl::InvalidArgumentError(
                absl::StrCat("rank ", r, "'s daemon \"", absl::CHexEscape(address),
                             "\" also hosts earlier ranks, but not rank ", r - 1,
                             ": a node's ranks must be contiguous (order the ranks by node)")),
            errors::Reason::kNodesInvalid);
      }
    }
    nodes.push_back({address, 1});
  }
  if (nodes.size() <= 1) return std::vector<GroupNode>{};
  for (size_t i = 0, first = 0; i < nodes.size(); first += nodes[i].num_ranks, ++i) {
    if (nodes[i].peer_address.empty()) {
      return errors::WithReason(
          absl::InvalidArgumentError(absl::StrCat(
              "ranks ", first, "..", first + nodes[i].num_ranks - 1,
              " have a daemon without a Peer address (its peer_listen is off) while other ranks' "
              "daemons have one: a group across daemons needs peer_listen on every daemon")),
          errors::Reason::kNodesInvalid);
    }
  }
  return nodes;
}

absl::StatusOr<v1::ListGroupsResponse> Client::ListGroups() {
  const std::shared_ptr<ControlHandle> control = impl_->Get().control;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
  v1::ListGroupsResponse response;
  EPD_RETURN_IF_ERROR(
      internal::AnnotateUnavailable(internal::FromGrpcStatus(control->stub->ListGroups(
                                        &context, v1::ListGroupsRequest(), &response)),
                                    control->target));
  return response;
}

}  // namespace epd
