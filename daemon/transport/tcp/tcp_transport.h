// The TCP transport (DESIGN.md §5.2): one data listener and one epoll progress thread per
// daemon, shared by every group link; per peer several non-blocking connections; writes
// striped over them with scatter-gather sendmsg; the immediate of a write delivered once
// every connection's part of it arrived. Wire bytes: proto/abi/tcp_wire.h.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/os/scoped_fd.h"
#include "daemon/core/logging.h"
#include "daemon/transport/transport.h"
#include "proto/abi/tcp_wire.h"

namespace epd::transport {

/// Logger of the transports ("epd.transport", daemon/core/logging.h).
using ::epd::kLogTransport;

/// What MakeTcpTransport is built with.
struct TcpTransportOptions {
  /// Data listener, "host:port" ("[v6]:port" for IPv6); port 0 = any free port.
  std::string listen_address = "127.0.0.1:0";
  /// Host put in descriptors for peers to connect to; "" = the listen host, or the
  /// machine's host name when that is a wildcard (0.0.0.0, ::).
  std::string advertise_host;
  /// Connections a peer opens to this node per group link, [1, 16].
  int32_t connections_per_peer = 2;
  /// Bound on connecting and handshaking, per peer (and per accepted connection).
  std::chrono::milliseconds connect_timeout{10000};
  /// Per peer of a link: writes posted and not yet completed (PostWrite answers
  /// RESOURCE_EXHAUSTED beyond), >= 1.
  int32_t max_writes_in_flight = 1024;
  /// Per peer of a link: pieces of the writes in flight, >= 1; a write with more pieces
  /// than this is INVALID_ARGUMENT. Rings cost 24 bytes a piece and 24 a write per peer
  /// (the defaults: about 400 KiB per peer of a link).
  int32_t max_pieces_in_flight = 16384;
  /// Per peer of a link: immediates received and not yet polled (the receiver stops
  /// reading from that peer while this many wait), >= 1.
  int32_t max_pending_imms = 1024;
  /// Pieces are cut into chunks of at most this many bytes, striped over the connections.
  uint64_t chunk_bytes = 512 * 1024;
  /// Called once on the progress thread as it starts, before anything else runs there
  /// (tests mark the thread, e.g. to count its allocations). May be empty.
  std::function<void()> on_progress_thread_start;
};

/// Starts the TCP transport: binds and listens on `options.listen_address` and starts the
/// progress thread. Errors: INVALID_ARGUMENT naming the option and its value;
/// UNAVAILABLE when the address cannot be bound (naming it and errno); INTERNAL for
/// epoll/eventfd/thread failures.
absl::StatusOr<std::unique_ptr<Transport>> MakeTcpTransport(const TcpTransportOptions& options);

/// The handshake that node `from_node`'s link of incarnation `incarnation` sends on
/// connection `connection` to the node that handed it `target` (its descriptor made for
/// `from_node`): magic, version, counts and the proof of proto/abi/tcp_wire.h. For the
/// transport and for tests that speak the wire by hand.
abi::TcpHandshake MakeTcpHandshake(const abi::TcpDescriptor& target, int32_t from_node,
                                   uint64_t incarnation, uint32_t connection);

/// The "host:port" the transport's data listener is bound to (the resolved port), for
/// logs and tests; "" when `transport` is not a TCP transport.
std::string TcpListenAddress(const Transport& transport);

/// Segments the kernel re-sent on TCP socket `fd` since it was opened (TCP_INFO's
/// tcpi_total_retrans). Errors: INVALID_ARGUMENT when `fd` is not a TCP socket (naming
/// errno). A syscall; allocates nothing on success.
absl::StatusOr<uint64_t> TcpTotalRetransmits(int fd);

/// Two ends of one plain TCP connection in this process.
struct PlainTcpPair {
  ScopedFd sender;    ///< The connecting end.
  ScopedFd receiver;  ///< The accepted end.
};

/// `count` connected TCP connections through one listener on `host` (a local address; the
/// listener is closed on return), both ends TCP_NODELAY with 10 s send/receive timeouts:
/// the plain sockets of the plain-TCP yardsticks (MeasurePlainTcp, epd_bench's exchange
/// across nodes). Errors: INVALID_ARGUMENT (host does not resolve), UNAVAILABLE (a socket
/// call failed, naming it and errno).
absl::StatusOr<std::vector<PlainTcpPair>> ConnectPlainTcpPairs(int32_t count,
                                                               const std::string& host);

/// What MeasurePlainTcp moved and how fast.
struct PlainTcpResult {
  uint64_t bytes = 0;       ///< Payload bytes moved (all connections).
  int32_t connections = 0;  ///< Connections used.
  double seconds = 0;       ///< From the first send to the last byte received.
  double GBps() const { return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0; }
};

/// The plain-TCP bound for the same bytes, as a yardstick for the transport (epd_bench): moves
/// `bytes` (split evenly) over `connections` TCP connections between two ends in this process
/// on `host` (a local address), one blocking sender and one receiver thread per connection,
/// 1 MiB send/recv calls, TCP_NODELAY, and times it. Every call is bounded (10 s socket
/// timeouts). Errors: INVALID_ARGUMENT (bytes 0, connections not in [1, 16]), UNAVAILABLE
/// (a socket call failed, naming it and errno).
absl::StatusOr<PlainTcpResult> MeasurePlainTcp(uint64_t bytes, int32_t connections,
                                               const std::string& host = "127.0.0.1");

}  // namespace epd::transport
