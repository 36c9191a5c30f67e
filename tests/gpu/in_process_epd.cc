// InProcessEpd (in_process_epd.h).
#include "tests/gpu/in_process_epd.h"

#include <stdlib.h>

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "client/cuda/cuda_ipc.h"
#include "common/status_macros.h"
#include "daemon/core/config.h"
#include "daemon/dataplane/cuda/cuda_data_plane.h"

namespace epd::testing {

absl::StatusOr<std::unique_ptr<InProcessEpd>> InProcessEpd::Start(const std::string& name,
                                                                  uint32_t op_timeout_ms) {
  auto e = std::make_unique<InProcessEpd>();
  std::string templ = absl::StrCat("/tmp/epd_", name, "_XXXXXX");
  if (::mkdtemp(templ.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp ", templ, " failed"));
  }
  e->dir_ = templ;
  v1::DaemonConfig config;
  config.set_socket_path(e->dir_ + "/epd.sock");
  config.set_socket_mode("0600");
  config.set_log_level("warn");
  config.set_backend(v1::BACKEND_CUDA);
  FillDaemonConfigDefaults(&config);
  config.set_op_timeout_ms(op_timeout_ms);
  DaemonOptions options;
  options.drain_grace = absl::Milliseconds(10);
  EPD_ASSIGN_OR_RETURN(e->daemon_, Daemon::Start(config, options));
  internal::SetInProcessAreaResolver(FindInProcessCudaArea);
  ClientOptions co;
  co.socket_path = e->daemon_->socket_path();
  co.client_name = name;
  EPD_ASSIGN_OR_RETURN(e->client_, Client::Connect(co));
  EPD_ASSIGN_OR_RETURN(v1::GetStatsResponse stats, e->client_->GetStats());
  if (stats.backend() != "cuda" || stats.gpus_size() == 0) {
    return absl::FailedPreconditionError(absl::StrCat("the in-process epd runs backend ",
                                                      stats.backend(), " with ", stats.gpus_size(),
                                                      " GPU(s): ", stats.backend_reason()));
  }
  e->gpu_uuid_ = stats.gpus(0).uuid();
  EPD_ASSIGN_OR_RETURN(e->device_, internal::DeviceOfUuid(e->gpu_uuid_));
  return e;
}

InProcessEpd::~InProcessEpd() {
  client_.reset();
  daemon_.reset();
  internal::SetInProcessAreaResolver({});
  if (!dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

}  // namespace epd::testing
