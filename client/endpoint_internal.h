// Internal to libepdclient: how Client::Join opens the Endpoint the daemon described.
#pragma once

#include <atomic>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "epd/client.h"
#include "epd/v1/control.pb.h"

namespace epd::internal {

/// Maps the endpoint `info` describes (shm region, doorbell, data area), checks the shm
/// ABI magic/version, and tells the daemon it is mapped (so the daemon unlinks the shm
/// name). `leave` is called once by Endpoint::Leave (and by the destructor) to release
/// the rank through the control plane.
/// `session_lost`, when given, turns true once the client's Session with the daemon has
/// ended (e.g. epd was killed): waits then return UNAVAILABLE at once instead of after
/// op_timeout + 5 s.
/// Errors: FAILED_PRECONDITION on an ABI mismatch, UNAVAILABLE when the shm is gone,
/// INTERNAL on mmap failure.
absl::StatusOr<std::unique_ptr<Endpoint>> OpenEndpoint(
    const v1::EndpointInfo& info, const v1::GroupSpec& spec, std::function<absl::Status()> leave,
    std::shared_ptr<const std::atomic<bool>> session_lost = nullptr);

}  // namespace epd::internal
