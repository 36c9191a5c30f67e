// The start counter behind epd_restarts_total (start_count.h).
#include "daemon/metrics/start_count.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/os/scoped_fd.h"

namespace epd::metrics {

std::string StartCountPath(const std::string& configured, const std::string& socket_path) {
  if (configured == "off") return "";
  if (!configured.empty()) return configured;
  const size_t slash = socket_path.rfind('/');
  return slash == std::string::npos ? "epd.starts"
                                    : socket_path.substr(0, slash + 1) + "epd.starts";
}

absl::StatusOr<uint64_t> RecordStart(const std::string& path) {
  uint64_t before = 0;
  absl::Status bad;
  {
    // The count is a few digits: a regular file, not followed through a link, read at most
    // 64 bytes, never blocking (a FIFO or a device planted at the path is refused).
    ScopedFd in(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
    if (in.get() < 0 && errno != ENOENT) {
      return absl::FailedPreconditionError(
          absl::StrCat("metrics_state_file ", path, ": cannot open it: ", std::strerror(errno),
                       errno == ELOOP ? " (a symbolic link: not followed)" : ""));
    }
    if (in.get() >= 0) {
      struct stat st {};
      if (::fstat(in.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
        return absl::FailedPreconditionError(
            absl::StrCat("metrics_state_file ", path, ": not a regular file; counting no starts"));
      }
      char buf[64];
      const ssize_t n = ::read(in.get(), buf, sizeof(buf));
      const std::string s(
          absl::StripAsciiWhitespace(absl::string_view(buf, n > 0 ? static_cast<size_t>(n) : 0)));
      if (!absl::SimpleAtoi(s, &before)) {
        bad = absl::InvalidArgumentError(
            absl::StrCat("metrics_state_file ", path, ": does not hold a count of starts (",
                         n < 0 ? std::strerror(errno) : absl::StrCat(s.size(), " bytes"),
                         "); counting from this start"));
        before = 0;
      }
    }
  }
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  {
    ScopedFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644));
    if (fd.get() < 0) {
      return absl::UnavailableError(absl::StrCat("metrics_state_file ", path, ": cannot write ",
                                                 tmp, ": ", std::strerror(errno)));
    }
    const std::string text = absl::StrCat(before + 1, "\n");
    if (::write(fd.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
      const int err = errno;
      ::unlink(tmp.c_str());
      return absl::UnavailableError(absl::StrCat("metrics_state_file ", path, ": cannot write ",
                                                 tmp, ": ", std::strerror(err)));
    }
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("metrics_state_file ", path, ": cannot rename ", tmp,
                                               " over it: ", std::strerror(err)));
  }
  if (!bad.ok()) return bad;
  return before;
}

}  // namespace epd::metrics
