// MeasurePlainTcp (tcp_transport.h): the same bytes over plain blocking TCP sockets.
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/errors/reason.h"
#include "common/os/scoped_fd.h"
#include "daemon/transport/tcp/tcp_transport.h"
#include "proto/abi/tcp_wire.h"

namespace epd::transport {
namespace {

constexpr size_t kCallBytes = 1 << 20;

absl::Status SocketError(const char* call) {
  return errors::WithReason(
      absl::UnavailableError(absl::StrCat("plain TCP measurement: ", call, ": ",
                                          std::strerror(errno), " (errno ", errno, ")")),
      errors::Reason::kTransportFailed);
}

void Configure(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  timeval tv{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
}

}  // namespace

absl::StatusOr<std::vector<PlainTcpPair>> ConnectPlainTcpPairs(int32_t count,
                                                               const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), "0", &hints, &res) != 0 || res == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("plain TCP measurement: cannot resolve host '", host, "'"));
  }
  sockaddr_storage sa{};
  socklen_t sa_len = res->ai_addrlen;
  std::memcpy(&sa, res->ai_addr, res->ai_addrlen);
  ::freeaddrinfo(res);

  ScopedFd listener(::socket(sa.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!listener.valid()) return SocketError("socket");
  if (::bind(listener.get(), reinterpret_cast<sockaddr*>(&sa), sa_len) != 0) {
    return SocketError("bind");
  }
  if (::listen(listener.get(), std::max(count, 1)) != 0) return SocketError("listen");
  if (::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&sa), &sa_len) != 0) {
    return SocketError("getsockname");
  }
  std::vector<PlainTcpPair> pairs;
  for (int32_t i = 0; i < count; ++i) {
    PlainTcpPair p;
    p.sender = ScopedFd(::socket(sa.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!p.sender.valid()) return SocketError("socket");
    Configure(p.sender.get());
    if (::connect(p.sender.get(), reinterpret_cast<sockaddr*>(&sa), sa_len) != 0) {
      return SocketError("connect");
    }
    p.receiver = ScopedFd(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!p.receiver.valid()) return SocketError("accept");
    Configure(p.receiver.get());
    pairs.push_back(std::move(p));
  }
  return pairs;
}

absl::StatusOr<PlainTcpResult> MeasurePlainTcp(uint64_t bytes, int32_t connections,
                                               const std::string& host) {
  if (bytes == 0 || connections < 1 ||
      connections > static_cast<int32_t>(abi::kTcpMaxConnections)) {
    return absl::InvalidArgumentError(
        absl::StrCat("plain TCP measurement: bytes ", bytes, ", connections ", connections,
                     " (want bytes > 0, connections in [1, ", abi::kTcpMaxConnections, "])"));
  }
  absl::StatusOr<std::vector<PlainTcpPair>> pairs = ConnectPlainTcpPairs(connections, host);
  if (!pairs.ok()) return pairs.status();
  std::vector<ScopedFd> senders, receivers;
  for (PlainTcpPair& p : *pairs) {
    senders.push_back(std::move(p.sender));
    receivers.push_back(std::move(p.receiver));
  }

  std::atomic<int> failed_errno{0};
  const auto share = [&](int32_t i) {
    return bytes / connections + (static_cast<uint64_t>(i) < bytes % connections ? 1 : 0);
  };
  const auto send_part = [&](int32_t i) {
    std::vector<char> buf(kCallBytes, static_cast<char>(i));
    for (uint64_t left = share(i); left > 0;) {
      const ssize_t r =
          ::send(senders[i].get(), buf.data(), std::min<uint64_t>(left, kCallBytes), MSG_NOSIGNAL);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        failed_errno = errno != 0 ? errno : EPIPE;
        return;
      }
      left -= static_cast<uint64_t>(r);
    }
  };
  const auto recv_part = [&](int32_t i) {
    std::vector<char> buf(kCallBytes);
    for (uint64_t left = share(i); left > 0;) {
      const ssize_t r =
          ::recv(receivers[i].get(), buf.data(), std::min<uint64_t>(left, kCallBytes), 0);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        failed_errno = errno != 0 ? errno : ECONNRESET;
        return;
      }
      left -= static_cast<uint64_t>(r);
    }
  };
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int32_t i = 0; i < connections; ++i) {
    threads.emplace_back(recv_part, i);
    threads.emplace_back(send_part, i);
  }
  for (std::thread& t : threads) t.join();
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  if (failed_errno != 0) {
    errno = failed_errno;
    return SocketError("send/recv");
  }
  PlainTcpResult result;
  result.bytes = bytes;
  result.connections = connections;
  result.seconds = took.count();
  return result;
}

}  // namespace epd::transport
