// Start-up safety of the real epd binary against another epd and against a hostile socket
// directory (daemon/core/daemon.cc PrepareSocketPath):
// - a second epd on a live epd's socket path, holding another lock file (as the same
//   socket path in another mount namespace does), never disturbs the live epd, whether it
//   then fails or starts;
// - `<socket>.lock` is never followed through a symlink, and nothing but a regular file
//   epd opened itself is truncated;
// - a socket path that is not a socket, a lock file epd did not write, and a socket
//   directory another user can write are refused before anything is created
//   (daemon/server/socket_path_checks.h).
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/daemon_process.h"

namespace epd::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

/// Runs epd_test_client joining rank 0 of group "g" on `socket_path`; true when it joined.
/// Its output is appended to `*output`.
bool ClientJoins(const std::string& socket_path, const std::string& dir, std::string* output) {
  SubprocessOptions options;
  options.stdout_path = dir + "/client.out";
  options.stderr_path = dir + "/client.err";
  options.pipe_stdin = true;
  absl::StatusOr<std::unique_ptr<Subprocess>> client =
      Subprocess::Spawn({TestClientBinary(), "--socket=" + socket_path, "--rank=0"}, options);
  if (!client.ok()) {
    *output = client.status().ToString();
    return false;
  }
  const absl::Status joined = (*client)->WaitForOutput("JOINED", absl::Seconds(10));
  *output = absl::StrCat((*client)->Stdout(), (*client)->Stderr());
  return joined.ok();
}

/// Starts a second epd on `socket_path` after removing the first one's lock file (what a
/// second epd in another mount namespace sees: the same path, another lock file).
absl::StatusOr<std::unique_ptr<DaemonProcess>> StartWithoutTheFirstsLock(
    const std::string& socket_path, bool wait_serving) {
  if (::unlink((socket_path + ".lock").c_str()) != 0) {
    return absl::InternalError(absl::StrCat("unlink ", socket_path, ".lock: ", errno));
  }
  DaemonProcessOptions options;
  options.socket_path = socket_path;
  options.wait_serving = wait_serving;
  return DaemonProcess::Start(options);
}

// A second epd on a live epd's socket path with another lock file (as the same path in
// another mount namespace has) is refused, and the live epd keeps serving joins: its
// endpoint memory has no name another process could delete (it used to: the second epd
// took the live one's doorbell page in /dev/shm for a leftover and removed it).
TEST(StartupSafetyTest, RefusedSecondEpdWithAnotherLockFileLeavesTheLiveEpdServing) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> first = DaemonProcess::Start();
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string socket = (*first)->socket_path();

  absl::StatusOr<std::unique_ptr<DaemonProcess>> second =
      StartWithoutTheFirstsLock(socket, /*wait_serving=*/false);
  ASSERT_TRUE(second.ok()) << second.status();
  absl::StatusOr<int> code = (*second)->WaitExit(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << (*second)->Logs();
  EXPECT_NE(*code, 0);
  EXPECT_THAT((*second)->Logs(), HasSubstr("refusing to start a second epd"));

  std::string client_output;
  EXPECT_TRUE(ClientJoins(socket, (*first)->dir(), &client_output))
      << client_output << "\n---- first epd ----\n"
      << (*first)->Logs();
  EXPECT_EQ((*first)->Stop().value_or(-1), 0);
}

// The same when the second epd does start (the first one's socket file was moved away, as
// in another mount namespace it is not there at all): the first epd keeps serving joins.
TEST(StartupSafetyTest, StartedSecondEpdLeavesTheFirstServing) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> first = DaemonProcess::Start();
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string socket = (*first)->socket_path();
  const std::string moved_socket = (*first)->dir() + "/moved.sock";
  ASSERT_EQ(::rename(socket.c_str(), moved_socket.c_str()), 0);

  absl::StatusOr<std::unique_ptr<DaemonProcess>> second =
      StartWithoutTheFirstsLock(socket, /*wait_serving=*/true);
  ASSERT_TRUE(second.ok()) << second.status();
  std::string client_output;
  EXPECT_TRUE(ClientJoins(moved_socket, (*first)->dir(), &client_output))
      << client_output << "\n---- first epd ----\n"
      << (*first)->Logs();
  EXPECT_TRUE(ClientJoins(socket, (*second)->dir(), &client_output))
      << client_output << "\n---- second epd ----\n"
      << (*second)->Logs();
  EXPECT_EQ((*second)->Stop().value_or(-1), 0);
  EXPECT_EQ((*first)->Stop().value_or(-1), 0);
}

/// Starts epd on `socket_path` expecting it to refuse; returns its exit code and log.
std::pair<int, std::string> RefusedStartOn(const std::string& socket_path) {
  DaemonProcessOptions options;
  options.socket_path = socket_path;
  options.tcp = false;
  options.wait_serving = false;
  absl::StatusOr<std::unique_ptr<DaemonProcess>> epd = DaemonProcess::Start(options);
  EXPECT_TRUE(epd.ok()) << epd.status();
  if (!epd.ok()) return {-1000, ""};
  absl::StatusOr<int> code = (*epd)->WaitExit(absl::Seconds(20));
  EXPECT_TRUE(code.ok()) << code.status() << "\n" << (*epd)->Logs();
  return {code.ok() ? *code : -1000, (*epd)->Logs()};
}

/// Starts epd on `<dir>/epd.sock` expecting it to refuse; returns its exit code and log.
std::pair<int, std::string> RefusedStart(const std::string& dir) {
  return RefusedStartOn(dir + "/epd.sock");
}

/// A hostile `<socket>.lock`: `make(dir)` puts it at `<dir>/epd.sock.lock` (returns 0, or
/// -1 with errno), where `<dir>/precious.txt` holds "precious content\n".
struct HostileLockFile {
  const char* what;
  std::function<int(const std::string& dir)> make;
  const char* refusal;  ///< In epd's message, besides the lock path.
};

/// epd on `<dir>/epd.sock` must refuse (exit 1, FAILED_PRECONDITION naming the lock path),
/// leave precious.txt as it was, create nothing through a link, and not start serving.
void ExpectRefusedTouchingNothing(const HostileLockFile& lock_file) {
  SCOPED_TRACE(lock_file.what);
  const std::string dir = MakeTempDir("epd_lock_");
  const std::string lock = dir + "/epd.sock.lock";
  std::ofstream(dir + "/precious.txt") << "precious content\n";
  ASSERT_EQ(lock_file.make(dir), 0) << std::strerror(errno);
  auto [code, logs] = RefusedStart(dir);
  EXPECT_EQ(code, 1) << logs;
  EXPECT_THAT(
      logs, AllOf(HasSubstr("FAILED_PRECONDITION"), HasSubstr(lock), HasSubstr(lock_file.refusal)));
  EXPECT_EQ(ReadFile(dir + "/precious.txt"), "precious content\n");
  EXPECT_FALSE(std::filesystem::exists(dir + "/created-through-the-link"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/epd.sock"));
  std::filesystem::remove_all(dir);
}

// Finding 2: `<socket>.lock` was opened following symlinks, then truncated and given epd's
// pid: a root epd on a socket in a directory others can write truncated any file (and
// created the file a dangling link names).
TEST(StartupSafetyTest, LockFileSymlinkIsRefusedAndItsTargetIsUntouched) {
  for (const char* target : {"precious.txt", "created-through-the-link"}) {
    ExpectRefusedTouchingNothing({target,
                                  [target](const std::string& dir) {
                                    return ::symlink((dir + "/" + target).c_str(),
                                                     (dir + "/epd.sock.lock").c_str());
                                  },
                                  "is a symbolic link"});
  }
}

// Not a regular file (a FIFO, a directory) or a second name of another file (a hard link,
// which epd would truncate): refused naming the path.
TEST(StartupSafetyTest, LockFileThatIsNotAPlainFileOfItsOwnIsRefused) {
  const std::vector<HostileLockFile> cases = {
      {"FIFO",
       [](const std::string& dir) { return ::mkfifo((dir + "/epd.sock.lock").c_str(), 0600); },
       "is not a regular file (a FIFO)"},
      {"directory",
       [](const std::string& dir) { return ::mkdir((dir + "/epd.sock.lock").c_str(), 0700); },
       "is not a regular file (a directory)"},
      {"hard link",
       [](const std::string& dir) {
         return ::link((dir + "/precious.txt").c_str(), (dir + "/epd.sock.lock").c_str());
       },
       "has 2 names (hard links)"},
  };
  for (const HostileLockFile& lock_file : cases) ExpectRefusedTouchingNothing(lock_file);
}

// An ordinary lock file left by an earlier epd is reused (and gets this epd's pid).
TEST(StartupSafetyTest, LeftoverRegularLockFileIsReused) {
  const std::string dir = MakeTempDir("epd_lock_reuse_");
  std::ofstream(dir + "/epd.sock.lock") << "12345678\n";
  DaemonProcessOptions options;
  options.socket_path = dir + "/epd.sock";
  options.tcp = false;
  absl::StatusOr<std::unique_ptr<DaemonProcess>> epd = DaemonProcess::Start(options);
  ASSERT_TRUE(epd.ok()) << epd.status();
  EXPECT_EQ(ReadFile(dir + "/epd.sock.lock"), absl::StrCat((*epd)->pid(), "\n"));
  EXPECT_EQ((*epd)->Stop().value_or(-1), 0);
  std::filesystem::remove_all(dir);
}

// Finding 8: --socket_group naming a group epd's user is not in said only "fchown to group
// root: Operation not permitted". epd runs as nobody (root: through setpriv, without
// supplementary groups) with --socket_group=root, which it may not give files to.
TEST(StartupSafetyTest, SocketGroupEpdsUserIsNotInNamesTheFileAndTheMembership) {
  std::vector<std::string> argv;
  if (::geteuid() == 0) {
    if (::access("/usr/bin/setpriv", X_OK) != 0) GTEST_SKIP() << "needs setpriv (util-linux)";
    argv = {"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"};
  } else {
    std::vector<gid_t> groups(::getgroups(0, nullptr) + 1);
    groups.resize(::getgroups(static_cast<int>(groups.size()), groups.data()));
    groups.push_back(::getegid());
    if (std::count(groups.begin(), groups.end(), 0) > 0) {
      GTEST_SKIP() << "the test user is in group root (gid 0)";
    }
  }
  const std::string dir = MakeTempDir("epd_group_");
  // nobody creates the socket's lock file there (sticky: epd accepts the directory).
  ASSERT_EQ(::chmod(dir.c_str(), 01777), 0);
  argv.insert(argv.end(), {EpdBinary(), "--backend=host", "--socket=" + dir + "/epd.sock",
                           "--socket_group=root"});
  absl::StatusOr<CommandResult> epd = RunCommand(argv, absl::Seconds(30));
  ASSERT_TRUE(epd.ok()) << epd.status();
  EXPECT_EQ(epd->exit_code, 1) << epd->stderr_text;
  EXPECT_THAT(
      epd->stderr_text,
      AllOf(HasSubstr("epd failed to start: PERMISSION_DENIED"),
            HasSubstr("cannot give " + dir + "/epd.sock"), HasSubstr("to group \"root\" (gid 0)"),
            HasSubstr("must be a member of group \"root\" (socket_group)"),
            HasSubstr("set socket_group to a dedicated group instead of root"),
            HasSubstr("or run epd as root"), Not(HasSubstr("usermod -aG root"))));
  std::filesystem::remove_all(dir);
}

// `epd --socket=/etc/passwd` left /etc/passwd.lock behind (then useradd failed): a socket
// path that exists and is not a socket is refused, naming it and its type, before the lock
// file (or anything else) is created, and it is left as it was.
TEST(StartupSafetyTest, SocketPathThatIsNotASocketIsRefusedBeforeAnythingIsCreated) {
  const std::string dir = MakeTempDir("epd_notsock_");
  std::ofstream(dir + "/passwd") << "root:x:0:0:root:/root:/bin/bash\n";
  ASSERT_EQ(::mkdir((dir + "/directory").c_str(), 0700), 0);
  ASSERT_EQ(::symlink((dir + "/passwd").c_str(), (dir + "/link").c_str()), 0);
  for (const auto& [name, type] : {std::pair<std::string, std::string>{"passwd", "a regular file"},
                                   {"directory", "a directory"},
                                   {"link", "a symbolic link"}}) {
    SCOPED_TRACE(name);
    const std::string socket = dir + "/" + name;
    auto [code, logs] = RefusedStartOn(socket);
    EXPECT_EQ(code, 1) << logs;
    EXPECT_THAT(logs,
                AllOf(HasSubstr("FAILED_PRECONDITION"),
                      HasSubstr(socket + " exists and is not a socket (it is " + type + ")")));
    EXPECT_FALSE(std::filesystem::exists(socket + ".lock")) << logs;
  }
  EXPECT_EQ(ReadFile(dir + "/passwd"), "root:x:0:0:root:/root:/bin/bash\n");
  EXPECT_TRUE(std::filesystem::is_directory(dir + "/directory"));
  EXPECT_TRUE(std::filesystem::is_empty(dir + "/directory"));
  EXPECT_TRUE(std::filesystem::is_symlink(dir + "/link"));
  std::filesystem::remove_all(dir);
}

// `<socket>.lock` that epd did not write (another program's file, with other contents) is
// refused and left as it was; epd's own leftover (a pid) is reused
// (LeftoverRegularLockFileIsReused).
TEST(StartupSafetyTest, LockFileWithOtherContentsIsRefusedAndUntouched) {
  const std::string dir = MakeTempDir("epd_lock_other_");
  const std::string lock = dir + "/epd.sock.lock";
  for (const std::string contents :
       {std::string("important data\n"), std::string("123 456\n"), std::string(40, '7')}) {
    SCOPED_TRACE(contents);
    std::ofstream(lock, std::ios::trunc) << contents;
    auto [code, logs] = RefusedStart(dir);
    EXPECT_EQ(code, 1) << logs;
    EXPECT_THAT(logs, AllOf(HasSubstr("FAILED_PRECONDITION"), HasSubstr(lock),
                            HasSubstr("does not hold what epd writes there (a process id)")));
    EXPECT_EQ(ReadFile(lock), contents);
    EXPECT_FALSE(std::filesystem::exists(dir + "/epd.sock"));
  }
  std::filesystem::remove_all(dir);
}

// A lock file another user created (possible in a sticky directory such as /tmp) is
// refused: epd would truncate it, and that user could hold its flock to keep epd down.
TEST(StartupSafetyTest, LockFileOfAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give the lock file to another user";
  const std::string dir = MakeTempDir("epd_lock_user_");
  const std::string lock = dir + "/epd.sock.lock";
  std::ofstream(lock) << "123\n";
  ASSERT_EQ(::chown(lock.c_str(), 65534, 65534), 0);
  auto [code, logs] = RefusedStart(dir);
  EXPECT_EQ(code, 1) << logs;
  EXPECT_THAT(logs, AllOf(HasSubstr(lock), HasSubstr("belongs to uid 65534, not to epd's user")));
  EXPECT_EQ(ReadFile(lock), "123\n");
  std::filesystem::remove_all(dir);
}

// A socket directory every user may write, without the sticky bit: anyone could replace
// the socket (clients would talk to an impostor) or its lock file. Refused naming the
// directory, its owner and mode and the fix, before anything is created; with the sticky
// bit (as /tmp has) it is accepted.
TEST(StartupSafetyTest, WorldWritableSocketDirectoryWithoutStickyBitIsRefused) {
  const std::string dir = MakeTempDir("epd_dir_0777_");
  ASSERT_EQ(::chmod(dir.c_str(), 0777), 0);
  auto [code, logs] = RefusedStart(dir);
  EXPECT_EQ(code, 1) << logs;
  EXPECT_THAT(logs, AllOf(HasSubstr("FAILED_PRECONDITION"), HasSubstr("the directory " + dir),
                          HasSubstr("(owner "), HasSubstr("mode 0777"),
                          HasSubstr("writable by every user and has no sticky bit"),
                          HasSubstr("chmod go-w " + dir), HasSubstr("chmod +t " + dir)));
  EXPECT_TRUE(std::filesystem::is_empty(dir)) << "epd created something in it";

  ASSERT_EQ(::chmod(dir.c_str(), 01777), 0);
  DaemonProcessOptions options;
  options.socket_path = dir + "/epd.sock";
  options.tcp = false;
  absl::StatusOr<std::unique_ptr<DaemonProcess>> epd = DaemonProcess::Start(options);
  ASSERT_TRUE(epd.ok()) << epd.status();
  EXPECT_EQ((*epd)->Stop().value_or(-1), 0);
  std::filesystem::remove_all(dir);
}

// A socket directory owned by another user (here nobody, mode 0777 as in the issue; 0755
// too: its owner may replace anything in it) is refused naming the owner.
TEST(StartupSafetyTest, SocketDirectoryOfAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give the directory to another user";
  for (const mode_t mode : {0777, 0755}) {
    const std::string dir = MakeTempDir("epd_dir_nobody_");
    ASSERT_EQ(::chown(dir.c_str(), 65534, 65534), 0);
    ASSERT_EQ(::chmod(dir.c_str(), mode), 0);
    auto [code, logs] = RefusedStart(dir);
    EXPECT_EQ(code, 1) << logs;
    EXPECT_THAT(logs,
                AllOf(HasSubstr("the directory " + dir + " (owner "), HasSubstr("(uid 65534)"),
                      HasSubstr("belongs to another user than root and epd's (uid 0)")));
    EXPECT_TRUE(std::filesystem::is_empty(dir)) << "epd created something in it";
    std::filesystem::remove_all(dir);
  }
}

// A symbolic link on the socket's path owned by another user (nobody's /tmp/evil ->
// /run/epdtarget, which passes every check) is refused naming the link, its owner and the
// fix: nobody could later point it at a directory of its own, where clients would connect
// to its socket. The same link owned by root is accepted and epd serves through it.
TEST(StartupSafetyTest, SocketPathThroughALinkOfAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give the link to another user";
  const std::string target = MakeTempDir("epd_link_target_");
  ASSERT_EQ(::chmod(target.c_str(), 0755), 0);
  const std::string parent = MakeTempDir("epd_link_parent_");
  ASSERT_EQ(::chmod(parent.c_str(), 01777), 0);  // As /tmp: anyone adds, only owners remove.
  const std::string link = parent + "/evil";
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  ASSERT_EQ(::lchown(link.c_str(), 65534, 65534), 0);
  auto [code, logs] = RefusedStartOn(link + "/epd.sock");
  EXPECT_EQ(code, 1) << logs;
  EXPECT_THAT(logs, AllOf(HasSubstr("FAILED_PRECONDITION"),
                          HasSubstr("the symbolic link " + link + " -> " + target),
                          HasSubstr("(uid 65534)"), HasSubstr("chown -h root " + link)));
  EXPECT_TRUE(std::filesystem::is_empty(target)) << "epd created something through the link";

  ASSERT_EQ(::lchown(link.c_str(), 0, 0), 0);
  DaemonProcessOptions options;
  options.socket_path = link + "/epd.sock";
  options.tcp = false;
  absl::StatusOr<std::unique_ptr<DaemonProcess>> epd = DaemonProcess::Start(options);
  ASSERT_TRUE(epd.ok()) << epd.status();
  std::string output;
  EXPECT_TRUE(ClientJoins(link + "/epd.sock", target, &output)) << output;
  EXPECT_EQ((*epd)->Stop().value_or(-1), 0);
  std::filesystem::remove_all(parent);
  std::filesystem::remove_all(target);
}

}  // namespace
}  // namespace epd::testing
