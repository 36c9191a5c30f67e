// A fatal signal leaves a trace in epd's log (daemon/core/fatal_signals.h): the real epd, sent
// SIGSEGV, SIGBUS, SIGABRT, SIGFPE or SIGILL, logs the signal's name and a symbolized stack
// trace on stderr, then dies of that very signal (so systemd and the kubelet see a crash).
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/daemon_process.h"

namespace epd::testing {
namespace {

using ::testing::HasSubstr;

struct FatalSignal {
  int number;
  const char* name;
};

void PrintTo(const FatalSignal& signal, std::ostream* os) { *os << signal.name; }

class FatalSignalTest : public ::testing::TestWithParam<FatalSignal> {};

TEST_P(FatalSignalTest, LogsTheSignalAndAStackTraceThenDiesOfIt) {
  const FatalSignal signal = GetParam();
  DaemonProcessOptions options;
  options.tcp = false;
  options.log_level = "info";
  absl::StatusOr<std::unique_ptr<DaemonProcess>> epd = DaemonProcess::Start(options);
  ASSERT_TRUE(epd.ok()) << epd.status();
  // To the main thread (its tid is the pid), so the trace's frames are known: it waits in
  // main() for a stop signal. A process-directed kill -SEGV is logged the same way, from
  // whichever thread takes it.
  ASSERT_EQ(::syscall(SYS_tgkill, (*epd)->pid(), (*epd)->pid(), signal.number), 0);
  absl::StatusOr<int> code = (*epd)->WaitExit(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << (*epd)->Logs();
  const std::string logs = (*epd)->Logs();
  EXPECT_EQ(*code, -signal.number) << logs;
  EXPECT_THAT(logs, HasSubstr(absl::StrCat("*** ", signal.name, " received at time=")));
  // The unwound trace: innermost first, down through main() to the program's entry.
  std::vector<std::string> frames;
  bool in_trace = false;
  for (absl::string_view line : absl::StrSplit(logs, '\n')) {
    if (absl::StartsWith(line, "*** stack trace")) in_trace = true;
    if (in_trace && absl::StartsWith(line, "    @ 0x")) frames.emplace_back(line);
  }
  ASSERT_GE(frames.size(), 3u) << logs;
  bool main_seen = false;
  for (const std::string& frame : frames) {
    if (absl::EndsWith(frame, "  main")) main_seen = true;
  }
  EXPECT_TRUE(main_seen) << "no frame of main() in the trace:\n" << logs;
}

// `kill -SEGV <pid>`: whichever thread takes it, the log has the signal and a trace.
TEST(FatalSignalProcessTest, KillSegvIsLoggedWithATraceToo) {
  DaemonProcessOptions options;
  options.tcp = false;
  options.log_level = "info";
  absl::StatusOr<std::unique_ptr<DaemonProcess>> epd = DaemonProcess::Start(options);
  ASSERT_TRUE(epd.ok()) << epd.status();
  (*epd)->process().Signal(SIGSEGV);
  absl::StatusOr<int> code = (*epd)->WaitExit(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << (*epd)->Logs();
  const std::string logs = (*epd)->Logs();
  EXPECT_EQ(*code, -SIGSEGV) << logs;
  EXPECT_THAT(logs, HasSubstr("*** SIGSEGV received at time="));
  const size_t trace = logs.find("*** stack trace");
  ASSERT_NE(trace, std::string::npos) << logs;
  EXPECT_GE(std::count(logs.begin() + trace, logs.end(), '@'), 2) << logs;
}

INSTANTIATE_TEST_SUITE_P(
    Signals, FatalSignalTest,
    ::testing::Values(FatalSignal{SIGSEGV, "SIGSEGV"}, FatalSignal{SIGBUS, "SIGBUS"},
                      FatalSignal{SIGABRT, "SIGABRT"}, FatalSignal{SIGFPE, "SIGFPE"},
                      FatalSignal{SIGILL, "SIGILL"}),
    [](const ::testing::TestParamInfo<FatalSignal>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace epd::testing
