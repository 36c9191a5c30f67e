// Raw TCP clients for tests: a connection to 127.0.0.1 (ConnectTcp), and for epd's metrics
// listener (--metrics_listen) a plain GET and the hostile ones (a flood of header lines, a
// head sent one byte at a time, idle connections). Header-only; everything on 127.0.0.1.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/os/scoped_fd.h"
#include "tests/common/unix_socket.h"

namespace epd::testing {

/// A blocking socket connected to 127.0.0.1:`port`; invalid when connect fails.
inline ScopedFd ConnectTcp(int port) {
  ScopedFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (!fd.valid() || ::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ScopedFd();
  }
  return fd;
}

/// GET `path` on a new connection; the whole answer (status line, headers, body), or ""
/// when it did not connect or close within `timeout`.
inline std::string RawGet(int port, const std::string& path,
                          absl::Duration timeout = absl::Seconds(10)) {
  ScopedFd fd = ConnectTcp(port);
  if (!fd.valid()) return "";
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: x\r\n\r\n");
  if (::send(fd.get(), request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    return "";
  }
  Reply reply = ReadUntilClosed(fd.get(), timeout);
  return reply.closed ? reply.bytes : "";
}

/// A request line, then header lines ("X-Flood-NNNNNN: y\r\n", each short) sent without
/// the empty line that ends a head, until `max_bytes` were sent or the server refused
/// more. `sent`: bytes the kernel took; `refused`: a send failed (the server closed);
/// `reply`: what the server answered (read until it closed, at most `read_timeout`).
struct FloodResult {
  size_t sent = 0;
  bool refused = false;
  Reply reply;
};

inline FloodResult FloodHeaderLines(int port, size_t max_bytes,
                                    absl::Duration read_timeout = absl::Seconds(10)) {
  FloodResult result;
  ScopedFd fd = ConnectTcp(port);
  if (!fd.valid()) return result;
  std::string chunk = "GET /metrics HTTP/1.1\r\nHost: x\r\n";
  int line = 0;
  while (result.sent < max_bytes) {
    while (chunk.size() < 4096) absl::StrAppend(&chunk, "X-Flood-", line++, ": y\r\n");
    size_t off = 0;
    while (off < chunk.size()) {
      const ssize_t n = ::send(fd.get(), chunk.data() + off, chunk.size() - off, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        result.refused = true;
        break;
      }
      off += static_cast<size_t>(n);
      result.sent += static_cast<size_t>(n);
    }
    if (result.refused) break;
    chunk.clear();
  }
  result.reply = ReadUntilClosed(fd.get(), read_timeout);
  return result;
}

/// A head sent one byte every `interval` (a request line, then header bytes, never the
/// empty line that ends it). How long the server kept the connection open, or
/// InfiniteDuration when it still was after `give_up`.
inline absl::Duration SlowHeadHeldFor(int port, absl::Duration interval, absl::Duration give_up) {
  ScopedFd fd = ConnectTcp(port);
  if (!fd.valid()) return absl::ZeroDuration();
  const absl::Time start = absl::Now();
  const std::string head = "GET /metrics HTTP/1.1\r\nX-Slow: ";
  size_t i = 0;
  while (absl::Now() - start < give_up) {
    const char c = i < head.size() ? head[i] : 'z';
    ++i;
    if (::send(fd.get(), &c, 1, MSG_NOSIGNAL) != 1) return absl::Now() - start;
    if (ReadUntilClosed(fd.get(), interval).closed) return absl::Now() - start;
  }
  return absl::InfiniteDuration();
}

/// `n` connections that send nothing.
inline std::vector<ScopedFd> OpenIdleConnections(int port, int n) {
  std::vector<ScopedFd> fds;
  for (int i = 0; i < n; ++i) fds.push_back(ConnectTcp(port));
  return fds;
}

}  // namespace epd::testing
