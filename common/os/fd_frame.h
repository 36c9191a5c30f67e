// Framing of the fd channel (docs/SECURITY.md "Shared memory the client cannot resize"), a
// second kind of connection to epd's unix socket beside gRPC. The client connects, sends
// abi::kFdChannelPreamble and one request frame; epd answers with one response frame that
// carries the endpoint's file descriptors (SCM_RIGHTS) and closes the connection.
//
// A frame is a 4-byte little-endian length, then that many bytes of body (a serialized
// epd.v1.FdChannelRequest / FdChannelResponse, proto/epd/v1/control.proto). Descriptors, if
// any, ride on the frame's first byte. Every call here waits at most until its deadline
// (poll, then a non-blocking send/recv), whatever the socket's own blocking mode.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/os/shm_region.h"

namespace epd {

/// What a client maps for one endpoint: the fd channel's answer (control.proto
/// FdChannelResponse), in the order the frame carries them.
struct EndpointFds {
  ScopedFd region;           ///< The endpoint's sealed region (EndpointInfo.shm_bytes).
  ScopedFd doorbell;         ///< Its engine's sealed doorbell page (sizeof(DoorbellPage)).
  uint64_t endpoint_id = 0;  ///< The endpoint `region` belongs to.
};

/// Largest frame body either side accepts, in bytes.
inline constexpr uint32_t kMaxFdFrameBytes = 4096;
/// Most descriptors one frame carries.
inline constexpr int kMaxFdFrameFds = 4;

/// Writes all of `bytes` to the connected stream socket `socket`. Errors:
/// DEADLINE_EXCEEDED when the peer does not take them by `deadline`, UNAVAILABLE when the
/// peer has closed (EPIPE, ECONNRESET; never SIGPIPE), INTERNAL otherwise.
absl::Status SendAll(int socket, absl::string_view bytes, absl::Time deadline);

/// Sends one frame of `body` with `fds` (borrowed, not closed) attached. Errors as SendAll,
/// and INVALID_ARGUMENT when `body` exceeds kMaxFdFrameBytes or `fds` kMaxFdFrameFds.
absl::Status SendFrame(int socket, absl::string_view body, absl::Span<const int> fds,
                       absl::Time deadline);

/// One received frame; its descriptors are owned (close-on-exec).
struct ReceivedFrame {
  std::string body;
  std::vector<ScopedFd> fds;
};

/// Reads one frame from a socket as far as the bytes that have arrived allow, without ever
/// blocking: for an event loop serving many connections (daemon/server/fd_channel.h), and the
/// base of ReceiveFrame. Descriptors are owned by the reader (closed with it).
class FrameReader {
 public:
  /// A frame of at most `max_bytes` (<= kMaxFdFrameBytes) of body carrying at most
  /// `max_fds` (<= kMaxFdFrameFds) descriptors.
  FrameReader(uint32_t max_bytes, int max_fds);

  /// Reads what `socket` has now. Returns true once the frame is complete (then frame()),
  /// false when more must arrive (poll for POLLIN and call again). Errors, after which the
  /// reader is done: INVALID_ARGUMENT when the length prefix exceeds max_bytes (naming
  /// both; the body is not read) or more than max_fds descriptors came (the kernel
  /// discards those that do not fit); UNAVAILABLE when the peer closed first (saying how
  /// many bytes came); INTERNAL for other socket errors.
  absl::StatusOr<bool> Continue(int socket);
  /// Bytes received so far and bytes the frame needs (4 until its length is known).
  size_t received() const { return received_; }
  size_t needed() const { return needed_; }
  /// The complete frame (after Continue returned true); moves it out.
  ReceivedFrame TakeFrame() { return std::move(frame_); }

 private:
  uint32_t max_bytes_;
  int max_fds_;
  char header_[4] = {};
  size_t received_ = 0;  ///< Header and body bytes so far.
  size_t needed_ = 4;
  bool truncated_ = false;
  ReceivedFrame frame_;
};

/// Receives one frame of at most `max_bytes` (<= kMaxFdFrameBytes) of body carrying at
/// most `max_fds` (<= kMaxFdFrameFds) descriptors. Descriptors received before an error
/// are closed. Errors: INVALID_ARGUMENT when the length prefix exceeds `max_bytes` (naming
/// both; the body is not read) or more than `max_fds` descriptors came (the kernel
/// discards those that do not fit); DEADLINE_EXCEEDED when the frame is not complete by
/// `deadline`; UNAVAILABLE when the peer closed first (saying how many bytes came);
/// INTERNAL for other socket errors.
absl::StatusOr<ReceivedFrame> ReceiveFrame(int socket, uint32_t max_bytes, int max_fds,
                                           absl::Time deadline);

}  // namespace epd
