#include "daemon/core/fd_limits.h"

#include <dirent.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/errors/reason.h"

namespace epd {

absl::StatusOr<FdLimit> GetFdLimit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return absl::InternalError(
        absl::StrCat("getrlimit(RLIMIT_NOFILE) failed: ", std::strerror(errno)));
  }
  return FdLimit{static_cast<uint64_t>(limit.rlim_cur), static_cast<uint64_t>(limit.rlim_max)};
}

absl::StatusOr<FdLimitChange> RaiseFdLimitToHard() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return absl::InternalError(
        absl::StrCat("getrlimit(RLIMIT_NOFILE) failed: ", std::strerror(errno)));
  }
  FdLimitChange change;
  change.before = {static_cast<uint64_t>(limit.rlim_cur), static_cast<uint64_t>(limit.rlim_max)};
  change.after = change.before;
  if (limit.rlim_cur == limit.rlim_max) return change;
  limit.rlim_cur = limit.rlim_max;
  if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return absl::InternalError(absl::StrCat("setrlimit(RLIMIT_NOFILE) from soft ",
                                            change.before.soft, " to the hard limit ",
                                            change.before.hard, " failed: ", std::strerror(errno)));
  }
  change.after.soft = change.before.hard;
  return change;
}

absl::StatusOr<uint64_t> CountOpenFds() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) {
    const int err = errno;
    if (err == EMFILE || err == ENFILE) {
      return errors::WithReason(absl::ResourceExhaustedError(absl::StrCat(
                                    "cannot open /proc/self/fd: ", std::strerror(err))),
                                errors::Reason::kQuotaExceeded);
    }
    return absl::InternalError(absl::StrCat("cannot open /proc/self/fd: ", std::strerror(err)));
  }
  uint64_t count = 0;
  while (const dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  ::closedir(dir);
  return count > 0 ? count - 1 : 0;  // The directory's own descriptor.
}

absl::Status CheckFreeFds(uint32_t min_free, absl::string_view what) {
  if (min_free == 0) return absl::OkStatus();
  absl::StatusOr<FdLimit> limit = GetFdLimit();
  if (!limit.ok()) return limit.status();
  absl::StatusOr<uint64_t> open = CountOpenFds();
  if (open.ok() && *open + min_free <= limit->soft) return absl::OkStatus();
  if (!open.ok() && !absl::IsResourceExhausted(open.status())) return open.status();
  const std::string in_use =
      open.ok() ? absl::StrCat(*open, " of its ", limit->soft)
                : absl::StrCat("all of its ", limit->soft, " (", open.status().message(), ")");
  return errors::WithReason(
      absl::ResourceExhaustedError(absl::StrCat(
          what, ": file descriptors: epd has ", in_use,
          " file descriptors open (RLIMIT_NOFILE, hard limit ", limit->hard,
          ") and keeps min_free_fds = ", min_free,
          " free for its listener, so it refuses new joins until descriptors are freed. Each "
          "endpoint joined but not yet mapped holds one: map the endpoints you join "
          "(Client::Join does) or leave them, end sessions holding endpoints they do not use; an "
          "operator may raise epd's hard limit (LimitNOFILE= in epd.service)")),
      errors::Reason::kQuotaExceeded);
}

}  // namespace epd
