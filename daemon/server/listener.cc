#include "daemon/server/listener.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "daemon/core/logging.h"
#include "grpcpp/server.h"
#include "grpcpp/server_posix.h"
#include "proto/abi/shm_abi.h"

namespace epd {
namespace {

constexpr char kLogListener[] = "epd.listener";
/// Connections accepted per round of the loop before the pending ones get their turn.
constexpr int kMaxAcceptsPerRound = 256;
/// While a pending connection has sent a proper prefix of a preamble it is re-peeked
/// this often (it stays readable, so it cannot wait in poll).
constexpr absl::Duration kPartialRecheck = absl::Milliseconds(10);
/// After an accept failure that a reserve fd cannot absorb, the listening socket is left
/// out of poll this long (it stays readable: polling it would spin).
constexpr absl::Duration kAcceptBackoff = absl::Milliseconds(100);
/// A failure run ends when no accept failed for this long.
constexpr absl::Duration kFailureRunGap = absl::Seconds(1);
/// Rate limit of the loop's warnings: this many per window, then one summary.
constexpr int kLogsPerWindow = 5;
constexpr absl::Duration kLogWindow = absl::Seconds(10);

std::string ErrnoText(int err) {
  const char* name = err == EMFILE    ? " (EMFILE)"
                     : err == ENFILE  ? " (ENFILE)"
                     : err == ENOMEM  ? " (ENOMEM)"
                     : err == ENOBUFS ? " (ENOBUFS)"
                                      : "";
  return absl::StrCat(std::strerror(err), name);
}

ScopedFd OpenReserve() { return ScopedFd(::open("/dev/null", O_RDONLY | O_CLOEXEC)); }

}  // namespace

ConnectionKind ClassifyConnection(std::string_view first_bytes) {
  const std::string_view fd_preamble(abi::kFdChannelPreamble, sizeof(abi::kFdChannelPreamble));
  bool could_be_more = false;
  for (std::string_view preamble : {kHttp2ClientPreface, fd_preamble}) {
    const size_t n = std::min(first_bytes.size(), preamble.size());
    if (first_bytes.substr(0, n) != preamble.substr(0, n)) continue;
    if (n == preamble.size()) {
      return preamble == kHttp2ClientPreface ? ConnectionKind::kGrpc : ConnectionKind::kFdChannel;
    }
    could_be_more = true;
  }
  return could_be_more ? ConnectionKind::kUndecided : ConnectionKind::kInvalid;
}

bool ConnectionCounter::Exempt(uint32_t uid) const {
  return std::find(limits_.exempt_uids.begin(), limits_.exempt_uids.end(), uid) !=
         limits_.exempt_uids.end();
}

ConnectionCounter::Admission ConnectionCounter::Admit(int fd, uint32_t uid) {
  Forget(fd);
  const bool exempt = Exempt(uid);
  if (!exempt) {
    if (limits_.per_uid != 0 && live(uid) >= limits_.per_uid) return Admission::kOverUidCap;
    if (limits_.total != 0 && live_capped_ >= limits_.total) return Admission::kOverTotalCap;
    ++live_capped_;
  }
  ++per_uid_[uid];
  ++live_total_;
  return Admission::kAdmitted;
}

void ConnectionCounter::Release(uint32_t uid) {
  auto it = per_uid_.find(uid);
  if (it == per_uid_.end()) return;
  if (--it->second == 0) per_uid_.erase(it);
  --live_total_;
  if (!Exempt(uid)) --live_capped_;
}

void ConnectionCounter::Forget(int fd) {
  auto it = tracked_.find(fd);
  if (it == tracked_.end()) return;
  Release(it->second.uid);
  tracked_.erase(it);
}

void ConnectionCounter::Track(int fd, uint32_t uid) {
  Forget(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {  // Already gone.
    Release(uid);
    return;
  }
  tracked_[fd] = Tracked{uid, static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
}

std::vector<int> ConnectionCounter::Sweep() {
  std::vector<int> gone;
  for (const auto& [fd, conn] : tracked_) {
    struct stat st {};
    if (::fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_dev) == conn.dev &&
        static_cast<uint64_t>(st.st_ino) == conn.ino) {
      continue;
    }
    gone.push_back(fd);
  }
  for (int fd : gone) Forget(fd);
  return gone;
}

uint32_t ConnectionCounter::live(uint32_t uid) const {
  auto it = per_uid_.find(uid);
  return it == per_uid_.end() ? 0 : it->second;
}

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Bind(Options options) {
  sockaddr_un addr{};
  if (options.socket_path.empty() || options.socket_path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket_path: \"", options.socket_path,
                                                   "\" is empty or longer than ",
                                                   sizeof(addr.sun_path) - 1, " bytes"));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, options.socket_path.c_str(), options.socket_path.size() + 1);
  ScopedFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) {
    return absl::UnavailableError(absl::StrCat("cannot create a unix socket for ",
                                               options.socket_path, ": ", ErrnoText(errno)));
  }
  // Nobody but epd may connect until the caller applies the configured mode and group.
  const mode_t old_umask = ::umask(0177);
  const int bound = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int bind_err = errno;
  ::umask(old_umask);
  if (bound != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot bind ", options.socket_path, ": ", ErrnoText(bind_err)));
  }
  if (::listen(fd.get(), options.backlog) != 0) {
    const int err = errno;
    ::unlink(options.socket_path.c_str());
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.socket_path, ": ", ErrnoText(err)));
  }
  ScopedFd wake(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  ScopedFd reserve = OpenReserve();
  if (!wake.valid() || !reserve.valid()) {
    const int err = errno;
    ::unlink(options.socket_path.c_str());
    return absl::InternalError(
        absl::StrCat("listener on ", options.socket_path,
                     ": cannot open its eventfd or reserve descriptor: ", ErrnoText(err)));
  }
  return std::unique_ptr<UnixListener>(
      new UnixListener(std::move(options), std::move(fd), std::move(wake), std::move(reserve)));
}

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::BindTcp(Options options,
                                                                    const std::string& listen) {
  const size_t colon = listen.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(listen.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", listen, "\" is not host:port with a port in [0, 65535]"));
  }
  std::string host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc =
          ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found);
      rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve \"", host, "\": ", ::gai_strerror(rc)));
  }
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> addresses(found, ::freeaddrinfo);
  std::string last_error = "no address";
  for (const addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    ScopedFd fd(::socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd.valid()) {
      last_error = absl::StrCat("socket: ", ErrnoText(errno));
      continue;
    }
    const int one = 1;
    const int zero = 0;
    // SO_REUSEADDR (a restart binds despite TIME_WAIT); no SO_REUSEPORT: a second daemon on
    // the same port must fail, not share it. A wildcard IPv6 address takes IPv4 too.
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (ai->ai_family == AF_INET6) {
      ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    }
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
      last_error = absl::StrCat("bind: ", ErrnoText(errno));
      continue;
    }
    if (::listen(fd.get(), options.backlog) != 0) {
      last_error = absl::StrCat("listen: ", ErrnoText(errno));
      continue;
    }
    sockaddr_storage bound{};
    socklen_t bound_len = sizeof(bound);
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &bound_len) != 0) {
      last_error = absl::StrCat("getsockname: ", ErrnoText(errno));
      continue;
    }
    const int bound_port =
        ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                          : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    ScopedFd wake(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    ScopedFd reserve = OpenReserve();
    if (!wake.valid() || !reserve.valid()) {
      return absl::InternalError(
          absl::StrCat("listener on ", listen,
                       ": cannot open its eventfd or reserve descriptor: ", ErrnoText(errno)));
    }
    auto listener = std::unique_ptr<UnixListener>(
        new UnixListener(std::move(options), std::move(fd), std::move(wake), std::move(reserve),
                         /*tcp=*/true));
    listener->port_ = bound_port;
    return listener;
  }
  return absl::UnavailableError(absl::StrCat("cannot listen on \"", listen, "\": ", last_error));
}

UnixListener::UnixListener(Options options, ScopedFd listen_fd, ScopedFd wake_fd,
                           ScopedFd reserve_fd, bool tcp)
    : options_(std::move(options)),
      tcp_(tcp),
      name_(options_.name),
      listen_fd_(std::move(listen_fd)),
      wake_fd_(std::move(wake_fd)),
      reserve_fd_(std::move(reserve_fd)),
      max_connections_per_uid_(options_.max_connections_per_uid),
      connections_(ConnectionCounter::Limits{options_.max_connections_per_uid,
                                             options_.max_connections, options_.exempt_uids}) {}

UnixListener::~UnixListener() { Stop(); }

void UnixListener::RememberPeer(int fd, const PeerCredentials& peer) {
  if (!tcp_) PeerCredentialsTable::Global().Set(fd, peer);
}

void UnixListener::ForgetPeer(int fd) {
  if (!tcp_) PeerCredentialsTable::Global().Erase(fd);
}

void UnixListener::Start(grpc::Server* server) {
  server_ = server;
  if (options_.fd_channel_handler) {
    for (int i = 0; i < std::max(1, options_.fd_channel_threads); ++i) {
      workers_.emplace_back([this] { ServeFdChannels(); });
    }
  }
  loop_ = std::thread([this] { Loop(); });
}

void UnixListener::Stop() {
  if (stop_.exchange(true)) {
    if (loop_.joinable()) loop_.join();
    return;
  }
  const uint64_t one = 1;
  (void)!::write(wake_fd_.get(), &one, sizeof(one));
  if (loop_.joinable()) loop_.join();
  {
    absl::MutexLock lock(&work_mu_);
    stop_workers_ = true;
  }
  for (std::thread& worker : workers_) worker.join();
  workers_.clear();
  std::deque<FdChannelWork> left;
  {
    absl::MutexLock lock(&work_mu_);
    left.swap(work_);
  }
  for (FdChannelWork& work : left) ForgetPeer(work.fd.get());
  for (Pending& p : pending_) ForgetPeer(p.fd.get());
  pending_.clear();
  listen_fd_ = ScopedFd();
}

ListenerStatus UnixListener::status() const {
  absl::MutexLock lock(&status_mu_);
  ListenerStatus s = counters_;
  const int64_t beat = heartbeat_ns_.load(std::memory_order_relaxed);
  s.heartbeat = beat == 0 ? absl::InfinitePast() : absl::FromUnixNanos(beat);
  const absl::Time now = absl::Now();
  if (failing_since_ != absl::InfiniteFuture() && now - last_failure_at_ < kFailureRunGap) {
    s.failing_for = now - failing_since_;
  }
  return s;
}

void UnixListener::RecordFailure(const std::string& what, absl::Time now) {
  absl::MutexLock lock(&status_mu_);
  if (failing_since_ == absl::InfiniteFuture() || now - last_failure_at_ >= kFailureRunGap) {
    failing_since_ = now;
  }
  last_failure_at_ = now;
  counters_.last_failure = what;
}

void UnixListener::RecordSuccess() {
  absl::MutexLock lock(&status_mu_);
  failing_since_ = absl::InfiniteFuture();
  ++counters_.accepted;
}

void UnixListener::Loop() {
  auto log = GetLogger(kLogListener);
  std::vector<pollfd> fds;
  std::vector<size_t> polled;  // pending_ index of fds[2 + k].
  while (!stop_.load(std::memory_order_acquire)) {
    absl::Time now = absl::Now();
    heartbeat_ns_.store(absl::ToUnixNanos(now), std::memory_order_relaxed);
    if (options_.loop_hook_for_testing) {
      options_.loop_hook_for_testing();
      if (stop_.load(std::memory_order_acquire)) break;
      now = absl::Now();
    }
    FlushSuppressedWarnings(now);
    if (now >= next_sweep_) {
      // gRPC closes the connections it was handed without telling us.
      for (int fd : connections_.Sweep()) ForgetPeer(fd);
      next_sweep_ = now + options_.sweep_interval;
    }

    // Poll set: the wake eventfd, the listening socket (unless backing off), and every
    // pending connection that has sent nothing yet.
    fds.clear();
    polled.clear();
    fds.push_back({wake_fd_.get(), POLLIN, 0});
    const bool poll_listen = now >= listen_backoff_until_;
    fds.push_back({poll_listen ? listen_fd_.get() : -1, POLLIN, 0});
    absl::Time wake_at = now + options_.poll_interval;
    if (!poll_listen) wake_at = std::min(wake_at, listen_backoff_until_);
    for (size_t i = 0; i < pending_.size(); ++i) {
      wake_at = std::min(wake_at, pending_[i].deadline);
      if (pending_[i].partial) {
        wake_at = std::min(wake_at, now + kPartialRecheck);
        continue;
      }
      fds.push_back({pending_[i].fd.get(), POLLIN | POLLRDHUP, 0});
      polled.push_back(i);
    }
    const int timeout_ms = static_cast<int>(std::clamp<int64_t>(
        absl::ToInt64Milliseconds(absl::Ceil(wake_at - now, absl::Milliseconds(1))), 0,
        absl::ToInt64Milliseconds(options_.poll_interval)));
    const int ready = ::poll(fds.data(), fds.size(), timeout_ms);
    if (ready < 0 && errno != EINTR) {
      const int err = errno;
      if (MayWarn(absl::Now())) log->warn("{}: poll failed: {}", name_, ErrnoText(err));
      absl::SleepFor(absl::Milliseconds(10));  // ENOMEM: do not spin.
      continue;
    }
    if (stop_.load(std::memory_order_acquire)) break;
    now = absl::Now();

    // Pending connections first (they were accepted earlier), then the backlog.
    for (size_t k = 0; k < polled.size() && ready > 0; ++k) {
      if (fds[2 + k].revents != 0) Route(pending_[polled[k]]);
    }
    for (Pending& p : pending_) {
      if (p.fd.valid() && p.partial) Route(p);
    }
    if (poll_listen && fds[1].revents != 0) AcceptReady(now);
    for (Pending& p : pending_) {
      if (p.fd.valid() && now >= p.deadline) ClosePending(p, Closed::kSilent);
    }
    // Closed entries leave; the order (oldest first) is kept for eviction.
    std::erase_if(pending_, [](const Pending& p) { return !p.fd.valid(); });
    absl::MutexLock lock(&status_mu_);
    counters_.live_connections = connections_.live_total();
  }
}

void UnixListener::AcceptReady(absl::Time now) {
  for (int n = 0; n < kMaxAcceptsPerRound; ++n) {
    ScopedFd fd(::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!fd.valid()) {
      const int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      // The connection went away before we took it, or a signal: not the listener's fault.
      if (err == ECONNABORTED || err == EINTR || err == EPROTO) continue;
      AcceptFailed(err, now);
      return;
    }
    // A TCP connection has no SO_PEERCRED: every one is counted as the same (uid 0) caller.
    std::optional<PeerCredentials> peer =
        tcp_ ? std::optional<PeerCredentials>(PeerCredentials{}) : SocketPeerCredentials(fd.get());
    if (!peer) {
      const int err = errno;
      if (MayWarn(now)) {
        GetLogger(kLogListener)
            ->warn("{}: closed a connection whose SO_PEERCRED the kernel refused: {}", name_,
                   ErrnoText(err));
      }
      CloseConnection(std::move(fd), Closed::kInvalid);
      continue;
    }
    RecordSuccess();
    connections_.SetPerUidLimit(max_connections_per_uid_.load(std::memory_order_relaxed));
    const ConnectionCounter::Admission admission = connections_.Admit(fd.get(), peer->uid);
    if (admission != ConnectionCounter::Admission::kAdmitted) {
      {
        absl::MutexLock lock(&status_mu_);
        ++counters_.refused_over_cap;
      }
      const bool warn = MayWarn(now);
      if (warn && tcp_) {
        GetLogger(kLogListener)
            ->warn(
                "{}: closed a new connection: {} connections are live, as many as it allows "
                "({})",
                name_, connections_.live_total(), options_.max_connections);
      } else if (warn) {
        const bool per_uid = admission == ConnectionCounter::Admission::kOverUidCap;
        GetLogger(kLogListener)
            ->warn(
                "{}: closed a new connection from {}: {} (max_connections_per_uid = {}, "
                "{} live connections in all, at most {} below the descriptor limit); raise "
                "max_connections_per_uid in the DaemonConfig if the uid needs more",
                name_, DescribeCredentials(*peer),
                per_uid ? absl::StrCat("uid ", peer->uid, " holds ", connections_.live(peer->uid),
                                       " connections")
                        : std::string("epd holds as many connections as it allows"),
                connections_.per_uid_limit(), connections_.live_total(), options_.max_connections);
      }
      fd = ScopedFd();
      continue;
    }
    // Recorded at accept: CallerCredentials looks the peer up by the fd gRPC names.
    RememberPeer(fd.get(), *peer);
    if (pending_.size() >= options_.max_pending) {
      // Evict the oldest connection that is still waiting (closed entries leave at the end
      // of the round).
      for (Pending& p : pending_) {
        if (p.fd.valid()) {
          ClosePending(p, Closed::kSilent);
          break;
        }
      }
      std::erase_if(pending_, [](const Pending& p) { return !p.fd.valid(); });
    }
    pending_.push_back(Pending{std::move(fd), *peer, now + options_.first_bytes_timeout, false});
    // Most clients send their preamble with connect: route at once when it is there.
    Route(pending_.back());
  }
}

void UnixListener::AcceptFailed(int err, absl::Time now) {
  auto log = GetLogger(kLogListener);
  const bool warn = MayWarn(now);
  if ((err == EMFILE || err == ENFILE) && reserve_fd_.valid()) {
    // Out of descriptors: give the reserve back, take the connection and close it, so the
    // client gets a clean close instead of waiting in the backlog forever.
    reserve_fd_ = ScopedFd();
    ScopedFd drained(::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    const bool took = drained.valid();
    drained = ScopedFd();
    reserve_fd_ = OpenReserve();
    RecordFailure(absl::StrCat("accept: ", ErrnoText(err),
                               ": epd is out of file descriptors; new connections are "
                               "closed at once until descriptors are freed"),
                  now);
    if (took) {
      absl::MutexLock lock(&status_mu_);
      ++counters_.refused_no_fds;
    }
    if (warn) {
      log->warn(
          "{}: out of file descriptors ({}): {} the new connection; each client gets a "
          "clean close until descriptors are freed (sessions ending, endpoints released). "
          "Raise epd's RLIMIT_NOFILE (LimitNOFILE= in epd.service) if this persists",
          name_, ErrnoText(err), took ? "accepted and closed" : "could not take");
    }
    if (!reserve_fd_.valid()) listen_backoff_until_ = now + kAcceptBackoff;
    return;
  }
  RecordFailure(absl::StrCat("accept: ", ErrnoText(err)), now);
  if (warn) {
    log->warn("{}: accept failed: {}; retrying in {}", name_, ErrnoText(err),
              absl::FormatDuration(kAcceptBackoff));
  }
  listen_backoff_until_ = now + kAcceptBackoff;
  if (!reserve_fd_.valid()) reserve_fd_ = OpenReserve();
}

bool UnixListener::Route(Pending& pending) {
  char buffer[kHttp2ClientPreface.size()];
  const ssize_t n = ::recv(pending.fd.get(), buffer, sizeof(buffer), MSG_PEEK | MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
  if (n <= 0) {  // EOF before any byte, or an error (ECONNRESET).
    ClosePending(pending, Closed::kInvalid);
    return true;
  }
  switch (ClassifyConnection(std::string_view(buffer, static_cast<size_t>(n)))) {
    case ConnectionKind::kUndecided:
      pending.partial = true;
      return false;
    case ConnectionKind::kInvalid:
      ClosePending(pending, Closed::kInvalid);
      return true;
    case ConnectionKind::kGrpc: {
      {
        absl::MutexLock lock(&status_mu_);
        ++counters_.grpc_connections;
      }
      // gRPC owns the fd from here and names the connection "fd:<fd>"; it stays counted
      // until a sweep finds it closed.
      connections_.Track(pending.fd.get(), pending.peer.uid);
      grpc::AddInsecureChannelFromFd(server_, pending.fd.Release());
      return true;
    }
    case ConnectionKind::kFdChannel: {
      char preamble[sizeof(abi::kFdChannelPreamble)];
      if (::recv(pending.fd.get(), preamble, sizeof(preamble), MSG_DONTWAIT) !=
              static_cast<ssize_t>(sizeof(preamble)) ||
          !options_.fd_channel_handler) {
        ClosePending(pending, Closed::kInvalid);
        return true;
      }
      bool queued = false;
      {
        absl::MutexLock lock(&work_mu_);
        if (work_.size() < options_.fd_channel_queue) {
          work_.push_back(FdChannelWork{std::move(pending.fd), pending.peer});
          queued = true;
        }
      }
      if (queued) {
        connections_.Release(pending.peer.uid);  // The worker's, bounded by its queue.
        absl::MutexLock lock(&status_mu_);
        ++counters_.fd_channel_connections;
        return true;
      }
      if (MayWarn(absl::Now())) {
        GetLogger(kLogListener)
            ->warn(
                "{}: {} fd-channel connections are waiting for a worker; closed one "
                "from {}",
                name_, options_.fd_channel_queue, DescribeCredentials(pending.peer));
      }
      ClosePending(pending, Closed::kInvalid);
      return true;
    }
  }
  return false;
}

void UnixListener::ClosePending(Pending& pending, Closed why) {
  if (!pending.fd.valid()) return;
  connections_.Release(pending.peer.uid);
  CloseConnection(std::move(pending.fd), why);
}

void UnixListener::CloseConnection(ScopedFd fd, Closed why) {
  if (!fd.valid()) return;
  ForgetPeer(fd.get());
  {
    absl::MutexLock lock(&status_mu_);  // Counted before the peer can see the close.
    ++(why == Closed::kInvalid ? counters_.closed_invalid : counters_.closed_silent);
  }
  fd = ScopedFd();
}

bool UnixListener::MayWarn(absl::Time now) {
  FlushSuppressedWarnings(now);
  if (warnings_in_window_ == 0) warning_window_end_ = now + kLogWindow;
  if (warnings_in_window_ < kLogsPerWindow) {
    ++warnings_in_window_;
    return true;
  }
  ++suppressed_warnings_;
  return false;
}

void UnixListener::FlushSuppressedWarnings(absl::Time now) {
  if (warnings_in_window_ == 0 || now < warning_window_end_) return;
  if (suppressed_warnings_ > 0) {
    GetLogger(kLogListener)
        ->warn("{}: {} more warning(s) like the above in {} were not logged", name_,
               suppressed_warnings_, absl::FormatDuration(kLogWindow));
  }
  warnings_in_window_ = 0;
  suppressed_warnings_ = 0;
}

void UnixListener::ServeFdChannels() {
  while (true) {
    FdChannelWork work;
    {
      absl::MutexLock lock(&work_mu_);
      work_mu_.Await(absl::Condition(
          +[](UnixListener* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->work_mu_) {
            return self->stop_workers_ || !self->work_.empty();
          },
          this));
      if (stop_workers_) return;
      work = std::move(work_.front());
      work_.pop_front();
    }
    ForgetPeer(work.fd.get());
    const PeerCredentials peer = work.peer;
    options_.fd_channel_handler(std::move(work.fd), peer);
  }
}

}  // namespace epd
