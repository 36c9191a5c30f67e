// absl::Status <-> grpc::Status with the catalog reason in error_details (grpc_status.h).
#include "common/errors/grpc_status.h"

#include <string>

#include "common/errors/reason.h"
#include "epd/v1/errors.pb.h"
#include "google/rpc/status.pb.h"

namespace epd::errors {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  google::rpc::Status detail;
  detail.set_code(static_cast<int32_t>(status.code()));
  detail.set_message(std::string(status.message()));
  epd::v1::ErrorInfo info;
  info.set_reason(static_cast<epd::v1::ErrorReason>(ReasonOf(status)));
  detail.add_details()->PackFrom(info);
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()),
                      detail.SerializeAsString());
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  absl::Status out(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  if (status.error_details().empty()) return out;
  google::rpc::Status detail;
  if (!detail.ParseFromString(status.error_details())) return out;
  for (const google::protobuf::Any& any : detail.details()) {
    epd::v1::ErrorInfo info;
    if (any.Is<epd::v1::ErrorInfo>() && any.UnpackTo(&info)) {
      return WithReason(std::move(out), static_cast<Reason>(info.reason()));
    }
  }
  return out;
}

}  // namespace epd::errors
