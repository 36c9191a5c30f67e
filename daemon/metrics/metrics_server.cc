// The metrics HTTP listener (metrics_server.h).
#include "daemon/metrics/metrics_server.h"

#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "daemon/metrics/exposition.h"

namespace epd::metrics {

using Clock = std::chrono::steady_clock;

namespace {

/// After its answer a connection is drained at most this long and this much.
constexpr auto kDrainTimeout = std::chrono::milliseconds(1000);
constexpr size_t kMaxDrainBytes = 256 * 1024;

/// Where the head ends (the index past its empty line), or npos while it has not. Lines
/// end in "\r\n" or, leniently, "\n".
size_t HeadEnd(absl::string_view in) {
  for (size_t i = in.find('\n'); i != absl::string_view::npos; i = in.find('\n', i + 1)) {
    if (i + 1 < in.size() && in[i + 1] == '\n') return i + 2;
    if (i + 2 < in.size() && in[i + 1] == '\r' && in[i + 2] == '\n') return i + 3;
  }
  return absl::string_view::npos;
}

std::string Response(int code, absl::string_view reason, absl::string_view content_type,
                     absl::string_view body, absl::string_view extra_header = "") {
  return absl::StrCat("HTTP/1.1 ", code, " ", reason, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\n", extra_header,
                      "Connection: close\r\n\r\n", body);
}

std::string PlainResponse(int code, absl::string_view reason, absl::string_view extra = "") {
  return Response(code, reason, "text/plain; charset=utf-8", absl::StrCat(reason, "\n"), extra);
}

}  // namespace

struct MetricsServer::Connection {
  enum class State { kReadHead, kWrite, kDrain, kClosed };
  ScopedFd fd;
  State state = State::kReadHead;
  std::string in;   ///< The head so far (at most max_head_bytes + 1 bytes).
  std::string out;  ///< The answer.
  size_t sent = 0;
  bool drain_after = true;  ///< Drain after the answer (not after a refused head).
  size_t drained = 0;
  Clock::time_point deadline;
};

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& listen, std::function<std::string()> render) {
  return Start(listen, std::move(render), Limits{});
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& listen, std::function<std::string()> render, Limits limits) {
  const size_t colon = listen.rfind(':');
  uint32_t port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(absl::string_view(listen).substr(colon + 1), &port) || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics_listen: \"", listen, "\" is not host:port (e.g. 127.0.0.1:9464)"));
  }
  std::string host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  limits.max_connections = std::max<size_t>(limits.max_connections, 1);
  std::unique_ptr<MetricsServer> s(new MetricsServer(std::move(render), limits));

  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port_text = std::to_string(port);
  if (const int rc = ::getaddrinfo(host.c_str(), port_text.c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("metrics_listen: cannot listen on ", listen, " (", ::gai_strerror(rc), ")"));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> addresses(found, &::freeaddrinfo);
  int bind_errno = 0;
  for (const addrinfo* a = addresses.get(); a != nullptr && !s->listen_fd_.valid();
       a = a->ai_next) {
    ScopedFd fd(
        ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
    if (!fd.valid()) {
      bind_errno = errno;
      continue;
    }
    // SO_REUSEADDR only: SO_REUSEPORT would let a second epd bind the same port and share
    // its scrapes with the first.
    int yes = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 ||
        ::listen(fd.get(), static_cast<int>(limits.max_connections)) != 0) {
      bind_errno = errno;
      continue;
    }
    s->listen_fd_ = std::move(fd);
  }
  if (!s->listen_fd_.valid()) {
    return absl::UnavailableError(absl::StrCat("metrics_listen: cannot listen on ", listen, " (",
                                               std::strerror(bind_errno),
                                               ": in use, or not an address of this host)"));
  }
  sockaddr_storage bound{};
  socklen_t bound_len = sizeof(bound);
  if (::getsockname(s->listen_fd_.get(), reinterpret_cast<sockaddr*>(&bound), &bound_len) != 0) {
    return absl::UnavailableError(
        absl::StrCat("metrics_listen: ", listen, ": getsockname: ", std::strerror(errno)));
  }
  s->port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                               : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  s->wake_fd_ = ScopedFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!s->wake_fd_.valid()) {
    return absl::UnavailableError(
        absl::StrCat("metrics_listen: ", listen, ": eventfd: ", std::strerror(errno)));
  }
  s->thread_ = std::thread([server = s.get()] { server->Run(); });
  return s;
}

MetricsServer::~MetricsServer() { Stop(); }

void MetricsServer::Stop() {
  if (!thread_.joinable()) return;
  stopping_.store(true);
  const uint64_t one = 1;
  while (::write(wake_fd_.get(), &one, sizeof(one)) < 0 && errno == EINTR) {
  }
  thread_.join();
  listen_fd_.Reset();
}

void MetricsServer::Run() {
  std::vector<Connection> connections;
  connections.reserve(limits_.max_connections);
  std::vector<pollfd> fds;
  fds.reserve(limits_.max_connections + 2);
  while (!stopping_.load()) {
    const bool accepting = connections.size() < limits_.max_connections;
    fds.clear();
    fds.push_back({wake_fd_.get(), POLLIN, 0});
    fds.push_back({accepting ? listen_fd_.get() : -1, POLLIN, 0});
    Clock::time_point next = Clock::time_point::max();
    for (const Connection& c : connections) {
      fds.push_back({c.fd.get(),
                     static_cast<short>(c.state == Connection::State::kWrite ? POLLOUT : POLLIN),
                     0});
      next = std::min(next, c.deadline);
    }
    int timeout_ms = -1;
    if (next != Clock::time_point::max()) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(next - Clock::now()).count();
      timeout_ms = static_cast<int>(std::clamp<int64_t>(left, 0, 60'000));
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) break;
    if (stopping_.load()) break;
    for (size_t i = 0; i < connections.size(); ++i) {
      Connection& c = connections[i];
      if (fds[i + 2].revents == 0) continue;
      switch (c.state) {
        case Connection::State::kReadHead:
          ReadHead(c);
          break;
        case Connection::State::kWrite:
          WriteAnswer(c);
          break;
        case Connection::State::kDrain:
          Drain(c);
          break;
        case Connection::State::kClosed:
          break;
      }
    }
    const Clock::time_point now = Clock::now();
    std::erase_if(connections, [now](const Connection& c) {
      return c.state == Connection::State::kClosed || now >= c.deadline;
    });
    if (accepting && (fds[1].revents & POLLIN) != 0) {
      while (connections.size() < limits_.max_connections) {
        ScopedFd fd(::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
        if (!fd.valid()) break;  // EAGAIN, or an error of that one connection.
        Connection& c = connections.emplace_back();
        c.fd = std::move(fd);
        c.deadline = Clock::now() + limits_.head_timeout;
      }
    }
  }
}

void MetricsServer::ReadHead(Connection& c) {
  char buf[4096];
  while (true) {
    const size_t room = limits_.max_head_bytes + 1 - c.in.size();
    const ssize_t n = ::recv(c.fd.get(), buf, std::min(sizeof(buf), room), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {  // The client closed (or reset) before its head was complete.
      c.state = Connection::State::kClosed;
      return;
    }
    const size_t searched = c.in.size() < 2 ? 0 : c.in.size() - 2;
    c.in.append(buf, static_cast<size_t>(n));
    const size_t end = HeadEnd(absl::string_view(c.in).substr(searched));
    if (end != absl::string_view::npos && searched + end <= limits_.max_head_bytes) {
      c.in.resize(searched + end);
      c.out = Answer(c.in);
    } else if (end != absl::string_view::npos || c.in.size() > limits_.max_head_bytes) {
      c.out = PlainResponse(431, "Request Header Fields Too Large");
      c.drain_after = false;
    } else {
      continue;
    }
    c.in = std::string();
    c.state = Connection::State::kWrite;
    c.deadline = Clock::now() + limits_.write_timeout;
    WriteAnswer(c);
    return;
  }
}

std::string MetricsServer::Answer(const std::string& head) {
  const absl::string_view line =
      absl::StripSuffix(absl::string_view(head).substr(0, head.find('\n')), "\r");
  const std::vector<absl::string_view> parts = absl::StrSplit(line, ' ');
  if (parts.size() != 3 || parts[0].empty() || parts[1].empty() ||
      !absl::StartsWith(parts[2], "HTTP/1.")) {
    return PlainResponse(400, "Bad Request");
  }
  if (parts[0] != "GET") return PlainResponse(405, "Method Not Allowed", "Allow: GET\r\n");
  const absl::string_view path = parts[1].substr(0, parts[1].find('?'));
  if (path != "/metrics") return PlainResponse(404, "Not Found");
  return Response(200, "OK", kPrometheusContentType, render_());
}

void MetricsServer::WriteAnswer(Connection& c) {
  while (c.sent < c.out.size()) {
    const ssize_t n =
        ::send(c.fd.get(), c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n < 0) {
      c.state = Connection::State::kClosed;
      return;
    }
    c.sent += static_cast<size_t>(n);
  }
  c.out = std::string();
  if (!c.drain_after) {
    c.state = Connection::State::kClosed;
    return;
  }
  ::shutdown(c.fd.get(), SHUT_WR);
  c.state = Connection::State::kDrain;
  c.deadline = std::min(c.deadline, Clock::now() + kDrainTimeout);
  Drain(c);
}

void MetricsServer::Drain(Connection& c) {
  char buf[4096];
  while (c.drained < kMaxDrainBytes) {
    const ssize_t n = ::recv(c.fd.get(), buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) break;
    c.drained += static_cast<size_t>(n);
  }
  c.state = Connection::State::kClosed;
}

}  // namespace epd::metrics
