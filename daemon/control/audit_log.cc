#include "daemon/control/audit_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "daemon/core/logging.h"

namespace epd {
namespace {

constexpr size_t kMaxFieldBytes = 512;
/// Ranks of each list an UpdateRankMask line names (RankMaskEvent).
constexpr size_t kMaxAuditedRanks = 64;
constexpr char kJournalPrefix[] = "EPD_AUDIT ";

/// `text` as a JSON string literal, quotes included.
std::string JsonString(absl::string_view text) {
  const bool cut = text.size() > kMaxFieldBytes;
  if (cut) text = text.substr(0, kMaxFieldBytes);
  std::string out = "\"";
  for (unsigned char c : text) {
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c < 0x20 || c >= 0x7f) {
      absl::StrAppendFormat(&out, "\\u%04x", c);
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  if (cut) out += "...";
  out.push_back('"');
  return out;
}

/// Whether `fd` is the file `path` names now (false when the path is gone).
bool SameFile(int fd, const std::string& path) {
  struct stat by_path {};
  struct stat by_fd {};
  if (::stat(path.c_str(), &by_path) != 0 || ::fstat(fd, &by_fd) != 0) return false;
  return by_path.st_dev == by_fd.st_dev && by_path.st_ino == by_fd.st_ino;
}

}  // namespace

std::string FormatAuditLine(const AuditEvent& event, absl::Time time) {
  std::string line = absl::StrCat(
      "{\"time\":", JsonString(absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", time, absl::UTCTimeZone())),
      ",\"action\":", JsonString(event.action));
  if (event.peer) {
    absl::StrAppend(&line, ",\"pid\":", event.peer->pid, ",\"uid\":", event.peer->uid,
                    ",\"gid\":", event.peer->gid);
  }
  if (!event.group.empty()) absl::StrAppend(&line, ",\"group\":", JsonString(event.group));
  if (event.rank >= 0) absl::StrAppend(&line, ",\"rank\":", event.rank);
  absl::StrAppend(&line, ",\"result\":", JsonString(absl::StatusCodeToString(event.result.code())),
                  ",\"message\":", JsonString(event.result.message()));
  if (!event.detail.empty()) absl::StrAppend(&line, ",\"detail\":", JsonString(event.detail));
  line += "}\n";
  return line;
}

absl::StatusOr<std::unique_ptr<AuditLog>> AuditLog::Open(const std::string& target) {
  if (target == "journal") return std::unique_ptr<AuditLog>(new AuditLog(""));
  if (target.empty() || target.front() != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("audit_log: \"", target, "\" is neither an absolute path nor \"journal\""));
  }
  std::unique_ptr<AuditLog> log(new AuditLog(target));
  absl::MutexLock lock(&log->mu_);
  EPD_RETURN_IF_ERROR(log->EnsureOpenLocked());
  return log;
}

absl::Status AuditLog::EnsureOpenLocked() {
  if (fd_.valid() && SameFile(fd_.get(), path_)) return absl::OkStatus();
  // O_NOFOLLOW: a symlink planted at the path cannot point the lines elsewhere.
  // O_NONBLOCK: a FIFO planted there cannot block epd (no reader: ENXIO; else refused
  // below); on a regular file it changes nothing.
  ScopedFd fd(::open(path_.c_str(),
                     O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOCTTY | O_NOFOLLOW | O_NONBLOCK,
                     0640));
  if (!fd.valid()) {
    const int error = errno;
    return absl::FailedPreconditionError(absl::StrCat(
        "audit_log: cannot open \"", path_, "\" for appending: ", std::strerror(error),
        error == ELOOP ? " (it is a symbolic link: name the regular file itself)"
        : error == ENXIO
            ? " (it is a FIFO or socket, not a regular file: remove it or name another path)"
            : " (does its directory exist, and may epd's user write there?)"));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("audit_log: fstat of \"", path_, "\": ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "audit_log: \"", path_, "\" is not a regular file (",
        S_ISFIFO(st.st_mode)  ? "a FIFO"
        : S_ISCHR(st.st_mode) ? "a character device"
                              : "not a file",
        "): epd appends its audit log only to a regular file; remove it or name another path"));
  }
  // Only epd's user (or root) may own it, and nobody else may write it: another user who
  // can would forge or erase the record of what was done.
  if (st.st_uid != ::geteuid() && st.st_uid != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "audit_log: \"", path_, "\" is owned by uid ", st.st_uid, ", not epd's (", ::geteuid(),
        ") nor root: another user could forge or erase its lines; remove it or name another "
        "path"));
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "audit_log: \"", path_, "\" has mode ", absl::StrFormat("%04o", st.st_mode & 07777),
        ": its group or others may write it and forge or erase its lines; chmod go-w it"));
  }
  fd_ = std::move(fd);
  return absl::OkStatus();
}

void AuditLog::Record(const AuditEvent& event) {
  std::string line = FormatAuditLine(event, absl::Now());
  absl::MutexLock lock(&mu_);
  absl::Status status;
  if (path_.empty()) {
    line.insert(0, kJournalPrefix);
    if (::write(STDERR_FILENO, line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
      status = absl::InternalError(absl::StrCat("write to stderr: ", std::strerror(errno)));
    }
  } else {
    status = EnsureOpenLocked();
    if (status.ok() &&
        ::write(fd_.get(), line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
      status =
          absl::InternalError(absl::StrCat("write to \"", path_, "\": ", std::strerror(errno)));
    }
  }
  if (status.ok()) return;
  ++write_failures_;
  const absl::Time now = absl::Now();
  if (now - last_warning_ >= absl::Seconds(10)) {
    last_warning_ = now;
    GetLogger(kLogControl)
        ->warn(
            "audit log: a line was not written ({} so far): {}; fix the file system or "
            "audit_log, the actions themselves went on",
            write_failures_, status.ToString());
  }
}

std::string RedactSessionId(const std::string& id) {
  return id.size() <= 8 ? id : id.substr(0, 8) + "...";
}

AuditEvent RankMaskEvent(const PeerCredentials& caller, const v1::UpdateRankMaskRequest& request,
                         const absl::Status& result) {
  AuditEvent event;
  event.action = audit::kRankMask;
  event.peer = caller;
  event.group = request.group();
  event.rank = request.rank();
  event.result = result;
  // The lists are the client's and may be long (refused past the group's num_ranks, but
  // audited all the same): each named up to kMaxAuditedRanks.
  event.detail = absl::StrCat(
      "mask [", BoundedRankList(absl::MakeConstSpan(request.mask()), kMaxAuditedRanks, ","),
      "] unmask [", BoundedRankList(absl::MakeConstSpan(request.unmask()), kMaxAuditedRanks, ","),
      "]", request.clean() ? " clean" : "");
  return event;
}

uint64_t AuditLog::write_failures() const {
  absl::MutexLock lock(&mu_);
  return write_failures_;
}

}  // namespace epd
