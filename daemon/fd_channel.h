// FdChannel: epd's side of the fd channel (proto/epd/v1/control.proto FdChannelRequest,
// framing in proto/fd_frame.h; docs/SECURITY.md "Shared memory the client cannot resize").
// epd's listener (daemon/listener.h) hands it every connection to epd's unix socket that
// starts with abi::kFdChannelPreamble, after consuming the preamble, together with the
// peer's SO_PEERCRED. The channel reads one request frame, asks its Fetch function for the
// endpoint's descriptors (the registry authorizes: the session exists, was opened by the
// peer's uid and holds the (group, rank)), answers with one response frame carrying them
// (SCM_RIGHTS) or the error, and closes the connection.
#pragma once

#include <functional>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/data_plane.h"
#include "daemon/peer_credentials.h"
#include "epd/v1/control.pb.h"
#include "shm_region.h"

namespace epd {

/// Bounds of one fd-channel connection.
struct FdChannelOptions {
  /// The whole request frame must arrive within this (from the hand-over), else the
  /// connection is closed without an answer.
  absl::Duration request_timeout = absl::Seconds(2);
  /// The answer must be taken by the peer's socket within this.
  absl::Duration response_timeout = absl::Seconds(2);
};

class FdChannel {
 public:
  /// The endpoint's descriptors for `request` from `peer`, or why not: NOT_FOUND,
  /// PERMISSION_DENIED, FAILED_PRECONDITION, RESOURCE_EXHAUSTED, each with a message the
  /// client is shown (GroupRegistry::TakeEndpointFds).
  using Fetch = std::function<absl::StatusOr<EndpointFds>(const v1::FdChannelRequest& request,
                                                          const PeerCredentials& peer)>;

  explicit FdChannel(Fetch fetch, FdChannelOptions options = {});

  /// Serves one connection: `conn` is a connected unix stream socket whose preamble was
  /// consumed; `peer` its SO_PEERCRED. Reads one FdChannelRequest frame (at most
  /// kMaxFdFrameBytes, within request_timeout), answers with one FdChannelResponse frame
  /// (with the endpoint region and doorbell descriptors on OK), and closes `conn`. A frame
  /// that is oversized, not a FdChannelRequest, or carries descriptors is answered with
  /// INVALID_ARGUMENT; a peer that sends nothing complete in time is closed without an
  /// answer. Every wait is bounded by the options; never throws. Thread-safe.
  void Serve(ScopedFd conn, const PeerCredentials& peer) const;

  /// The listener's handler type (daemon/listener.h): a callable serving `this`.
  std::function<void(ScopedFd, const PeerCredentials&)> Handler() const {
    return [this](ScopedFd conn, const PeerCredentials& peer) { Serve(std::move(conn), peer); };
  }

 private:
  Fetch fetch_;
  FdChannelOptions options_;
};

}  // namespace epd
