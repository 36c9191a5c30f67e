// The start counter behind epd_restarts_total (start_count.h).
#include "daemon/metrics/start_count.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
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
    std::ifstream in(path);
    if (in) {
      std::stringstream text;
      text << in.rdbuf();
      const std::string s(absl::StripAsciiWhitespace(text.str()));
      if (!absl::SimpleAtoi(s, &before)) {
        bad = absl::InvalidArgumentError(
            absl::StrCat("metrics_state_file ", path, ": holds \"", absl::CEscape(s.substr(0, 32)),
                         "\", not a count of starts; counting from this start"));
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
