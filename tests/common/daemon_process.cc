#include "tests/common/daemon_process.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/os/scoped_fd.h"
#include "common/status_macros.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace epd::testing {
namespace {

/// Writes `text` to a new file at `path` readable by its owner only (0600).
absl::Status WritePrivateFile(const std::string& path, const std::string& text) {
  const ScopedFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (!fd.valid()) {
    return absl::InternalError(absl::StrCat("open ", path, ": ", std::strerror(errno)));
  }
  const ssize_t written = ::write(fd.get(), text.data(), text.size());
  if (written != static_cast<ssize_t>(text.size())) {
    return absl::InternalError(absl::StrCat("write ", path, ": short write"));
  }
  return absl::OkStatus();
}

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

DaemonProcessOptions UnixSocketOnly(const std::string& op_timeout) {
  DaemonProcessOptions options;
  options.tcp = false;
  options.log_level = "info";
  options.extra_args = {"--op_timeout=" + op_timeout};
  return options;
}

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
  if (options.peer) {
    d->peer_port_ = options.peer_port != 0 ? options.peer_port : PickFreeTcpPort();
    if (d->peer_port_ == 0) return absl::UnavailableError("no free TCP port on 127.0.0.1");
    const std::string secret_path = d->dir_ + "/peer.secret";
    EPD_RETURN_IF_ERROR(WritePrivateFile(secret_path, options.peer_secret));
    d->argv_.push_back(absl::StrCat("--peer_listen=127.0.0.1:", d->peer_port_));
    d->argv_.push_back("--peer_secret_file=" + secret_path);
    d->argv_.push_back(absl::StrCat("--peer_heartbeat_ms=", options.peer_heartbeat_ms));
  }
  if (!options.config_text.empty()) {
    std::string config_path = d->dir_ + "/epd.textproto";
    std::ofstream(config_path) << options.config_text;
    d->argv_.push_back("--config=" + config_path);
  }
  for (const std::string& arg : options.extra_args) d->argv_.push_back(arg);

  d->wrapper_ = options.wrapper;
  EPD_RETURN_IF_ERROR(d->Spawn());
  if (options.wait_serving) {
    absl::Status serving = d->WaitServing(options.start_timeout);
    if (!serving.ok()) return serving;
  }
  return d;
}

absl::Status DaemonProcess::Spawn() {
  SubprocessOptions process_options;
  process_options.stdout_path = dir_ + "/epd.stdout";
  process_options.stderr_path = dir_ + "/epd.log";
  std::vector<std::string> command = wrapper_;
  command.insert(command.end(), argv_.begin(), argv_.end());
  absl::StatusOr<std::unique_ptr<Subprocess>> process = Subprocess::Spawn(command, process_options);
  if (!process.ok()) return process.status();
  process_ = *std::move(process);
  return absl::OkStatus();
}

absl::Status DaemonProcess::Restart(absl::Duration timeout) {
  if (process_->Running()) Kill();
  std::error_code ec;
  ++restarts_;
  std::filesystem::rename(dir_ + "/epd.log", absl::StrCat(dir_, "/epd.log.", restarts_), ec);
  std::filesystem::rename(dir_ + "/epd.stdout", absl::StrCat(dir_, "/epd.stdout.", restarts_), ec);
  EPD_RETURN_IF_ERROR(Spawn());
  return WaitServing(timeout);
}

std::string DaemonProcess::peer_address() const {
  return peer_port_ == 0 ? "" : absl::StrCat("127.0.0.1:", peer_port_);
}

absl::StatusOr<std::vector<std::unique_ptr<DaemonProcess>>> StartNodes(
    int num_nodes, DaemonProcessOptions options) {
  options.peer = true;
  options.socket_path.clear();
  const bool wait = options.wait_serving;
  options.wait_serving = false;
  std::vector<std::unique_ptr<DaemonProcess>> nodes;
  std::vector<int> taken;
  for (int i = 0; i < num_nodes; ++i) {
    // Ports picked one after the other can repeat: each node gets one no other node has.
    options.peer_port = 0;
    for (int attempt = 0; attempt < 20 && options.peer_port == 0; ++attempt) {
      const int port = PickFreeTcpPort();
      if (port != 0 && std::find(taken.begin(), taken.end(), port) == taken.end()) {
        options.peer_port = port;
      }
    }
    if (options.peer_port == 0) return absl::UnavailableError("no free TCP port on 127.0.0.1");
    taken.push_back(options.peer_port);
    EPD_ASSIGN_OR_RETURN(std::unique_ptr<DaemonProcess> node, DaemonProcess::Start(options));
    taken.push_back(node->tcp_port());
    nodes.push_back(std::move(node));
  }
  if (wait) {
    for (size_t i = 0; i < nodes.size(); ++i) {
      absl::Status serving = nodes[i]->WaitServing(options.start_timeout);
      if (!serving.ok()) {
        return absl::UnavailableError(absl::StrCat("node ", i, ": ", serving.message()));
      }
    }
  }
  return nodes;
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
