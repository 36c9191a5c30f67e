// UnixListener: epd's own accept loop on its unix socket. It records each peer's
// SO_PEERCRED (PeerCredentialsTable::Global(), for CallerCredentials), routes a connection
// by its first bytes (HTTP/2 preface -> gRPC through grpc::AddInsecureChannelFromFd;
// abi::kFdChannelPreamble -> Options::fd_channel_handler; anything else -> closed), counts
// connections per uid until they close, survives EMFILE/ENFILE with a reserve descriptor,
// and beats a heartbeat for health. The behaviour and its limits are in docs/SECURITY.md
// "Connections". BindTcp runs the same loop on a TCP port (the plaintext Peer listener).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/os/shm_region.h"
#include "daemon/server/peer_credentials.h"

namespace grpc {
class Server;
}  // namespace grpc

namespace epd {

/// The HTTP/2 client connection preface (RFC 9113 §3.4): the first 24 bytes of every gRPC
/// connection.
inline constexpr std::string_view kHttp2ClientPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// What a connection is, judged by the bytes it sent first.
enum class ConnectionKind {
  kUndecided,  ///< A proper prefix of a known preamble (or nothing yet): wait for more.
  kGrpc,       ///< Starts with kHttp2ClientPreface.
  kFdChannel,  ///< Starts with abi::kFdChannelPreamble.
  kInvalid,    ///< Anything else.
};

/// Classifies a connection by `first_bytes` (what a MSG_PEEK returned, any length).
ConnectionKind ClassifyConnection(std::string_view first_bytes);

/// What the accept loop reports for health (UnixListener::status()).
struct ListenerStatus {
  /// When the accept loop last went round (absl::InfinitePast() before it started).
  absl::Time heartbeat = absl::InfinitePast();
  /// How long accept has been failing without a success in between (0 while it works).
  /// A failure run ends when an accept succeeds or when no accept failed for a second.
  absl::Duration failing_for = absl::ZeroDuration();
  /// The latest accept failure, e.g. "accept: Too many open files (EMFILE): ..."; "" when
  /// none happened yet.
  std::string last_failure;
  uint64_t accepted = 0;                ///< Connections accepted and kept for routing.
  uint64_t grpc_connections = 0;        ///< Handed to gRPC.
  uint64_t fd_channel_connections = 0;  ///< Handed to the fd-channel handler.
  uint64_t closed_invalid = 0;          ///< Closed: first bytes not a known preamble, or EOF.
  uint64_t closed_silent = 0;     ///< Closed: nothing within first_bytes_timeout (or evicted).
  uint64_t refused_no_fds = 0;    ///< Accepted with the reserve fd and closed (EMFILE/ENFILE).
  uint64_t refused_over_cap = 0;  ///< Closed at accept: the uid's or the total cap was reached.
  uint64_t live_connections = 0;  ///< Counted now (waiting for first bytes or held by gRPC).
};

/// The live connections of each uid (ConnectionCounter::Admit at accept until Release, or
/// until Sweep finds a connection handed over with Track closed), and the caps on them.
/// Not thread-safe: the accept loop owns it.
class ConnectionCounter {
 public:
  struct Limits {
    uint32_t per_uid = 0;               ///< Live connections per uid; 0 = no limit.
    uint64_t total = 0;                 ///< Live connections of every uid not exempt; 0 = no limit.
    std::vector<uint32_t> exempt_uids;  ///< Counted, never refused.
  };
  enum class Admission { kAdmitted, kOverUidCap, kOverTotalCap };

  explicit ConnectionCounter(Limits limits) : limits_(std::move(limits)) {}

  /// A connection just accepted as descriptor `fd` from `uid`: kAdmitted (counted from now)
  /// or which cap refuses it (not counted). A descriptor number still tracked (Track) is
  /// free again, since the kernel just handed it out: that connection is gone and its count
  /// is released first.
  Admission Admit(int fd, uint32_t uid);
  /// An admitted connection of `uid` closed by the listener.
  void Release(uint32_t uid);
  /// An admitted connection of `uid` handed over as `fd` to an owner that closes it
  /// unseen (gRPC): counted until Sweep finds `fd` closed or naming another file.
  void Track(int fd, uint32_t uid);
  /// Checks every tracked descriptor (fstat: EBADF, or another device/inode than at Track)
  /// and releases the connections gone; returns their descriptor numbers.
  std::vector<int> Sweep();

  /// Replaces Limits::per_uid (a config reload): connections already admitted stay.
  void SetPerUidLimit(uint32_t per_uid) { limits_.per_uid = per_uid; }
  uint32_t per_uid_limit() const { return limits_.per_uid; }

  uint32_t live(uint32_t uid) const;                   ///< Live connections of `uid`.
  uint64_t live_total() const { return live_total_; }  ///< Of every uid, exempt included.
  size_t tracked() const { return tracked_.size(); }   ///< Handed over, not yet swept.

 private:
  struct Tracked {
    uint32_t uid = 0;
    uint64_t dev = 0;
    uint64_t ino = 0;
  };
  bool Exempt(uint32_t uid) const;
  void Forget(int fd);

  Limits limits_;
  std::unordered_map<uint32_t, uint32_t> per_uid_;
  std::unordered_map<int, Tracked> tracked_;
  uint64_t live_total_ = 0;
  uint64_t live_capped_ = 0;  ///< Of the uids not exempt.
};

class UnixListener {
 public:
  /// Serves one fd-channel connection: `conn` (non-blocking, close-on-exec, the 8-byte
  /// preamble already read) and its peer's credentials. Runs on one of the listener's
  /// fd_channel_threads, never on the accept loop; it must return within a bounded time
  /// (a hostile peer may send nothing), as the threads are few. Owns `conn`.
  using FdChannelHandler = std::function<void(ScopedFd conn, const PeerCredentials& peer)>;

  struct Options {
    /// Filesystem path of the socket (the caller has made it free: no file there).
    std::string socket_path;
    /// listen(2) backlog (the kernel caps it at net.core.somaxconn).
    int backlog = 4096;
    /// A connection must send its whole preamble within this time or it is closed.
    absl::Duration first_bytes_timeout = absl::Seconds(2);
    /// Most connections waiting for their first bytes; a new one beyond that closes the
    /// oldest.
    size_t max_pending = 4096;
    /// Fd-channel connections; null = close each at once (no fd channel served).
    FdChannelHandler fd_channel_handler;
    /// Threads running fd_channel_handler, and how many connections may wait for one
    /// (beyond that a new fd-channel connection is closed, logged rate-limited).
    int fd_channel_threads = 2;
    size_t fd_channel_queue = 256;
    /// Caps on live connections (ConnectionCounter::Limits; DaemonConfig.max_connections_per_uid,
    /// and the daemon's total below its descriptor limit); 0 = no limit.
    uint32_t max_connections_per_uid = 0;
    uint64_t max_connections = 0;
    std::vector<uint32_t> exempt_uids;
    /// How often the loop checks whether gRPC closed the connections it was handed.
    absl::Duration sweep_interval = absl::Milliseconds(250);
    /// Longest poll of the accept loop (its heartbeat period and Stop()'s latency).
    absl::Duration poll_interval = absl::Milliseconds(100);
    /// Names the listener in its log lines (e.g. "listener: out of file descriptors ...").
    std::string name = "listener";
    /// Called by the accept loop at the top of every round. Tests stall the loop with it.
    std::function<void()> loop_hook_for_testing;
  };

  /// Creates the socket, binds it at options.socket_path with mode 0600 (umask 0177 around
  /// bind: the caller then applies the configured mode and group) and listens. Nothing is
  /// accepted before Start. Errors: INVALID_ARGUMENT for a path longer than sun_path,
  /// UNAVAILABLE naming the path and errno when socket/bind/listen fail, INTERNAL when the
  /// reserve descriptor cannot be opened.
  static absl::StatusOr<std::unique_ptr<UnixListener>> Bind(Options options);
  /// The same accept loop on a TCP socket bound to `listen` ("host:port", "[v6]:port"; an
  /// empty or wildcard host listens on every address; port 0 = a free one, see port()),
  /// ignoring options.socket_path. A TCP connection has no SO_PEERCRED: all count as one
  /// caller (uid 0, not exempt unless exempt_uids says so), so only max_connections caps
  /// them, and nothing is recorded in PeerCredentialsTable. Errors: INVALID_ARGUMENT for a
  /// malformed `listen`, UNAVAILABLE naming it when resolving, bind or listen fail.
  static absl::StatusOr<std::unique_ptr<UnixListener>> BindTcp(Options options,
                                                               const std::string& listen);
  /// The bound TCP port (BindTcp); 0 for a unix socket.
  int port() const { return port_; }
  ~UnixListener();  ///< Stop().
  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;

  /// Starts the accept loop. gRPC connections go to `server` (started, without a listening
  /// port; it must outlive Stop()). Call once.
  void Start(grpc::Server* server);

  /// Stops accepting, closes every connection still waiting for its first bytes or for a
  /// worker, joins the loop and the workers. The socket file stays (the daemon removes
  /// it). Idempotent; returns within about poll_interval plus the longest handler call.
  void Stop();

  /// The accept loop's heartbeat, failures and counters. Thread-safe.
  ListenerStatus status() const;

  /// Replaces Options::max_connections_per_uid (a config reload; 0 = no limit): from the
  /// next accepted connection on; live connections are never closed for it. Thread-safe.
  void SetMaxConnectionsPerUid(uint32_t max_connections_per_uid) {
    max_connections_per_uid_.store(max_connections_per_uid, std::memory_order_relaxed);
  }

 private:
  struct Pending {
    ScopedFd fd;
    PeerCredentials peer;
    absl::Time deadline;
    bool partial = false;  ///< Sent a proper prefix of a preamble: re-peek, not polled.
  };
  struct FdChannelWork {
    ScopedFd fd;
    PeerCredentials peer;
  };

  UnixListener(Options options, ScopedFd listen_fd, ScopedFd wake_fd, ScopedFd reserve_fd,
               bool tcp = false);
  /// PeerCredentialsTable for a unix socket; nothing for TCP.
  void RememberPeer(int fd, const PeerCredentials& peer);
  void ForgetPeer(int fd);
  void Loop();
  /// Accepts what the backlog holds (a bounded number per round).
  void AcceptReady(absl::Time now);
  /// Handles accept's errno `err`: EMFILE/ENFILE drain with the reserve fd, backoff.
  void AcceptFailed(int err, absl::Time now);
  /// Routes `pending` if its first bytes decide it; true when it left the pending set.
  bool Route(Pending& pending);
  enum class Closed { kInvalid, kSilent };
  /// Closes a connection epd will not serve, counting it as `why`.
  void CloseConnection(ScopedFd fd, Closed why);
  /// Rate limit of the loop's warnings: true when one may be logged now.
  bool MayWarn(absl::Time now);
  /// Logs how many warnings MayWarn held back once their window has passed.
  void FlushSuppressedWarnings(absl::Time now);
  void RecordFailure(const std::string& what, absl::Time now);
  void RecordSuccess();
  void ServeFdChannels();
  /// A pending connection leaves without being handed over: closed and uncounted.
  void ClosePending(Pending& pending, Closed why);

  const Options options_;
  const bool tcp_ = false;
  const std::string name_;
  int port_ = 0;
  ScopedFd listen_fd_;
  ScopedFd wake_fd_;     ///< eventfd: Stop() wakes the loop's poll.
  ScopedFd reserve_fd_;  ///< /dev/null, closed to accept-and-close on EMFILE.
  grpc::Server* server_ = nullptr;
  std::thread loop_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> heartbeat_ns_{0};  ///< absl::ToUnixNanos of the last round; 0 = none.
  /// SetMaxConnectionsPerUid's value, applied to connections_ by the accept loop.
  std::atomic<uint32_t> max_connections_per_uid_;

  // Accept loop state (the loop thread only).
  std::vector<Pending> pending_;
  ConnectionCounter connections_;
  absl::Time next_sweep_ = absl::InfinitePast();
  absl::Time listen_backoff_until_ = absl::InfinitePast();
  absl::Time warning_window_end_ = absl::InfinitePast();
  int warnings_in_window_ = 0;
  uint64_t suppressed_warnings_ = 0;

  mutable absl::Mutex status_mu_;
  ListenerStatus counters_ ABSL_GUARDED_BY(status_mu_);
  absl::Time failing_since_ ABSL_GUARDED_BY(status_mu_) = absl::InfiniteFuture();
  absl::Time last_failure_at_ ABSL_GUARDED_BY(status_mu_) = absl::InfinitePast();

  absl::Mutex work_mu_;
  std::deque<FdChannelWork> work_ ABSL_GUARDED_BY(work_mu_);
  bool stop_workers_ ABSL_GUARDED_BY(work_mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace epd
