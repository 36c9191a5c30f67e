// Fuzz target: every Control RPC (proto/epd/v1/control.proto) of the real ControlService,
// GroupRegistry and host data plane, served in-process on a unix socketpair registered the
// way epd's listener registers an accepted connection (its SO_PEERCRED: the caller has an
// identity, so calls get past authentication into the handlers). Each input opens a
// Session, then drives up to 8 calls: each request is a valid template (group "fz", this
// session's id) with fuzz bytes merged over it as protobuf wire bytes, so both well-formed
// and hostile field values reach the handlers; a second Session stream gets fuzzed
// SessionRequests. Properties checked (abort() on violation, so the driver reports it):
// - no crash and no call answered later than 4 s (GetGroupEndpoints waits are capped at
//   50 ms here; every other call answers at once);
// - once the input's sessions end, the registry holds no group and no session (state of
//   a hostile client is released with its session).
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "daemon/control/control_service.h"
#include "daemon/control/group_registry.h"
#include "daemon/dataplane/host/host_data_plane.h"
#include "daemon/gpu/gpu_inventory.h"
#include "daemon/server/peer_credentials.h"
#include "epd/v1/control.grpc.pb.h"
#include "grpcpp/create_channel_posix.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/server_posix.h"
#include "spdlog/spdlog.h"
#include "tests/fuzz/fuzz_input.h"

namespace {

namespace v1 = epd::v1;
using epd::fuzz::FuzzInput;
using Clock = std::chrono::steady_clock;

constexpr auto kCallBound = std::chrono::seconds(4);

struct World {
  std::unique_ptr<epd::DataPlane> plane;
  std::unique_ptr<epd::GroupRegistry> registry;
  std::unique_ptr<epd::ControlService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<v1::Control::Stub> stub;

  World() {
    epd::fuzz::Quiet();
    epd::HostDataPlaneOptions o;
    o.op_timeout_ms = 200;
    o.host_threads = 1;
    plane = std::move(epd::MakeHostDataPlane(o).value());
    epd::GroupRegistry::Options options;
    options.max_groups = 8;
    options.max_endpoints_wait_ms = 50;
    options.max_endpoint_bytes_per_uid = 64ull << 20;
    options.operator_uid = ::geteuid();
    registry = std::make_unique<epd::GroupRegistry>(
        plane.get(), epd::GpuInventory::FromList({}, "fuzz: host backend"), options);
    service = std::make_unique<epd::ControlService>(registry.get(),
                                                    [] { return v1::GetStatsResponse(); });
    grpc::ServerBuilder builder;
    builder.RegisterService(service.get());
    server = builder.BuildAndStart();
    int fds[2];
    if (server == nullptr ||
        ::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, fds) != 0) {
      std::abort();
    }
    // As epd's listener does with a connection it accepted (gRPC needs non-blocking fds).
    std::optional<epd::PeerCredentials> creds = epd::SocketPeerCredentials(fds[0]);
    if (!creds) std::abort();
    epd::PeerCredentialsTable::Global().Set(fds[0], *creds);
    grpc::AddInsecureChannelFromFd(server.get(), fds[0]);
    stub = v1::Control::NewStub(grpc::CreateInsecureChannelFromFd("fuzz", fds[1]));
  }
};

v1::GroupSpec TemplateSpec() {
  v1::GroupSpec spec;
  spec.set_name("fz");
  spec.set_num_ranks(2);
  spec.set_num_experts(4);
  spec.set_hidden(128);
  spec.set_num_topk(2);
  spec.set_max_tokens_per_rank(4);
  spec.set_ll_max_tokens_per_rank(4);
  return spec;
}

/// One unary call with a deadline; abort() when it answers later than kCallBound.
template <typename Request, typename Response>
grpc::Status Call(v1::Control::Stub* stub,
                  grpc::Status (v1::Control::Stub::*rpc)(grpc::ClientContext*, const Request&,
                                                         Response*),
                  const Request& request, const char* name) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  Response response;
  const Clock::time_point start = Clock::now();
  grpc::Status status = (stub->*rpc)(&context, request, &response);
  if (Clock::now() - start > kCallBound) {
    std::fprintf(stderr, "fuzz: %s answered after more than 4 s: %s\n", name,
                 status.error_message().c_str());
    std::abort();
  }
  return status;
}

/// Opens a Session: the stream and its id ("" when refused).
struct Session {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>> stream;
  std::string id;

  Session(v1::Control::Stub* stub, const v1::SessionRequest& hello) {
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    stream = stub->Session(&context);
    v1::SessionResponse open;
    if (stream->Write(hello) && stream->Read(&open)) id = open.session_id();
  }
  void Close() {
    stream->WritesDone();
    v1::SessionResponse more;
    while (stream->Read(&more)) {
    }
    (void)stream->Finish();
  }
};

/// Sets the session id of a request from the template unless the fuzz keeps its own.
template <typename Request>
void Fill(FuzzInput& in, const std::string& session_id, Request* request) {
  request->set_group("fz");
  request->set_rank(in.Byte() % 3);
  request->set_session_id(session_id);
  in.MergeInto(request);
}

void Drive(World& w, FuzzInput& in) {
  v1::SessionRequest hello;
  hello.set_client_name("fuzz");
  Session session(w.stub.get(), hello);
  v1::Control::Stub* stub = w.stub.get();
  for (int call = 0; call < 8 && !in.empty(); ++call) {
    switch (in.Byte() % 8) {
      case 0: {
        v1::JoinGroupRequest r;
        *r.mutable_spec() = TemplateSpec();
        r.set_rank(in.Byte() % 3);
        r.set_session_id(session.id);
        in.MergeInto(&r);
        (void)Call(stub, &v1::Control::Stub::JoinGroup, r, "JoinGroup");
        break;
      }
      case 1: {
        v1::LeaveGroupRequest r;
        Fill(in, session.id, &r);
        (void)Call(stub, &v1::Control::Stub::LeaveGroup, r, "LeaveGroup");
        break;
      }
      case 2: {
        v1::GetGroupEndpointsRequest r;
        Fill(in, session.id, &r);
        r.set_wait_ms(r.wait_ms() % 51);
        (void)Call(stub, &v1::Control::Stub::GetGroupEndpoints, r, "GetGroupEndpoints");
        break;
      }
      case 3: {
        v1::ListGroupsRequest r;
        in.MergeInto(&r);
        (void)Call(stub, &v1::Control::Stub::ListGroups, r, "ListGroups");
        break;
      }
      case 4: {
        v1::GetStatsRequest r;
        in.MergeInto(&r);
        (void)Call(stub, &v1::Control::Stub::GetStats, r, "GetStats");
        break;
      }
      case 5: {
        v1::UpdateRankMaskRequest r;
        Fill(in, session.id, &r);
        (void)Call(stub, &v1::Control::Stub::UpdateRankMask, r, "UpdateRankMask");
        break;
      }
      case 6: {
        v1::GetRankMaskRequest r;
        Fill(in, session.id, &r);
        (void)Call(stub, &v1::Control::Stub::GetRankMask, r, "GetRankMask");
        break;
      }
      default: {
        // A second Session: fuzzed SessionRequests, the first opening it.
        v1::SessionRequest first;
        in.MergeInto(&first);
        const Clock::time_point start = Clock::now();
        Session other(stub, first);
        for (int i = in.Byte() % 4; i > 0; --i) {
          v1::SessionRequest more;
          in.MergeInto(&more);
          if (!other.stream->Write(more)) break;
        }
        other.Close();
        if (Clock::now() - start > kCallBound) {
          std::fprintf(stderr, "fuzz: a Session stream took more than 4 s\n");
          std::abort();
        }
        break;
      }
    }
  }
  session.Close();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static World* world = new World();  // Lives for the whole fuzzing process.
  FuzzInput in(data, size);
  Drive(*world, in);
  // Sessions ended: their endpoints, and groups left without ranks, are released (the
  // registry does so as the stream's end reaches it: bounded wait).
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(5);
  epd::GroupRegistry::Counters c = world->registry->counters();
  while ((c.num_groups != 0 || c.num_sessions != 0) && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    c = world->registry->counters();
  }
  if (c.num_groups != 0 || c.num_sessions != 0) {
    std::fprintf(stderr, "fuzz: after the sessions ended, %d group(s) and %d session(s) remain\n",
                 c.num_groups, c.num_sessions);
    std::abort();
  }
  return 0;
}
