// The error catalog at the gRPC edge: absl::Status <-> grpc::Status keeping the reason.
// The reason travels in grpc::Status::error_details as a serialized google.rpc.Status
// whose details hold one Any(epd.v1.ErrorInfo) (proto/epd/v1/errors.proto). Built into
// epd_proto (it needs protobuf and gRPC, which epd_common does not have).
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace epd::errors {

/// The grpc::Status of `status`: same code and message; error_details carries its reason
/// (ReasonOf: the generic one when it has none). OK gives grpc::Status::OK.
grpc::Status ToGrpcStatus(const absl::Status& status);

/// The absl::Status of `status`, with the reason of its error_details as payload. Details
/// that do not parse (a peer of another version) are ignored: the status then has no
/// payload and ReasonOf gives the generic reason of its code.
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace epd::errors
