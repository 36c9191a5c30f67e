#include "tests/common/subprocess.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

extern char** environ;

namespace epd::testing {
namespace {

std::string ReadFile(const std::string& path) {
  if (path.empty()) return "";
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

int DecodeWaitStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return -WTERMSIG(status);
  return -1000;
}

}  // namespace

std::string MakeTempDir(const std::string& prefix) {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern =
      absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/", prefix, "XXXXXX");
  std::vector<char> buffer(pattern.begin(), pattern.end());
  buffer.push_back('\0');
  if (::mkdtemp(buffer.data()) == nullptr) {
    std::fprintf(stderr, "mkdtemp(%s): %s\n", pattern.c_str(), std::strerror(errno));
    std::abort();
  }
  return buffer.data();
}

int PickFreeTcpPort() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Spawn(const std::vector<std::string>& argv,
                                                              SubprocessOptions options) {
  if (argv.empty()) return absl::InvalidArgumentError("argv is empty");
  // A write to the stdin of a child that died must fail with EPIPE, not kill the test.
  static const bool sigpipe_ignored = [] { return ::signal(SIGPIPE, SIG_IGN) != SIG_ERR; }();
  (void)sigpipe_ignored;
  std::unique_ptr<Subprocess> p(new Subprocess());
  p->options_ = options;

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  int stdin_pipe[2] = {-1, -1};
  if (options.pipe_stdin) {
    if (::pipe2(stdin_pipe, O_CLOEXEC) != 0) {
      posix_spawn_file_actions_destroy(&actions);
      return absl::InternalError(absl::StrCat("pipe2: ", std::strerror(errno)));
    }
    posix_spawn_file_actions_adddup2(&actions, stdin_pipe[0], 0);
  } else {
    posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  }
  auto redirect = [&](int fd, const std::string& path) {
    posix_spawn_file_actions_addopen(&actions, fd, path.empty() ? "/dev/null" : path.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
  };
  redirect(1, options.stdout_path);
  redirect(2, options.stderr_path);

  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t empty, defaults;
  sigemptyset(&empty);
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGTERM);
  sigaddset(&defaults, SIGINT);
  sigaddset(&defaults, SIGPIPE);
  posix_spawnattr_setsigmask(&attr, &empty);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);

  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  int rc = ::posix_spawn(&p->pid_, argv[0].c_str(), &actions, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (stdin_pipe[0] >= 0) ::close(stdin_pipe[0]);
  if (rc != 0) {
    if (stdin_pipe[1] >= 0) ::close(stdin_pipe[1]);
    return absl::InternalError(absl::StrCat("posix_spawn ", argv[0], ": ", std::strerror(rc)));
  }
  p->stdin_fd_ = stdin_pipe[1];
  return p;
}

Subprocess::~Subprocess() {
  CloseStdin();
  if (!reaped_ && pid_ > 0) {
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }
}

void Subprocess::Signal(int signal) {
  if (!reaped_ && pid_ > 0) ::kill(pid_, signal);
}

absl::Status Subprocess::WriteStdin(absl::string_view text) {
  if (stdin_fd_ < 0) return absl::FailedPreconditionError("no stdin pipe");
  while (!text.empty()) {
    ssize_t n = ::write(stdin_fd_, text.data(), text.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat("write to child stdin: ", std::strerror(errno)));
    }
    text.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

void Subprocess::CloseStdin() {
  if (stdin_fd_ >= 0) {
    ::close(stdin_fd_);
    stdin_fd_ = -1;
  }
}

absl::StatusOr<int> Subprocess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (!Running()) return exit_code_;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("pid ", pid_, " still running after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
}

bool Subprocess::Running() {
  if (reaped_) return false;
  int status = 0;
  pid_t r = ::waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    reaped_ = true;
    exit_code_ = DecodeWaitStatus(status);
    return false;
  }
  return r == 0;
}

std::string Subprocess::Stdout() const { return ReadFile(options_.stdout_path); }
std::string Subprocess::Stderr() const { return ReadFile(options_.stderr_path); }

absl::Status Subprocess::WaitForOutput(absl::string_view text, absl::Duration timeout,
                                       bool in_stderr) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    std::string output = in_stderr ? Stderr() : Stdout();
    if (absl::StrContains(output, text)) return absl::OkStatus();
    if (!Running()) {
      return absl::FailedPreconditionError(
          absl::StrCat("pid ", pid_, " exited with ", exit_code_, " before printing \"", text,
                       "\"; stdout: ", Stdout(), "; stderr: ", Stderr()));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "no \"", text, "\" from pid ", pid_, " within ", absl::FormatDuration(timeout),
          "; stdout: ", Stdout(), "; stderr: ", Stderr()));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

absl::StatusOr<CommandResult> RunCommand(const std::vector<std::string>& argv,
                                         absl::Duration timeout) {
  std::string dir = MakeTempDir("epd_cmd_");
  SubprocessOptions options;
  options.stdout_path = dir + "/stdout";
  options.stderr_path = dir + "/stderr";
  absl::StatusOr<std::unique_ptr<Subprocess>> p = Subprocess::Spawn(argv, options);
  if (!p.ok()) return p.status();
  absl::StatusOr<int> code = (*p)->Wait(timeout);
  CommandResult result;
  result.stdout_text = (*p)->Stdout();
  result.stderr_text = (*p)->Stderr();
  p->reset();
  ::unlink(options.stdout_path.c_str());
  ::unlink(options.stderr_path.c_str());
  ::rmdir(dir.c_str());
  if (!code.ok()) {
    return absl::DeadlineExceededError(absl::StrCat(
        absl::StrJoin(argv, " "), ": ", code.status().message(), "; stderr: ", result.stderr_text));
  }
  result.exit_code = *code;
  return result;
}

std::vector<std::string> AsUser(uint32_t uid, const std::vector<std::string>& argv) {
  std::vector<std::string> full = {"/usr/bin/setpriv", absl::StrCat("--reuid=", uid),
                                   absl::StrCat("--regid=", uid), "--clear-groups"};
  full.insert(full.end(), argv.begin(), argv.end());
  return full;
}

}  // namespace epd::testing
