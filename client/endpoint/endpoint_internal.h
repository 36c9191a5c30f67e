// Internal to libepdclient: how Client::Join opens the Endpoint the daemon described.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "client/session_watch.h"
#include "common/os/fd_frame.h"
#include "epd/client.h"
#include "epd/v1/control.pb.h"

namespace epd::internal {

/// Asks the daemon for every rank's endpoint of the caller's group (GetGroupEndpoints),
/// waiting up to `wait_ms` for every rank to join. Client-launched mode calls it once per
/// endpoint, before its first op.
using GroupEndpointsFn =
    std::function<absl::StatusOr<v1::GetGroupEndpointsResponse>(uint32_t wait_ms)>;

/// Asks the daemon for the caller's group's rank mask: UpdateRankMask with `update`'s
/// mask, unmask and clean (group, rank and session filled in by the function), or
/// GetRankMask when `update` is null.
using RankMaskFn =
    std::function<absl::StatusOr<v1::RankMask>(const v1::UpdateRankMaskRequest* update)>;

/// Maps the endpoint `info` describes: its region and doorbell from `fds` (as the fd
/// channel handed them: client/fd_channel.h; both are closed once mapped) and, on the CUDA
/// backend, its data area; checks the seals and sizes (ShmRegion::Map) and the shm ABI
/// magic/version. `leave` is called once by Endpoint::Leave (and by the destructor) to
/// release the rank through the control plane.
/// `session`, when given, says when the client's Session with the daemon has ended:
/// waits then return UNAVAILABLE at once instead of after op_timeout + 5 s, and a CUDA
/// stream left waiting for the daemon is released.
/// `group_endpoints` is needed for client-launched endpoints (info.launch_mode =
/// LAUNCH_MODE_CLIENT); their first op fails with FAILED_PRECONDITION without it.
/// `rank_mask` serves Endpoint::UpdateRankMask/QueryRankMask/CleanRankMask (they are
/// FAILED_PRECONDITION without it).
/// Errors: FAILED_PRECONDITION on an ABI mismatch, a descriptor that is not a sealed memfd
/// of the expected size, or fds of another endpoint; INTERNAL on mmap failure.
absl::StatusOr<std::unique_ptr<Endpoint>> OpenEndpoint(
    const v1::EndpointInfo& info, const v1::GroupSpec& spec, EndpointFds fds,
    std::function<absl::Status()> leave, std::shared_ptr<SessionWatch> session = nullptr,
    GroupEndpointsFn group_endpoints = nullptr, RankMaskFn rank_mask = nullptr);

}  // namespace epd::internal
