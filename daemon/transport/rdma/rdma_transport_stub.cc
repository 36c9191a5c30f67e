// MakeRdmaTransport where the RDMA transport itself is not part of the build: the daemon
// links, preflight and configuration work, and a transport "rdma" that reaches this is
// refused with UNIMPLEMENTED (the preflight line says so).
#include "daemon/transport/rdma/rdma_transport.h"

namespace epd::transport {

absl::StatusOr<std::unique_ptr<Transport>> MakeRdmaTransport(
    const RdmaTransportOptions& /*options*/) {
  return absl::UnimplementedError("RDMA transport not built");
}

}  // namespace epd::transport
