// DaemonProcess: the real `epd` binary started for an integration test, on a socket in a
// fresh temporary directory and (by default) a free TCP port on 127.0.0.1.
//
//   auto epd = DaemonProcess::Start();   // waits until health says SERVING
//   ASSERT_TRUE(epd.ok()) << epd.status();
//   ... options.socket_path = (*epd)->socket_path(); ...
//   EXPECT_EQ(*(*epd)->Stop(), 0);       // SIGTERM, wait, exit code; (*epd)->Logs() = its log
//
// With options.peer it also serves the Peer service on 127.0.0.1 (groups across daemons);
// StartNodes starts several such daemons, the nodes of a cluster on one machine.
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
  /// The Peer listener (groups across daemons): --peer_listen=127.0.0.1:<peer_port>,
  /// --peer_secret_file=<dir>/peer.secret (peer_secret, written 0600) and
  /// --peer_heartbeat_ms.
  bool peer = false;
  int peer_port = 0;  ///< 0 = a free port.
  /// Every daemon of a test's cluster presents the same one (at least 16 bytes).
  std::string peer_secret = "epd-test-cluster-secret-0123456789";
  int peer_heartbeat_ms = 100;
  /// Wait until health is SERVING (else return right after spawning).
  bool wait_serving = true;
  absl::Duration start_timeout = absl::Seconds(20);
};

/// The options of a test that talks to epd over its unix socket only: no TCP listener, log
/// level info, --op_timeout=`op_timeout` (e.g. "10s").
DaemonProcessOptions UnixSocketOnly(const std::string& op_timeout = "10s");

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
  /// With a Peer listener: its port, and "127.0.0.1:<port>", the address a spec's
  /// NodeSpec.peer_address names this daemon by (0 / "" without one).
  int peer_port() const { return peer_port_; }
  std::string peer_address() const;
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
  /// Starts epd again with the same argv (socket, ports, config, secret) after it exited or
  /// was killed (SIGKILLs it first when it still runs), and waits until SERVING. The new
  /// log replaces the old one in Logs(); the old one stays in <dir>/epd.log.<n>.
  absl::Status Restart(absl::Duration timeout = absl::Seconds(20));
  bool Running() { return process_->Running(); }

  /// Everything epd wrote to stderr (its log) and stdout.
  std::string Logs() const;
  Subprocess& process() { return *process_; }

 private:
  DaemonProcess() = default;
  /// Spawns argv_ (through wrapper_), logging to <dir>/epd.log.
  absl::Status Spawn();
  std::string dir_;
  std::string socket_path_;
  int tcp_port_ = 0;
  int peer_port_ = 0;
  int restarts_ = 0;
  std::vector<std::string> wrapper_;
  std::vector<std::string> argv_;
  std::unique_ptr<Subprocess> process_;
};

/// `num_nodes` daemons on this machine standing in for the nodes of a cluster, each with its
/// own socket, directory and Peer port (options.peer is forced on; every daemon gets the same
/// peer_secret; options.peer_port and socket_path are ignored). They start together, then
/// each is waited for. UNAVAILABLE (with the log) when one does not become SERVING.
absl::StatusOr<std::vector<std::unique_ptr<DaemonProcess>>> StartNodes(
    int num_nodes, DaemonProcessOptions options = {});

}  // namespace epd::testing
