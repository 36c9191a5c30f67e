// OpenRanks: every rank of a DataPlaneGroup opened in this process by the real client code
// (internal::OpenEndpoint over the fds the group hands out), with no daemon process: the
// set-up of the unit tests that drive a host-backend group through epd::Endpoint.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/endpoint/endpoint_internal.h"
#include "common/status_macros.h"
#include "daemon/dataplane/data_plane.h"
#include "epd/client.h"

namespace epd::testing {

/// Attaches ranks [0, spec.num_ranks()) of `group` (created from `spec`) and opens their
/// endpoints, indexed by rank; an endpoint's destruction detaches its rank. The first
/// attach or open error.
inline absl::StatusOr<std::vector<std::unique_ptr<Endpoint>>> OpenRanks(DataPlaneGroup& group,
                                                                        const v1::GroupSpec& spec) {
  std::vector<std::unique_ptr<Endpoint>> eps;
  for (int r = 0; r < spec.num_ranks(); ++r) {
    v1::EndpointInfo info;
    EPD_RETURN_IF_ERROR(group.AttachRank(r, "", v1::LAUNCH_MODE_UNSPECIFIED, {}, &info));
    EPD_ASSIGN_OR_RETURN(EndpointFds fds, group.TakeEndpointFds(r));
    DataPlaneGroup* g = &group;
    EPD_ASSIGN_OR_RETURN(std::unique_ptr<Endpoint> ep,
                         internal::OpenEndpoint(info, spec, std::move(fds), [g, r] {
                           g->DetachRank(r);
                           return absl::OkStatus();
                         }));
    eps.push_back(std::move(ep));
  }
  return eps;
}

}  // namespace epd::testing
