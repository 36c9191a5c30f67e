// Client: the connection to the local epd (client/include/epd/client.h). Connect opens
// the Session stream and a background thread keeps reading it for the client's lifetime;
// the daemon treats the stream's end as this process's death and releases its endpoints.
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
#include "client/fd_channel.h"
#include "client/request_text.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "epd/v1/control.grpc.pb.h"

namespace epd {
namespace {

/// Deadline of the unary control RPCs (JoinGroup allocates buffers: allow time).
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

}  // namespace

struct Client::Impl {
  ClientOptions options;
  std::shared_ptr<ControlHandle> control;

  grpc::ClientContext session_context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>> stream;
  std::thread reader;

  absl::Mutex mu;
  std::string session_id ABSL_GUARDED_BY(mu);
  bool ended ABSL_GUARDED_BY(mu) = false;
  absl::Status end_status ABSL_GUARDED_BY(mu);
  std::string last_event ABSL_GUARDED_BY(mu);
  std::string session_id_copy;  ///< Set once Connect succeeds; read without the lock.
  /// Marked lost when the Session stream ends: endpoints stop waiting for completions
  /// then, and release CUDA streams left waiting for the daemon.
  std::shared_ptr<internal::SessionWatch> session_watch =
      std::make_shared<internal::SessionWatch>();

  /// Reader thread: records the session id and later events until the stream ends.
  void ReadSession() {
    v1::SessionResponse response;
    while (stream->Read(&response)) {
      absl::MutexLock lock(&mu);
      if (session_id.empty()) session_id = response.session_id();
      last_event = response.event();
    }
    grpc::Status status = stream->Finish();
    session_watch->MarkLost();
    absl::MutexLock lock(&mu);
    ended = true;
    end_status = status.ok() ? errors::WithReason(absl::UnavailableError("epd ended the session"),
                                                  errors::Reason::kDaemonUnavailable)
                             : internal::FromGrpcStatus(status);
  }

  absl::Status SessionAlive() {
    absl::MutexLock lock(&mu);
    if (!ended) return absl::OkStatus();
    return errors::WithReason(
        absl::UnavailableError(absl::StrCat("the session with epd on ", control->target,
                                            " ended: ", end_status.message())),
        errors::Reason::kDaemonUnavailable);
  }

  ~Impl() {
    session_context.TryCancel();
    if (reader.joinable()) reader.join();
  }
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  EPD_RETURN_IF_ERROR(internal::CheckRequestText("ClientOptions::client_name", options.client_name,
                                                 internal::kMaxClientNameBytes));
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  auto control = std::make_shared<ControlHandle>();
  control->target = internal::ChannelTarget(options.socket_path);
  control->channel = internal::MakeControlChannel(control->target);
  control->stub = v1::Control::NewStub(control->channel);
  impl->control = control;

  // A path where nothing can answer fails at once instead of after connect_timeout.
  EPD_RETURN_IF_ERROR(internal::CheckUnixSocket(control->target, "ClientOptions::socket_path"));
  const absl::Time deadline = absl::Now() + options.connect_timeout;
  if (!control->channel->WaitForConnected(absl::ToChronoTime(deadline))) {
    return errors::WithReason(
        absl::UnavailableError(absl::StrCat(
            "no epd daemon answers on ", control->target, " within ",
            absl::FormatDuration(options.connect_timeout), " (is epd running on that socket?)")),
        errors::Reason::kDaemonUnavailable);
  }
  impl->stream = control->stub->Session(&impl->session_context);
  v1::SessionRequest hello;
  hello.set_client_pid(::getpid());
  hello.set_client_name(options.client_name.empty() ? DefaultClientName() : options.client_name);
  hello.set_client_version(kEpdVersion);
  if (!impl->stream->Write(hello)) {
    // The server may refuse before the first write lands (e.g. UNIMPLEMENTED from epd's
    // TCP health listener): explained as when the refusal comes after it.
    grpc::Status status = impl->stream->Finish();
    return internal::ExplainControlError(
        status.ok() ? errors::WithReason(absl::UnavailableError("Session stream closed"),
                                         errors::Reason::kDaemonUnavailable)
                    : internal::FromGrpcStatus(status),
        control->target);
  }
  Impl* raw = impl.get();
  impl->reader = std::thread([raw] { raw->ReadSession(); });
  {
    absl::MutexLock lock(&impl->mu);
    auto answered = [raw]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(raw->mu) {
      return !raw->session_id.empty() || raw->ended;
    };
    if (!impl->mu.AwaitWithDeadline(absl::Condition(&answered), deadline)) {
      impl->session_context.TryCancel();  // The reader ends; ~Impl joins it.
      return errors::WithReason(absl::UnavailableError(absl::StrCat(
                                    "epd on ", control->target, " did not open a Session within ",
                                    absl::FormatDuration(options.connect_timeout))),
                                errors::Reason::kDaemonUnavailable);
    }
    if (impl->session_id.empty()) {
      return internal::ExplainControlError(impl->end_status, control->target);
    }
    impl->session_id_copy = impl->session_id;
  }
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

const std::string& Client::session_id() const { return impl_->session_id_copy; }

absl::StatusOr<std::unique_ptr<Endpoint>> Client::Join(const JoinOptions& options) {
  EPD_RETURN_IF_ERROR(impl_->SessionAlive());
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
  std::shared_ptr<ControlHandle> control = impl_->control;
  v1::JoinGroupRequest request;
  *request.mutable_spec() = options.spec;
  request.set_rank(options.rank);
  request.set_gpu_uuid(options.gpu_uuid);
  request.set_session_id(impl_->session_id_copy);
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
  const std::string session_id = impl_->session_id_copy;
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
                                  impl_->session_watch, group_endpoints, rank_mask);
  }();
  if (!endpoint.ok()) {
    leave().IgnoreError();  // Give the rank back: this process cannot use it.
    return endpoint.status();
  }
  return endpoint;
}

absl::StatusOr<v1::GetStatsResponse> Client::GetStats() {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
  v1::GetStatsResponse response;
  EPD_RETURN_IF_ERROR(
      internal::AnnotateUnavailable(internal::FromGrpcStatus(impl_->control->stub->GetStats(
                                        &context, v1::GetStatsRequest(), &response)),
                                    impl_->control->target));
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

absl::Status Client::Reconnect(absl::Duration /*timeout*/) {
  return absl::UnimplementedError("Client::Reconnect is not built yet");
}

absl::StatusOr<v1::ListGroupsResponse> Client::ListGroups() {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
  v1::ListGroupsResponse response;
  EPD_RETURN_IF_ERROR(
      internal::AnnotateUnavailable(internal::FromGrpcStatus(impl_->control->stub->ListGroups(
                                        &context, v1::ListGroupsRequest(), &response)),
                                    impl_->control->target));
  return response;
}

}  // namespace epd
