// CheckUnixSocket / ClassifyUnixSocketProbe (client/control_channel.h): a socket the user
// may not reach or connect to is PERMISSION_DENIED at once, naming the path and the fix
// (it was "does not exist" for a socket in a 0700 directory, and a 5 s wait then "is epd
// running?" for a 0660 socket of another group). The classification is tested from errno
// values (so the permission cases run as root too, where the kernel never refuses); the
// real syscalls are tested as a user the kernel does refuse: as root, a child process
// that drops to nobody (65534); otherwise this user with the permission bits taken away.
#include "client/control_channel.h"

#include <grp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/errors/grpc_status.h"
#include "common/errors/reason.h"
#include "common/os/shm_region.h"
#include "epd/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace epd::internal {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr char kPath[] = "/run/epd/epd.sock";

UnixSocketProbe SocketProbe(int connect_errno) {
  UnixSocketProbe probe;
  probe.mode = S_IFSOCK | 0660;
  probe.gid = 990;
  probe.group_name = "epd";
  probe.connect_errno = connect_errno;
  probe.uid = 1000;
  probe.user_name = "alice";
  return probe;
}

TEST(ClassifyUnixSocketProbe, MissingSocketIsUnavailable) {
  for (int err : {ENOENT, ENOTDIR}) {
    UnixSocketProbe probe;
    probe.stat_errno = err;
    absl::Status status = ClassifyUnixSocketProbe(kPath, "--socket", probe);
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
    EXPECT_THAT(std::string(status.message()),
                AllOf(HasSubstr(kPath), HasSubstr("does not exist"), HasSubstr("--socket")));
  }
}

// gRPC's own UNAVAILABLE (nothing answers) gets "no epd daemon answers"; an UNAVAILABLE
// the daemon answered with (its reason) is its error, unchanged: a reload whose new
// metrics_listen cannot be bound read as "no epd daemon answers".
TEST(AnnotateUnavailable, OnlyGrpcsOwnUnavailableReadsAsNoDaemon) {
  const absl::Status grpc_own = FromGrpcStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "x"));
  absl::Status annotated = AnnotateUnavailable(grpc_own, "unix:///s");
  EXPECT_THAT(std::string(annotated.message()), HasSubstr("no epd daemon answers on unix:///s"));
  EXPECT_EQ(errors::ReasonOf(annotated), errors::Reason::kDaemonUnavailable);

  for (const absl::Status& daemons :
       {errors::WithReason(absl::UnavailableError("metrics_listen: cannot listen on h:1"),
                           errors::Reason::kConfigInvalid),
        errors::WithReason(absl::UnavailableError("epd is shutting down"),
                           errors::Reason::kDaemonDraining),
        // A daemon error without a specific reason travels with the generic one.
        FromGrpcStatus(errors::ToGrpcStatus(absl::UnavailableError("busy")))}) {
    annotated = ExplainControlError(daemons, "unix:///s");
    EXPECT_EQ(annotated, daemons);
    EXPECT_THAT(std::string(annotated.message()), ::testing::Not(HasSubstr("no epd daemon")));
  }
}

TEST(ClassifyUnixSocketProbe, UnsearchableDirectoryIsPermissionDeniedNotMissing) {
  for (int err : {EACCES, EPERM}) {
    UnixSocketProbe probe;
    probe.stat_errno = err;
    probe.uid = 1000;
    probe.user_name = "alice";
    absl::Status status = ClassifyUnixSocketProbe(kPath, "--socket", probe);
    EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << status;
    EXPECT_THAT(std::string(status.message()),
                AllOf(HasSubstr(kPath), HasSubstr("not searchable"), HasSubstr("alice (uid 1000)"),
                      HasSubstr("socket_group"), ::testing::Not(HasSubstr("does not exist"))));
  }
}

TEST(ClassifyUnixSocketProbe, ConnectDeniedIsPermissionDeniedNamingGroupAndMode) {
  for (int err : {EACCES, EPERM}) {
    absl::Status status = ClassifyUnixSocketProbe(kPath, "--socket", SocketProbe(err));
    EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << status;
    EXPECT_THAT(std::string(status.message()),
                AllOf(HasSubstr(kPath), HasSubstr("mode 0660"), HasSubstr("group epd (gid 990)"),
                      HasSubstr("alice (uid 1000)"), HasSubstr("add this user to group epd"),
                      HasSubstr("socket_mode"), HasSubstr("socket_group"),
                      ::testing::Not(HasSubstr("is epd running"))));
  }
  // A gid without a name is given as the number.
  UnixSocketProbe probe = SocketProbe(EACCES);
  probe.group_name.clear();
  EXPECT_THAT(std::string(ClassifyUnixSocketProbe(kPath, "--socket", probe).message()),
              AllOf(HasSubstr("group gid 990"), HasSubstr("add this user to group 990")));
}

// A socket of group root (epd without a socket_group, run as root): joining group root
// would give the user far more than the socket, so the fix offered is a dedicated group.
TEST(ClassifyUnixSocketProbe, ConnectDeniedOnAGroupRootSocketNeverAdvisesJoiningRoot) {
  for (const char* name : {"root", ""}) {
    UnixSocketProbe probe = SocketProbe(EACCES);
    probe.gid = 0;
    probe.group_name = name;
    const absl::Status status = ClassifyUnixSocketProbe(kPath, "--socket", probe);
    EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << status;
    EXPECT_THAT(std::string(status.message()),
                AllOf(HasSubstr(kPath), HasSubstr("mode 0660"), HasSubstr("alice (uid 1000)"),
                      HasSubstr("a group of its own"), HasSubstr("groupadd epd"),
                      HasSubstr("socket_group"), HasSubstr("socket_mode to \"0660\""),
                      ::testing::Not(HasSubstr("add this user to group root")),
                      ::testing::Not(HasSubstr("add this user to group 0"))))
        << status;
  }
}

TEST(ClassifyUnixSocketProbe, OtherOutcomesKeepTheirMeaning) {
  absl::Status refused = ClassifyUnixSocketProbe(kPath, "--socket", SocketProbe(ECONNREFUSED));
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(refused.message()), HasSubstr("nothing listens"));
  EXPECT_TRUE(ClassifyUnixSocketProbe(kPath, "--socket", SocketProbe(0)).ok());
  EXPECT_TRUE(ClassifyUnixSocketProbe(kPath, "--socket", SocketProbe(EAGAIN)).ok());
  UnixSocketProbe file = SocketProbe(0);
  file.mode = S_IFREG | 0644;
  EXPECT_EQ(ClassifyUnixSocketProbe(kPath, "--socket", file).code(),
            absl::StatusCode::kFailedPrecondition);
}

/// A temporary directory with a listening unix socket "s" in it; removed at the end.
class SocketDir {
 public:
  SocketDir() {
    char dir[] = "/tmp/epd_control_channel_test_XXXXXX";
    EXPECT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
    ::chmod(dir_.c_str(), 0755);
    path_ = dir_ + "/s";
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strcpy(addr.sun_path, path_.c_str());
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(::listen(fd_, 8), 0);
  }
  ~SocketDir() {
    ::close(fd_);
    ::chmod(dir_.c_str(), 0700);
    std::filesystem::remove_all(dir_);
  }
  const std::string& dir() const { return dir_; }
  const std::string& path() const { return path_; }
  std::string target() const { return "unix://" + path_; }

 private:
  std::string dir_;
  std::string path_;
  int fd_ = -1;
};

/// Runs `check` as a user the kernel refuses: as root, in a child process running as
/// nobody (65534:65534, no supplementary groups); else in this process.
absl::Status RunUnprivileged(const std::function<absl::Status()>& check) {
  if (::geteuid() != 0) return check();
  int fds[2];
  if (::pipe(fds) != 0) return absl::InternalError("pipe");
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    if (::setgroups(0, nullptr) != 0 || ::setgid(65534) != 0 || ::setuid(65534) != 0) _exit(99);
    absl::Status status = check();
    std::string out = absl::StrCat(static_cast<int>(status.code()), " ", status.message());
    (void)!::write(fds[1], out.data(), out.size());
    _exit(0);
  }
  ::close(fds[1]);
  std::string out;
  char buffer[4096];
  ssize_t n;
  while ((n = ::read(fds[0], buffer, sizeof(buffer))) > 0) out.append(buffer, n);
  ::close(fds[0]);
  int wstatus = 0;
  ::waitpid(pid, &wstatus, 0);
  if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0) {
    return absl::InternalError(absl::StrCat("child could not become nobody: ", wstatus));
  }
  size_t space = out.find(' ');
  return absl::Status(static_cast<absl::StatusCode>(std::atoi(out.substr(0, space).c_str())),
                      space == std::string::npos ? "" : out.substr(space + 1));
}

absl::Status CheckAsUnprivileged(const std::string& target) {
  return RunUnprivileged([&] { return CheckUnixSocket(target, "--socket"); });
}

TEST(CheckUnixSocket, SocketWithoutWritePermissionIsPermissionDenied) {
  SocketDir dir;
  // Root's group (or this user's own group when not root): not one nobody is in.
  ASSERT_EQ(::chmod(dir.path().c_str(), ::geteuid() == 0 ? 0660 : 0000), 0);
  absl::Status status = CheckAsUnprivileged(dir.target());
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << status;
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr(dir.path()), HasSubstr("permission denied connecting"),
                    HasSubstr("socket_mode")));
}

TEST(CheckUnixSocket, SocketInAClosedDirectoryIsPermissionDeniedNotMissing) {
  SocketDir dir;
  ASSERT_EQ(::chmod(dir.path().c_str(), 0666), 0);
  ASSERT_EQ(::chmod(dir.dir().c_str(), ::geteuid() == 0 ? 0700 : 0000), 0);
  absl::Status status = CheckAsUnprivileged(dir.target());
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << status;
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr(dir.path()), HasSubstr("not searchable")));
}

TEST(CheckUnixSocket, ReachableMissingAndRefusedSocketsAsBefore) {
  SocketDir dir;
  EXPECT_TRUE(CheckUnixSocket(dir.target(), "--socket").ok());
  absl::Status missing = CheckUnixSocket(dir.target() + ".missing", "--socket");
  EXPECT_EQ(missing.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(missing.message()), HasSubstr("does not exist"));
  EXPECT_TRUE(CheckUnixSocket("127.0.0.1:1", "--socket").ok());  // Not a unix target.
}

}  // namespace
// A relative socket path (or "unix:relative") becomes an absolute unix:// target, so the
// socket checks see it: a client on a missing relative socket learns at once, naming the
// file, instead of after its connect timeout; other targets are unchanged.
TEST(ChannelTarget, RelativeSocketPathsBecomeAbsoluteAndMissingOnesAreReportedAtOnce) {
  const std::string cwd = std::filesystem::current_path().string();
  EXPECT_EQ(ChannelTarget("run/epd.sock"), absl::StrCat("unix://", cwd, "/run/epd.sock"));
  EXPECT_EQ(ChannelTarget("unix:epd.sock"), absl::StrCat("unix://", cwd, "/epd.sock"));
  EXPECT_EQ(ChannelTarget("/run/epd/epd.sock"), "unix:///run/epd/epd.sock");
  EXPECT_EQ(ChannelTarget("unix:///run/epd/epd.sock"), "unix:///run/epd/epd.sock");
  EXPECT_EQ(ChannelTarget("127.0.0.1:50051"), "127.0.0.1:50051");
  EXPECT_EQ(ChannelTarget("unix-abstract:epd"), "unix-abstract:epd");

  ClientOptions options;
  options.socket_path = "no-such-dir-of-this-test/epd.sock";
  options.connect_timeout = absl::Seconds(20);
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  ASSERT_FALSE(client.ok());
  EXPECT_THAT(std::string(client.status().message()),
              ::testing::HasSubstr(absl::StrCat(cwd, "/no-such-dir-of-this-test/epd.sock")));
}

}  // namespace epd::internal
