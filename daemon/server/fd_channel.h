// FdChannel: epd's side of the fd channel (control.proto FdChannelRequest, framing in
// common/os/fd_frame.h). The listener (daemon/server/listener.h) hands it each connection
// that starts with abi::kFdChannelPreamble, with the peer's SO_PEERCRED; the channel reads
// one request, asks its Fetch function for the endpoint's descriptors (the registry
// authorizes), answers with them (SCM_RIGHTS) or the error, and closes the connection. One
// thread polls every pending request, so a silent peer holds a bounded slot until its
// deadline, never a thread (docs/SECURITY.md "Shared memory the client cannot resize").
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/os/fd_frame.h"
#include "common/os/shm_region.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/server/peer_credentials.h"
#include "epd/v1/control.pb.h"

namespace epd {

/// Bounds of the fd channel.
struct FdChannelOptions {
  /// The whole request frame must arrive within this (from the hand-over), else the
  /// connection is closed without an answer.
  absl::Duration request_timeout = absl::Seconds(2);
  /// The answer must be taken by the peer's socket within this (it always fits in an empty
  /// socket buffer; the bound is for a peer that shrank it).
  absl::Duration response_timeout = absl::Milliseconds(200);
  /// Most connections waiting for their request at a time; a new one beyond that closes
  /// the oldest.
  size_t max_pending = 1024;
};

class FdChannel {
 public:
  /// The endpoint's descriptors for `request` from `peer`, or why not: NOT_FOUND,
  /// PERMISSION_DENIED, FAILED_PRECONDITION, RESOURCE_EXHAUSTED, each with a message the
  /// client is shown (GroupRegistry::TakeEndpointFds). Called on the channel's thread.
  using Fetch = std::function<absl::StatusOr<EndpointFds>(const v1::FdChannelRequest& request,
                                                          const PeerCredentials& peer)>;

  /// Starts the channel's thread. INTERNAL when its wake-up eventfd cannot be made.
  static absl::StatusOr<std::unique_ptr<FdChannel>> Start(Fetch fetch,
                                                          FdChannelOptions options = {});
  /// Closes every pending connection (without an answer) and joins the thread.
  ~FdChannel();
  FdChannel(const FdChannel&) = delete;
  FdChannel& operator=(const FdChannel&) = delete;

  /// Takes one connection and returns at once: `conn` is a connected unix stream socket
  /// whose preamble was consumed; `peer` its SO_PEERCRED. The channel then reads one
  /// FdChannelRequest frame (at most kMaxFdFrameBytes, within request_timeout), answers
  /// with one FdChannelResponse frame (with the endpoint region and doorbell descriptors
  /// on OK), and closes `conn`. A frame that is oversized, not an FdChannelRequest, or
  /// carries descriptors is answered INVALID_ARGUMENT; a peer that sends nothing complete
  /// in time, or closes, is closed without an answer. Thread-safe.
  void Serve(ScopedFd conn, const PeerCredentials& peer);

  /// The listener's handler (daemon/server/listener.h): Serve on this channel, which must outlive
  /// the listener's use of it.
  std::function<void(ScopedFd, const PeerCredentials&)> Handler() {
    return [this](ScopedFd conn, const PeerCredentials& peer) { Serve(std::move(conn), peer); };
  }

 private:
  struct Pending {
    Pending(ScopedFd c, const PeerCredentials& p, absl::Time d)
        : conn(std::move(c)), peer(p), deadline(d), reader(kMaxFdFrameBytes, /*max_fds=*/0) {}
    ScopedFd conn;
    PeerCredentials peer;
    absl::Time deadline;
    FrameReader reader;
  };

  FdChannel(Fetch fetch, FdChannelOptions options, ScopedFd wake);
  void Loop();
  /// Reads what `p` sent; true when it is done (answered or dropped).
  bool Advance(Pending& p);
  /// Answers `p` with `status` (or, on OK, the descriptors of `fds`).
  void Answer(Pending& p, const absl::Status& status, const EndpointFds& fds);

  const Fetch fetch_;
  const FdChannelOptions options_;
  ScopedFd wake_;  ///< eventfd: Serve and the destructor wake the loop's poll.
  std::thread loop_;

  absl::Mutex mu_;
  std::deque<std::unique_ptr<Pending>> incoming_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;

  std::vector<std::unique_ptr<Pending>> pending_;  ///< The loop thread's only.
};

}  // namespace epd
