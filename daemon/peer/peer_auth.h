// The Peer service's authentication as pure functions (DESIGN.md §5.3, docs/SECURITY.md
// "Daemons across nodes"): the handshake's proof and session key, the join-secret digest,
// the per-call request MAC, and the TLS caller's certificate names against its daemon id.
// grpc_peer_mesh.cc runs the protocol with them; tools and tests speak it by hand.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"

namespace epd::peer {

/// The handshake's values (peer.proto HelloRequest.proof and PeerAuth's session key), for
/// tools and tests that speak the Peer protocol by hand.
std::string HelloProof(absl::string_view secret, absl::string_view server_nonce,
                       absl::string_view client_nonce, absl::string_view daemon_id);
std::string SessionKey(absl::string_view secret, absl::string_view server_nonce,
                       absl::string_view client_nonce, absl::string_view daemon_id);
/// With mutual TLS, the Peer server's check of a caller's identity: OK when the host of
/// `daemon_id` ("host:port", "[v6]:port") is one of the certificate's subject alternative
/// names `sans` (DNS names, "*." wildcards of one label, IP addresses), or, when it has
/// none, one of its `common_names`; else PERMISSION_DENIED naming both.
absl::Status CheckPeerCertificateNames(absl::string_view daemon_id,
                                       const std::vector<std::string>& sans,
                                       const std::vector<std::string>& common_names);
/// GroupRegistration.join_secret_digest: HMAC-SHA256(secret, "epd-join-secret-v1" 0
/// group, join_secret), 32 bytes.
std::string JoinSecretDigest(absl::string_view secret, absl::string_view group,
                             absl::string_view join_secret);
/// PeerAuth.mac of a request whose auth is cleared: over `method` ("Rendezvous",
/// "Heartbeat", "Leave"), the session's call `counter` and the request's deterministic
/// serialization.
std::string PeerRequestMac(absl::string_view session_key, absl::string_view method,
                           uint64_t counter, const google::protobuf::Message& request_without_auth);
/// Fills request->auth for `session_id` / `session_key` and the session's call `counter`
/// (strictly rising, from 1) of a RendezvousRequest, HeartbeatRequest or LeaveRequest.
template <typename Request>
void SignPeerRequest(absl::string_view method, absl::string_view session_id,
                     absl::string_view session_key, uint64_t counter, Request* request) {
  Request copy = *request;
  copy.clear_auth();
  request->mutable_auth()->set_session_id(std::string(session_id));
  request->mutable_auth()->set_counter(counter);
  request->mutable_auth()->set_mac(PeerRequestMac(session_key, method, counter, copy));
}

}  // namespace epd::peer
