#include "tests/common/daemon_process.h"

#include <signal.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace epd::testing {
namespace {

std::string FromEnvOr(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : fallback;
}

}  // namespace

#ifndef EPD_BINARY
#define EPD_BINARY "epd"
#endif
#ifndef EPCTL_BINARY
#define EPCTL_BINARY "epctl"
#endif
#ifndef EPD_TEST_CLIENT_BINARY
#define EPD_TEST_CLIENT_BINARY "epd_test_client"
#endif

std::string EpdBinary() { return FromEnvOr("EPD_BINARY", EPD_BINARY); }
std::string EpctlBinary() { return FromEnvOr("EPCTL_BINARY", EPCTL_BINARY); }
std::string TestClientBinary() {
  return FromEnvOr("EPD_TEST_CLIENT_BINARY", EPD_TEST_CLIENT_BINARY);
}

absl::StatusOr<std::unique_ptr<DaemonProcess>> DaemonProcess::Start(DaemonProcessOptions options) {
  std::unique_ptr<DaemonProcess> d(new DaemonProcess());
  d->dir_ = MakeTempDir("epd_it_");
  d->socket_path_ = options.socket_path.empty() ? d->dir_ + "/epd.sock" : options.socket_path;
  d->argv_ = {EpdBinary(), "--socket=" + d->socket_path_};
  if (!options.backend.empty()) d->argv_.push_back("--backend=" + options.backend);
  if (!options.log_level.empty()) d->argv_.push_back("--log_level=" + options.log_level);
  if (options.tcp) {
    d->tcp_port_ = PickFreeTcpPort();
    if (d->tcp_port_ == 0) return absl::UnavailableError("no free TCP port on 127.0.0.1");
    d->argv_.push_back(absl::StrCat("--listen=127.0.0.1:", d->tcp_port_));
  }
  if (!options.config_text.empty()) {
    std::string config_path = d->dir_ + "/epd.textproto";
    std::ofstream(config_path) << options.config_text;
    d->argv_.push_back("--config=" + config_path);
  }
  for (const std::string& arg : options.extra_args) d->argv_.push_back(arg);

  SubprocessOptions process_options;
  process_options.stdout_path = d->dir_ + "/epd.stdout";
  process_options.stderr_path = d->dir_ + "/epd.log";
  std::vector<std::string> command = options.wrapper;
  command.insert(command.end(), d->argv_.begin(), d->argv_.end());
  absl::StatusOr<std::unique_ptr<Subprocess>> process = Subprocess::Spawn(command, process_options);
  if (!process.ok()) return process.status();
  d->process_ = *std::move(process);
  if (options.wait_serving) {
    absl::Status serving = d->WaitServing(options.start_timeout);
    if (!serving.ok()) return serving;
  }
  return d;
}

DaemonProcess::~DaemonProcess() {
  process_.reset();  // SIGKILLs a daemon still running (its memory has no name to leave).
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

std::string DaemonProcess::tcp_target() const {
  return tcp_port_ == 0 ? "" : absl::StrCat("127.0.0.1:", tcp_port_);
}

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> DaemonProcess::CheckHealth(
    const std::string& service, const std::string& target, absl::Duration timeout) const {
  auto channel = grpc::CreateChannel(target.empty() ? unix_target() : target,
                                     grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  }
  return response.status();
}

absl::Status DaemonProcess::WaitServing(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (!process_->Running()) {
      return absl::UnavailableError(absl::StrCat("epd exited before serving; log:\n", Logs()));
    }
    auto status = CheckHealth("", "", absl::Milliseconds(500));
    if (status.ok() && *status == grpc::health::v1::HealthCheckResponse::SERVING) {
      return absl::OkStatus();
    }
    if (absl::Now() >= deadline) {
      return absl::UnavailableError(absl::StrCat(
          "epd not SERVING within ", absl::FormatDuration(timeout), "; log:\n", Logs()));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

absl::StatusOr<int> DaemonProcess::Stop(absl::Duration timeout) {
  process_->Signal(SIGTERM);
  absl::StatusOr<int> code = process_->Wait(timeout);
  if (!code.ok()) Kill();
  return code;
}

absl::StatusOr<int> DaemonProcess::WaitExit(absl::Duration timeout) {
  return process_->Wait(timeout);
}

void DaemonProcess::Kill() {
  process_->Signal(SIGKILL);
  process_->Wait(absl::Seconds(5)).IgnoreError();
}

std::string DaemonProcess::Logs() const { return process_->Stderr() + process_->Stdout(); }

}  // namespace epd::testing
