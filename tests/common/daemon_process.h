// DaemonProcess: the real `epd` binary started for an integration test, on a socket in a
// fresh temporary directory and (by default) a free TCP port on 127.0.0.1.
//
//   auto epd = DaemonProcess::Start();   // waits until health says SERVING
//   ASSERT_TRUE(epd.ok()) << epd.status();
//   ... options.socket_path = (*epd)->socket_path(); ...
//   EXPECT_EQ(*(*epd)->Stop(), 0);       // SIGTERM, wait, exit code; (*epd)->Logs() = its log
//
// The destructor SIGKILLs a daemon still running and removes the directory. Binaries come
// from the EPD_BINARY, EPCTL_BINARY, EPD_TEST_CLIENT_BINARY definitions or environment.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.pb.h"
#include "tests/common/subprocess.h"

namespace epd::testing {

std::string EpdBinary();
std::string EpctlBinary();
std::string TestClientBinary();

struct DaemonProcessOptions {
  std::string backend = "host";  ///< --backend; "" = not passed.
  bool tcp = true;               ///< --listen=127.0.0.1:<free port>.
  /// Socket path; "" = <dir>/epd.sock. Set it to another daemon's to share a socket.
  std::string socket_path;
  /// Text-format DaemonConfig written to <dir>/epd.textproto and passed as --config.
  std::string config_text;
  std::vector<std::string> extra_args;  ///< More flags, e.g. "--op_timeout=2s".
  /// A command that runs epd by exec, e.g. {"/usr/bin/prlimit", "--nofile=256:512", "--"}
  /// (pid() is then epd's); empty = none.
  std::vector<std::string> wrapper;
  std::string log_level = "debug";
  /// Wait until health is SERVING (else return right after spawning).
  bool wait_serving = true;
  absl::Duration start_timeout = absl::Seconds(20);
};

class DaemonProcess {
 public:
  /// Spawns epd. With wait_serving, UNAVAILABLE (with epd's log) when it does not become
  /// SERVING within start_timeout or exits first.
  static absl::StatusOr<std::unique_ptr<DaemonProcess>> Start(DaemonProcessOptions options = {});
  ~DaemonProcess();

  pid_t pid() const { return process_->pid(); }
  /// Temporary directory holding the socket, the config and the logs.
  const std::string& dir() const { return dir_; }
  const std::string& socket_path() const { return socket_path_; }
  /// "unix:///<socket_path>".
  std::string unix_target() const { return "unix://" + socket_path_; }
  /// The TCP port (0 without tcp) and its target "127.0.0.1:<port>".
  int tcp_port() const { return tcp_port_; }
  std::string tcp_target() const;
  /// The argv epd was started with.
  const std::vector<std::string>& argv() const { return argv_; }

  /// One grpc.health.v1.Health/Check of `service` on `target` (unix_target() by default).
  /// The RPC's error when it fails (UNAVAILABLE when nothing answers).
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> CheckHealth(
      const std::string& service = "", const std::string& target = "",
      absl::Duration timeout = absl::Seconds(2)) const;
  /// Polls CheckHealth("") until SERVING. UNAVAILABLE with the logs when epd exits or the
  /// timeout passes.
  absl::Status WaitServing(absl::Duration timeout);

  /// SIGTERM, then waits up to `timeout` for the exit. Returns the exit code (-N = killed
  /// by signal N); DEADLINE_EXCEEDED when still running (then SIGKILLed).
  absl::StatusOr<int> Stop(absl::Duration timeout = absl::Seconds(5));
  /// Waits for an exit without signalling (e.g. a daemon expected to refuse to start).
  absl::StatusOr<int> WaitExit(absl::Duration timeout);
  /// SIGKILL (a crash).
  void Kill();
  bool Running() { return process_->Running(); }

  /// Everything epd wrote to stderr (its log) and stdout.
  std::string Logs() const;
  Subprocess& process() { return *process_; }

 private:
  DaemonProcess() = default;
  std::string dir_;
  std::string socket_path_;
  int tcp_port_ = 0;
  std::vector<std::string> argv_;
  std::unique_ptr<Subprocess> process_;
};

}  // namespace epd::testing
