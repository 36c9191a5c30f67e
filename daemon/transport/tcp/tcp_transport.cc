// TcpTransport (tcp_transport.h, DESIGN.md §5.2).
//
// Threads: the engine thread of each group calls its TcpGroupLink (PostWrite pushes into
// per-peer single-producer rings and pokes the eventfd; PollImm pops from a per-peer ring);
// the one progress thread of the transport does every socket call after connect(2): it
// holds TcpCore::mu_ while it handles one batch of epoll events and progresses every link,
// and Connect/Close/Shutdown take the same mutex, so a link's connections are only touched
// under it. Every epoll event carries a key (what it is: the eventfd, the listener, an
// accepted connection still handshaking, or link id + peer + direction + index), never a
// pointer, so an event of something closed meanwhile finds nothing.
#include "daemon/transport/tcp/tcp_transport.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/errors/reason.h"
#include "common/os/scoped_fd.h"
#include "common/status_macros.h"
#include "daemon/core/keyed_mac.h"
#include "daemon/core/logging.h"
#include "daemon/transport/link_common.h"
#include "proto/abi/tcp_wire.h"

namespace epd::transport {
namespace {

static_assert(std::endian::native == std::endian::little,
              "proto/abi/tcp_wire.h is little-endian on the wire");

using Clock = std::chrono::steady_clock;
using abi::TcpAck;
using abi::TcpDescriptor;
using abi::TcpFrameHeader;
using abi::TcpFrameKind;
using abi::TcpHandshake;

constexpr int kMaxIov = 64;                  // iovecs per sendmsg.
constexpr int kMaxEvents = 64;               // epoll events per wait.
constexpr size_t kMaxPending = 64;           // Accepted connections still handshaking.
constexpr uint64_t kReadBudget = 4u << 20;   // Bytes per connection per loop turn.
constexpr uint64_t kWriteBudget = 8u << 20;  // Bytes per connection per loop turn.
constexpr int kTickMs = 50;                  // Loop tick (deadlines are checked per tick).
constexpr int kRecvRounds = 8;               // Receive rounds per peer per loop turn.
/// How long a peer that closed a connection cleanly is read on (PeerClosing).
constexpr std::chrono::milliseconds kCloseDrain{1000};
/// Backoff of a connection closed by the listener before its acknowledgement (a flood may
/// have dropped it), doubling per retry, until the connect timeout.
constexpr std::chrono::milliseconds kMinRetryBackoff{10};
constexpr std::chrono::milliseconds kMaxRetryBackoff{500};
constexpr char kPeerTokenLabel[] = "epd-tcp-peer-token-v2";
constexpr char kHandshakeLabel[] = "epd-tcp-handshake-v2";
using Token = std::array<uint8_t, abi::kTcpTokenBytes>;
constexpr int32_t kMaxNodes = 4096;

std::shared_ptr<spdlog::logger> Log() { return GetLogger(kLogTransport); }

std::string Errno(int err) { return absl::StrCat(std::strerror(err), " (errno ", err, ")"); }

bool IsWildcard(const std::string& host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "*";
}

/// Splits "host:port" / "[v6]:port". INVALID_ARGUMENT naming `what` and the value.
absl::Status ParseHostPort(absl::string_view what, absl::string_view address, std::string* host,
                           uint16_t* port) {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " '", address, "': ", why, " (want host:port or [v6]:port)"));
  };
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos) return bad("no port");
  absl::string_view h = address.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  if (h.find(':') != absl::string_view::npos && address.front() != '[') {
    return bad("an IPv6 host must be in brackets");
  }
  uint32_t p = 0;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &p) || p > 65535) return bad("bad port");
  if (h.size() >= abi::kTcpHostBytes) return bad("host too long");
  *host = std::string(h);
  *port = static_cast<uint16_t>(p);
  return absl::OkStatus();
}

/// Resolves host:port to one socket address (getaddrinfo: a host name may block on DNS).
absl::Status Resolve(const std::string& host, uint16_t port, bool passive, sockaddr_storage* out,
                     socklen_t* out_len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* res = nullptr;
  const std::string port_str = std::to_string(port);
  const char* node = (passive && IsWildcard(host)) ? nullptr : host.c_str();
  const int rc = ::getaddrinfo(node, port_str.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return errors::WithReason(absl::UnavailableError(absl::StrCat("cannot resolve '", host, ":",
                                                                  port, "': ", ::gai_strerror(rc))),
                              errors::Reason::kTransportFailed);
  }
  std::memcpy(out, res->ai_addr, res->ai_addrlen);
  *out_len = res->ai_addrlen;
  ::freeaddrinfo(res);
  return absl::OkStatus();
}

std::string SockaddrString(const sockaddr_storage& sa, socklen_t len) {
  char host[NI_MAXHOST] = {0};
  char serv[NI_MAXSERV] = {0};
  if (::getnameinfo(reinterpret_cast<const sockaddr*>(&sa), len, host, sizeof host, serv,
                    sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "?";
  }
  return sa.ss_family == AF_INET6 ? absl::StrCat("[", host, "]:", serv)
                                  : absl::StrCat(host, ":", serv);
}

/// A labelled HMAC-SHA256 (daemon/core/keyed_mac.h) under a token-sized key, cut to a
/// token (proto/abi/tcp_wire.h).
Token TokenMac(const uint8_t* key, absl::string_view label,
               std::initializer_list<absl::string_view> parts) {
  const std::string mac = LabelledHmacSha256(
      absl::string_view(reinterpret_cast<const char*>(key), abi::kTcpTokenBytes), label, parts);
  Token token{};
  std::memcpy(token.data(), mac.data(), token.size());
  return token;
}

template <typename T>
absl::string_view Bytes(const T& v) {
  return absl::string_view(reinterpret_cast<const char*>(&v), sizeof v);
}

/// The token node `self`'s link (secret `link_secret`) hands node `for_node`.
Token PeerToken(const uint8_t* link_secret, int32_t self, int32_t for_node) {
  return TokenMac(link_secret, kPeerTokenLabel, {Bytes(self), Bytes(for_node)});
}

/// The proof of a handshake made with `token` (proto/abi/tcp_wire.h).
Token HandshakeProof(const uint8_t* token, int32_t from_node, int32_t to_node,
                     uint64_t incarnation) {
  return TokenMac(token, kHandshakeLabel, {Bytes(from_node), Bytes(to_node), Bytes(incarnation)});
}

/// Compares two tokens in time independent of where they differ.
bool TokenEqual(const uint8_t* a, const uint8_t* b) {
  return ConstantTimeEqual(
      absl::string_view(reinterpret_cast<const char*>(a), abi::kTcpTokenBytes),
      absl::string_view(reinterpret_cast<const char*>(b), abi::kTcpTokenBytes));
}

/// What MoveBytes did.
enum class Io { kDone, kAgain, kClosed, kError };

/// Moves bytes [*done, len) of `buf` over the non-blocking socket `fd` (send when `sending`,
/// else recv) until all moved (kDone) or it would block (kAgain); kClosed: the peer closed
/// (recv); kError: errno says why.
Io MoveBytes(int fd, void* buf, size_t len, size_t* done, bool sending) {
  while (*done < len) {
    char* at = static_cast<char*>(buf) + *done;
    const ssize_t r = sending ? ::send(fd, at, len - *done, MSG_NOSIGNAL | MSG_DONTWAIT)
                              : ::recv(fd, at, len - *done, MSG_DONTWAIT);
    if (r > 0) {
      *done += static_cast<size_t>(r);
    } else if (r < 0 && errno == EINTR) {
      continue;
    } else if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return Io::kAgain;
    } else {
      return r == 0 ? Io::kClosed : Io::kError;
    }
  }
  return Io::kDone;
}

// epoll keys: kind in bits 62-63; a link connection also carries link id (bits 32-61),
// peer node (16-31), inbound (8) and connection index (0-7).
enum KeyKind : uint64_t { kKeyWake = 0, kKeyListener = 1, kKeyPending = 2, kKeyConn = 3 };
uint64_t ConnKey(uint32_t link_id, int32_t node, bool inbound, uint32_t index) {
  return (uint64_t{kKeyConn} << 62) | (uint64_t{link_id & 0x3fffffffu} << 32) |
         (static_cast<uint64_t>(node & 0xffff) << 16) | (inbound ? 0x100u : 0u) | (index & 0xff);
}
uint64_t PendingKey(uint64_t id) {
  return (uint64_t{kKeyPending} << 62) | (id & ((1ull << 62) - 1));
}

/// TcpTotalRetransmits, 0 when unknown (a closed or not yet connected socket).
uint64_t RetransmitsOrZero(int fd) {
  if (fd < 0) return 0;
  absl::StatusOr<uint64_t> n = TcpTotalRetransmits(fd);
  return n.ok() ? *n : 0;
}

void SetNoDelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/// One data connection of a peer (outbound: this node sends on it; inbound: receives).
struct Conn {
  /// kRetry: closed by the listener before its acknowledgement; reopened at retry_at.
  enum class Phase : uint8_t { kConnecting, kHandshake, kAwaitAck, kReady, kRetry };
  enum class Recv : uint8_t { kHeader, kPayload, kDonePending };

  ScopedFd fd;
  uint32_t index = 0;
  bool readable = false;
  bool writable = false;

  // Outbound.
  Phase phase = Phase::kConnecting;
  TcpHandshake hs{};
  size_t hs_sent = 0;
  TcpAck ack{};
  size_t ack_got = 0;
  Clock::time_point retry_at{};
  std::chrono::milliseconds backoff = kMinRetryBackoff;
  // The send cursor: the next chunk of write `cur_write` this connection looks at.
  uint64_t cur_write = 0;
  uint64_t cur_piece = 0;   // Piece index within the write.
  uint64_t cur_offset = 0;  // Byte offset within the piece.
  uint64_t cur_chunk = 0;   // Chunk counter within the write.
  std::array<iovec, kMaxIov> iov{};
  std::array<TcpFrameHeader, kMaxIov> hdr{};
  int niov = 0;
  int iov_pos = 0;
  uint64_t batch_dones = 0;  // kDone frames in the batch being sent.
  uint64_t writes_sent = 0;  // Writes whose part on this connection is fully sent.

  // Inbound.
  Recv rstate = Recv::kHeader;
  TcpFrameHeader rhdr{};
  size_t rhdr_got = 0;
  uint8_t* dst = nullptr;
  uint64_t dst_left = 0;
  uint64_t dones = 0;        // kDone frames received (= the next write's seq).
  uint64_t incarnation = 0;  // The sending link's (from its handshake).
};

struct WriteEntry {
  uint64_t piece_begin = 0;  // Index into the piece ring (absolute).
  uint64_t piece_end = 0;
  uint32_t imm = 0;
};

/// One peer node of a link.
struct Peer : PeerCounters {
  int32_t node = 0;
  std::string address;       // "host:port" of its descriptor (Connect).
  uint64_t incarnation = 0;  // Of its descriptor (Connect); 0 before.
  sockaddr_storage sa{};     // Its resolved address (Connect), for retries.
  socklen_t sa_len = 0;
  int retries = 0;             // Connections closed before their acknowledgement.
  std::string last_retry_why;  // Why the last one was.
  std::string inbound_from;    // Where its first inbound connection came from.
  absl::Status status;         // Why it failed (guarded by TcpGroupLink::status_mu_).
  Clock::time_point deadline{};
  uint64_t peer_recv_bytes = 0;  // From its descriptor (set before kReady).

  // Outbound (under TcpCore::mu_ except the atomics and the rings' owned halves).
  std::vector<Conn> out;
  uint64_t retransmits_closed = 0;  // Of outbound connections closed (CloseOut).
  size_t ready_out = 0;
  std::vector<WriteEntry> writes;  // Ring of max_writes_in_flight.
  std::vector<WritePiece> pieces;  // Ring of max_pieces_in_flight.
  uint64_t pieces_posted = 0;      // Engine thread.
  std::atomic<uint64_t> pieces_released{0};

  // Inbound.
  std::vector<Conn> in;  // connections_per_peer slots.
  // imm_slots: a ring of max_pending_imms, indexed by seq.
  std::atomic<bool> recv_paused{false};
  // The peer closed a connection cleanly (PeerClosing): its inbound connections are read to
  // their EOFs (or close_deadline), then it fails with close_why.
  bool closing = false;
  Clock::time_point close_deadline{};
  std::string close_why;
  // Inbound connections of another incarnation of the peer than the one connected (or of
  // any, while it is failed): acknowledged, not read, until the engine calls Connect with
  // that incarnation's descriptor. One per connection index, the newest.
  std::vector<ScopedFd> parked;
  std::vector<uint64_t> parked_incarnation;
};

class TcpGroupLink;

/// What the transport shares between its links: listener, epoll, progress thread.
class TcpCore {
 public:
  explicit TcpCore(TcpTransportOptions options) : options_(std::move(options)) {}
  ~TcpCore() { Shutdown(); }

  absl::Status Start();
  void Shutdown();
  void Wake() {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd_.get(), &one, sizeof one);
  }
  /// Adds `link` to the progress loop; FAILED_PRECONDITION after Shutdown.
  absl::Status Register(TcpGroupLink* link);
  void Unregister(TcpGroupLink* link);
  absl::Status EpollAdd(int fd, uint64_t key);
  void EpollMod(int fd, uint64_t key);

  const TcpTransportOptions& options() const { return options_; }
  const std::string& advertise_host() const { return advertise_host_; }
  uint16_t port() const { return port_; }
  std::string listen_address() const { return listen_address_; }
  uint32_t NextLinkId() { return next_link_id_.fetch_add(1) & 0x3fffffffu; }
  std::mutex& mu() { return mu_; }
  bool stopped() const { return stop_.load(); }

 private:
  struct Pending {
    ScopedFd fd;
    uint64_t id = 0;
    TcpHandshake hs{};
    size_t got = 0;
    Clock::time_point deadline{};
    std::string from;  ///< "host:port".
    std::string host;  ///< The remote address without the port.
  };

  void Run();
  void Accept(Clock::time_point now);
  void OnPendingReadable(uint64_t id);
  void Refuse(Pending& p, absl::string_view why);
  /// The index in pending_ of the connection to drop when it is full: the oldest of the
  /// remote address holding the most handshaking connections.
  size_t PendingVictim() const;
  TcpGroupLink* FindLink(uint32_t id);

  const TcpTransportOptions options_;
  std::string advertise_host_;
  std::string listen_address_;
  uint16_t port_ = 0;
  ScopedFd listen_fd_;
  ScopedFd epoll_fd_;
  ScopedFd wake_fd_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<uint32_t> next_link_id_{1};
  ShutdownOnce shutdown_;

  std::mutex mu_;  // Guards everything below and every link's connections.
  std::vector<TcpGroupLink*> links_;
  std::vector<Pending> pending_;
  uint64_t next_pending_id_ = 1;
  bool accept_again_ = false;  // The last accept failed for want of a resource.
  LogRateLimiter refusals_{2, 10, "the TCP data listener"};
};

class TcpGroupLink final : public GroupLink {
 public:
  TcpGroupLink(std::shared_ptr<TcpCore> core, GroupLinkOptions options)
      : core_(std::move(core)), id_(core_->NextLinkId()), options_(std::move(options)) {}
  ~TcpGroupLink() override { Close(); }

  /// Sizes the rings and draws the token; the link is not yet registered.
  absl::Status Init();

  std::string LocalDescriptor() const override { return Descriptor(-1); }
  std::string LocalDescriptorFor(int32_t node) const override { return Descriptor(node); }
  absl::Status Connect(int32_t node, std::string_view descriptor) override;
  PeerState State(int32_t node) const override;
  absl::Status PeerStatus(int32_t node) const override;
  absl::Status PostWrite(int32_t node, std::span<const WritePiece> pieces, uint32_t imm) override;
  uint64_t WritesCompleted(int32_t node) const override;
  bool PollImm(int32_t node, uint32_t* imm) override;
  void FailPeer(int32_t node, const absl::Status& cause) override;
  LinkCounters Counters(int32_t node) const override;
  void Close() override;

  // Progress-thread side, all under TcpCore::mu_.
  uint32_t id() const { return id_; }
  /// Whether `hs` carries a proof made with the token this link handed hs.from_node (a
  /// peer node of the link) for this node; in time independent of where it differs.
  bool Admits(const TcpHandshake& hs) const;
  void OnConnEvent(int32_t node, bool inbound, uint32_t index, uint32_t events);
  /// Routes an accepted, handshaken connection here; an error says why it is refused.
  absl::Status AttachInbound(ScopedFd& fd, const TcpHandshake& hs, const std::string& from);
  /// Moves bytes on every connection; true when more work is ready right now.
  bool Progress(Clock::time_point now);
  /// Closes every connection and fails every peer with `cause`: Close (`wake` false) or
  /// Shutdown (`wake` true: the engine learns of it).
  void Detach(const absl::Status& cause, bool wake);

 private:
  bool ValidNode(int32_t node) const { return IsPeerNode(options_, node); }
  /// "group 'g': node 1 (host:port)". `p.address` is written by Connect only (the engine
  /// thread, under TcpCore::mu_), so either thread may call this.
  std::string PeerName(const Peer& p) const {
    return NameWith(p, p.address.empty() ? "address unknown" : p.address);
  }
  /// PeerName, or with the address an inbound connection came from (under TcpCore::mu_).
  std::string PeerNameLocked(const Peer& p) const {
    if (!p.address.empty() || p.inbound_from.empty()) return PeerName(p);
    return NameWith(p, absl::StrCat("connected from ", p.inbound_from));
  }
  /// "group 'g': node 1 (LABEL; data WHERE)" with the node's label, else "(WHERE)".
  std::string NameWith(const Peer& p, absl::string_view where) const {
    return PeerNodeName(options_, p.node, where, "data ");
  }
  void CallWake() const {
    if (options_.wake) options_.wake();
  }
  /// Who fails a peer: the progress thread (log, wake the engine), the engine thread inside
  /// a call (log; the engine knows), or the link closing (neither).
  enum class FailedBy { kProgress, kEngine, kClose };
  /// Closes `p`'s connections and makes it kFailed with `why` (the first cause wins).
  void Fail(Peer& p, absl::string_view why, FailedBy by = FailedBy::kProgress);
  /// The peer closed a connection cleanly (its daemon tore the group down or died): what it
  /// sent before on its other connections is still read, up to each one's EOF (an op's last
  /// immediate may be on one of them, its bytes behind the close: connections do not keep
  /// order with each other), bounded by kCloseDrain; then `p` fails with `why`. Nothing
  /// more is sent to it meanwhile.
  void PeerClosing(Peer& p, absl::string_view why);
  /// Connect for a peer connected before (a new incarnation): drops its connections, its
  /// writes in flight and its undelivered immediates, clears its error, and takes the
  /// parked inbound connections of the new incarnation. Under TcpCore::mu_, engine thread.
  void Reset(Peer& p);
  /// After Connect set p.incarnation: inbound connections of another incarnation go, and
  /// the parked ones of this incarnation take their slots.
  void AdoptParked(Peer& p);
  /// The descriptor for `node` (-1: none; its token then admits no one).
  std::string Descriptor(int32_t node) const;
  /// Closes outbound connection `c` of `p`, keeping its retransmit count (Counters).
  static void CloseOut(Peer& p, Conn& c) {
    p.retransmits_closed += RetransmitsOrZero(c.fd.get());
    c.fd.Reset();
  }
  /// Opens outbound connection `c` of `p` (non-blocking connect to p.sa); false after
  /// failing `p`, naming the cause.
  bool OpenConn(Peer& p, Conn& c, FailedBy by);
  /// The listener closed `c` before its acknowledgement: `c` is reopened after its backoff
  /// (a flood of connections may have dropped it), until the connect timeout.
  void RetryConn(Peer& p, Conn& c, const std::string& why, Clock::time_point now);
  void ProgressConnect(Peer& p, Conn& c, Clock::time_point now);
  bool ProgressSend(Peer& p, Conn& c);
  bool BuildBatch(Peer& p, Conn& c);
  bool ProgressRecv(Peer& p, Conn& c);
  absl::Status ParseFrame(Conn& c);
  bool TryDone(Peer& p, Conn& c);
  void CheckOutboundEof(Peer& p, Conn& c);

  const std::shared_ptr<TcpCore> core_;
  const uint32_t id_;
  const GroupLinkOptions options_;
  Token link_secret_{};                       // Never leaves this node; tokens are derived from it.
  uint64_t incarnation_ = 0;                  // Random, != 0.
  std::vector<std::unique_ptr<Peer>> peers_;  // Indexed by node (self's is unused).
  mutable std::mutex status_mu_;              // Guards Peer::status.
  bool registered_ = false;                   // Engine thread.
  bool closed_ = false;                       // Engine thread.
};

// ---------------------------------------------------------------------------------------
// TcpCore

absl::Status TcpCore::Start() {
  std::string host;
  EPD_RETURN_IF_ERROR(ParseHostPort("tcp listen address", options_.listen_address, &host, &port_));
  sockaddr_storage sa{};
  socklen_t sa_len = 0;
  EPD_RETURN_IF_ERROR(Resolve(host, port_, /*passive=*/true, &sa, &sa_len));
  listen_fd_.Reset(::socket(sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!listen_fd_.valid()) return absl::InternalError(absl::StrCat("socket: ", Errno(errno)));
  int one = 1;
  ::setsockopt(listen_fd_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(listen_fd_.get(), reinterpret_cast<sockaddr*>(&sa), sa_len) != 0 ||
      ::listen(listen_fd_.get(), 512) != 0) {
    return errors::WithReason(
        absl::UnavailableError(absl::StrCat("tcp listen address '", options_.listen_address,
                                            "': cannot listen: ", Errno(errno))),
        errors::Reason::kTransportFailed);
  }
  sockaddr_storage bound{};
  socklen_t bound_len = sizeof bound;
  ::getsockname(listen_fd_.get(), reinterpret_cast<sockaddr*>(&bound), &bound_len);
  listen_address_ = SockaddrString(bound, bound_len);
  port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  advertise_host_ = options_.advertise_host;
  if (advertise_host_.empty()) advertise_host_ = host;
  if (IsWildcard(advertise_host_)) {
    char name[256] = {0};
    if (::gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') {
      return absl::InvalidArgumentError(
          absl::StrCat("tcp listen address '", options_.listen_address,
                       "' is a wildcard and the host name is unknown: set the advertised host"));
    }
    advertise_host_ = name;
  }
  if (advertise_host_.size() >= abi::kTcpHostBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("tcp advertised host '", advertise_host_, "' is too long"));
  }

  epoll_fd_.Reset(::epoll_create1(EPOLL_CLOEXEC));
  wake_fd_.Reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!epoll_fd_.valid() || !wake_fd_.valid()) {
    return absl::InternalError(absl::StrCat("epoll/eventfd: ", Errno(errno)));
  }
  EPD_RETURN_IF_ERROR(EpollAdd(wake_fd_.get(), uint64_t{kKeyWake} << 62));
  EPD_RETURN_IF_ERROR(EpollAdd(listen_fd_.get(), uint64_t{kKeyListener} << 62));
  pending_.reserve(kMaxPending);
  links_.reserve(64);
  thread_ = std::thread([this] { Run(); });
  Log()->info("TCP transport listening on {} (advertised host {}, {} connections per peer)",
              listen_address_, advertise_host_, options_.connections_per_peer);
  return absl::OkStatus();
}

void TcpCore::Shutdown() {
  ShutdownCore(
      shutdown_, stop_, thread_, [this] { Wake(); }, mu_, links_, "TCP",
      [this] {
        pending_.clear();
        listen_fd_.Reset();
      });
}

absl::Status TcpCore::EpollAdd(int fd, uint64_t key) {
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
  ev.data.u64 = key;
  if (::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
    return absl::InternalError(absl::StrCat("epoll_ctl: ", Errno(errno)));
  }
  return absl::OkStatus();
}

void TcpCore::EpollMod(int fd, uint64_t key) {
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
  ev.data.u64 = key;
  ::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_MOD, fd, &ev);
}

absl::Status TcpCore::Register(TcpGroupLink* link) {
  std::lock_guard<std::mutex> l(mu_);
  if (stop_.load()) return absl::FailedPreconditionError("the TCP transport was shut down");
  links_.push_back(link);
  return absl::OkStatus();
}

void TcpCore::Unregister(TcpGroupLink* link) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = std::find(links_.begin(), links_.end(), link);
  if (it != links_.end()) links_.erase(it);
  link->Detach(errors::WithReason(absl::UnavailableError("the link was closed"),
                                  errors::Reason::kTransportFailed),
               /*wake=*/false);
}

TcpGroupLink* TcpCore::FindLink(uint32_t id) {
  for (TcpGroupLink* link : links_) {
    if (link->id() == id) return link;
  }
  return nullptr;
}

void TcpCore::Run() {
  if (options_.on_progress_thread_start) options_.on_progress_thread_start();
  std::array<epoll_event, kMaxEvents> events{};
  int timeout = kTickMs;
  while (!stop_.load()) {
    const int n = ::epoll_wait(epoll_fd_.get(), events.data(), kMaxEvents, timeout);
    if (n < 0 && errno != EINTR) {
      Log()->error("epoll_wait: {}", Errno(errno));
      std::this_thread::sleep_for(std::chrono::milliseconds(kTickMs));
    }
    std::lock_guard<std::mutex> l(mu_);
    const Clock::time_point now = Clock::now();
    for (int i = 0; i < n; ++i) {
      const uint64_t key = events[i].data.u64;
      switch (key >> 62) {
        case kKeyWake: {
          uint64_t v = 0;
          [[maybe_unused]] ssize_t r = ::read(wake_fd_.get(), &v, sizeof v);
          break;
        }
        case kKeyListener:
          Accept(now);
          break;
        case kKeyPending:
          OnPendingReadable(key & ((1ull << 62) - 1));
          break;
        default: {
          TcpGroupLink* link = FindLink(static_cast<uint32_t>((key >> 32) & 0x3fffffffu));
          if (link != nullptr) {
            link->OnConnEvent(static_cast<int32_t>((key >> 16) & 0xffff), (key & 0x100) != 0,
                              static_cast<uint32_t>(key & 0xff), events[i].events);
          }
        }
      }
    }
    if (accept_again_) Accept(now);
    bool more = false;
    for (TcpGroupLink* link : links_) more |= link->Progress(now);
    for (size_t i = 0; i < pending_.size();) {
      if (now >= pending_[i].deadline) {
        Refuse(pending_[i], "no handshake within the connect timeout");
        pending_.erase(pending_.begin() + static_cast<ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
    timeout = more ? 0 : kTickMs;
  }
}

void TcpCore::Accept(Clock::time_point now) {
  for (;;) {
    sockaddr_storage sa{};
    socklen_t len = sizeof sa;
    ScopedFd fd(::accept4(listen_fd_.get(), reinterpret_cast<sockaddr*>(&sa), &len,
                          SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!fd.valid()) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      // Out of descriptors or memory: the connections stay in the backlog and no new edge
      // may come, so the loop tries again next turn.
      accept_again_ = errno != EAGAIN && errno != EWOULDBLOCK;
      if (accept_again_) {
        LogLimited(*Log(), spdlog::level::warn, refusals_, "accept", "accept on {}: {}",
                   listen_address_, Errno(errno));
      }
      return;
    }
    Pending p;
    p.from = SockaddrString(sa, len);
    p.host = p.from.substr(0, p.from.rfind(':'));
    if (pending_.size() >= kMaxPending) {
      // A handshaking connection makes room: connections that stay silent cannot hold the
      // listener shut to the peers that come after them, and a flood from one address drops
      // its own connections, not a real peer's that has not sent its handshake yet.
      const size_t victim = PendingVictim();
      Refuse(pending_[victim],
             "too many connections are handshaking; the oldest of the busiest address is dropped");
      pending_.erase(pending_.begin() + static_cast<ptrdiff_t>(victim));
    }
    SetNoDelay(fd.get());
    p.id = next_pending_id_++;
    p.deadline = now + options_.connect_timeout;
    if (!EpollAdd(fd.get(), PendingKey(p.id)).ok()) continue;
    p.fd = std::move(fd);
    pending_.push_back(std::move(p));
    OnPendingReadable(pending_.back().id);  // Bytes may have arrived with the connection.
  }
}

size_t TcpCore::PendingVictim() const {
  // pending_ is in accept order and holds at most kMaxPending: quadratic is cheap enough,
  // and runs only while the listener is full.
  size_t victim = 0, most = 0;
  for (size_t i = 0; i < pending_.size(); ++i) {
    size_t same = 0, first = i;
    for (size_t j = 0; j < pending_.size(); ++j) {
      if (pending_[j].host != pending_[i].host) continue;
      if (same++ == 0) first = j;
    }
    if (same > most) {
      most = same;
      victim = first;
    }
  }
  return victim;
}

void TcpCore::Refuse(Pending& p, absl::string_view why) {
  LogLimited(*Log(), spdlog::level::warn, refusals_, p.from,
             "refused a data connection from {}: {}", p.from, why);
  p.fd.Reset();
}

void TcpCore::OnPendingReadable(uint64_t id) {
  auto it =
      std::find_if(pending_.begin(), pending_.end(), [id](const Pending& p) { return p.id == id; });
  if (it == pending_.end()) return;
  Pending& p = *it;
  const Io io = MoveBytes(p.fd.get(), &p.hs, sizeof p.hs, &p.got, /*sending=*/false);
  if (io == Io::kAgain) return;  // Wait for more.
  std::string why;
  if (io != Io::kDone) {
    why = io == Io::kClosed
              ? absl::StrCat("closed after ", p.got, " of ", sizeof p.hs, " handshake bytes")
              : absl::StrCat("recv: ", Errno(errno));
  } else if (p.hs.magic != abi::kTcpHandshakeMagic) {
    why = absl::StrFormat("bad handshake magic 0x%08x", p.hs.magic);
  } else if (p.hs.version != abi::kTcpWireVersion) {
    why =
        absl::StrCat("wire version ", p.hs.version, ", this daemon speaks ", abi::kTcpWireVersion);
  } else {
    // Every link's proof is compared, each in constant time.
    TcpGroupLink* match = nullptr;
    for (TcpGroupLink* link : links_) {
      if (link->Admits(p.hs)) match = link;
    }
    if (match == nullptr) {
      why = absl::StrCat("its proof for node ", p.hs.from_node,
                         " matches no group link here (a stale or foreign descriptor, or a "
                         "node presenting another node's)");
    } else if (const absl::Status s = match->AttachInbound(p.fd, p.hs, p.from); !s.ok()) {
      why = std::string(s.message());
    }
  }
  if (!why.empty()) Refuse(p, why);
  pending_.erase(it);
}

// ---------------------------------------------------------------------------------------
// TcpGroupLink: setup and the caller's side

absl::Status TcpGroupLink::Init() {
  const TcpTransportOptions& o = core_->options();
  EPD_RETURN_IF_ERROR(CheckGroupLinkOptions(options_, kMaxNodes));
  std::array<uint8_t, abi::kTcpTokenBytes + sizeof(uint64_t)> random{};
  size_t got = 0;
  while (got < random.size() || incarnation_ == 0) {
    if (got == random.size()) got = abi::kTcpTokenBytes;  // Draw the incarnation again.
    const ssize_t r = ::getrandom(random.data() + got, random.size() - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return absl::InternalError(absl::StrCat("getrandom: ", Errno(errno)));
    got += static_cast<size_t>(r);
    if (got == random.size()) {
      std::memcpy(link_secret_.data(), random.data(), link_secret_.size());
      std::memcpy(&incarnation_, random.data() + link_secret_.size(), sizeof incarnation_);
    }
  }
  peers_.resize(static_cast<size_t>(options_.num_nodes));
  for (int32_t n = 0; n < options_.num_nodes; ++n) {
    if (n == options_.self_node) continue;
    auto p = std::make_unique<Peer>();
    p->node = n;
    p->writes.resize(static_cast<size_t>(o.max_writes_in_flight));
    p->pieces.resize(static_cast<size_t>(o.max_pieces_in_flight));
    p->in.resize(static_cast<size_t>(o.connections_per_peer));
    for (size_t i = 0; i < p->in.size(); ++i) p->in[i].index = static_cast<uint32_t>(i);
    p->imm_slots.resize(static_cast<size_t>(o.max_pending_imms));
    p->parked.resize(static_cast<size_t>(o.connections_per_peer));
    p->parked_incarnation.resize(static_cast<size_t>(o.connections_per_peer), 0);
    peers_[static_cast<size_t>(n)] = std::move(p);
  }
  EPD_RETURN_IF_ERROR(core_->Register(this));
  registered_ = true;
  return absl::OkStatus();
}

std::string TcpGroupLink::Descriptor(int32_t node) const {
  TcpDescriptor d{};
  d.magic = abi::kTcpDescriptorMagic;
  d.version = abi::kTcpWireVersion;
  d.num_connections = static_cast<uint16_t>(core_->options().connections_per_peer);
  d.node = options_.self_node;
  d.port = core_->port();
  d.recv_bytes = options_.recv_bytes;
  d.incarnation = incarnation_;
  d.for_node = ValidNode(node) ? node : -1;
  if (d.for_node >= 0) {
    const Token token = PeerToken(link_secret_.data(), options_.self_node, node);
    std::memcpy(d.token, token.data(), token.size());
  }
  const std::string& host = core_->advertise_host();
  std::memcpy(d.host, host.data(), std::min(host.size(), sizeof d.host - 1));
  return std::string(reinterpret_cast<const char*>(&d), sizeof d);
}

absl::Status TcpGroupLink::Connect(int32_t node, std::string_view descriptor) {
  if (closed_) {
    return absl::FailedPreconditionError(
        absl::StrCat("group '", options_.group, "': the link is closed"));
  }
  if (!ValidNode(node)) return NotAPeerError(options_, node, "Connect");
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("group '", options_.group, "': descriptor of node ", node, ": ", why));
  };
  TcpDescriptor d{};
  if (descriptor.size() != sizeof d) {
    return bad(absl::StrCat(descriptor.size(), " bytes, a TCP descriptor has ", sizeof d));
  }
  std::memcpy(&d, descriptor.data(), sizeof d);
  if (d.magic != abi::kTcpDescriptorMagic) return bad(absl::StrFormat("magic 0x%08x", d.magic));
  if (d.version != abi::kTcpWireVersion) {
    return bad(
        absl::StrCat("wire version ", d.version, ", this daemon speaks ", abi::kTcpWireVersion));
  }
  if (d.node != node) return bad(absl::StrCat("it is node ", d.node, "'s"));
  if (d.num_connections < 1 || d.num_connections > abi::kTcpMaxConnections) {
    return bad(absl::StrCat("num_connections ", d.num_connections, " not in [1, ",
                            abi::kTcpMaxConnections, "]"));
  }
  if (d.port == 0 || d.reserved != 0 || d.reserved2 != 0) {
    return bad("port 0 or reserved bytes set");
  }
  if (d.for_node != options_.self_node) {
    return bad(absl::StrCat("it was made for node ", d.for_node, ", this is node ",
                            options_.self_node, " (each node connects with its own)"));
  }
  if (d.incarnation == 0) return bad("incarnation 0");
  const size_t host_len = strnlen(d.host, sizeof d.host);
  if (host_len == 0 || host_len == sizeof d.host) return bad("host empty or not terminated");
  Peer& p = *peers_[static_cast<size_t>(node)];
  const std::string host(d.host, host_len);
  const std::string address = host.find(':') != std::string::npos
                                  ? absl::StrCat("[", host, "]:", d.port)
                                  : absl::StrCat(host, ":", d.port);
  sockaddr_storage sa{};
  socklen_t sa_len = 0;
  const absl::Status resolved = Resolve(host, d.port, /*passive=*/false, &sa, &sa_len);

  std::lock_guard<std::mutex> l(core_->mu());
  bool stale_inbound = false;
  for (const Conn& c : p.in) stale_inbound |= c.incarnation != 0 && c.incarnation != d.incarnation;
  if (p.state.load() != PeerState::kIdle || stale_inbound) Reset(p);
  p.address = address;
  p.incarnation = d.incarnation;
  AdoptParked(p);
  p.peer_recv_bytes = d.recv_bytes;
  p.deadline = Clock::now() + core_->options().connect_timeout;
  p.retries = 0;
  p.last_retry_why.clear();
  p.state = PeerState::kConnecting;
  if (!resolved.ok()) {
    Fail(p, resolved.message(), FailedBy::kEngine);
    return absl::OkStatus();
  }
  p.sa = sa;
  p.sa_len = sa_len;
  p.out.resize(d.num_connections);
  for (uint32_t i = 0; i < d.num_connections; ++i) {
    Conn& c = p.out[i];
    c.index = i;
    c.hs = MakeTcpHandshake(d, options_.self_node, incarnation_, i);
    if (!OpenConn(p, c, FailedBy::kEngine)) return absl::OkStatus();
  }
  core_->Wake();
  return absl::OkStatus();
}

bool TcpGroupLink::OpenConn(Peer& p, Conn& c, FailedBy by) {
  c.fd.Reset(::socket(p.sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  c.phase = Conn::Phase::kConnecting;
  c.hs_sent = 0;
  c.ack_got = 0;
  c.readable = false;
  c.writable = false;
  if (!c.fd.valid()) {
    Fail(p, absl::StrCat("socket: ", Errno(errno)), by);
    return false;
  }
  SetNoDelay(c.fd.get());
  if (::connect(c.fd.get(), reinterpret_cast<const sockaddr*>(&p.sa), p.sa_len) != 0 &&
      errno != EINPROGRESS) {
    Fail(p, absl::StrCat("connect: ", Errno(errno)), by);
    return false;
  }
  const absl::Status added = core_->EpollAdd(c.fd.get(), ConnKey(id_, p.node, false, c.index));
  if (!added.ok()) {
    Fail(p, added.message(), by);
    return false;
  }
  return true;
}

void TcpGroupLink::RetryConn(Peer& p, Conn& c, const std::string& why, Clock::time_point now) {
  CloseOut(p, c);
  c.phase = Conn::Phase::kRetry;
  c.retry_at = now + c.backoff;
  c.backoff = std::min(c.backoff * 2, kMaxRetryBackoff);
  ++p.retries;
  Log()->debug("{}: {}; connecting again in {} ms", PeerName(p), why,
               (c.retry_at - now) / std::chrono::milliseconds(1));
  p.last_retry_why = why;
}

bool TcpGroupLink::Admits(const TcpHandshake& hs) const {
  if (!ValidNode(hs.from_node) || hs.to_node != options_.self_node) return false;
  const Token token = PeerToken(link_secret_.data(), options_.self_node, hs.from_node);
  const Token proof = HandshakeProof(token.data(), hs.from_node, hs.to_node, hs.incarnation);
  return TokenEqual(proof.data(), hs.proof);
}

PeerState TcpGroupLink::State(int32_t node) const {
  if (!ValidNode(node)) return NonPeerState(options_, node);
  return peers_[static_cast<size_t>(node)]->state.load(std::memory_order_acquire);
}

absl::Status TcpGroupLink::PeerStatus(int32_t node) const {
  if (!ValidNode(node)) return NonPeerStatus(options_, node);
  const Peer& p = *peers_[static_cast<size_t>(node)];
  if (p.state.load(std::memory_order_acquire) != PeerState::kFailed) return absl::OkStatus();
  std::lock_guard<std::mutex> l(status_mu_);
  return p.status;
}

absl::Status TcpGroupLink::PostWrite(int32_t node, std::span<const WritePiece> pieces,
                                     uint32_t imm) {
  if (!ValidNode(node)) return NotAPeerError(options_, node, "PostWrite");
  Peer& p = *peers_[static_cast<size_t>(node)];
  const PeerState state = p.state.load(std::memory_order_acquire);
  if (state != PeerState::kReady) {
    if (state == PeerState::kFailed) return PeerStatus(node);
    return errors::WithReason(
        absl::UnavailableError(absl::StrCat(PeerName(p), " is not connected yet")),
        errors::Reason::kTransportFailed);
  }
  const uint64_t max_pieces = p.pieces.size();
  if (pieces.size() > max_pieces) {
    return absl::InvalidArgumentError(
        absl::StrCat(PeerName(p), ": a write of ", pieces.size(), " pieces, at most ", max_pieces));
  }
  if (const ptrdiff_t bad = FirstPieceOutside(pieces, p.peer_recv_bytes); bad >= 0) {
    return PieceOutsideError(pieces, bad, p.peer_recv_bytes, PeerName(p));
  }
  const uint64_t posted = p.writes_posted.load(std::memory_order_relaxed);
  if (posted - p.writes_done.load(std::memory_order_acquire) >= p.writes.size() ||
      p.pieces_posted + pieces.size() - p.pieces_released.load(std::memory_order_acquire) >
          max_pieces) {
    return absl::ResourceExhaustedError(absl::StrCat(PeerName(p), ": too many writes in flight"));
  }
  WriteEntry& e = p.writes[posted % p.writes.size()];
  e.piece_begin = p.pieces_posted;
  for (const WritePiece& w : pieces) p.pieces[p.pieces_posted++ % max_pieces] = w;
  e.piece_end = p.pieces_posted;
  e.imm = imm;
  p.writes_posted.store(posted + 1, std::memory_order_release);
  core_->Wake();
  return absl::OkStatus();
}

LinkCounters TcpGroupLink::Counters(int32_t node) const {
  LinkCounters out;
  if (!ValidNode(node)) return out;
  // The connections are the progress thread's: read under its lock, one syscall each.
  std::lock_guard<std::mutex> l(core_->mu());
  const Peer& p = *peers_[static_cast<size_t>(node)];
  uint64_t n = p.retransmits_closed;
  for (const Conn& c : p.out) n += RetransmitsOrZero(c.fd.get());
  out.retransmits = static_cast<int64_t>(n);
  return out;
}

uint64_t TcpGroupLink::WritesCompleted(int32_t node) const {
  if (!ValidNode(node)) return 0;
  // kFailed is stored under TcpCore::mu_ after the peer's sockets closed; the progress
  // thread sends nothing for it after that, so no source is read any more.
  return peers_[static_cast<size_t>(node)]->WritesCompleted();
}

bool TcpGroupLink::PollImm(int32_t node, uint32_t* imm) {
  if (!ValidNode(node)) return false;
  Peer& p = *peers_[static_cast<size_t>(node)];
  if (!p.PopImm(imm)) return false;
  if (p.recv_paused.load(std::memory_order_acquire)) {
    p.recv_paused.store(false, std::memory_order_relaxed);
    core_->Wake();
  }
  return true;
}

void TcpGroupLink::FailPeer(int32_t node, const absl::Status& cause) {
  if (!ValidNode(node) || closed_) return;
  std::lock_guard<std::mutex> l(core_->mu());
  Fail(*peers_[static_cast<size_t>(node)], cause.message(), FailedBy::kEngine);
}

void TcpGroupLink::Close() {
  if (closed_) return;
  closed_ = true;
  if (registered_) core_->Unregister(this);
}

void TcpGroupLink::Detach(const absl::Status& cause, bool wake) {
  bool failed = false;
  for (auto& p : peers_) {
    if (p == nullptr) continue;
    failed |= p->state.load() != PeerState::kFailed;
    Fail(*p, cause.message(), FailedBy::kClose);
  }
  if (wake && failed) CallWake();
}

// ---------------------------------------------------------------------------------------
// TcpGroupLink: the progress side (under TcpCore::mu_)

void TcpGroupLink::Fail(Peer& p, absl::string_view why, FailedBy by) {
  for (Conn& c : p.out) CloseOut(p, c);
  for (Conn& c : p.in) c.fd.Reset();
  if (by == FailedBy::kClose) {
    for (ScopedFd& fd : p.parked) fd.Reset();
  }
  if (p.state.load() == PeerState::kFailed) return;
  absl::Status status =
      errors::WithReason(absl::UnavailableError(absl::StrCat(PeerNameLocked(p), ": ", why)),
                         errors::Reason::kTransportFailed);
  if (by != FailedBy::kClose) Log()->warn("{}", status.message());
  {
    std::lock_guard<std::mutex> l(status_mu_);
    p.status = std::move(status);
  }
  p.state.store(PeerState::kFailed, std::memory_order_release);
  if (by == FailedBy::kProgress) CallWake();
}

void TcpGroupLink::Reset(Peer& p) {
  for (Conn& c : p.out) CloseOut(p, c);
  p.out.clear();
  p.ready_out = 0;
  p.writes_posted.store(0, std::memory_order_relaxed);
  p.pieces_posted = 0;
  p.writes_done.store(0, std::memory_order_relaxed);
  p.pieces_released.store(0, std::memory_order_relaxed);
  for (size_t i = 0; i < p.in.size(); ++i) {
    Conn fresh;
    fresh.index = static_cast<uint32_t>(i);
    p.in[i] = std::move(fresh);
  }
  p.delivered.store(0, std::memory_order_relaxed);
  p.consumed.store(0, std::memory_order_relaxed);
  p.recv_paused.store(false, std::memory_order_relaxed);
  p.inbound_from.clear();
  p.closing = false;
  p.close_why.clear();
  {
    std::lock_guard<std::mutex> l(status_mu_);
    p.status = absl::OkStatus();
  }
  p.state.store(PeerState::kIdle, std::memory_order_release);
}

void TcpGroupLink::AdoptParked(Peer& p) {
  for (size_t i = 0; i < p.in.size(); ++i) {
    Conn& c = p.in[i];
    if (c.fd.valid() || c.dones > 0 || c.rhdr_got > 0) continue;
    if (!p.parked[i].valid() || p.parked_incarnation[i] != p.incarnation) continue;
    c.fd = std::move(p.parked[i]);
    c.incarnation = p.incarnation;
    c.readable = true;  // Bytes may be waiting (edge-triggered).
  }
}

void TcpGroupLink::PeerClosing(Peer& p, absl::string_view why) {
  if (p.state.load() == PeerState::kFailed) return;
  if (!p.closing) {
    p.closing = true;
    p.close_why = std::string(why);
    p.close_deadline = Clock::now() + kCloseDrain;
    for (Conn& c : p.in) c.readable = true;  // Read what is there now.
  }
  bool open = false;
  for (const Conn& c : p.in) open |= c.fd.valid();
  if (!open) Fail(p, p.close_why);
}

void TcpGroupLink::OnConnEvent(int32_t node, bool inbound, uint32_t index, uint32_t events) {
  if (!ValidNode(node)) return;
  Peer& p = *peers_[static_cast<size_t>(node)];
  std::vector<Conn>& conns = inbound ? p.in : p.out;
  if (index >= conns.size()) return;
  Conn& c = conns[index];
  if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) c.readable = true;
  if (events & (EPOLLOUT | EPOLLHUP | EPOLLERR)) c.writable = true;
}

absl::Status TcpGroupLink::AttachInbound(ScopedFd& fd, const TcpHandshake& hs,
                                         const std::string& from) {
  const std::string who = absl::StrCat("group '", options_.group, "': handshake from node ",
                                       hs.from_node, " (", from, ") ");
  if (!ValidNode(hs.from_node)) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, "names no peer node (num_nodes ", options_.num_nodes, ")"));
  }
  if (hs.to_node != options_.self_node) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, "is for node ", hs.to_node, ", this is node ", options_.self_node));
  }
  const auto want = static_cast<uint32_t>(core_->options().connections_per_peer);
  if (hs.num_connections != want || hs.connection >= want || hs.reserved != 0) {
    return absl::InvalidArgumentError(absl::StrCat(who, "has connection ", hs.connection, " of ",
                                                   hs.num_connections, ", this node takes ", want));
  }
  Peer& p = *peers_[static_cast<size_t>(hs.from_node)];
  Conn& c = p.in[hs.connection];
  // After the peer failed, or from another incarnation than the one connected (or than the
  // one already in the slot), a connection is for a Connect to come (its daemon registered
  // the group anew): parked until then, the newest per index.
  const bool park = p.state.load() == PeerState::kFailed ||
                    (p.incarnation != 0 && hs.incarnation != p.incarnation) ||
                    (c.incarnation != 0 && hs.incarnation != c.incarnation);
  if (!park && (c.fd.valid() || c.dones > 0 || c.rhdr_got > 0)) {
    return absl::AlreadyExistsError(absl::StrCat(who, "repeats connection ", hs.connection));
  }
  TcpAck ack{};
  ack.magic = abi::kTcpAckMagic;
  ack.version = abi::kTcpWireVersion;
  ack.node = options_.self_node;
  ack.connection = hs.connection;
  if (::send(fd.get(), &ack, sizeof ack, MSG_NOSIGNAL | MSG_DONTWAIT) !=
      static_cast<ssize_t>(sizeof ack)) {
    return errors::WithReason(
        absl::UnavailableError(absl::StrCat(who, "could not be acknowledged: ", Errno(errno))),
        errors::Reason::kTransportFailed);
  }
  core_->EpollMod(fd.get(), ConnKey(id_, hs.from_node, true, hs.connection));
  if (park) {
    if (p.parked[hs.connection].valid()) {
      Log()->debug("{}replaces the parked connection {} (incarnation {:x})", who, hs.connection,
                   p.parked_incarnation[hs.connection]);
    }
    p.parked[hs.connection] = std::move(fd);
    p.parked_incarnation[hs.connection] = hs.incarnation;
    return absl::OkStatus();
  }
  c.fd = std::move(fd);
  c.incarnation = hs.incarnation;
  c.readable = true;
  if (p.inbound_from.empty()) p.inbound_from = from;
  return absl::OkStatus();
}

bool TcpGroupLink::Progress(Clock::time_point now) {
  bool more = false;
  for (auto& pp : peers_) {
    if (pp == nullptr) continue;
    Peer& p = *pp;
    const PeerState state = p.state.load(std::memory_order_relaxed);
    if (state == PeerState::kFailed) continue;
    if (state == PeerState::kConnecting) {
      for (Conn& c : p.out) {
        if (p.state.load() == PeerState::kConnecting) ProgressConnect(p, c, now);
      }
      if (p.state.load() == PeerState::kConnecting && now >= p.deadline) {
        Fail(p, absl::StrCat("not connected within ", core_->options().connect_timeout.count(),
                             " ms (", p.ready_out, " of ", p.out.size(), " connections ready",
                             p.retries == 0
                                 ? std::string()
                                 : absl::StrCat("; ", p.retries,
                                                " closed before their acknowledgement, the last: ",
                                                p.last_retry_why),
                             ")"));
      }
    } else if (state == PeerState::kReady && p.closing) {
      if (now >= p.close_deadline) {
        Fail(p, absl::StrCat(p.close_why, " (its other connections not closed within ",
                             kCloseDrain.count(), " ms)"));
      }
    } else if (state == PeerState::kReady) {
      bool sent = false;
      for (Conn& c : p.out) {
        if (p.state.load() != PeerState::kReady) break;
        CheckOutboundEof(p, c);
        if (p.state.load() != PeerState::kReady || p.closing) break;
        more |= ProgressSend(p, c);
        sent = true;
      }
      if (sent && p.state.load() == PeerState::kReady && !p.closing) {
        uint64_t done = UINT64_MAX;
        for (const Conn& c : p.out) done = std::min(done, c.writes_sent);
        if (done > p.writes_done.load(std::memory_order_relaxed)) {
          p.pieces_released.store(p.writes[(done - 1) % p.writes.size()].piece_end,
                                  std::memory_order_release);
          p.writes_done.store(done, std::memory_order_release);
          CallWake();
        }
      }
    }
    // A write completed: connections waiting for it may go on (ProgressRecv's barrier);
    // a few rounds here, then another turn of the loop.
    for (int round = 0; round < kRecvRounds; ++round) {
      const uint64_t delivered = p.delivered.load(std::memory_order_relaxed);
      for (Conn& c : p.in) {
        if (p.state.load() == PeerState::kFailed) break;
        if (c.fd.valid()) more |= ProgressRecv(p, c);
      }
      if (p.delivered.load(std::memory_order_relaxed) == delivered) break;
      if (round + 1 == kRecvRounds) more = true;
    }
  }
  return more;
}

void TcpGroupLink::ProgressConnect(Peer& p, Conn& c, Clock::time_point now) {
  if (c.phase == Conn::Phase::kRetry) {
    if (now < c.retry_at || !OpenConn(p, c, FailedBy::kProgress)) return;
  }
  if (c.phase == Conn::Phase::kConnecting) {
    if (!c.writable) return;
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(c.fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) return Fail(p, absl::StrCat("connect: ", Errno(err)));
    c.phase = Conn::Phase::kHandshake;
  }
  if (c.phase == Conn::Phase::kHandshake) {
    const Io io = MoveBytes(c.fd.get(), &c.hs, sizeof c.hs, &c.hs_sent, /*sending=*/true);
    if (io == Io::kAgain) {
      c.writable = false;
      return;
    }
    if (io != Io::kDone) {
      return RetryConn(p, c, absl::StrCat("handshake on connection ", c.index, ": ", Errno(errno)),
                       now);
    }
    c.phase = Conn::Phase::kAwaitAck;
  }
  if (c.phase == Conn::Phase::kAwaitAck) {
    if (!c.readable) return;
    const Io io = MoveBytes(c.fd.get(), &c.ack, sizeof c.ack, &c.ack_got, /*sending=*/false);
    if (io == Io::kAgain) {
      c.readable = false;
      return;
    }
    if (io != Io::kDone) {
      return RetryConn(p, c,
                       absl::StrCat("connection ", c.index,
                                    " was closed by the listener before its acknowledgement (",
                                    io == Io::kClosed ? "closed" : Errno(errno),
                                    "): a flood of connections there, a stale descriptor, another "
                                    "wire version or connection count?"),
                       now);
    }
    if (c.ack.magic != abi::kTcpAckMagic || c.ack.version != abi::kTcpWireVersion ||
        c.ack.node != p.node || c.ack.connection != c.index) {
      return Fail(p, absl::StrFormat("bad handshake answer on connection %u (magic 0x%08x, "
                                     "version %u, node %d)",
                                     c.index, c.ack.magic, c.ack.version, c.ack.node));
    }
    c.phase = Conn::Phase::kReady;
    if (++p.ready_out == p.out.size()) {
      p.state.store(PeerState::kReady, std::memory_order_release);
      Log()->debug("{}: connected ({} connections)", PeerName(p), p.out.size());
      CallWake();
    }
  }
}

void TcpGroupLink::CheckOutboundEof(Peer& p, Conn& c) {
  while (c.readable) {
    char scratch[64];
    const ssize_t r = ::recv(c.fd.get(), scratch, sizeof scratch, MSG_DONTWAIT);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      c.readable = false;
      return;
    }
    if (r == 0) {
      CloseOut(p, c);
      return PeerClosing(p, absl::StrCat("connection ", c.index, " was closed by the peer"));
    }
    return Fail(p, r > 0 ? absl::StrCat("sent bytes on send-only connection ", c.index)
                         : absl::StrCat("connection ", c.index, ": ", Errno(errno)));
  }
}

bool TcpGroupLink::BuildBatch(Peer& p, Conn& c) {
  c.niov = 0;
  c.iov_pos = 0;
  c.batch_dones = 0;
  int nh = 0;
  const uint64_t posted = p.writes_posted.load(std::memory_order_acquire);
  const uint64_t nconn = p.out.size();
  const uint64_t chunk = core_->options().chunk_bytes;
  while (c.cur_write < posted && c.niov + 2 <= kMaxIov) {
    const WriteEntry& w = p.writes[c.cur_write % p.writes.size()];
    bool added = false;
    while (w.piece_begin + c.cur_piece < w.piece_end) {
      const WritePiece& piece = p.pieces[(w.piece_begin + c.cur_piece) % p.pieces.size()];
      if (c.cur_offset >= piece.bytes) {
        ++c.cur_piece;
        c.cur_offset = 0;
        continue;
      }
      const uint64_t len = std::min(chunk, piece.bytes - c.cur_offset);
      const bool mine = (c.cur_chunk + c.cur_write) % nconn == c.index;
      if (mine) {
        TcpFrameHeader& h = c.hdr[nh++];
        h = abi::MakeTcpFrame(TcpFrameKind::kPiece, c.cur_write, piece.remote_offset + c.cur_offset,
                              len, 0);
        c.iov[c.niov++] = iovec{&h, sizeof h};
        c.iov[c.niov++] =
            iovec{const_cast<char*>(static_cast<const char*>(piece.src)) + c.cur_offset, len};
      }
      ++c.cur_chunk;
      c.cur_offset += len;
      if (mine) {
        added = true;
        break;
      }
    }
    if (added) continue;
    TcpFrameHeader& h = c.hdr[nh++];
    h = abi::MakeTcpFrame(TcpFrameKind::kDone, c.cur_write, 0, 0, w.imm);
    c.iov[c.niov++] = iovec{&h, sizeof h};
    ++c.batch_dones;
    ++c.cur_write;
    c.cur_piece = c.cur_offset = c.cur_chunk = 0;
  }
  return c.niov > 0;
}

bool TcpGroupLink::ProgressSend(Peer& p, Conn& c) {
  uint64_t budget = kWriteBudget;
  while (c.writable) {
    if (c.iov_pos == c.niov && !BuildBatch(p, c)) return false;
    msghdr m{};
    m.msg_iov = &c.iov[static_cast<size_t>(c.iov_pos)];
    m.msg_iovlen = static_cast<size_t>(c.niov - c.iov_pos);
    const ssize_t r = ::sendmsg(c.fd.get(), &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        c.writable = false;
        return false;
      }
      Fail(p, absl::StrCat("connection ", c.index, ": send: ", Errno(errno)));
      return false;
    }
    size_t left = static_cast<size_t>(r);
    while (left > 0 && c.iov_pos < c.niov) {
      iovec& v = c.iov[static_cast<size_t>(c.iov_pos)];
      const size_t take = std::min(left, v.iov_len);
      v.iov_base = static_cast<char*>(v.iov_base) + take;
      v.iov_len -= take;
      left -= take;
      if (v.iov_len == 0) ++c.iov_pos;
    }
    while (c.iov_pos < c.niov && c.iov[static_cast<size_t>(c.iov_pos)].iov_len == 0) ++c.iov_pos;
    if (c.iov_pos == c.niov) {
      c.writes_sent += c.batch_dones;
      c.batch_dones = 0;
    }
    const uint64_t sent = static_cast<uint64_t>(r);
    if (sent >= budget) return true;
    budget -= sent;
  }
  return false;
}

absl::Status TcpGroupLink::ParseFrame(Conn& c) {
  const TcpFrameHeader& h = c.rhdr;
  if (h.magic != abi::kTcpFrameMagic || h.version != abi::kTcpWireVersion || h.reserved != 0) {
    return errors::WithReason(
        absl::DataLossError(absl::StrFormat("connection %u: bad frame (magic 0x%08x, version %u)",
                                            c.index, h.magic, h.version)),
        errors::Reason::kPeerProtocol);
  }
  if (h.seq != c.dones) {
    return errors::WithReason(
        absl::DataLossError(absl::StrCat("connection ", c.index, ": frame of write ", h.seq,
                                         ", expected write ", c.dones)),
        errors::Reason::kPeerProtocol);
  }
  if (h.kind == static_cast<uint16_t>(TcpFrameKind::kPiece)) {
    const uint64_t region = options_.recv_bytes;
    if (h.imm != 0 || h.bytes > region || h.offset > region - h.bytes) {
      return errors::WithReason(
          absl::DataLossError(
              absl::StrCat("connection ", c.index, ": piece at offset ", h.offset, " of ", h.bytes,
                           " bytes is outside this node's receive region of ", region, " bytes")),
          errors::Reason::kPeerProtocol);
    }
    c.dst = static_cast<uint8_t*>(options_.recv_base) + h.offset;
    c.dst_left = h.bytes;
    c.rstate = h.bytes > 0 ? Conn::Recv::kPayload : Conn::Recv::kHeader;
    return absl::OkStatus();
  }
  if (h.kind == static_cast<uint16_t>(TcpFrameKind::kDone) && h.offset == 0 && h.bytes == 0) {
    c.rstate = Conn::Recv::kDonePending;
    return absl::OkStatus();
  }
  return errors::WithReason(
      absl::DataLossError(absl::StrCat("connection ", c.index, ": bad frame kind ", h.kind)),
      errors::Reason::kPeerProtocol);
}

bool TcpGroupLink::TryDone(Peer& p, Conn& c) {
  const uint64_t seq = c.dones;
  const uint64_t cap = p.imm_slots.size();
  if (seq >= p.consumed.load(std::memory_order_acquire) + cap) return false;
  p.imm_slots[seq % cap] = c.rhdr.imm;
  ++c.dones;
  c.rstate = Conn::Recv::kHeader;
  uint64_t delivered = UINT64_MAX;
  for (const Conn& in : p.in) delivered = std::min(delivered, in.dones);
  if (delivered > p.delivered.load(std::memory_order_relaxed)) {
    p.delivered.store(delivered, std::memory_order_release);
    CallWake();
  }
  return true;
}

bool TcpGroupLink::ProgressRecv(Peer& p, Conn& c) {
  uint64_t budget = kReadBudget;
  for (;;) {
    if (c.rstate == Conn::Recv::kDonePending) {
      if (!TryDone(p, c)) {
        p.recv_paused.store(true, std::memory_order_release);
        // PollImm may have made room between the check and the flag: check again.
        if (!TryDone(p, c)) return false;
        p.recv_paused.store(false, std::memory_order_relaxed);
      }
      continue;
    }
    // Write c.dones starts only once every connection finished the write before it, so a
    // later write's bytes always land after an earlier one's (the same offset written twice
    // ends with the later bytes). Progress runs this connection again when that happens.
    if (c.rstate == Conn::Recv::kHeader && c.rhdr_got == 0 &&
        c.dones > p.delivered.load(std::memory_order_relaxed)) {
      return false;
    }
    if (!c.readable) return false;
    if (budget == 0) return true;
    std::array<iovec, 2> iov{};
    int n = 0;
    const bool payload = c.rstate == Conn::Recv::kPayload;
    if (payload) {
      const uint64_t take = std::min(c.dst_left, budget);
      iov[n++] = iovec{c.dst, take};
      if (take == c.dst_left) iov[n++] = iovec{&c.rhdr, sizeof c.rhdr};
    } else {
      iov[n++] = iovec{reinterpret_cast<char*>(&c.rhdr) + c.rhdr_got, sizeof c.rhdr - c.rhdr_got};
    }
    const ssize_t r = ::readv(c.fd.get(), iov.data(), n);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      c.readable = false;
      return false;
    }
    if (r == 0 && c.rstate == Conn::Recv::kHeader && c.rhdr_got == 0) {
      // A clean close between frames: this connection is done; the others are read on.
      c.fd.Reset();
      PeerClosing(p, absl::StrCat("connection ", c.index, " from the peer was closed"));
      return false;
    }
    if (r <= 0) {
      Fail(p, r == 0 ? absl::StrCat("connection ", c.index, " from the peer was closed mid-frame")
                     : absl::StrCat("connection ", c.index, " from the peer: ", Errno(errno)));
      return false;
    }
    uint64_t left = static_cast<uint64_t>(r);
    budget -= std::min(budget, left);
    if (payload) {
      const uint64_t take = std::min(left, c.dst_left);
      c.dst += take;
      c.dst_left -= take;
      left -= take;
      if (c.dst_left == 0) c.rstate = Conn::Recv::kHeader;
    }
    c.rhdr_got += left;
    if (c.rstate == Conn::Recv::kHeader && c.rhdr_got == sizeof c.rhdr) {
      c.rhdr_got = 0;
      const absl::Status s = ParseFrame(c);
      if (!s.ok()) {
        Fail(p, s.message());
        return false;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// TcpTransport

class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(std::shared_ptr<TcpCore> core) : core_(std::move(core)) {}
  ~TcpTransport() override { Shutdown(); }
  std::string name() const override { return "tcp"; }
  absl::StatusOr<std::unique_ptr<GroupLink>> CreateGroupLink(
      const GroupLinkOptions& options) override {
    if (core_->stopped()) {
      return absl::FailedPreconditionError("the TCP transport was shut down");
    }
    auto link = std::make_unique<TcpGroupLink>(core_, options);
    EPD_RETURN_IF_ERROR(link->Init());
    return std::unique_ptr<GroupLink>(std::move(link));
  }
  void Shutdown() override { core_->Shutdown(); }
  std::string listen_address() const { return core_->listen_address(); }

 private:
  std::shared_ptr<TcpCore> core_;
};

}  // namespace

abi::TcpHandshake MakeTcpHandshake(const abi::TcpDescriptor& target, int32_t from_node,
                                   uint64_t incarnation, uint32_t connection) {
  TcpHandshake hs{};
  hs.magic = abi::kTcpHandshakeMagic;
  hs.version = abi::kTcpWireVersion;
  hs.num_connections = target.num_connections;
  const Token proof = HandshakeProof(target.token, from_node, target.node, incarnation);
  std::memcpy(hs.proof, proof.data(), proof.size());
  hs.from_node = from_node;
  hs.to_node = target.node;
  hs.connection = connection;
  hs.incarnation = incarnation;
  return hs;
}

absl::StatusOr<std::unique_ptr<Transport>> MakeTcpTransport(const TcpTransportOptions& options) {
  const auto range = [](absl::string_view name, int64_t v, int64_t lo, int64_t hi) {
    if (v >= lo && v <= hi) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("tcp ", name, " ", v, " not in [", lo, ", ", hi, "]"));
  };
  EPD_RETURN_IF_ERROR(
      range("connections_per_peer", options.connections_per_peer, 1, abi::kTcpMaxConnections));
  EPD_RETURN_IF_ERROR(
      range("connect_timeout (ms)", options.connect_timeout.count(), 1, int64_t{24} * 3600 * 1000));
  EPD_RETURN_IF_ERROR(range("max_writes_in_flight", options.max_writes_in_flight, 1, 1 << 20));
  EPD_RETURN_IF_ERROR(range("max_pieces_in_flight", options.max_pieces_in_flight, 1, 1 << 24));
  EPD_RETURN_IF_ERROR(range("max_pending_imms", options.max_pending_imms, 1, 1 << 20));
  EPD_RETURN_IF_ERROR(
      range("chunk_bytes",
            static_cast<int64_t>(std::min<uint64_t>(options.chunk_bytes, uint64_t{1} << 40)), 4096,
            int64_t{1} << 30));
  auto core = std::make_shared<TcpCore>(options);
  EPD_RETURN_IF_ERROR(core->Start());
  return std::unique_ptr<Transport>(std::make_unique<TcpTransport>(std::move(core)));
}

absl::StatusOr<uint64_t> TcpTotalRetransmits(int fd) {
  tcp_info info{};
  socklen_t len = sizeof info;
  if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("getsockopt(TCP_INFO) on fd ", fd, ": ", Errno(errno)));
  }
  return static_cast<uint64_t>(info.tcpi_total_retrans);
}

std::string TcpListenAddress(const Transport& transport) {
  const auto* tcp = dynamic_cast<const TcpTransport*>(&transport);
  return tcp == nullptr ? std::string() : tcp->listen_address();
}

}  // namespace epd::transport
