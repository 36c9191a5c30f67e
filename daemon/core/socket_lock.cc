// The socket lock file (socket_lock.h).
#include "daemon/core/socket_lock.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "daemon/server/socket_path_checks.h"

namespace epd {
namespace {

/// The pid written in the socket's lock file by the epd that holds it (WriteLockHolder),
/// or 0 when the file holds none (the holder has not written it yet) or that process is
/// gone.
pid_t ReadLockHolder(int lock_fd) {
  char text[32] = {};
  const ssize_t n = ::pread(lock_fd, text, sizeof(text) - 1, 0);
  if (n <= 0) return 0;
  char* end = nullptr;
  const long pid = std::strtol(text, &end, 10);
  if (pid <= 0 || end == text) return 0;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno != EPERM) return 0;
  return static_cast<pid_t>(pid);
}

/// Writes this process's pid into the socket's lock file (which it holds), so that an epd
/// refused by the lock can name the holder. Best effort: the lock alone is what excludes.
void WriteLockHolder(int lock_fd) {
  const std::string text = absl::StrCat(::getpid(), "\n");
  if (::ftruncate(lock_fd, 0) == 0) {
    (void)!::pwrite(lock_fd, text.data(), text.size(), 0);
  }
}

}  // namespace

absl::StatusOr<ScopedFd> OpenSocketLockFile(const std::string& lock_path) {
  const std::string remedy =
      "; remove it (epd recreates it), and keep the socket's directory writable by epd's user "
      "alone";
  const std::string not_ours =
      "; choose another --socket (remove the file only if you know it is a leftover of epd's)";
  ScopedFd fd(::open(lock_path.c_str(),
                     O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC, 0600));
  if (!fd.valid()) {
    const int err = errno;
    struct stat st {};
    if (::lstat(lock_path.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) {
      return errors::WithReason(
          absl::FailedPreconditionError(absl::StrCat("socket_path: the lock file ", lock_path,
                                                     " is a symbolic link; epd does not follow it "
                                                     "(it would truncate the file it points to)",
                                                     remedy)),
          errors::Reason::kSocketUnsafe);
    }
    if (err == EISDIR) {
      return errors::WithReason(absl::FailedPreconditionError(
                                    absl::StrCat("socket_path: the lock file ", lock_path,
                                                 " is not a regular file (a directory)", remedy)),
                                errors::Reason::kSocketUnsafe);
    }
    return errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat("socket_path: cannot open the lock file ",
                                                   lock_path, ": ", std::strerror(err))),
        errors::Reason::kSocketUnsafe);
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    return errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat("socket_path: cannot stat the lock file ",
                                                   lock_path, ": ", std::strerror(errno))),
        errors::Reason::kSocketUnsafe);
  }
  if (!S_ISREG(st.st_mode)) {
    return errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat("socket_path: the lock file ", lock_path,
                                                   " is not a regular file (",
                                                   FileTypeName(st.st_mode), ")", remedy)),
        errors::Reason::kSocketUnsafe);
  }
  if (st.st_nlink != 1) {
    return errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            "socket_path: the lock file ", lock_path, " has ", st.st_nlink,
            " names (hard links): it is another file's name too, which epd would truncate",
            remedy)),
        errors::Reason::kSocketUnsafe);
  }
  if (st.st_uid != ::geteuid()) {
    return errors::WithReason(absl::FailedPreconditionError(absl::StrCat(
                                  "socket_path: the lock file ", lock_path, " belongs to uid ",
                                  st.st_uid, ", not to epd's user (uid ", ::geteuid(),
                                  "): epd did not create it, and would truncate it", not_ours)),
                              errors::Reason::kSocketUnsafe);
  }
  // What WriteLockHolder leaves there: a pid and a newline (nothing before the first write).
  char text[34] = {};
  const ssize_t n = ::pread(fd.get(), text, sizeof(text) - 1, 0);
  const size_t digits = n > 0 ? std::strspn(text, "0123456789") : 0;
  if (n < 0 || st.st_size > 32 ||
      (n > 0 && !(digits == static_cast<size_t>(n) ||
                  (digits + 1 == static_cast<size_t>(n) && text[digits] == '\n')))) {
    return errors::WithReason(
        absl::FailedPreconditionError(
            absl::StrCat("socket_path: the lock file ", lock_path, " (", st.st_size,
                         " bytes) does not hold what epd writes there (a process id): it is "
                         "another program's file, which epd would truncate",
                         not_ours)),
        errors::Reason::kSocketUnsafe);
  }
  return fd;
}

absl::StatusOr<SocketLockAttempt> TryLockSocketFile(const std::string& lock_path) {
  SocketLockAttempt attempt;
  EPD_ASSIGN_OR_RETURN(attempt.lock, OpenSocketLockFile(lock_path));
  if (::flock(attempt.lock.get(), LOCK_EX | LOCK_NB) != 0) {
    attempt.error = errno;
    attempt.holder = ReadLockHolder(attempt.lock.get());
    attempt.lock = ScopedFd();
    return attempt;
  }
  WriteLockHolder(attempt.lock.get());
  return attempt;
}

}  // namespace epd
