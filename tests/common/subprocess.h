// Subprocess: a child process for integration tests (the real epd, real clients, epctl).
// Its stdout and stderr go to files in a directory of the test's choosing, so a test can
// wait for a line, read everything afterwards, and print it when an expectation fails.
// The destructor kills (SIGKILL) and reaps a child that is still running.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace epd::testing {

/// A fresh directory under $TMPDIR (or /tmp): "<tmp>/<prefix>XXXXXX". Aborts the test
/// process when it cannot be created.
std::string MakeTempDir(const std::string& prefix);

/// A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then closed).
int PickFreeTcpPort();

struct SubprocessOptions {
  /// Files receiving the child's stdout and stderr ("" = /dev/null).
  std::string stdout_path;
  std::string stderr_path;
  /// Give the child a pipe as stdin (CloseStdin() ends it); otherwise /dev/null.
  bool pipe_stdin = false;
};

class Subprocess {
 public:
  /// Starts argv[0] (a path) with argv. The child starts with no blocked signals.
  static absl::StatusOr<std::unique_ptr<Subprocess>> Spawn(const std::vector<std::string>& argv,
                                                           SubprocessOptions options = {});
  ~Subprocess();
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  pid_t pid() const { return pid_; }
  /// Sends `signal` (no-op once the child was reaped).
  void Signal(int signal);
  /// Writes `text` to the child's stdin (pipe_stdin only).
  absl::Status WriteStdin(absl::string_view text);
  /// Closes the child's stdin (pipe_stdin only): it reads EOF.
  void CloseStdin();

  /// Waits for the child to exit. Returns its exit code, or -N when killed by signal N.
  /// DEADLINE_EXCEEDED (child still running) after `timeout`.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  /// True until the child has exited (reaps it when it has).
  bool Running();

  /// Everything the child wrote to stdout / stderr so far.
  std::string Stdout() const;
  std::string Stderr() const;
  /// Waits until stdout (or stderr when `in_stderr`) contains `text`. DEADLINE_EXCEEDED
  /// after `timeout`, FAILED_PRECONDITION when the child exits first (both with the
  /// output so far in the message).
  absl::Status WaitForOutput(absl::string_view text, absl::Duration timeout,
                             bool in_stderr = false);

 private:
  Subprocess() = default;
  pid_t pid_ = -1;
  bool reaped_ = false;
  int exit_code_ = 0;
  int stdin_fd_ = -1;
  SubprocessOptions options_;
};

/// What RunCommand returns.
struct CommandResult {
  int exit_code = 0;  ///< Or -N when killed by signal N.
  std::string stdout_text;
  std::string stderr_text;
};

/// argv to be run as user `uid` with group `uid` and no supplementary groups, through
/// setpriv (util-linux; the caller must be root and should skip without /usr/bin/setpriv).
std::vector<std::string> AsUser(uint32_t uid, const std::vector<std::string>& argv);

/// Runs argv to completion (SIGKILL after `timeout`, then DEADLINE_EXCEEDED).
absl::StatusOr<CommandResult> RunCommand(const std::vector<std::string>& argv,
                                         absl::Duration timeout = absl::Seconds(30));

}  // namespace epd::testing
