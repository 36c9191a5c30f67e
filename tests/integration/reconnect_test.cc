// Client::Reconnect across a daemon restart: two real client processes (epd_dp_reconnect,
// ranks 0 and 1 of one group) run checked rounds on a real epd (host backend); epd is
// stopped (SIGTERM) or killed (SIGKILL) and started again on the same socket; ops fail with
// UNAVAILABLE at once; both clients call Reconnect, their endpoints are re-bound, an op
// submitted before the restart fails with UNAVAILABLE, and the next rounds are exact.
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/daemon_process.h"
#include "tests/common/subprocess.h"

namespace epd::testing {
namespace {

using ::testing::HasSubstr;

std::string ReconnectClientBinary() { return std::string(EPD_TEST_BIN_DIR) + "/epd_dp_reconnect"; }

/// The last line of `out` that starts with `prefix` ("" when none).
std::string LastLine(const std::string& out, absl::string_view prefix) {
  std::string last;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (absl::StartsWith(line, prefix)) last = std::string(line);
  }
  return last;
}

enum class Fault { kSigterm, kSigkill };

class ReconnectTest : public ::testing::TestWithParam<Fault> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<DaemonProcess>> epd = DaemonProcess::Start(UnixSocketOnly());
    ASSERT_TRUE(epd.ok()) << epd.status();
    epd_ = std::move(*epd);
    for (int rank = 0; rank < 2; ++rank) {
      SubprocessOptions o;
      o.pipe_stdin = true;
      o.stdout_path = absl::StrCat(epd_->dir(), "/rank", rank, ".out");
      o.stderr_path = absl::StrCat(epd_->dir(), "/rank", rank, ".err");
      auto p = Subprocess::Spawn({ReconnectClientBinary(), "--socket=" + epd_->socket_path(),
                                  "--group=rc", absl::StrCat("--rank=", rank)},
                                 o);
      ASSERT_TRUE(p.ok()) << p.status();
      clients_.push_back(std::move(*p));
    }
    for (auto& c : clients_) {
      ASSERT_TRUE(c->WaitForOutput("JOINED", absl::Seconds(10)).ok()) << c->Stdout();
    }
  }

  /// Sends `command` to both clients and waits for `expect` from each.
  void Both(const std::string& command, const std::string& expect,
            absl::Duration timeout = absl::Seconds(30)) {
    for (auto& c : clients_) ASSERT_TRUE(c->WriteStdin(command + "\n").ok());
    for (auto& c : clients_) {
      ASSERT_TRUE(c->WaitForOutput(expect, timeout).ok())
          << command << ": " << c->Stdout() << c->Stderr() << "\n--- epd:\n"
          << epd_->Logs();
    }
  }

  std::unique_ptr<DaemonProcess> epd_;
  std::vector<std::unique_ptr<Subprocess>> clients_;
};

TEST_P(ReconnectTest, BothRanksRejoinAndTheNextOpsAreExact) {
  Both("round", "ROUND 1 OK");
  // Rank 0 submits an op its peer never joins: it is in flight when epd goes.
  ASSERT_TRUE(clients_[0]->WriteStdin("submit\n").ok());
  ASSERT_TRUE(clients_[0]->WaitForOutput("SUBMITTED", absl::Seconds(10)).ok())
      << clients_[0]->Stdout();
  const std::string before = LastLine(clients_[0]->Stdout(), "JOINED");

  if (GetParam() == Fault::kSigterm) {
    absl::StatusOr<int> code = epd_->Stop();
    ASSERT_TRUE(code.ok()) << code.status();
  } else {
    epd_->Kill();
    ASSERT_TRUE(epd_->WaitExit(absl::Seconds(10)).ok());
  }
  // Ops fail at once (not after op_timeout) while epd is down.
  const absl::Time probe_start = absl::Now();
  Both("probe", "PROBE UNAVAILABLE", absl::Seconds(5));
  EXPECT_LT(absl::Now() - probe_start, absl::Seconds(3));

  if (GetParam() == Fault::kSigkill) {
    // Reconnect waits for the daemon: asked before epd is back, it completes once it is.
    for (auto& c : clients_) ASSERT_TRUE(c->WriteStdin("reconnect\n").ok());
    absl::SleepFor(absl::Milliseconds(300));
    for (auto& c : clients_) EXPECT_THAT(c->Stdout(), ::testing::Not(HasSubstr("RECONNECT")));
    ASSERT_TRUE(epd_->Restart().ok()) << epd_->Logs();
    for (auto& c : clients_) {
      ASSERT_TRUE(c->WaitForOutput("RECONNECT OK", absl::Seconds(25)).ok())
          << c->Stdout() << "\n--- epd:\n"
          << epd_->Logs();
    }
  } else {
    ASSERT_TRUE(epd_->Restart().ok()) << epd_->Logs();
    Both("reconnect", "RECONNECT OK");
  }
  // A new Session, and a new endpoint behind the same Endpoint object.
  const std::string after = LastLine(clients_[0]->Stdout(), "RECONNECT OK");
  const std::vector<std::string> b = absl::StrSplit(before, ' ');
  const std::vector<std::string> a = absl::StrSplit(after, ' ');
  ASSERT_EQ(b.size(), 3u) << before;
  ASSERT_EQ(a.size(), 4u) << after;
  EXPECT_NE(a[2], b[1]) << "the session id did not change";

  // The op submitted to the old daemon is lost, and says so.
  ASSERT_TRUE(clients_[0]->WriteStdin("wait_pending\n").ok());
  ASSERT_TRUE(clients_[0]->WaitForOutput("PENDING ", absl::Seconds(10)).ok());
  EXPECT_THAT(LastLine(clients_[0]->Stdout(), "PENDING"),
              HasSubstr("PENDING UNAVAILABLE: Wait: op"));
  EXPECT_THAT(LastLine(clients_[0]->Stdout(), "PENDING"), HasSubstr("Reconnect"));

  Both("round", "ROUND 2 OK");
  Both("round", "ROUND 3 OK");
  // A second Reconnect with the Session open changes nothing.
  Both("reconnect", "RECONNECT");
  Both("round", "ROUND 4 OK");
  for (auto& c : clients_) {
    std::vector<std::string> reconnects;
    for (absl::string_view line : absl::StrSplit(c->Stdout(), '\n')) {
      if (absl::StartsWith(line, "RECONNECT")) reconnects.emplace_back(line);
    }
    ASSERT_EQ(reconnects.size(), 2u) << c->Stdout();
    EXPECT_EQ(reconnects[0], reconnects[1]) << "the second Reconnect changed the binding";
  }

  for (auto& c : clients_) {
    c->CloseStdin();
    absl::StatusOr<int> code = c->Wait(absl::Seconds(10));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0) << c->Stdout() << c->Stderr();
  }
  absl::StatusOr<int> code = epd_->Stop();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << epd_->Logs();
}

INSTANTIATE_TEST_SUITE_P(Faults, ReconnectTest, ::testing::Values(Fault::kSigterm, Fault::kSigkill),
                         [](const ::testing::TestParamInfo<Fault>& info) {
                           return info.param == Fault::kSigterm ? std::string("Sigterm")
                                                                : std::string("Sigkill");
                         });

}  // namespace
}  // namespace epd::testing
