// The one-epd-per-socket lock: an exclusive flock on "<socket>.lock", held for the
// daemon's life, with the holder's pid written in the file so a refused epd can name it.
#pragma once

#include <sys/types.h>

#include <string>

#include "absl/status/statusor.h"
#include "common/os/scoped_fd.h"

namespace epd {

/// What TryLockSocketFile found.
struct SocketLockAttempt {
  /// The lock file's descriptor, holding the lock (keep it open for the daemon's life;
  /// the kernel releases the lock however the process ends); invalid when another
  /// process holds the lock.
  ScopedFd lock;
  /// When the lock is held by another process: the pid it wrote in the file, 0 when it
  /// wrote none yet or that process is gone.
  pid_t holder = 0;
  /// When the lock is held by another process: flock's errno.
  int error = 0;
};

/// Opens `lock_path` (OpenSocketLockFile), takes an exclusive non-blocking flock on it and,
/// when it got the lock, writes this process's pid there (best effort: the lock alone
/// excludes). Errors: those of OpenSocketLockFile; a lock held elsewhere is not an error
/// (SocketLockAttempt::lock is then invalid).
absl::StatusOr<SocketLockAttempt> TryLockSocketFile(const std::string& lock_path);

/// Opens (creating it when missing, mode 0600) the socket's lock file `lock_path`. So that
/// a root epd in a directory others can write never truncates a file someone else chose,
/// the last component is never followed (O_NOFOLLOW), and the file must be a regular file
/// with this one name, owned by epd's user and holding nothing but what epd writes there.
/// FAILED_PRECONDITION naming the path when it is a symbolic link, not a regular file, has
/// other names (hard links), belongs to another user, holds anything but a pid, or cannot
/// be opened.
absl::StatusOr<ScopedFd> OpenSocketLockFile(const std::string& lock_path);

}  // namespace epd
