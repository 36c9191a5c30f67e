// Fuzz target: the Peer service (proto/epd/v1/peer.proto) of a real GrpcPeerMesh listening
// on 127.0.0.1, which has registered group "pz" spanning itself (node 0) and a node 1 at
// kCaller, the daemon id this target claims. Each input drives up to 8 calls: Challenge;
// Hello (from fuzz bytes, or a correct handshake over the last server nonce with fields
// merged over it); Rendezvous, Heartbeat and Leave (a valid template with fuzz bytes merged
// over it as protobuf wire bytes, then signed with the session's key and the next counter,
// or left with the fuzzed auth), so the handlers' request checks are reached past
// authentication; and peer_auth's certificate-name check on fuzzed names. Properties
// (abort() on violation): no crash; every call answers within 4 s; a correct handshake is
// never refused; a call signed with the session's key and a fresh counter is never
// UNAUTHENTICATED; once the input ends, the mesh still completes a correct handshake.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/peer/grpc_peer_mesh.h"
#include "daemon/peer/peer_auth.h"
#include "epd/v1/peer.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "tests/fuzz/fuzz_input.h"

namespace {

namespace v1 = epd::v1;
namespace peer = epd::peer;
using epd::fuzz::FuzzInput;
using Clock = std::chrono::steady_clock;

constexpr char kSecret[] = "epd-fuzz-peer-secret-0123456789";
constexpr char kCaller[] = "127.0.0.1:1";  // Node 1 of group "pz": nothing listens there.

struct World {
  std::unique_ptr<peer::GrpcPeerMesh> mesh;
  std::unique_ptr<peer::GroupPeers> group;
  v1::GroupSpec spec;
  std::unique_ptr<v1::Peer::Stub> stub;

  World() {
    epd::fuzz::Quiet();
    peer::PeerMeshOptions options;
    options.listen = "127.0.0.1:0";
    options.secret = kSecret;
    options.heartbeat_interval = absl::Milliseconds(200);
    auto started = peer::GrpcPeerMesh::Start(options);
    if (!started.ok()) {
      std::fprintf(stderr, "fuzz: %s\n", started.status().ToString().c_str());
      std::abort();
    }
    mesh = *std::move(started);
    spec.set_name("pz");
    spec.set_num_ranks(2);
    spec.set_num_experts(4);
    spec.set_hidden(128);
    spec.set_num_topk(2);
    spec.set_max_tokens_per_rank(4);
    for (const std::string& address : {mesh->advertised_address(), std::string(kCaller)}) {
      v1::NodeSpec* node = spec.add_nodes();
      node->set_peer_address(address);
      node->set_num_ranks(1);
    }
    peer::GroupMembership membership;
    membership.spec = spec;
    membership.self_node = 0;
    membership.transport_descriptor = "fuzz";
    membership.join_secret_digest = mesh->JoinSecretDigest("pz", "");
    membership.wake = [] {};
    auto registered = mesh->RegisterGroup(membership);
    if (!registered.ok()) {
      std::fprintf(stderr, "fuzz: %s\n", registered.status().ToString().c_str());
      std::abort();
    }
    group = *std::move(registered);
    stub = v1::Peer::NewStub(
        grpc::CreateChannel(mesh->advertised_address(), grpc::InsecureChannelCredentials()));
  }
};

/// One call with a deadline; abort() when it answers after 4 s.
template <typename Request, typename Response>
grpc::Status Call(v1::Peer::Stub* stub,
                  grpc::Status (v1::Peer::Stub::*rpc)(grpc::ClientContext*, const Request&,
                                                      Response*),
                  const Request& request, Response* response, const char* name) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  const Clock::time_point start = Clock::now();
  grpc::Status status = (stub->*rpc)(&context, request, response);
  if (Clock::now() - start > std::chrono::seconds(4)) {
    std::fprintf(stderr, "fuzz: %s answered after more than 4 s: %s\n", name,
                 status.error_message().c_str());
    std::abort();
  }
  return status;
}

/// A handshake's state: the last server nonce, and the session once Hello succeeded.
struct Handshake {
  std::string server_nonce;
  std::string session_id, key;
  uint64_t counter = 0;
};

/// A correct handshake (Challenge, then Hello with the right proof); abort() when refused.
void Greet(World& w, Handshake& h, const std::string& client_nonce) {
  v1::ChallengeRequest challenge;
  challenge.set_protocol_version(peer::kPeerProtocolVersion);
  v1::ChallengeResponse nonce;
  grpc::Status s = Call(w.stub.get(), &v1::Peer::Stub::Challenge, challenge, &nonce, "Challenge");
  if (!s.ok()) {
    std::fprintf(stderr, "fuzz: a correct Challenge was refused: %s\n", s.error_message().c_str());
    std::abort();
  }
  v1::HelloRequest hello;
  hello.set_protocol_version(peer::kPeerProtocolVersion);
  hello.set_daemon_id(kCaller);
  hello.set_server_nonce(nonce.server_nonce());
  hello.set_client_nonce(client_nonce);
  hello.set_proof(peer::HelloProof(kSecret, nonce.server_nonce(), client_nonce, kCaller));
  v1::HelloResponse welcome;
  s = Call(w.stub.get(), &v1::Peer::Stub::Hello, hello, &welcome, "Hello");
  if (!s.ok()) {
    std::fprintf(stderr, "fuzz: a correct Hello was refused: %s\n", s.error_message().c_str());
    std::abort();
  }
  h.session_id = welcome.session_id();
  h.key = peer::SessionKey(kSecret, nonce.server_nonce(), client_nonce, kCaller);
  h.counter = 0;
}

/// Signs `request` for the session (when there is one and the fuzz asks) and sends it;
/// abort() when a correctly signed call is refused as UNAUTHENTICATED.
template <typename Request, typename Response>
void Signed(World& w, FuzzInput& in, Handshake& h, const char* method,
            grpc::Status (v1::Peer::Stub::*rpc)(grpc::ClientContext*, const Request&, Response*),
            Request& request) {
  const bool sign = !h.session_id.empty() && in.Byte() % 4 != 0;
  if (sign) peer::SignPeerRequest(method, h.session_id, h.key, ++h.counter, &request);
  Response response;
  grpc::Status s = Call(w.stub.get(), rpc, request, &response, method);
  if (sign && s.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
    std::fprintf(stderr, "fuzz: a correctly signed %s was refused: %s\n", method,
                 s.error_message().c_str());
    std::abort();
  }
}

v1::GroupRegistration Registration(const World& w) {
  v1::GroupRegistration r;
  *r.mutable_spec() = w.spec;
  r.set_node(1);
  r.set_incarnation(7);
  r.set_transport_descriptor("peer");
  r.set_daemon_instance(11);
  r.set_registration_seq(1);
  r.set_joined_ranks(std::string(1, '\1'));
  return r;
}

void Drive(World& w, FuzzInput& in) {
  Handshake h;
  for (int call = 0; call < 8 && !in.empty(); ++call) {
    switch (in.Byte() % 7) {
      case 0: {
        v1::ChallengeRequest r;
        r.set_protocol_version(in.Bool() ? peer::kPeerProtocolVersion : in.U32());
        v1::ChallengeResponse nonce;
        if (Call(w.stub.get(), &v1::Peer::Stub::Challenge, r, &nonce, "Challenge").ok()) {
          h.server_nonce = nonce.server_nonce();
        }
        break;
      }
      case 1: {
        // Fuzzed fields over a handshake that is correct but for them.
        v1::HelloRequest r;
        const std::string client_nonce = in.Take(32);
        r.set_protocol_version(peer::kPeerProtocolVersion);
        r.set_daemon_id(kCaller);
        r.set_server_nonce(h.server_nonce);
        r.set_client_nonce(client_nonce);
        r.set_proof(peer::HelloProof(kSecret, h.server_nonce, client_nonce, kCaller));
        in.MergeInto(&r);
        v1::HelloResponse welcome;
        if (Call(w.stub.get(), &v1::Peer::Stub::Hello, r, &welcome, "Hello").ok()) {
          h.session_id = welcome.session_id();
          h.key = peer::SessionKey(kSecret, r.server_nonce(), r.client_nonce(), r.daemon_id());
          h.counter = 0;
        }
        h.server_nonce.clear();
        break;
      }
      case 2:
        Greet(w, h, std::string(32, static_cast<char>(in.Byte())));
        break;
      case 3: {
        v1::RendezvousRequest r;
        *r.mutable_registration() = Registration(w);
        in.MergeInto(&r);
        Signed(w, in, h, "Rendezvous", &v1::Peer::Stub::Rendezvous, r);
        break;
      }
      case 4: {
        v1::HeartbeatRequest r;
        r.mutable_held()->set_daemon_instance(11);
        v1::HeldGroup* held = r.mutable_held()->add_groups();
        held->set_name("pz");
        held->set_incarnation(7);
        held->set_joined_ranks(std::string(1, '\1'));
        in.MergeInto(&r);
        Signed(w, in, h, "Heartbeat", &v1::Peer::Stub::Heartbeat, r);
        break;
      }
      case 5: {
        v1::LeaveRequest r;
        r.set_group("pz");
        r.set_incarnation(7);
        in.MergeInto(&r);
        Signed(w, in, h, "Leave", &v1::Peer::Stub::Leave, r);
        break;
      }
      default: {
        std::vector<std::string> sans, common_names;
        const std::string id = in.Bytes();
        for (int i = in.Byte() % 4; i > 0; --i) sans.push_back(in.Bytes());
        for (int i = in.Byte() % 3; i > 0; --i) common_names.push_back(in.Bytes());
        (void)peer::CheckPeerCertificateNames(id, sans, common_names);
        break;
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static World* world = new World();  // Lives for the whole fuzzing process.
  FuzzInput in(data, size);
  Drive(*world, in);
  // Whatever came before, the service still serves a correct peer.
  Handshake h;
  Greet(*world, h, std::string(32, 'z'));
  return 0;
}
