#include "daemon/server/socket_path_checks.h"

#include <grp.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/errors/reason.h"

namespace epd {
namespace {

std::string Errno(int err) { return std::strerror(err); }

/// The name of user `uid` ("" when it has none).
std::string UserName(uid_t uid) {
  std::vector<char> buffer(16384);
  passwd entry{};
  passwd* result = nullptr;
  if (::getpwuid_r(uid, &entry, buffer.data(), buffer.size(), &result) != 0 || !result) return "";
  return result->pw_name;
}

/// The name of group `gid` ("" when it has none).
std::string GroupName(gid_t gid) {
  std::vector<char> buffer(16384);
  group entry{};
  group* result = nullptr;
  if (::getgrgid_r(gid, &entry, buffer.data(), buffer.size(), &result) != 0 || !result) return "";
  return result->gr_name;
}

/// "alice (uid 1000)", or "uid 1000" without a name.
std::string Named(const std::string& name, const char* kind, unsigned id) {
  return name.empty() ? absl::StrCat(kind, " ", id) : absl::StrCat(name, " (", kind, " ", id, ")");
}

}  // namespace

std::string FileTypeName(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a file";
}

absl::Status ClassifySocketDirectory(const std::string& socket_path, const DirectoryStat& dir,
                                     uid_t daemon_uid) {
  const std::string owner = Named(dir.owner_name, "uid", dir.uid);
  const std::string group = Named(dir.group_name, "gid", dir.gid);
  const std::string described = absl::StrFormat("%s (owner %s, group %s, mode %04o)", dir.path,
                                                owner, group, dir.mode & 07777);
  const std::string prefix = absl::StrCat("socket_path: ", socket_path, ": ");
  if (!S_ISDIR(dir.mode)) {
    return errors::WithReason(absl::FailedPreconditionError(absl::StrCat(
                                  prefix, dir.path, " is not a directory (", FileTypeName(dir.mode),
                                  "); choose another --socket")),
                              errors::Reason::kSocketUnsafe);
  }
  if (dir.uid != 0 && dir.uid != daemon_uid) {
    return errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            prefix, "the directory ", described,
            " belongs to another user than root and epd's (uid ", daemon_uid,
            "), who can remove or replace epd's socket and lock file there; put the socket in a "
            "directory that root or epd's user owns and only its owner can write (e.g. /run/epd, "
            "which the systemd unit's RuntimeDirectory= creates), or give ",
            dir.path, " to one of them (chown)")),
        errors::Reason::kSocketUnsafe);
  }
  if ((dir.mode & (S_IWGRP | S_IWOTH)) != 0 && (dir.mode & S_ISVTX) == 0) {
    const std::string who = (dir.mode & S_IWOTH) != 0
                                ? std::string("every user")
                                : absl::StrCat("every member of group ", group);
    return errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            prefix, "the directory ", described, " is writable by ", who,
            " and has no sticky bit, so any of them can remove or replace epd's socket and lock "
            "file there; make it writable by its owner alone (chmod go-w ",
            dir.path, "), or set its sticky bit (chmod +t ", dir.path,
            ", as /tmp has), or choose a --socket in another directory (e.g. /run/epd)")),
        errors::Reason::kSocketUnsafe);
  }
  return absl::OkStatus();
}

namespace {

/// lstat of `path` as a DirectoryStat; FAILED_PRECONDITION naming `socket_path` and `path`.
absl::Status StatEntry(const std::string& socket_path, const std::string& path,
                       DirectoryStat* entry) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    return errors::WithReason(
        absl::FailedPreconditionError(
            absl::StrCat("socket_path: ", socket_path, ": cannot stat ", path, ": ", Errno(errno))),
        errors::Reason::kSocketUnsafe);
  }
  *entry = DirectoryStat{path,       st.st_uid,           st.st_gid,
                         st.st_mode, UserName(st.st_uid), GroupName(st.st_gid)};
  return absl::OkStatus();
}

/// ClassifySocketDirectory of the directory `path` as lstat finds it.
absl::Status CheckOneDirectory(const std::string& socket_path, const std::string& path,
                               uid_t daemon_uid) {
  DirectoryStat entry;
  if (absl::Status status = StatEntry(socket_path, path, &entry); !status.ok()) return status;
  return ClassifySocketDirectory(socket_path, entry, daemon_uid);
}

/// `path`'s components ("/" and "" left out), last first (a stack to pop in path order).
void PushComponents(const std::filesystem::path& path, std::vector<std::string>* stack) {
  std::vector<std::string> parts;
  for (const std::filesystem::path& part : path.relative_path()) {
    if (!part.empty()) parts.push_back(part.string());
  }
  stack->insert(stack->end(), parts.rbegin(), parts.rend());
}

/// The walk the kernel makes to the socket's directory, one component at a time, from
/// `socket_path` made absolute (not resolved): every directory looked up in passes
/// ClassifySocketDirectory and every symbolic link met passes ClassifySocketPathLink, its
/// target then walked the same way. Stops at the first component that does not exist
/// (epd creates it, CreateSocketDirectories).
absl::Status WalkSocketPath(const std::string& socket_path, uid_t daemon_uid) {
  namespace fs = std::filesystem;
  // A kernel's own limit on links followed in one lookup (MAXSYMLINKS).
  constexpr int kMaxLinks = 40;
  fs::path dir = fs::path(socket_path).parent_path();
  if (dir.is_relative()) {
    std::error_code error;
    const fs::path cwd = fs::current_path(error);
    if (error) {
      return errors::WithReason(absl::FailedPreconditionError(absl::StrCat(
                                    "socket_path: ", socket_path,
                                    ": cannot read the working directory: ", error.message())),
                                errors::Reason::kSocketUnsafe);
    }
    dir = cwd / dir;
  }
  std::vector<std::string> pending;
  PushComponents(dir, &pending);
  fs::path resolved = "/";  // Free of links: every component was looked up by lstat.
  int links = 0;
  while (!pending.empty()) {
    const std::string name = pending.back();
    pending.pop_back();
    if (name == ".") continue;
    if (name == "..") {
      resolved = resolved.parent_path();
      continue;
    }
    if (absl::Status status = CheckOneDirectory(socket_path, resolved.string(), daemon_uid);
        !status.ok()) {
      return status;
    }
    const fs::path next = resolved / name;
    struct stat st {};
    if (::lstat(next.c_str(), &st) != 0) {
      if (errno == ENOENT) return absl::OkStatus();
      return errors::WithReason(
          absl::FailedPreconditionError(absl::StrCat("socket_path: ", socket_path, ": cannot stat ",
                                                     next.string(), ": ", Errno(errno))),
          errors::Reason::kSocketUnsafe);
    }
    if (!S_ISLNK(st.st_mode)) {
      resolved = next;
      continue;
    }
    std::error_code error;
    const fs::path target = fs::read_symlink(next, error);
    if (error) {
      return errors::WithReason(absl::FailedPreconditionError(absl::StrCat(
                                    "socket_path: ", socket_path, ": cannot read the link ",
                                    next.string(), ": ", error.message())),
                                errors::Reason::kSocketUnsafe);
    }
    if (++links > kMaxLinks) {
      return errors::WithReason(absl::FailedPreconditionError(absl::StrCat(
                                    "socket_path: ", socket_path, ": more than ", kMaxLinks,
                                    " symbolic links on the way to its directory")),
                                errors::Reason::kSocketUnsafe);
    }
    const DirectoryStat link{next.string(), st.st_uid,           st.st_gid,
                             st.st_mode,    UserName(st.st_uid), GroupName(st.st_gid)};
    if (absl::Status status =
            ClassifySocketPathLink(socket_path, link, target.string(), daemon_uid);
        !status.ok()) {
      return status;
    }
    if (target.is_absolute()) resolved = "/";
    PushComponents(target, &pending);
  }
  return CheckOneDirectory(socket_path, resolved.string(), daemon_uid);
}

}  // namespace

absl::Status ClassifySocketPathLink(const std::string& socket_path, const DirectoryStat& link,
                                    const std::string& target, uid_t daemon_uid) {
  if (!S_ISLNK(link.mode) || link.uid == 0 || link.uid == daemon_uid) return absl::OkStatus();
  return errors::WithReason(
      absl::FailedPreconditionError(absl::StrCat(
          "socket_path: ", socket_path, ": the symbolic link ", link.path, " -> ", target,
          " on the way to the socket belongs to ", Named(link.owner_name, "uid", link.uid),
          ", another user than root and epd's (uid ", daemon_uid,
          "), who can point it at a directory of theirs at any time, where clients would "
          "connect to their socket instead of epd's; give --socket a path without that link "
          "(e.g. its target, `realpath ",
          link.path, "`, or /run/epd), or give the link to root or epd's user (chown -h root ",
          link.path, ")")),
      errors::Reason::kSocketUnsafe);
}

absl::Status CheckSocketDirectories(const std::string& socket_path, uid_t daemon_uid) {
  std::filesystem::path dir = std::filesystem::path(socket_path).parent_path();
  if (dir.empty()) dir = ".";
  // The nearest directory that exists (epd creates the missing ones below it).
  struct stat st {};
  while (::lstat(dir.c_str(), &st) != 0 && (errno == ENOENT || errno == ENOTDIR) &&
         dir.has_relative_path()) {
    dir = dir.parent_path();
  }
  std::unique_ptr<char, decltype(&std::free)> real(::realpath(dir.c_str(), nullptr), &std::free);
  if (real == nullptr) {
    return errors::WithReason(absl::FailedPreconditionError(absl::StrCat(
                                  "socket_path: ", socket_path, ": cannot resolve the directory ",
                                  dir.string(), ": ", Errno(errno))),
                              errors::Reason::kSocketUnsafe);
  }
  for (std::filesystem::path p(real.get());; p = p.parent_path()) {
    if (absl::Status status = CheckOneDirectory(socket_path, p.string(), daemon_uid);
        !status.ok()) {
      return status;
    }
    if (!p.has_relative_path()) break;  // "/" is done.
  }
  // The path as configured: its links, and the directories that hold them.
  return WalkSocketPath(socket_path, daemon_uid);
}

absl::Status CreateSocketDirectories(const std::string& socket_path, std::string* created_top) {
  created_top->clear();
  std::vector<std::filesystem::path> missing;  // Innermost first.
  struct stat st {};
  for (std::filesystem::path p = std::filesystem::path(socket_path).parent_path();
       p.has_relative_path() && ::lstat(p.c_str(), &st) != 0 && errno == ENOENT;
       p = p.parent_path()) {
    missing.push_back(p);
  }
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    if (::mkdir(it->c_str(), 0755) != 0 && errno != EEXIST) {
      return errors::WithReason(
          absl::FailedPreconditionError(absl::StrCat(
              "socket_path: cannot create directory ", it->string(), ": ", Errno(errno),
              " (run epd with a RuntimeDirectory, or choose another --socket)")),
          errors::Reason::kSocketUnsafe);
    }
  }
  if (!missing.empty()) *created_top = missing.back().string();
  return absl::OkStatus();
}

absl::Status CheckSocketPathIsFreeOrASocket(const std::string& socket_path) {
  struct stat st {};
  if (::lstat(socket_path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return errors::WithReason(absl::FailedPreconditionError(absl::StrCat(
                                  "socket_path: cannot stat ", socket_path, ": ", Errno(errno))),
                              errors::Reason::kSocketUnsafe);
  }
  if (S_ISSOCK(st.st_mode)) return absl::OkStatus();
  return errors::WithReason(
      absl::FailedPreconditionError(
          absl::StrCat("socket_path: ", socket_path, " exists and is not a socket (it is ",
                       FileTypeName(st.st_mode),
                       "); epd leaves it as it is and creates nothing beside it: choose another "
                       "--socket, or remove it if it is a leftover of yours")),
      errors::Reason::kSocketUnsafe);
}

}  // namespace epd
