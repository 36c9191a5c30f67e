// Internal to libepdclient: the client's side of the fd channel (proto/epd/v1/control.proto
// FdChannelRequest; framing in common/os/fd_frame.h). After JoinGroup, Client::Join fetches the
// endpoint's sealed region and its engine's doorbell page as file descriptors on a second
// connection to epd's unix socket, then maps them (ShmRegion::Map checks the seals).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/os/fd_frame.h"

namespace epd::internal {

/// The socket file of a ChannelTarget: "unix:///path" (or "unix:/path") → "/path".
/// FAILED_PRECONDITION for any other target (host:port): the fd channel, like Control,
/// exists on epd's unix socket alone.
absl::StatusOr<std::string> UnixSocketPathOf(absl::string_view target);

/// Asks epd on the unix socket `socket_path` for the descriptors of rank `rank` of group
/// `group`, which the Session `session_id` of this process joined: connects, sends
/// abi::kFdChannelPreamble and one FdChannelRequest frame, and reads the answer, all
/// within `timeout`. Returns exactly the two descriptors of an OK answer (region, then
/// doorbell); any other descriptor that arrives is closed. Errors: the daemon's (NOT_FOUND,
/// PERMISSION_DENIED, FAILED_PRECONDITION, RESOURCE_EXHAUSTED, with its message);
/// UNAVAILABLE when epd cannot be reached, or closes without an answer or answers with
/// something else than a frame (an epd too old to have an fd channel does); DEADLINE_EXCEEDED;
/// INTERNAL for a frame that is not an FdChannelResponse or an OK one without two
/// descriptors.
absl::StatusOr<EndpointFds> FetchEndpointFds(const std::string& socket_path,
                                             const std::string& session_id,
                                             const std::string& group, int32_t rank,
                                             absl::Duration timeout);

}  // namespace epd::internal
