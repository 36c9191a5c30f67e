// The identity of a local client: the kernel's SO_PEERCRED of its connection to epd's unix
// socket, recorded when epd accepted the connection (daemon/server/listener.h), never taken from a
// request. docs/SECURITY.md says what each part of epd uses it for.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace grpc {
class ServerContextBase;
}  // namespace grpc

namespace epd {

/// A peer process as the kernel saw it when it connected (pid in epd's pid namespace).
struct PeerCredentials {
  int64_t pid = 0;
  uint32_t uid = 0;
  uint32_t gid = 0;

  bool operator==(const PeerCredentials&) const = default;
};

/// "pid 123 uid 1000 gid 1000", for logs and errors.
std::string DescribeCredentials(const PeerCredentials& creds);

/// SO_PEERCRED of a connected unix socket. INTERNAL naming errno when the kernel refuses.
std::optional<PeerCredentials> SocketPeerCredentials(int fd);

/// Process-wide map from the connection fd epd accepted to its peer's credentials. gRPC
/// names a call's connection "fd:N" when epd hands it accepted fd N
/// (grpc::AddInsecureChannelFromFd), so CallerCredentials finds a call's peer by that name.
/// An entry is replaced when the fd number is reused by a later accept. Thread-safe.
class PeerCredentialsTable {
 public:
  static PeerCredentialsTable& Global();

  void Set(int fd, const PeerCredentials& creds);
  void Erase(int fd);
  /// The credentials of grpc_peer ("fd:N"); nullopt for any other peer string (TCP,
  /// in-process channels) or an fd epd did not accept.
  std::optional<PeerCredentials> Lookup(std::string_view grpc_peer) const;

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<int, PeerCredentials> by_fd_ ABSL_GUARDED_BY(mu_);
};

/// The credentials of the process that made a gRPC call on epd's unix socket; nullopt when
/// the call did not come through epd's own listener (the TCP health listener).
std::optional<PeerCredentials> CallerCredentials(const grpc::ServerContextBase& context);

}  // namespace epd
