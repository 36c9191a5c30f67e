// SecurityTest: the fixture of every security test (tests/security/*_test.cc). Each test
// starts a real epd (host backend), a victim group of real processes (epd_victim.cc: one
// per rank, each checking every OK result exactly against kernels/host), and a real
// attacker process (epd_attacker.cc), then checks docs/SECURITY.md's promises:
//   - epd keeps SERVING (grpc health on its socket; a crash is reported with its signal);
//   - the victims' every OK result is exact, and they keep getting OK results during the
//     attack and after it;
//   - the attacker gets clear errors (each test checks its own);
//   - epd's log stays bounded (lines written during the attack).
// On failure, TearDown prints the tails of epd's log and of every process's output.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/common/daemon_process.h"
#include "tests/common/subprocess.h"

namespace epd::testing::security {

std::string VictimBinary();
std::string AttackerBinary();

/// argv run as nobody:nogroup (65534) without supplementary groups (through setpriv).
std::vector<std::string> AsNobody(std::vector<std::string> argv);
/// "" when this process can run AsNobody (it is root and setpriv exists); else why not,
/// for GTEST_SKIP.
std::string WhyNotAsNobody();

/// What an attacker run printed: its exit code (-N: killed by signal N), its stdout, the
/// sum of every key=value of its SUMMARY lines (one per supervised child that finished),
/// and of the last PROGRESS line of each child (children that crashed included).
struct AttackResult {
  int exit_code = 0;
  std::string output;
  std::map<std::string, int64_t> summary;
  std::map<std::string, int64_t> progress;
  int64_t Get(const std::string& key) const { return Find(summary, key); }
  int64_t Progress(const std::string& key) const { return Find(progress, key); }

 private:
  static int64_t Find(const std::map<std::string, int64_t>& m, const std::string& key) {
    auto it = m.find(key);
    return it == m.end() ? 0 : it->second;
  }
};

/// Where epd's log stood: lines, and of them warnings and errors.
struct LogMark {
  int64_t lines = 0;
  int64_t warnings = 0;
};

/// Token `i` (0-based, split on spaces) of `line`; "" past the end.
std::string Token(const std::string& line, size_t i);

/// Lines of `text` that start with `prefix`.
std::vector<std::string> LinesStartingWith(const std::string& text, const std::string& prefix);

/// How SecurityTest::StartEpd runs epd.
struct EpdOptions {
  std::vector<std::string> extra_args;  ///< More flags.
  /// Runs epd (e.g. {"/usr/bin/prlimit", "--nofile=1024:1024", "--"}).
  std::vector<std::string> wrapper;
  std::string config_text;    ///< A DaemonConfig in text format ("" = none).
  bool world_socket = false;  ///< Socket 0666 in a 0755 directory: other users connect.
};

class SecurityTest : public ::testing::Test {
 protected:
  void TearDown() override;

  /// Starts epd --backend=host on a fresh socket: log level info, op_timeout 2 s, no TCP.
  void StartEpd(EpdOptions options = {});

  /// Starts rank `rank` of victim group `group` (seed and secret shared by its ranks) and
  /// waits for its JOINED line (fatal failure otherwise).
  void StartVictimRank(const std::string& group, int rank, const std::string& secret = "");
  /// Starts every rank of victim group `group`, then waits until each has run
  /// `rounds` OK rounds.
  void StartVictims(const std::string& group = "victim", const std::string& secret = "",
                    int rounds = 3);
  /// Waits until every victim has `count` OK rounds or more (fatal failure otherwise).
  void WaitVictimOkRounds(int64_t count, absl::Duration timeout);
  /// The fewest OK rounds any victim has run so far.
  int64_t VictimOkRounds() const;
  /// Expects every victim to have run at least `min_new` more OK rounds than `before`
  /// (their progress during an attack).
  void ExpectVictimProgress(int64_t before, int64_t min_new, const std::string& during);
  /// After the attack: each victim runs 3 more OK rounds (unless epd is gone), stops
  /// (stdin closed; SIGKILL after 15 s), exits 0; no result of any round was wrong; and
  /// neither epd nor a victim reported a sanitizer error (ASan/UBSan builds).
  void StopVictimsAndExpectExact();

  /// Expects no AddressSanitizer, LeakSanitizer or UndefinedBehaviorSanitizer report in
  /// `output` (what `who` wrote).
  void ExpectNoSanitizerReport(const std::string& who, const std::string& output);

  /// Spawns the attacker with `args` (the socket is added), as nobody when `as_nobody`.
  std::unique_ptr<Subprocess> SpawnAttacker(std::vector<std::string> args, bool as_nobody = false);
  /// Runs the attacker to its end (SIGKILL after `timeout`, then a failure).
  AttackResult RunAttacker(std::vector<std::string> args, absl::Duration timeout,
                           bool as_nobody = false);
  /// What a finished (or killed) attacker process printed.
  AttackResult ResultOf(Subprocess& attacker, int exit_code);

  /// Expects epd to be running and health SERVING on its socket; `when` names the moment.
  void ExpectEpdServing(const std::string& when);
  /// A new client of this process: connects (a new connection to epd's socket; 5 s), and
  /// with `join` joins a 1-rank group `group` and runs a GetDispatchLayout on it. The first
  /// error, naming the step.
  absl::Status ProbeFreshClient(const std::string& group, bool join = true);
  /// Expects a fresh client to connect, join and run an op (ProbeFreshClient).
  void ExpectNewClientServed(const std::string& when);
  /// What epd has logged so far.
  LogMark MarkLog() const;
  /// Expects at most `line_budget` lines, of which at most `warning_budget` warnings or
  /// errors, logged since `since`. Client-caused warnings are rate-limited per uid
  /// (docs/SECURITY.md), so the warning budget is small; joins and leaves log a few info
  /// lines each, which the line budget allows for.
  void ExpectLogBounded(const LogMark& since, int64_t line_budget, int64_t warning_budget,
                        const std::string& what);

  std::unique_ptr<DaemonProcess> epd_;
  std::vector<std::unique_ptr<Subprocess>> victims_;
  std::vector<std::unique_ptr<Subprocess>> attackers_;
  int attacker_runs_ = 0;
  int probes_ = 0;
};

}  // namespace epd::testing::security
