#include "daemon/server/peer_credentials.h"

#include <sys/socket.h>

#include <charconv>

#include "absl/strings/str_cat.h"
#include "grpcpp/server_context.h"

namespace epd {

std::string DescribeCredentials(const PeerCredentials& creds) {
  return absl::StrCat("pid ", creds.pid, " uid ", creds.uid, " gid ", creds.gid);
}

std::optional<PeerCredentials> SocketPeerCredentials(int fd) {
  struct ucred cred {};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof(cred)) {
    return std::nullopt;
  }
  return PeerCredentials{cred.pid, cred.uid, cred.gid};
}

PeerCredentialsTable& PeerCredentialsTable::Global() {
  static PeerCredentialsTable table;  // Never destroyed before gRPC's threads: static.
  return table;
}

void PeerCredentialsTable::Set(int fd, const PeerCredentials& creds) {
  absl::MutexLock lock(&mu_);
  by_fd_[fd] = creds;
}

void PeerCredentialsTable::Erase(int fd) {
  absl::MutexLock lock(&mu_);
  by_fd_.erase(fd);
}

std::optional<PeerCredentials> PeerCredentialsTable::Lookup(std::string_view grpc_peer) const {
  constexpr std::string_view kPrefix = "fd:";
  if (grpc_peer.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  std::string_view digits = grpc_peer.substr(kPrefix.size());
  int fd = -1;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), fd);
  if (ec != std::errc() || end != digits.data() + digits.size() || fd < 0) return std::nullopt;
  absl::MutexLock lock(&mu_);
  auto it = by_fd_.find(fd);
  if (it == by_fd_.end()) return std::nullopt;
  return it->second;
}

std::optional<PeerCredentials> CallerCredentials(const grpc::ServerContextBase& context) {
  return PeerCredentialsTable::Global().Lookup(context.peer());
}

}  // namespace epd
