#include "daemon/peer/grpc_peer_mesh.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <openssl/rand.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/errors/grpc_status.h"
#include "common/errors/reason.h"
#include "common/os/scoped_fd.h"
#include "common/status_macros.h"
#include "daemon/control/spec_validation.h"
#include "daemon/core/fd_limits.h"
#include "daemon/core/keyed_mac.h"
#include "daemon/core/logging.h"
#include "daemon/server/listener.h"
#include "epd/v1/peer.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace epd::peer {
namespace {

constexpr size_t kNonceBytes = 32;
constexpr size_t kSessionIdBytes = 16;
constexpr size_t kMacBytes = 32;
/// Handshake nonces outstanding at once (older ones are dropped), and how long one lives.
constexpr size_t kMaxPendingNonces = 1024;
constexpr absl::Duration kNonceLifetime = absl::Seconds(10);
/// Authenticated sessions kept (the least recently used goes first).
constexpr size_t kMaxSessions = 4096;
/// Longest daemon id (advertised address) accepted in a handshake.
constexpr size_t kMaxDaemonIdBytes = 255;
/// Most groups one heartbeat may carry.
constexpr int kMaxHeldGroups = 65536;
/// Rendezvous retry backoff bounds.
constexpr absl::Duration kMinBackoff = absl::Milliseconds(20);
constexpr absl::Duration kMaxBackoff = absl::Seconds(1);
/// Shortest deadline of one Peer call (the heartbeat interval may be shorter); a loaded
/// machine answers late rather than never.
constexpr absl::Duration kMinCallDeadline = absl::Milliseconds(500);
/// Teardown notices queued per peer at most (the oldest go first); they are best effort,
/// the peer's heartbeats tell it the same.
constexpr size_t kMaxQueuedLeaves = 1024;
/// How long Shutdown spends sending the teardown notices still queued.
constexpr absl::Duration kShutdownLeaveBudget = absl::Milliseconds(500);

constexpr char kWelcomeLabel[] = "epd-peer-welcome-v1";
constexpr absl::Duration kServerHandshakeTimeout = absl::Seconds(5);
/// A plaintext Peer connection that has not sent the HTTP/2 preface within this time is
/// closed by the accept loop.
constexpr absl::Duration kPeerFirstBytesTimeout = absl::Seconds(2);

std::string RandomBytes(size_t n) {
  std::string out(n, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)) != 1) {
    // RAND_bytes fails only when the OS entropy source is gone; nothing safe remains.
    std::abort();
  }
  return out;
}

uint64_t RandomNonZero64() {
  uint64_t v = 0;
  while (v == 0) {
    std::string b = RandomBytes(sizeof(v));
    std::memcpy(&v, b.data(), sizeof(v));
  }
  return v;
}

/// The Peer service's MACs: labelled HMAC-SHA256 (daemon/core/keyed_mac.h).
std::string Mac(absl::string_view key, absl::string_view label,
                std::initializer_list<absl::string_view> parts) {
  return LabelledHmacSha256(key, label, parts);
}

bool SameMac(absl::string_view a, absl::string_view b) {
  return a.size() == kMacBytes && ConstantTimeEqual(a, b);
}

/// The MAC of a request: over the method and the request's deterministic bytes with its
/// auth cleared.
template <typename Request>
std::string RequestMac(absl::string_view session_key, absl::string_view method,
                       const Request& request) {
  Request copy = request;
  copy.clear_auth();
  return PeerRequestMac(session_key, method, request.auth().counter(), copy);
}

std::chrono::system_clock::time_point DeadlineAfter(absl::Duration d) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d);
}

std::string Hex(absl::string_view bytes) { return absl::BytesToHexString(bytes); }

std::string MsText(absl::Duration d) { return absl::StrCat(absl::ToInt64Milliseconds(d), " ms"); }

absl::Status FromGrpc(const grpc::Status& s) {
  absl::Status st = errors::FromGrpcStatus(s);
  // gRPC's own failures carry no reason: the peer could not be reached (in time).
  if (absl::IsUnavailable(st) || absl::IsDeadlineExceeded(st)) {
    st = errors::WithDefaultReason(std::move(st), errors::Reason::kPeerUnreachable);
  }
  return st;
}

}  // namespace

std::string RankRangeText(int32_t first_rank, int32_t num_ranks) {
  if (num_ranks == 1) return absl::StrCat("rank ", first_rank);
  return absl::StrCat("ranks ", first_rank, "-", first_rank + num_ranks - 1);
}

absl::Status ProbeGrpcListener(const std::string& host, int port, absl::Duration timeout) {
  const std::string where = absl::StrCat(host, ":", port);
  const absl::Time until = absl::Now() + timeout;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  std::string bare = host;
  if (bare.size() >= 2 && bare.front() == '[' && bare.back() == ']') {
    bare = bare.substr(1, bare.size() - 2);
  }
  if (int rc = ::getaddrinfo(bare.c_str(), std::to_string(port).c_str(), &hints, &found);
      rc != 0 || found == nullptr) {
    return errors::WithReason(
        absl::UnavailableError(
            absl::StrCat("probe of ", where, ": cannot resolve the host: ", ::gai_strerror(rc))),
        errors::Reason::kPeerUnreachable);
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> hold(found, &::freeaddrinfo);
  ScopedFd fd(::socket(found->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) {
    const int err = errno;
    return errors::WithReason(
        absl::UnavailableError(
            absl::StrCat("probe of ", where, ": cannot make a socket: ", std::strerror(err))),
        errors::Reason::kPeerUnreachable);
  }
  if (::connect(fd.get(), found->ai_addr, found->ai_addrlen) != 0 && errno != EINPROGRESS) {
    const int err = errno;
    return errors::WithReason(
        absl::UnavailableError(absl::StrCat("probe of ", where, ": connect: ", std::strerror(err))),
        errors::Reason::kPeerUnreachable);
  }
  // Waits for `events` until `until`; the revents, or 0 at the deadline.
  auto wait = [&](short events) -> short {
    while (true) {
      const int64_t ms = absl::ToInt64Milliseconds(until - absl::Now());
      if (ms <= 0) return 0;
      pollfd p{fd.get(), events, 0};
      const int n = ::poll(&p, 1, static_cast<int>(ms));
      if (n > 0) return p.revents;
      if (n < 0 && errno != EINTR) return POLLERR;
    }
  };
  const std::string stalled = absl::StrCat(
      "the Peer listener at ", where, " took no connection within ", MsText(timeout),
      " (its accept loop may have stopped, e.g. after the daemon ran out of file descriptors; "
      "restart epd if this persists)");
  if (wait(POLLOUT) == 0) {
    return errors::WithReason(absl::DeadlineExceededError(stalled),
                              errors::Reason::kPeerUnreachable);
  }
  int err = 0;
  socklen_t len = sizeof(err);
  if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
    return errors::WithReason(
        absl::UnavailableError(absl::StrCat("probe of ", where, ": connect: ", std::strerror(err))),
        errors::Reason::kPeerUnreachable);
  }
  // The HTTP/2 preface and an empty SETTINGS frame. A server that took the connection
  // answers (its SETTINGS, or a close when it speaks TLS); one whose accept loop is gone
  // leaves it in the backlog and says nothing.
  static constexpr char kHello[] =
      "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";
  if (::send(fd.get(), kHello, sizeof(kHello) - 1, MSG_NOSIGNAL) < 0 && errno != EAGAIN) {
    const int e = errno;
    return errors::WithReason(
        absl::UnavailableError(absl::StrCat("probe of ", where, ": send: ", std::strerror(e))),
        errors::Reason::kPeerUnreachable);
  }
  if (wait(POLLIN) == 0) {
    return errors::WithReason(absl::DeadlineExceededError(stalled),
                              errors::Reason::kPeerUnreachable);
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------
// State shared by the mesh, its service, its workers and the GroupPeers.

namespace {

enum class NodeState { kSelf, kMissing, kRegistered, kLost, kMismatch };

struct NodeEntry {
  std::string address;
  int32_t first_rank = 0;
  int32_t num_ranks = 0;
  NodeState state = NodeState::kMissing;
  PeerDescriptor descriptor;      ///< Valid in kRegistered (and the lost one in kLost).
  uint64_t daemon_instance = 0;   ///< Of the registration held.
  uint64_t registration_seq = 0;  ///< Of the registration held.
  std::vector<bool> joined;       ///< As last published (empty = unknown).
  std::string reason;             ///< kLost / kMismatch.
  absl::Time next_attempt = absl::InfinitePast();
  absl::Duration backoff = kMinBackoff;
  bool refresh = false;  ///< Its daemon holds a newer registration: ask again.
};

struct GroupEntry {
  GroupMembership membership;
  uint64_t incarnation = 0;
  uint64_t registration_seq = 0;
  std::vector<NodeEntry> nodes;
  std::vector<bool> local_joined;
  bool removed = false;
};

std::string NodeText(const GroupEntry& g, int32_t node) {
  const NodeEntry& n = g.nodes[node];
  return absl::StrCat("node ", node, " (", n.address, ", ",
                      RankRangeText(n.first_rank, n.num_ranks), ")");
}

std::string JoinedBytes(const std::vector<bool>& joined) {
  std::string out(joined.size(), '\0');
  for (size_t i = 0; i < joined.size(); ++i) out[i] = joined[i] ? 1 : 0;
  return out;
}

struct Leave {
  std::string group;
  uint64_t incarnation = 0;
};

/// One peer daemon (by advertised address): its channel, session and worker thread.
struct PeerConn {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Peer::Stub> stub;
  // Session (set by the worker's handshake; guarded by State::mu).
  std::string session_id;
  std::string session_key;
  uint64_t session_counter = 0;  ///< The counter of the session's last call.
  absl::Time session_opened;
  absl::Time last_heard;
  /// Heartbeats and handshakes that failed since it was last heard from.
  int failed_probes = 0;
  absl::Time next_heartbeat = absl::InfinitePast();
  absl::Time next_handshake = absl::InfinitePast();
  absl::Duration handshake_backoff = kMinBackoff;
  std::deque<Leave> leaves;
  std::string last_error;  ///< Of the last failed call ("" after a success).
  /// Set by the worker as it ends because no group names this peer and no teardown notice
  /// is queued (its channel is gone then); RegisterGroup joins it and drops the entry.
  bool retired = false;
  void Heard() {
    last_heard = absl::Now();
    failed_probes = 0;
    last_error.clear();
  }
  std::thread worker;
};

struct Session {
  std::string daemon_id;
  std::string key;
  absl::Time opened;
  absl::Time last_used;
  uint64_t counter = 0;  ///< Of the last call accepted.
};

struct PendingNonce {
  std::string nonce;
  absl::Time created;
};

}  // namespace

struct GrpcPeerMesh::State {
  PeerMeshOptions options;
  std::string advertised;
  int port = 0;
  uint64_t daemon_instance = RandomNonZero64();
  std::shared_ptr<grpc::ChannelCredentials> channel_credentials;
  std::unique_ptr<v1::Peer::Service> service;
  std::unique_ptr<grpc::Server> server;
  /// The plaintext Peer listener (null with TLS: gRPC's own then). Stopped before server.
  std::unique_ptr<UnixListener> listener;
  LogRateLimiter refusals{LogRateLimiter::kDefaultPerSecond, LogRateLimiter::kDefaultBurst,
                          "Peer callers"};

  mutable absl::Mutex mu;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  uint64_t registration_seq ABSL_GUARDED_BY(mu) = 0;
  std::map<std::string, std::shared_ptr<GroupEntry>> groups ABSL_GUARDED_BY(mu);
  std::map<std::string, std::unique_ptr<PeerConn>> peers ABSL_GUARDED_BY(mu);
  absl::CondVar work;  ///< Signalled when a worker may have something to do.

  absl::Mutex auth_mu;
  std::deque<PendingNonce> nonces ABSL_GUARDED_BY(auth_mu);
  std::map<std::string, Session> sessions ABSL_GUARDED_BY(auth_mu);

  absl::Duration interval() const { return options.heartbeat_interval; }
  absl::Duration call_deadline() const { return std::max(interval(), kMinCallDeadline); }

  /// Logs the count of refusals suppressed so far once the limiter allows (every Peer call
  /// looks, so the count comes out after a flood ends).
  void ReportSuppressedRefusals() {
    if (refusals.suppressed() == 0) return;
    LogRateLimiter::Decision d = refusals.TakeReport();
    if (d.log) LogSuppressedReport(*GetLogger(kLogPeer), spdlog::level::warn, refusals, d);
  }

  void LogRefusal(const std::string& source, const std::string& what) {
    auto log = GetLogger(kLogPeer);
    LogRateLimiter::Decision d = refusals.Allow(source);
    if (!d.log) return;
    LogSuppressedReport(*log, spdlog::level::warn, refusals, d);
    log->warn("Peer call from {} refused: {}", source, what);
  }

  void WakeGroup(GroupEntry& g) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (g.membership.wake) g.membership.wake();
  }

  /// This node's registration of `g` as node `to_node` is to see it (its descriptor).
  v1::GroupRegistration OwnRegistration(const GroupEntry& g, int32_t to_node) const {
    v1::GroupRegistration r;
    *r.mutable_spec() = g.membership.spec;
    r.set_node(g.membership.self_node);
    r.set_incarnation(g.incarnation);
    const std::vector<std::string>& per_node = g.membership.transport_descriptors;
    r.set_transport_descriptor(per_node.empty() ? g.membership.transport_descriptor
                                                : per_node[static_cast<size_t>(to_node)]);
    r.set_daemon_instance(daemon_instance);
    r.set_registration_seq(g.registration_seq);
    r.set_joined_ranks(JoinedBytes(g.local_joined));
    r.set_join_secret_digest(g.membership.join_secret_digest);
    return r;
  }

  v1::HeldGroups Held() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    v1::HeldGroups held;
    held.set_daemon_instance(daemon_instance);
    held.set_registration_seq(registration_seq);
    for (const auto& [name, g] : groups) {
      v1::HeldGroup* h = held.add_groups();
      h->set_name(name);
      h->set_incarnation(g->incarnation);
      h->set_joined_ranks(JoinedBytes(g->local_joined));
    }
    return held;
  }

  /// Checks a registration from `daemon_id` against the group `g` holds. OK or the status
  /// to answer / record.
  static absl::Status CheckRegistration(const GroupEntry& g, const v1::GroupRegistration& r,
                                        absl::string_view daemon_id) {
    if (absl::Status s = CheckSameSpec(g.membership.spec, r.spec()); !s.ok()) {
      return errors::WithReason(
          absl::FailedPreconditionError(
              absl::StrCat("group \"", g.membership.spec.name(), "\": node ", r.node(), " (",
                           daemon_id, ") registered it with a different spec: ", s.message())),
          errors::Reason::kSpecMismatch);
    }
    // In time independent of where they differ; neither digest nor secret is named.
    const std::string& ours = g.membership.join_secret_digest;
    const std::string& theirs = r.join_secret_digest();
    if (ours.size() != theirs.size() ||
        CRYPTO_memcmp(ours.data(), theirs.data(), ours.size()) != 0) {
      return errors::WithReason(
          absl::FailedPreconditionError(absl::StrCat(
              "group \"", g.membership.spec.name(), "\": node ", r.node(), " (", daemon_id,
              ") registered it with a different join_secret (its ranks presented another "
              "JoinOptions.join_secret, or none, than this node's); every node's ranks must "
              "present "
              "the same one")),
          errors::Reason::kSpecMismatch);
    }
    if (r.node() == g.membership.self_node) {
      return errors::WithReason(
          absl::InvalidArgumentError(
              absl::StrCat("registration names node ", r.node(), ", which is this daemon's own")),
          errors::Reason::kPeerProtocol);
    }
    // Transport settings every node must share (RDMA: queue pairs per peer, link layer):
    // refused here rather than at the first Connect. Both nodes are named by number and
    // address, so the text reads the same at either node.
    if (g.membership.compare_descriptors) {
      const std::vector<std::string>& per_node = g.membership.transport_descriptors;
      const size_t peer = static_cast<size_t>(r.node());
      const std::string& ours =
          per_node.size() > peer ? per_node[peer] : g.membership.transport_descriptor;
      const int32_t self = g.membership.self_node;
      const std::string our_node =
          absl::StrCat("node ", self, " (", g.membership.spec.nodes(self).peer_address(), ")");
      const std::string their_node = absl::StrCat("node ", r.node(), " (", daemon_id, ")");
      if (absl::Status s = g.membership.compare_descriptors(ours, r.transport_descriptor(),
                                                            our_node, their_node);
          !s.ok()) {
        return absl::FailedPreconditionError(
            absl::StrCat("group \"", g.membership.spec.name(), "\": spec.transport \"",
                         g.membership.spec.transport(), "\": ", s.message()));
      }
    }
    return absl::OkStatus();
  }

  /// Records node r.node()'s registration of `g` (r checked by CheckRegistration).
  void ApplyRegistration(GroupEntry& g, const v1::GroupRegistration& r)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    NodeEntry& n = g.nodes[r.node()];
    n.refresh = false;
    n.backoff = kMinBackoff;
    if (n.state == NodeState::kLost && n.descriptor.incarnation == r.incarnation()) {
      return;  // The registration that was lost stays lost; a new one brings it back.
    }
    if (n.state == NodeState::kRegistered && n.descriptor.incarnation == r.incarnation()) {
      ApplyJoined(n, r.joined_ranks());
      return;
    }
    const bool was_lost = n.state == NodeState::kLost;
    n.state = NodeState::kRegistered;
    n.descriptor.incarnation = r.incarnation();
    n.descriptor.transport = r.transport_descriptor();
    n.daemon_instance = r.daemon_instance();
    n.registration_seq = r.registration_seq();
    n.reason.clear();
    n.joined.clear();
    ApplyJoined(n, r.joined_ranks());
    auto p = peers.find(n.address);
    if (p != peers.end()) p->second->Heard();
    GetLogger(kLogPeer)->info("group \"{}\": {} registered (incarnation {:x}){}",
                              g.membership.spec.name(), NodeText(g, r.node()), r.incarnation(),
                              was_lost ? ", again after it was lost" : "");
    WakeGroup(g);
  }

  static void ApplyJoined(NodeEntry& n, absl::string_view bytes) {
    if (bytes.size() != static_cast<size_t>(n.num_ranks)) return;  // Unknown / malformed.
    n.joined.assign(bytes.size(), false);
    for (size_t i = 0; i < bytes.size(); ++i) n.joined[i] = bytes[i] != 0;
  }

  void MarkLost(GroupEntry& g, int32_t node, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    NodeEntry& n = g.nodes[node];
    if (n.state != NodeState::kRegistered) return;
    n.state = NodeState::kLost;
    n.reason = why;
    GetLogger(kLogPeer)->warn("group \"{}\": {} lost: {}", g.membership.spec.name(),
                              NodeText(g, node), why);
    WakeGroup(g);
  }

  void MarkMismatch(GroupEntry& g, int32_t node, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    NodeEntry& n = g.nodes[node];
    if (n.state == NodeState::kMismatch && n.reason == why) return;
    n.state = NodeState::kMismatch;
    n.reason = why;
    GetLogger(kLogPeer)->warn("{}", why);
    WakeGroup(g);
  }

  /// The node at `address` in `g`, or -1.
  static int32_t NodeAt(const GroupEntry& g, absl::string_view address) {
    for (int32_t i = 0; i < static_cast<int32_t>(g.nodes.size()); ++i) {
      if (i != g.membership.self_node && g.nodes[i].address == address) return i;
    }
    return -1;
  }

  bool HasRegisteredNodeAt(absl::string_view address) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (const auto& [name, g] : groups) {
      const int32_t node = NodeAt(*g, address);
      if (node >= 0 && g->nodes[node].state == NodeState::kRegistered) return true;
    }
    return false;
  }

  /// What `address` says it holds (from a heartbeat either way).
  void ApplyHeld(const std::string& address, const v1::HeldGroups& held)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto p = peers.find(address);
    if (p != peers.end()) p->second->Heard();
    std::map<absl::string_view, const v1::HeldGroup*> by_name;
    for (const v1::HeldGroup& h : held.groups()) by_name.emplace(h.name(), &h);
    for (auto& [name, g] : groups) {
      const int32_t node = NodeAt(*g, address);
      if (node < 0) continue;
      NodeEntry& n = g->nodes[node];
      auto it = by_name.find(name);
      if (it != by_name.end()) {
        const bool same = it->second->incarnation() == n.descriptor.incarnation;
        if (same && n.state == NodeState::kRegistered) {
          ApplyJoined(n, it->second->joined_ranks());
        } else if (same && n.state == NodeState::kLost) {
          // The registration that was lost: it stays lost until a new one.
        } else if (n.state != NodeState::kMissing || !n.refresh) {
          n.refresh = true;  // It holds a registration we do not have: ask for it.
          n.next_attempt = absl::InfinitePast();
          work.SignalAll();
        }
        continue;
      }
      // Not held there: the registration we have ended, unless the list predates it.
      if (n.state == NodeState::kRegistered && (held.daemon_instance() != n.daemon_instance ||
                                                held.registration_seq() >= n.registration_seq)) {
        MarkLost(*g, node,
                 held.daemon_instance() != n.daemon_instance
                     ? "its daemon restarted and does not hold the group"
                     : "its daemon no longer holds the group (it tore the group down)");
      }
    }
  }

  // ---- Sessions (server side) ----

  std::string NewNonce() {
    absl::MutexLock lock(&auth_mu);
    const absl::Time now = absl::Now();
    while (!nonces.empty() &&
           (nonces.size() >= kMaxPendingNonces || now - nonces.front().created > kNonceLifetime)) {
      nonces.pop_front();
    }
    nonces.push_back({RandomBytes(kNonceBytes), now});
    return nonces.back().nonce;
  }

  bool TakeNonce(absl::string_view nonce) {
    absl::MutexLock lock(&auth_mu);
    const absl::Time now = absl::Now();
    for (auto it = nonces.begin(); it != nonces.end(); ++it) {
      if (it->nonce.size() == nonce.size() &&
          CRYPTO_memcmp(it->nonce.data(), nonce.data(), nonce.size()) == 0) {
        const bool fresh = now - it->created <= kNonceLifetime;
        nonces.erase(it);
        return fresh;
      }
    }
    return false;
  }

  std::string OpenSession(const std::string& daemon_id, std::string key) {
    absl::MutexLock lock(&auth_mu);
    if (sessions.size() >= kMaxSessions) {
      auto oldest = std::min_element(
          sessions.begin(), sessions.end(),
          [](const auto& a, const auto& b) { return a.second.last_used < b.second.last_used; });
      sessions.erase(oldest);
    }
    std::string id = RandomBytes(kSessionIdBytes);
    const absl::Time now = absl::Now();
    sessions[id] = Session{daemon_id, std::move(key), now, now, 0};
    return id;
  }

  static absl::Status UnknownSession() {
    return errors::WithReason(
        absl::UnauthenticatedError(
            "unknown Peer session (the callee restarted or forgot it): handshake again"),
        errors::Reason::kPeerAuthFailed);
  }

  /// The caller's daemon id when `auth` is a valid MAC of `request` in a live session and
  /// its counter is above the session's last one (which it then becomes).
  template <typename Request>
  absl::StatusOr<std::string> Authenticate(absl::string_view method, const Request& request) {
    const std::string& id = request.auth().session_id();
    const uint64_t counter = request.auth().counter();
    std::string key;
    {
      absl::MutexLock lock(&auth_mu);
      auto it = sessions.find(id);
      if (it == sessions.end()) return UnknownSession();
      key = it->second.key;
    }
    if (!SameMac(request.auth().mac(), RequestMac(key, method, request))) {
      return errors::WithReason(absl::UnauthenticatedError("bad Peer request MAC"),
                                errors::Reason::kPeerAuthFailed);
    }
    absl::MutexLock lock(&auth_mu);
    auto it = sessions.find(id);
    if (it == sessions.end()) return UnknownSession();
    Session& session = it->second;
    const absl::Time now = absl::Now();
    if (now - session.opened > options.session_lifetime) {
      const std::string who = session.daemon_id;
      sessions.erase(it);
      return errors::WithReason(
          absl::UnauthenticatedError(absl::StrCat(
              "Peer session ", Hex(id), " of ", EscapeClientText(who), " expired (it lives ",
              absl::FormatDuration(options.session_lifetime), "): handshake again")),
          errors::Reason::kPeerAuthFailed);
    }
    if (counter <= session.counter) {
      return errors::WithReason(
          absl::UnauthenticatedError(
              absl::StrCat("Peer session ", Hex(id), " of ", EscapeClientText(session.daemon_id),
                           ": call counter ", counter, " is not above the last accepted ",
                           session.counter, " (a replayed or reordered call)")),
          errors::Reason::kPeerAuthFailed);
    }
    session.counter = counter;
    session.last_used = now;
    return session.daemon_id;
  }
};

namespace {

using State = GrpcPeerMesh::State;

grpc::Status ToGrpc(const absl::Status& s) { return errors::ToGrpcStatus(s); }

std::string CallerOf(grpc::ServerContext* context) { return EscapeClientText(context->peer()); }

/// The Peer service.
class PeerService final : public v1::Peer::Service {
 public:
  explicit PeerService(State* state) : state_(state) {}

  grpc::Status Challenge(grpc::ServerContext* context, const v1::ChallengeRequest* request,
                         v1::ChallengeResponse* response) override {
    state_->ReportSuppressedRefusals();
    response->set_protocol_version(kPeerProtocolVersion);
    if (absl::Status s = CheckVersion(request->protocol_version()); !s.ok()) {
      return Refuse(context, s);
    }
    response->set_server_nonce(state_->NewNonce());
    return grpc::Status::OK;
  }

  grpc::Status Hello(grpc::ServerContext* context, const v1::HelloRequest* request,
                     v1::HelloResponse* response) override {
    state_->ReportSuppressedRefusals();
    if (absl::Status s = CheckVersion(request->protocol_version()); !s.ok()) {
      return Refuse(context, s);
    }
    if (request->daemon_id().empty() || request->daemon_id().size() > kMaxDaemonIdBytes ||
        request->client_nonce().size() != kNonceBytes ||
        request->server_nonce().size() != kNonceBytes || request->proof().size() != kMacBytes) {
      return Refuse(context,
                    errors::WithReason(absl::InvalidArgumentError("malformed Peer handshake"),
                                       errors::Reason::kPeerProtocol));
    }
    if (!state_->TakeNonce(request->server_nonce())) {
      return Refuse(context, errors::WithReason(
                                 absl::UnauthenticatedError("unknown or expired handshake nonce"),
                                 errors::Reason::kPeerAuthFailed));
    }
    const std::string& secret = state_->options.secret;
    const std::string expected =
        HelloProof(secret, request->server_nonce(), request->client_nonce(), request->daemon_id());
    if (!SameMac(request->proof(), expected)) {
      return Refuse(context,
                    errors::WithReason(absl::UnauthenticatedError(absl::StrCat(
                                           "daemon \"", EscapeClientText(request->daemon_id()),
                                           "\" does not know the shared secret (peer_secret_file "
                                           "differs between the daemons)")),
                                       errors::Reason::kPeerAuthFailed));
    }
    if (!state_->options.tls_ca_pem.empty()) {
      // Mutual TLS: the caller's certificate (verified against the CA by the TLS layer)
      // must name the host of the daemon id it claims.
      std::vector<std::string> sans, common_names;
      if (std::shared_ptr<const grpc::AuthContext> auth = context->auth_context()) {
        for (const grpc::string_ref& v : auth->FindPropertyValues(GRPC_X509_SAN_PROPERTY_NAME)) {
          sans.emplace_back(v.data(), v.size());
        }
        for (const grpc::string_ref& v : auth->FindPropertyValues(GRPC_X509_CN_PROPERTY_NAME)) {
          common_names.emplace_back(v.data(), v.size());
        }
      }
      if (absl::Status s = CheckPeerCertificateNames(request->daemon_id(), sans, common_names);
          !s.ok()) {
        return Refuse(context, s);
      }
    }
    std::string key =
        SessionKey(secret, request->server_nonce(), request->client_nonce(), request->daemon_id());
    response->set_session_id(state_->OpenSession(request->daemon_id(), std::move(key)));
    response->set_daemon_id(state_->advertised);
    response->set_proof(
        Mac(secret, kWelcomeLabel,
            {request->client_nonce(), request->server_nonce(), state_->advertised}));
    GetLogger(kLogPeer)->debug("Peer session opened for {} ({})",
                               EscapeClientText(request->daemon_id()), CallerOf(context));
    return grpc::Status::OK;
  }

  grpc::Status Rendezvous(grpc::ServerContext* context, const v1::RendezvousRequest* request,
                          v1::RendezvousResponse* response) override {
    absl::StatusOr<std::string> caller = state_->Authenticate("Rendezvous", *request);
    if (!caller.ok()) return Refuse(context, caller.status());
    const v1::GroupRegistration& r = request->registration();
    if (absl::Status s = CheckIncoming(r, *caller); !s.ok()) return Refuse(context, s);
    absl::MutexLock lock(&state_->mu);
    auto it = state_->groups.find(r.spec().name());
    if (state_->stopping || it == state_->groups.end()) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          absl::StrCat("group \"", r.spec().name(), "\" is not registered at ",
                                       state_->advertised, " yet"));
    }
    GroupEntry& g = *it->second;
    if (absl::Status s = State::CheckRegistration(g, r, *caller); !s.ok()) {
      const int32_t node = State::NodeAt(g, *caller);
      if (absl::IsFailedPrecondition(s) && node >= 0) {
        state_->MarkMismatch(g, node, std::string(s.message()));
      }
      return ToGrpc(s);
    }
    state_->ApplyRegistration(g, r);
    *response->mutable_registration() = state_->OwnRegistration(g, r.node());
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext* context, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override {
    state_->ReportSuppressedRefusals();
    absl::StatusOr<std::string> caller = state_->Authenticate("Heartbeat", *request);
    if (!caller.ok()) return Refuse(context, caller.status());
    if (request->held().groups_size() > kMaxHeldGroups) {
      return Refuse(
          context, errors::WithReason(absl::InvalidArgumentError("heartbeat lists too many groups"),
                                      errors::Reason::kPeerProtocol));
    }
    absl::MutexLock lock(&state_->mu);
    state_->ApplyHeld(*caller, request->held());
    *response->mutable_held() = state_->Held();
    return grpc::Status::OK;
  }

  grpc::Status Leave(grpc::ServerContext* context, const v1::LeaveRequest* request,
                     v1::LeaveResponse*) override {
    absl::StatusOr<std::string> caller = state_->Authenticate("Leave", *request);
    if (!caller.ok()) return Refuse(context, caller.status());
    absl::MutexLock lock(&state_->mu);
    auto it = state_->groups.find(request->group());
    if (it == state_->groups.end()) return grpc::Status::OK;
    GroupEntry& g = *it->second;
    const int32_t node = State::NodeAt(g, *caller);
    if (node >= 0 && g.nodes[node].state == NodeState::kRegistered &&
        g.nodes[node].descriptor.incarnation == request->incarnation()) {
      state_->MarkLost(g, node, "it left the group (its daemon tore the group down)");
    }
    return grpc::Status::OK;
  }

 private:
  static absl::Status CheckVersion(uint32_t theirs) {
    if (theirs == kPeerProtocolVersion) return absl::OkStatus();
    return errors::WithReason(absl::FailedPreconditionError(absl::StrCat(
                                  "Peer protocol version mismatch: the caller speaks version ",
                                  theirs, ", this daemon speaks version ", kPeerProtocolVersion,
                                  " (run the same epd version on every node of a group)")),
                              errors::Reason::kPeerProtocol);
  }

  /// A registration from `caller`, checked before anything of it is used.
  static absl::Status CheckIncoming(const v1::GroupRegistration& r, absl::string_view caller) {
    EPD_RETURN_IF_ERROR(ValidateGroupSpec(r.spec()));
    if (!SpansNodes(r.spec())) {
      return errors::WithReason(
          absl::InvalidArgumentError("registration of a group that does not span nodes"),
          errors::Reason::kPeerProtocol);
    }
    if (r.node() < 0 || r.node() >= r.spec().nodes_size()) {
      return errors::WithReason(
          absl::InvalidArgumentError(absl::StrCat("registration.node: ", r.node(),
                                                  " is outside [0, ", r.spec().nodes_size(), ")")),
          errors::Reason::kPeerProtocol);
    }
    if (r.spec().nodes(r.node()).peer_address() != caller) {
      return errors::WithReason(
          absl::InvalidArgumentError(absl::StrCat(
              "registration.node: ", r.node(), " is ", r.spec().nodes(r.node()).peer_address(),
              " in the spec, not the caller ", EscapeClientText(caller))),
          errors::Reason::kPeerProtocol);
    }
    if (r.incarnation() == 0) {
      return errors::WithReason(absl::InvalidArgumentError("registration.incarnation: 0"),
                                errors::Reason::kPeerProtocol);
    }
    if (r.transport_descriptor().size() > kMaxTransportDescriptorBytes) {
      return errors::WithReason(
          absl::InvalidArgumentError(
              absl::StrCat("registration.transport_descriptor: ", r.transport_descriptor().size(),
                           " bytes, more than ", kMaxTransportDescriptorBytes)),
          errors::Reason::kPeerProtocol);
    }
    return absl::OkStatus();
  }

  grpc::Status Refuse(grpc::ServerContext* context, const absl::Status& s) {
    state_->LogRefusal(CallerOf(context), std::string(s.message()));
    return ToGrpc(s);
  }

  State* state_;
};

}  // namespace

// ---------------------------------------------------------------------------------------
// Client side: one worker per peer daemon.

namespace {

/// Handshake with `pc`'s daemon (no lock held). The session id and key, or why not.
absl::Status Handshake(State* st, PeerConn* pc, std::string* session_id, std::string* key) {
  grpc::ClientContext c1;
  c1.set_deadline(DeadlineAfter(st->call_deadline()));
  v1::ChallengeRequest challenge;
  challenge.set_protocol_version(kPeerProtocolVersion);
  v1::ChallengeResponse nonce;
  if (grpc::Status s = pc->stub->Challenge(&c1, challenge, &nonce); !s.ok()) return FromGrpc(s);
  if (nonce.protocol_version() != kPeerProtocolVersion) {
    return errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            "Peer protocol version mismatch: ", pc->address, " speaks version ",
            nonce.protocol_version(), ", this daemon speaks version ", kPeerProtocolVersion)),
        errors::Reason::kPeerProtocol);
  }
  if (nonce.server_nonce().size() != kNonceBytes) {
    return errors::WithReason(absl::InvalidArgumentError("malformed handshake nonce"),
                              errors::Reason::kPeerProtocol);
  }
  v1::HelloRequest hello;
  hello.set_protocol_version(kPeerProtocolVersion);
  hello.set_daemon_id(st->advertised);
  hello.set_server_nonce(nonce.server_nonce());
  hello.set_client_nonce(RandomBytes(kNonceBytes));
  hello.set_proof(
      HelloProof(st->options.secret, hello.server_nonce(), hello.client_nonce(), st->advertised));
  grpc::ClientContext c2;
  c2.set_deadline(DeadlineAfter(st->call_deadline()));
  v1::HelloResponse welcome;
  if (grpc::Status s = pc->stub->Hello(&c2, hello, &welcome); !s.ok()) return FromGrpc(s);
  if (welcome.daemon_id() != pc->address) {
    return errors::WithReason(
        absl::FailedPreconditionError(
            absl::StrCat("the daemon at ", pc->address, " advertises itself as \"",
                         EscapeClientText(welcome.daemon_id()),
                         "\"; a spec must name every daemon by its advertised peer address")),
        errors::Reason::kNodesInvalid);
  }
  if (!SameMac(welcome.proof(), Mac(st->options.secret, kWelcomeLabel,
                                    {hello.client_nonce(), hello.server_nonce(), pc->address}))) {
    return errors::WithReason(
        absl::UnauthenticatedError(absl::StrCat(
            "the daemon at ", pc->address,
            " does not know the shared secret (peer_secret_file differs between the daemons)")),
        errors::Reason::kPeerAuthFailed);
  }
  if (welcome.session_id().size() != kSessionIdBytes) {
    return errors::WithReason(absl::InvalidArgumentError("malformed session id"),
                              errors::Reason::kPeerProtocol);
  }
  *session_id = welcome.session_id();
  *key = SessionKey(st->options.secret, hello.server_nonce(), hello.client_nonce(), st->advertised);
  return absl::OkStatus();
}

/// A registration a peer answered for node `node` of `g`, checked before use.
absl::Status CheckAnswered(const GroupEntry& g, int32_t node, const v1::GroupRegistration& r) {
  EPD_RETURN_IF_ERROR(ValidateGroupSpec(r.spec()));
  if (r.node() != node) {
    return errors::WithReason(
        absl::InvalidArgumentError(
            absl::StrCat("answered the registration of node ", r.node(), ", not of node ", node)),
        errors::Reason::kPeerProtocol);
  }
  if (r.incarnation() == 0 || r.transport_descriptor().size() > kMaxTransportDescriptorBytes) {
    return errors::WithReason(
        absl::InvalidArgumentError("malformed registration (incarnation or descriptor)"),
        errors::Reason::kPeerProtocol);
  }
  return State::CheckRegistration(g, r, g.nodes[node].address);
}

class Worker {
 public:
  Worker(State* st, PeerConn* pc) : st_(st), pc_(pc) {}

  void Run() {
    absl::MutexLock lock(&st_->mu);
    while (!st_->stopping) {
      const absl::Time now = absl::Now();
      CheckLiveness(now);
      if (Step(now)) continue;
      if (!HasGroups() && pc_->leaves.empty()) {
        // Nothing needs this peer any more: the worker ends and the channel goes, so that an
        // address a spec named once is not dialled for ever (a later group starts anew).
        pc_->retired = true;
        pc_->stub.reset();
        pc_->channel.reset();
        return;
      }
      st_->work.WaitWithDeadline(&st_->mu, NextWake(now));
    }
    // Teardown notices still queued go out within a small budget.
    const absl::Time until = absl::Now() + kShutdownLeaveBudget;
    while (!pc_->leaves.empty() && !pc_->session_id.empty() && absl::Now() < until) {
      SendLeave();
    }
  }

 private:
  /// Does the first thing due; false when nothing is.
  bool Step(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(st_->mu) {
    const bool wanted = HasGroups() || !pc_->leaves.empty();
    if (!wanted) return false;
    if (!pc_->session_id.empty() &&
        now - pc_->session_opened >= st_->options.session_lifetime / 2) {
      pc_->session_id.clear();  // Renewed well before the server refuses it.
    }
    if (pc_->session_id.empty()) {
      if (now < pc_->next_handshake) return false;
      DoHandshake();
      return true;
    }
    if (!pc_->leaves.empty()) {
      SendLeave();
      return true;
    }
    if (HasGroups() && now >= pc_->next_heartbeat) {
      SendHeartbeat();
      return true;
    }
    for (auto& [name, g] : st_->groups) {
      const int32_t node = State::NodeAt(*g, pc_->address);
      if (node < 0) continue;
      NodeEntry& n = g->nodes[node];
      if ((n.state != NodeState::kRegistered || n.refresh) && now >= n.next_attempt) {
        SendRendezvous(g, node);
        return true;
      }
    }
    return false;
  }

  bool HasGroups() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(st_->mu) {
    for (const auto& [name, g] : st_->groups) {
      if (State::NodeAt(*g, pc_->address) >= 0) return true;
    }
    return false;
  }

  absl::Time NextWake(absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(st_->mu) {
    absl::Time at = now + st_->interval();
    if (!HasGroups()) return at;
    at = std::min(at, pc_->session_id.empty() ? pc_->next_handshake : pc_->next_heartbeat);
    for (const auto& [name, g] : st_->groups) {
      const int32_t node = State::NodeAt(*g, pc_->address);
      if (node < 0) continue;
      const NodeEntry& n = g->nodes[node];
      if (n.state != NodeState::kRegistered || n.refresh) at = std::min(at, n.next_attempt);
      if (n.state == NodeState::kRegistered && pc_->failed_probes >= kLostAfterIntervals) {
        at = std::min(at, pc_->last_heard + kLostAfterIntervals * st_->interval());
      }
    }
    return std::max(at, now + absl::Milliseconds(1));
  }

  void CheckLiveness(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(st_->mu) {
    const absl::Duration bound = kLostAfterIntervals * st_->interval();
    // Silent for the bound, and probed in vain that many times (so that a worker that was
    // itself starved of CPU asks again before it judges).
    if (now - pc_->last_heard <= bound || pc_->failed_probes < kLostAfterIntervals) return;
    for (auto& [name, g] : st_->groups) {
      const int32_t node = State::NodeAt(*g, pc_->address);
      if (node < 0 || g->nodes[node].state != NodeState::kRegistered) continue;
      st_->MarkLost(
          *g, node,
          absl::StrCat(
              "its daemon answered nothing for ", MsText(now - pc_->last_heard), " and ",
              pc_->failed_probes, " probes in a row (heartbeat every ", MsText(st_->interval()),
              ", lost after ", kLostAfterIntervals, " intervals)",
              pc_->last_error.empty() ? "" : absl::StrCat("; last error: ", pc_->last_error)));
    }
  }

  void NoteError(const absl::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(st_->mu) {
    std::string text = errors::StatusText(s);
    if (text != pc_->last_error) {
      GetLogger(kLogPeer)->info("Peer {}: {}", pc_->address, text);
      pc_->last_error = std::move(text);
    }
    if (absl::IsUnauthenticated(s)) pc_->session_id.clear();
  }

  void DoHandshake() ABSL_EXCLUSIVE_LOCKS_REQUIRED(st_->mu) {
    std::string id;
    std::string key;
    st_->mu.Unlock();
    absl::Status s = Handshake(st_, pc_, &id, &key);
    st_->mu.Lock();
    if (s.ok()) {
      pc_->session_id = std::move(id);
      pc_->session_key = std::move(key);
      pc_->session_counter = 0;
      pc_->session_opened = absl::Now();
      pc_->Heard();
      pc_->handshake_backoff = kMinBackoff;
      pc_->next_heartbeat = absl::InfinitePast();
      if (!pc_->last_error.empty()) {
        GetLogger(kLogPeer)->info("Peer {}: session open", pc_->address);
      }
      pc_->last_error.clear();
      return;
    }
    NoteError(s);
    ++pc_->failed_probes;
    // Unreachable and no group needs it: its teardown notices are dropped (best effort).
    if (!HasGroups()) pc_->leaves.clear();
    pc_->next_handshake = absl::Now() + pc_->handshake_backoff;
    pc_->handshake_backoff = std::min(pc_->handshake_backoff * 2, kMaxBackoff);
  }

  template <typename Request>
  void Sign(absl::string_view method, Request* request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(st_->mu) {
    SignPeerRequest(method, pc_->session_id, pc_->session_key, ++pc_->session_counter, request);
  }

  void SendLeave() ABSL_EXCLUSIVE_LOCKS_REQUIRED(st_->mu) {
    v1::LeaveRequest request;
    request.set_group(pc_->leaves.front().group);
    request.set_incarnation(pc_->leaves.front().incarnation);
    pc_->leaves.pop_front();
    Sign("Leave", &request);
    st_->mu.Unlock();
    grpc::ClientContext context;
    context.set_deadline(DeadlineAfter(st_->call_deadline()));
    v1::LeaveResponse response;
    grpc::Status s = pc_->stub->Leave(&context, request, &response);
    st_->mu.Lock();
    if (!s.ok()) NoteError(FromGrpc(s));  // Best effort: heartbeats tell the rest.
  }

  void SendHeartbeat() ABSL_EXCLUSIVE_LOCKS_REQUIRED(st_->mu) {
    v1::HeartbeatRequest request;
    *request.mutable_held() = st_->Held();
    Sign("Heartbeat", &request);
    pc_->next_heartbeat = absl::Now() + st_->interval();
    st_->mu.Unlock();
    grpc::ClientContext context;
    context.set_deadline(DeadlineAfter(st_->call_deadline()));
    v1::HeartbeatResponse response;
    grpc::Status s = pc_->stub->Heartbeat(&context, request, &response);
    st_->mu.Lock();
    if (!s.ok()) {
      NoteError(FromGrpc(s));
      ++pc_->failed_probes;
      return;
    }
    if (response.held().groups_size() > kMaxHeldGroups) {
      NoteError(
          errors::WithReason(absl::InvalidArgumentError("heartbeat answer lists too many groups"),
                             errors::Reason::kPeerProtocol));
      return;
    }
    st_->ApplyHeld(pc_->address, response.held());
  }

  void SendRendezvous(const std::shared_ptr<GroupEntry>& g, int32_t node)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(st_->mu) {
    v1::RendezvousRequest request;
    *request.mutable_registration() = st_->OwnRegistration(*g, node);
    Sign("Rendezvous", &request);
    NodeEntry& n = g->nodes[node];
    n.next_attempt = absl::Now() + n.backoff;
    n.backoff = std::min(n.backoff * 2, kMaxBackoff);
    std::shared_ptr<GroupEntry> keep = g;
    st_->mu.Unlock();
    grpc::ClientContext context;
    context.set_deadline(DeadlineAfter(st_->call_deadline()));
    v1::RendezvousResponse response;
    grpc::Status s = pc_->stub->Rendezvous(&context, request, &response);
    st_->mu.Lock();
    if (keep->removed) return;
    if (!s.ok()) {
      if (s.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
        st_->MarkMismatch(*keep, node, s.error_message());
      } else if (s.error_code() != grpc::StatusCode::NOT_FOUND) {
        NoteError(FromGrpc(s));
      }
      return;
    }
    if (absl::Status c = CheckAnswered(*keep, node, response.registration()); !c.ok()) {
      if (absl::IsFailedPrecondition(c)) {
        st_->MarkMismatch(*keep, node, std::string(c.message()));
      } else {
        NoteError(c);
      }
      return;
    }
    st_->ApplyRegistration(*keep, response.registration());
  }

  State* st_;
  PeerConn* pc_;
};

// ---------------------------------------------------------------------------------------
// GroupPeers.

class GroupPeersImpl final : public GroupPeers {
 public:
  GroupPeersImpl(std::shared_ptr<State> st, std::shared_ptr<GroupEntry> g)
      : st_(std::move(st)), g_(std::move(g)) {}

  ~GroupPeersImpl() override {
    absl::MutexLock lock(&st_->mu);
    g_->removed = true;
    auto it = st_->groups.find(g_->membership.spec.name());
    if (it != st_->groups.end() && it->second == g_) st_->groups.erase(it);
    if (st_->stopping) return;
    for (int32_t i = 0; i < static_cast<int32_t>(g_->nodes.size()); ++i) {
      if (i == g_->membership.self_node) continue;
      auto p = st_->peers.find(g_->nodes[i].address);
      if (p != st_->peers.end()) {
        std::deque<Leave>& leaves = p->second->leaves;
        if (leaves.size() >= kMaxQueuedLeaves) leaves.pop_front();
        leaves.push_back({g_->membership.spec.name(), g_->incarnation});
      }
    }
    st_->work.SignalAll();
  }

  std::optional<PeerDescriptor> Descriptor(int32_t node) const override {
    absl::MutexLock lock(&st_->mu);
    if (node < 0 || node >= static_cast<int32_t>(g_->nodes.size())) return std::nullopt;
    const NodeEntry& n = g_->nodes[node];
    if (n.state != NodeState::kRegistered) return std::nullopt;
    return n.descriptor;
  }

  absl::Status Health() const override {
    absl::MutexLock lock(&st_->mu);
    const std::string& name = g_->membership.spec.name();
    if (st_->stopping) {
      return errors::WithReason(absl::UnavailableError(absl::StrCat(
                                    "group \"", name, "\": epd's Peer service is shutting down")),
                                errors::Reason::kPeerUnreachable);
    }
    for (int32_t i = 0; i < static_cast<int32_t>(g_->nodes.size()); ++i) {
      const NodeEntry& n = g_->nodes[i];
      if (n.state == NodeState::kLost) {
        return errors::WithReason(
            absl::UnavailableError(
                absl::StrCat("group \"", name, "\": ", NodeText(*g_, i), " is lost: ", n.reason)),
            errors::Reason::kPeerUnreachable);
      }
      if (n.state == NodeState::kMismatch) {
        return errors::WithReason(absl::FailedPreconditionError(n.reason),
                                  errors::Reason::kSpecMismatch);
      }
    }
    return absl::OkStatus();
  }

  std::string DescribeMissing() const override {
    absl::MutexLock lock(&st_->mu);
    std::vector<std::string> parts;
    for (int32_t i = 0; i < static_cast<int32_t>(g_->nodes.size()); ++i) {
      const NodeEntry& n = g_->nodes[i];
      if (n.state == NodeState::kMissing) {
        std::string why;
        auto p = st_->peers.find(n.address);
        if (p != st_->peers.end() && !p->second->last_error.empty()) {
          why = absl::StrCat(" (", p->second->last_error, ")");
        }
        parts.push_back(absl::StrCat(NodeText(*g_, i), " has not joined", why));
        continue;
      }
      if (n.state != NodeState::kRegistered || n.joined.empty()) continue;
      std::vector<int32_t> missing;
      for (int32_t r = 0; r < n.num_ranks; ++r) {
        if (!n.joined[r]) missing.push_back(n.first_rank + r);
      }
      if (missing.empty()) continue;
      std::string list = absl::StrJoin(
          missing.begin(), missing.begin() + std::min<size_t>(missing.size(), 16), ", ");
      if (missing.size() > 16) absl::StrAppend(&list, ", ... (", missing.size(), " in all)");
      parts.push_back(absl::StrCat("node ", i, " (", n.address, "): rank",
                                   missing.size() == 1 ? " " : "s ", list, " not joined"));
    }
    return absl::StrJoin(parts, "; ");
  }

  void SetLocalRanksJoined(const std::vector<bool>& joined) override {
    absl::MutexLock lock(&st_->mu);
    std::vector<bool> copy = joined;
    copy.resize(static_cast<size_t>(g_->nodes[g_->membership.self_node].num_ranks), false);
    g_->local_joined = std::move(copy);
  }

 private:
  std::shared_ptr<State> st_;
  std::shared_ptr<GroupEntry> g_;
};

bool IsWildcardHost(absl::string_view listen) {
  const size_t colon = listen.rfind(':');
  absl::string_view host = colon == absl::string_view::npos ? listen : listen.substr(0, colon);
  return host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::" || host == "[::0]";
}

}  // namespace

// ---------------------------------------------------------------------------------------
// GrpcPeerMesh.

absl::StatusOr<std::unique_ptr<GrpcPeerMesh>> GrpcPeerMesh::Start(PeerMeshOptions options) {
  if (options.listen.empty()) {
    return errors::WithReason(absl::InvalidArgumentError("peer_listen: empty"),
                              errors::Reason::kConfigInvalid);
  }
  if (options.secret.size() < kMinPeerSecretBytes) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  "peer_secret_file: the secret has ", options.secret.size(),
                                  " bytes, fewer than ", kMinPeerSecretBytes)),
                              errors::Reason::kConfigInvalid);
  }
  const int tls_parts =
      !options.tls_cert_pem.empty() + !options.tls_key_pem.empty() + !options.tls_ca_pem.empty();
  if (tls_parts != 0 && tls_parts != 3) {
    return errors::WithReason(
        absl::InvalidArgumentError(
            "peer_tls_cert_file, peer_tls_key_file, peer_tls_ca_file: give all three or none"),
        errors::Reason::kConfigInvalid);
  }
  if (options.heartbeat_interval < absl::Milliseconds(10)) {
    return errors::WithReason(absl::InvalidArgumentError("peer_heartbeat_ms: below 10"),
                              errors::Reason::kConfigInvalid);
  }
  if (options.session_lifetime < absl::Milliseconds(100)) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(
            "session_lifetime: ", absl::FormatDuration(options.session_lifetime), ", below 100ms")),
        errors::Reason::kConfigInvalid);
  }
  if (options.advertise.empty() && IsWildcardHost(options.listen)) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(
            "peer_listen: \"", options.listen,
            "\" is a wildcard address, which other daemons cannot reach: set peer_advertise")),
        errors::Reason::kConfigInvalid);
  }
  auto st = std::make_shared<State>();
  st->options = std::move(options);
  std::shared_ptr<grpc::ServerCredentials> server_credentials;
  if (tls_parts == 3) {
    grpc::SslServerCredentialsOptions ssl(
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    ssl.pem_root_certs = st->options.tls_ca_pem;
    ssl.pem_key_cert_pairs.push_back({st->options.tls_key_pem, st->options.tls_cert_pem});
    server_credentials = grpc::SslServerCredentials(ssl);
    grpc::SslCredentialsOptions client;
    client.pem_root_certs = st->options.tls_ca_pem;
    client.pem_private_key = st->options.tls_key_pem;
    client.pem_cert_chain = st->options.tls_cert_pem;
    st->channel_credentials = grpc::SslCredentials(client);
  } else {
    server_credentials = grpc::InsecureServerCredentials();
    st->channel_credentials = grpc::InsecureChannelCredentials();
  }
  st->service = std::make_unique<PeerService>(st.get());
  grpc::ServerBuilder builder;
  if (tls_parts == 3) {
    // gRPC hands no accepted descriptor over with server credentials: a TLS Peer listener
    // is gRPC's own (docs/MULTINODE.md "Known gaps").
    builder.AddListeningPort(st->options.listen, server_credentials, &st->port);
  } else {
    // Plaintext: epd's own accept loop (a cap on live connections, a reserve descriptor
    // for EMFILE, a first-bytes timeout) hands each HTTP/2 connection to the server.
    UnixListener::Options listener_options;
    listener_options.name = "Peer listener";
    listener_options.backlog = 1024;
    listener_options.max_pending = 256;
    listener_options.first_bytes_timeout = kPeerFirstBytesTimeout;
    if (absl::StatusOr<FdLimit> fd_limit = GetFdLimit(); fd_limit.ok()) {
      listener_options.max_connections = std::max<uint64_t>(fd_limit->soft / 4, 16);
    }
    absl::StatusOr<std::unique_ptr<UnixListener>> listener =
        UnixListener::BindTcp(std::move(listener_options), st->options.listen);
    if (!listener.ok()) {
      return errors::WithReason(
          absl::UnavailableError(absl::StrCat("peer_listen: ", listener.status().message())),
          errors::Reason::kPeerUnreachable);
    }
    st->listener = *std::move(listener);
    st->port = st->listener->port();
  }
  builder.SetMaxReceiveMessageSize(st->options.max_message_bytes);
  // No SO_REUSEPORT: a second daemon on the same peer port must fail, not share it.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 16);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, 5 * 60 * 1000);
  // A connection that has not finished its handshake (TLS, or the HTTP/2 settings) within
  // this time is closed, so that idle connections cannot hold descriptors for long.
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                             static_cast<int>(absl::ToInt64Milliseconds(kServerHandshakeTimeout)));
  builder.RegisterService(st->service.get());
  st->server = builder.BuildAndStart();
  if (st->server != nullptr && st->listener != nullptr) st->listener->Start(st->server.get());
  if (st->server == nullptr || st->port == 0) {
    return errors::WithReason(
        absl::UnavailableError(absl::StrCat("peer_listen: cannot listen on \"", st->options.listen,
                                            "\" (in use, or not an address of this host)")),
        errors::Reason::kPeerUnreachable);
  }
  if (!st->options.advertise.empty()) {
    st->advertised = st->options.advertise;
  } else {
    const std::string& l = st->options.listen;
    st->advertised = absl::StrCat(l.substr(0, l.rfind(':')), ":", st->port);
  }
  GetLogger(kLogPeer)->info("Peer service on {} (advertised as {}), {}, heartbeat every {}",
                            st->options.listen, st->advertised,
                            tls_parts == 3 ? "mutual TLS" : "plaintext (no TLS)",
                            MsText(st->options.heartbeat_interval));
  return std::unique_ptr<GrpcPeerMesh>(new GrpcPeerMesh(std::move(st)));
}

GrpcPeerMesh::GrpcPeerMesh(std::shared_ptr<State> state) : state_(std::move(state)) {}

GrpcPeerMesh::~GrpcPeerMesh() { Shutdown(); }

void GrpcPeerMesh::Shutdown() {
  std::vector<std::thread> workers;
  {
    absl::MutexLock lock(&state_->mu);
    if (state_->stopping) return;
    state_->stopping = true;
    state_->work.SignalAll();
    for (auto& [address, pc] : state_->peers) workers.push_back(std::move(pc->worker));
  }
  for (std::thread& t : workers) t.join();
  if (state_->listener != nullptr) state_->listener->Stop();
  state_->server->Shutdown(DeadlineAfter(absl::Milliseconds(500)));
  state_->server->Wait();
}

absl::StatusOr<std::unique_ptr<GroupPeers>> GrpcPeerMesh::RegisterGroup(
    GroupMembership membership) {
  const v1::GroupSpec& spec = membership.spec;
  EPD_RETURN_IF_ERROR(ValidateGroupSpec(spec));
  if (!SpansNodes(spec)) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  "group \"", spec.name(), "\" lists ", spec.nodes_size(),
                                  " nodes; only a group across 2 or more "
                                  "nodes registers with the Peer mesh")),
                              errors::Reason::kNodesInvalid);
  }
  if (membership.self_node < 0 || membership.self_node >= spec.nodes_size()) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat("self_node: ", membership.self_node,
                                                " is outside [0, ", spec.nodes_size(), ")")),
        errors::Reason::kNodesInvalid);
  }
  if (spec.nodes(membership.self_node).peer_address() != state_->advertised) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  "group \"", spec.name(), "\": node ", membership.self_node,
                                  " is ", spec.nodes(membership.self_node).peer_address(),
                                  ", not this daemon (", state_->advertised, ")")),
                              errors::Reason::kNodesInvalid);
  }
  if (!membership.transport_descriptors.empty() &&
      membership.transport_descriptors.size() != static_cast<size_t>(spec.nodes_size())) {
    return errors::WithReason(
        absl::InvalidArgumentError(
            absl::StrCat("transport_descriptors: ", membership.transport_descriptors.size(),
                         " entries for ", spec.nodes_size(), " nodes")),
        errors::Reason::kNodesInvalid);
  }
  for (const std::string& d : membership.transport_descriptors) {
    if (d.size() > kMaxTransportDescriptorBytes) {
      return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                    "transport_descriptors: an entry of ", d.size(),
                                    " bytes, more than ", kMaxTransportDescriptorBytes)),
                                errors::Reason::kNodesInvalid);
    }
  }
  if (membership.transport_descriptor.size() > kMaxTransportDescriptorBytes) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  "transport_descriptor: ", membership.transport_descriptor.size(),
                                  " bytes, more than ", kMaxTransportDescriptorBytes)),
                              errors::Reason::kNodesInvalid);
  }
  // Peers whose workers retired: dropped under the lock, their threads joined after it.
  struct Retired {
    std::vector<std::unique_ptr<PeerConn>> conns;
    ~Retired() {
      for (auto& pc : conns) pc->worker.join();
    }
  } retired;
  absl::MutexLock lock(&state_->mu);
  if (state_->stopping) {
    return errors::WithReason(absl::UnavailableError("the Peer mesh is shutting down"),
                              errors::Reason::kPeerUnreachable);
  }
  for (auto it = state_->peers.begin(); it != state_->peers.end();) {
    if (it->second->retired) {
      retired.conns.push_back(std::move(it->second));
      it = state_->peers.erase(it);
    } else {
      ++it;
    }
  }
  if (state_->groups.count(spec.name()) != 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("group \"", spec.name(), "\" is registered with the Peer mesh already"));
  }
  auto g = std::make_shared<GroupEntry>();
  g->incarnation = RandomNonZero64();
  g->registration_seq = ++state_->registration_seq;
  int32_t first = 0;
  for (int32_t i = 0; i < spec.nodes_size(); ++i) {
    NodeEntry n;
    n.address = spec.nodes(i).peer_address();
    n.first_rank = first;
    n.num_ranks = spec.nodes(i).num_ranks();
    n.state = i == membership.self_node ? NodeState::kSelf : NodeState::kMissing;
    first += n.num_ranks;
    g->nodes.push_back(std::move(n));
  }
  g->local_joined.assign(static_cast<size_t>(spec.nodes(membership.self_node).num_ranks()), false);
  g->membership = std::move(membership);
  const absl::Time now = absl::Now();
  for (int32_t i = 0; i < static_cast<int32_t>(g->nodes.size()); ++i) {
    if (i == g->membership.self_node) continue;
    const std::string& address = g->nodes[i].address;
    auto found = state_->peers.find(address);
    if (found == state_->peers.end()) {
      auto pc = std::make_unique<PeerConn>();
      pc->address = address;
      grpc::ChannelArguments args;
      args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
      args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
      args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
      args.SetMaxReceiveMessageSize(state_->options.max_message_bytes);
      pc->channel = grpc::CreateCustomChannel(address, state_->channel_credentials, args);
      pc->stub = v1::Peer::NewStub(pc->channel);
      pc->last_heard = now;
      PeerConn* raw = pc.get();
      State* st = state_.get();
      // The worker starts before the peer is listed, so that no entry is left without one.
      // Workers this call started for other peers end by themselves: no group names them.
      try {
        if (state_->options.before_worker_start) state_->options.before_worker_start(address);
        pc->worker = std::thread([st, raw] { Worker(st, raw).Run(); });
      } catch (const std::system_error& e) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "group \"", g->membership.spec.name(), "\": cannot start the Peer worker thread for ",
            NodeText(*g, i), ": ", e.what(),
            " (the daemon is out of threads: raise its RLIMIT_NPROC / ulimit -u, or end groups)"));
      }
      found = state_->peers.emplace(address, std::move(pc)).first;
    }
    PeerConn* pc = found->second.get();
    // A peer quiet before this group counted on it gets the full liveness bound.
    if (!state_->HasRegisteredNodeAt(address)) pc->last_heard = now;
  }
  const std::string name = g->membership.spec.name();
  GetLogger(kLogPeer)->info("group \"{}\" registered as node {} of {} (incarnation {:x})", name,
                            g->membership.self_node, g->nodes.size(), g->incarnation);
  state_->groups[name] = g;
  state_->work.SignalAll();
  return std::unique_ptr<GroupPeers>(std::make_unique<GroupPeersImpl>(state_, std::move(g)));
}

std::string GrpcPeerMesh::advertised_address() const { return state_->advertised; }

absl::Status GrpcPeerMesh::ProbeListener(absl::Duration timeout) const {
  const std::string& listen = state_->options.listen;
  const size_t colon = listen.rfind(':');
  std::string host = colon == std::string::npos ? std::string() : listen.substr(0, colon);
  if (IsWildcardHost(listen)) host = host.find(':') != std::string::npos ? "::1" : "127.0.0.1";
  return ProbeGrpcListener(host, state_->port, timeout);
}

std::string GrpcPeerMesh::JoinSecretDigest(std::string_view group,
                                           std::string_view join_secret) const {
  return peer::JoinSecretDigest(state_->options.secret,
                                absl::string_view(group.data(), group.size()),
                                absl::string_view(join_secret.data(), join_secret.size()));
}

int GrpcPeerMesh::num_peer_workers() const {
  absl::MutexLock lock(&state_->mu);
  return static_cast<int>(std::count_if(state_->peers.begin(), state_->peers.end(),
                                        [](const auto& p) { return !p.second->retired; }));
}

int GrpcPeerMesh::bound_port() const { return state_->port; }

std::vector<v1::GroupNodeInfo> GrpcPeerMesh::NodeStatuses(const std::string& group) const {
  std::vector<v1::GroupNodeInfo> out;
  absl::MutexLock lock(&state_->mu);
  auto it = state_->groups.find(group);
  if (it == state_->groups.end()) return out;
  const GroupEntry& g = *it->second;
  for (int32_t i = 0; i < static_cast<int32_t>(g.nodes.size()); ++i) {
    const NodeEntry& n = g.nodes[i];
    v1::GroupNodeInfo info;
    info.set_node(i);
    info.set_peer_address(n.address);
    info.set_first_rank(n.first_rank);
    info.set_num_ranks(n.num_ranks);
    info.set_reason(n.reason);
    info.set_joined_ranks(-1);
    switch (n.state) {
      case NodeState::kSelf:
        info.set_state(v1::NODE_STATE_SELF);
        info.set_incarnation(g.incarnation);
        info.set_joined_ranks(
            static_cast<int32_t>(std::count(g.local_joined.begin(), g.local_joined.end(), true)));
        break;
      case NodeState::kMissing:
        info.set_state(v1::NODE_STATE_MISSING);
        break;
      case NodeState::kRegistered:
        info.set_state(v1::NODE_STATE_REGISTERED);
        info.set_incarnation(n.descriptor.incarnation);
        if (!n.joined.empty()) {
          info.set_joined_ranks(
              static_cast<int32_t>(std::count(n.joined.begin(), n.joined.end(), true)));
        }
        break;
      case NodeState::kLost:
        info.set_state(v1::NODE_STATE_LOST);
        info.set_incarnation(n.descriptor.incarnation);
        break;
      case NodeState::kMismatch:
        info.set_state(v1::NODE_STATE_MISMATCH);
        break;
    }
    out.push_back(std::move(info));
  }
  return out;
}

}  // namespace epd::peer
