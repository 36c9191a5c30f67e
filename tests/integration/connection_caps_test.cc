// Connection caps of the real epd (host backend, socket 0666; needs root to connect as
// another user, else skipped): a process of uid nobody that opens many connections each
// sending only what a gRPC client sends first (the HTTP/2 preface and SETTINGS) holds at
// most max_connections_per_uid of them; the rest are closed at once. Meanwhile root (exempt)
// still runs epctl status and health, and nobody itself gets in again once its
// connections close (epd notices gRPC closing them).
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/as_other_user.h"

namespace epd::testing {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kNobody = 65534;
constexpr int kCap = 16;
constexpr int kOpened = 40;

/// What the flooding child reports through its pipe.
struct FloodReport {
  int32_t connected = 0;        ///< connect + send succeeded.
  int32_t closed_by_epd = 0;    ///< Read EOF (or a reset) within about a second.
  int32_t failed_syscalls = 0;  ///< setres[ug]id, socket, connect or send failed.
};

/// In a forked child (system calls only: the parent has threads): becomes uid/gid nobody,
/// opens kOpened connections to `addr` sending the HTTP/2 preface and an empty SETTINGS
/// frame on each, waits about a second, counts those epd closed, writes a FloodReport to
/// `report_fd` and holds every connection until `hold_fd` reaches EOF.
[[noreturn]] void FloodAsNobody(const sockaddr_un& addr, int report_fd, int hold_fd) {
  static const char kHello[] =
      "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
      "\0\0\0\x04\0\0\0\0";  // + the terminating NUL: the SETTINGS frame's last byte.
  FloodReport report;
  if (::setresgid(kNobody, kNobody, kNobody) != 0 || ::setresuid(kNobody, kNobody, kNobody) != 0) {
    report.failed_syscalls = -1;
    (void)!::write(report_fd, &report, sizeof(report));
    _exit(2);
  }
  int fds[kOpened];
  for (int i = 0; i < kOpened; ++i) {
    fds[i] = ::socket(AF_UNIX, SOCK_STREAM, 0);
    if (fds[i] < 0 ||
        ::connect(fds[i], reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::send(fds[i], kHello, sizeof(kHello), MSG_NOSIGNAL) !=
            static_cast<ssize_t>(sizeof(kHello))) {
      ++report.failed_syscalls;
      continue;
    }
    ++report.connected;
  }
  const struct timespec settle = {1, 0};
  ::nanosleep(&settle, nullptr);
  for (int i = 0; i < kOpened; ++i) {
    if (fds[i] < 0) continue;
    char buffer[4096];
    while (true) {  // gRPC's own SETTINGS may be waiting first: drain, then look for EOF.
      const ssize_t n = ::recv(fds[i], buffer, sizeof(buffer), MSG_DONTWAIT);
      if (n > 0) continue;
      if (n == 0 || (n < 0 && errno == ECONNRESET)) ++report.closed_by_epd;
      break;
    }
  }
  (void)!::write(report_fd, &report, sizeof(report));
  char c;
  (void)!::read(hold_fd, &c, 1);
  _exit(0);
}

class ConnectionCapsTest : public AsOtherUserTest {
 protected:
  /// `epctl <command>` run as `uid` (root when 0) with a short timeout.
  CommandResult Epctl(uint32_t uid, const std::string& command) {
    std::vector<std::string> argv = {EpctlBinary(), "--socket=" + epd_->socket_path(),
                                     "--timeout=2s", command};
    absl::StatusOr<CommandResult> r =
        RunCommand(uid == 0 ? argv : AsUser(uid, argv), absl::Seconds(20));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.value_or(CommandResult{-1, "", ""});
  }
};

TEST_F(ConnectionCapsTest, OneUidHoldsAtMostItsCapWhileRootStillGetsIn) {
  ASSERT_NO_FATAL_FAILURE(
      StartEpd({"--socket_mode=0666", absl::StrCat("--max_connections_per_uid=", kCap)}));
  ASSERT_EQ(::chmod(epd_->dir().c_str(), 0755), 0);
  ASSERT_EQ(Epctl(kNobody, "status").exit_code, 0) << "nobody cannot reach epd at all";

  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, epd_->socket_path().c_str(), sizeof(addr.sun_path) - 1);
  int report_pipe[2], hold_pipe[2];
  ASSERT_EQ(::pipe(report_pipe), 0);
  ASSERT_EQ(::pipe(hold_pipe), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(report_pipe[0]);
    ::close(hold_pipe[1]);
    FloodAsNobody(addr, report_pipe[1], hold_pipe[0]);
  }
  ::close(report_pipe[1]);
  ::close(hold_pipe[0]);
  FloodReport report;
  ASSERT_EQ(::read(report_pipe[0], &report, sizeof(report)), static_cast<ssize_t>(sizeof(report)));
  ::close(report_pipe[0]);
  EXPECT_EQ(report.failed_syscalls, 0);
  EXPECT_EQ(report.connected, kOpened);
  EXPECT_EQ(report.closed_by_epd, kOpened - kCap) << "epd held more than the cap";

  // While nobody holds its cap: root (exempt) runs epctl; nobody gets no further connection.
  CommandResult root_status = Epctl(0, "status");
  EXPECT_EQ(root_status.exit_code, 0) << root_status.stdout_text << root_status.stderr_text;
  CommandResult root_health = Epctl(0, "health");
  EXPECT_EQ(root_health.exit_code, 0) << root_health.stdout_text << root_health.stderr_text;
  EXPECT_NE(Epctl(kNobody, "status").exit_code, 0) << "nobody got past its cap";

  // Nobody's connections close; epd sees gRPC close them and nobody gets in again.
  ::close(hold_pipe[1]);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  EXPECT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) << wstatus;
  int exit_code = -1;
  for (int attempt = 0; attempt < 10 && exit_code != 0; ++attempt) {
    exit_code = Epctl(kNobody, "status").exit_code;
  }
  EXPECT_EQ(exit_code, 0) << "nobody stayed locked out after its connections closed";
  EXPECT_THAT(epd_->Logs(), HasSubstr("max_connections_per_uid = 16"));
}

}  // namespace
}  // namespace epd::testing
