// GrpcPeerMesh: the PeerMesh of epd (peer_mesh.h) over the Peer gRPC service
// (proto/epd/v1/peer.proto): its own gRPC server on peer_listen, a cached channel and a
// worker thread per peer daemon (handshake, rendezvous with backoff, heartbeats, teardown
// notices). DESIGN.md §5.3.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "daemon/peer/peer_auth.h"
#include "daemon/peer/peer_mesh.h"
#include "epd/v1/peer.pb.h"

namespace epd::peer {

/// The Peer protocol version this build speaks; daemons of other versions are refused at
/// the handshake (FAILED_PRECONDITION naming both).
inline constexpr uint32_t kPeerProtocolVersion = 2;
/// Smallest shared secret accepted, in bytes.
inline constexpr size_t kMinPeerSecretBytes = 16;
/// Largest transport descriptor a peer may send, in bytes.
inline constexpr size_t kMaxTransportDescriptorBytes = 64 << 10;
/// Missed heartbeat intervals after which a peer is lost.
inline constexpr int kLostAfterIntervals = 3;

struct PeerMeshOptions {
  /// "host:port" to listen on (port 0 = any free port).
  std::string listen;
  /// The address peers reach this daemon at; "" = `listen` (with the bound port when
  /// `listen` asks for port 0; a wildcard host is refused then).
  std::string advertise;
  /// The cluster's shared secret (at least kMinPeerSecretBytes bytes).
  std::string secret;
  /// PEM contents (not paths): all three for mutual TLS, or none for plaintext.
  std::string tls_cert_pem;
  std::string tls_key_pem;
  std::string tls_ca_pem;
  /// How long a Peer session lives from its handshake: the server refuses its calls after
  /// that (UNAUTHENTICATED), and the client handshakes anew once half of it has passed.
  absl::Duration session_lifetime = absl::Hours(1);
  /// Heartbeat interval; a peer that answers none for kLostAfterIntervals is lost.
  absl::Duration heartbeat_interval = absl::Milliseconds(500);
  /// Largest Peer message accepted, in bytes.
  int max_message_bytes = 4 << 20;
  /// For tests: called with a peer's address just before its worker thread starts; may
  /// throw std::system_error as std::thread does when no thread can be made.
  std::function<void(const std::string& address)> before_worker_start;
};

/// The daemon-wide mesh. Start() binds the listener; destroying it (or Shutdown()) stops
/// the server, sends pending teardown notices (bounded) and joins every thread. GroupPeers
/// handed out may outlive it (their Health is then UNAVAILABLE).
class GrpcPeerMesh final : public PeerMesh {
 public:
  /// Errors: INVALID_ARGUMENT (a bad option, named), UNAVAILABLE (cannot listen).
  static absl::StatusOr<std::unique_ptr<GrpcPeerMesh>> Start(PeerMeshOptions options);
  ~GrpcPeerMesh() override;
  GrpcPeerMesh(const GrpcPeerMesh&) = delete;
  GrpcPeerMesh& operator=(const GrpcPeerMesh&) = delete;

  /// Idempotent; returns within about a second.
  void Shutdown();

  absl::StatusOr<std::unique_ptr<GroupPeers>> RegisterGroup(GroupMembership membership) override;
  std::string advertised_address() const override;
  std::string JoinSecretDigest(std::string_view group, std::string_view join_secret) const override;
  std::vector<v1::GroupNodeInfo> NodeStatuses(const std::string& group) const override;

  /// The TCP port the Peer server is bound to.
  int bound_port() const;
  /// Whether the Peer listener still takes connections: ProbeGrpcListener on the listen
  /// address (a wildcard one through loopback) and the bound port. For health.
  absl::Status ProbeListener(absl::Duration timeout) const;
  /// Peer daemons this mesh runs a worker (thread and channel) for: those a registered
  /// group names, and those still sending teardown notices. For tests.
  int num_peer_workers() const;

  struct State;  ///< Shared with the service, the workers and the GroupPeers.

 private:
  explicit GrpcPeerMesh(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

/// Connects to a gRPC server's listener at `host` ("127.0.0.1", "::1", a name) and `port`,
/// sends the HTTP/2 preface and an empty SETTINGS frame, and waits up to `timeout` for any
/// answer (bytes or a close: the server took the connection). DEADLINE_EXCEEDED when none
/// comes (the server's accept loop is gone, or the backlog is full); UNAVAILABLE when the
/// probe itself fails (no socket, connection refused), naming the address and errno.
absl::Status ProbeGrpcListener(const std::string& host, int port, absl::Duration timeout);
}  // namespace epd::peer
