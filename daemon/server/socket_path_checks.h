// Checks of epd's socket path made before epd creates anything for it (Daemon's
// PrepareSocketPath): what the socket path already is, and who besides epd could remove,
// rename or create files in the directories above it (the checks sshd's StrictModes makes
// of a user's files). A root epd that accepted either would let another user aim it at a
// file of that user's choice (e.g. `--socket=/etc/passwd` creating /etc/passwd.lock) or
// swap the socket and its lock file under it.
#pragma once

#include <sys/types.h>

#include <string>

#include "absl/status/status.h"

namespace epd {

/// What ClassifySocketDirectory and ClassifySocketPathLink need of one file on the socket's
/// path (from lstat): its path, owner and mode, and for the message the owner's and the group's
/// names ("" = show the number).
struct DirectoryStat {
  std::string path;
  uid_t uid = 0;
  gid_t gid = 0;
  mode_t mode = 0;  ///< st_mode: the file type and the permission bits.
  std::string owner_name;
  std::string group_name;
};

/// The type of a file as a phrase: "a regular file", "a directory", "a symbolic link",
/// "a FIFO", "a socket", "a character device", "a block device" ("not a file" otherwise).
std::string FileTypeName(mode_t mode);

/// OK when nobody but root and `daemon_uid` can remove, rename or create entries of `dir`:
/// it is a directory owned by root or `daemon_uid` and not writable by its group or by
/// others, unless it has the sticky bit (then others may add entries, but not remove or
/// rename entries they do not own: /tmp, root 1777, is accepted). FAILED_PRECONDITION
/// naming `socket_path`, the directory, its owner, group and mode, what another user
/// could do, and the fix, otherwise.
absl::Status ClassifySocketDirectory(const std::string& socket_path, const DirectoryStat& dir,
                                     uid_t daemon_uid);

/// OK unless `link` (lstat of a component of the socket's path; `target` is what it points
/// at) is a symbolic link owned by another user than root and `daemon_uid`: that user could
/// remove it (in a sticky directory such as /tmp the owner of an entry may) and point the
/// path at a directory of theirs, where clients would meet their socket. Any other file
/// type is OK here (ClassifySocketDirectory judges directories). FAILED_PRECONDITION
/// naming `socket_path`, the link, its target, its owner and the fix otherwise.
absl::Status ClassifySocketPathLink(const std::string& socket_path, const DirectoryStat& link,
                                    const std::string& target, uid_t daemon_uid);

/// ClassifySocketDirectory of every directory from the socket's (its canonical path,
/// symbolic links resolved) up to "/", innermost first; then the path as configured (made
/// absolute, not resolved) walked one component at a time as the kernel looks it up:
/// every directory looked up in passes ClassifySocketDirectory, and every symbolic link
/// met passes ClassifySocketPathLink before its target is walked the same way (at most 40
/// links). The first refusal is returned.
/// A socket directory that does not exist yet is skipped: its nearest existing ancestor
/// is the first checked (epd creates the missing ones itself, see
/// CreateSocketDirectories). FAILED_PRECONDITION naming a directory that cannot be
/// read (lstat, realpath) too.
absl::Status CheckSocketDirectories(const std::string& socket_path, uid_t daemon_uid);

/// Creates the missing directories above `socket_path`, top-down, each with mode 0755
/// (less the umask): never writable by group or others, whatever the umask. `*created_top`
/// is the topmost one created ("" when none was missing). FAILED_PRECONDITION naming the
/// directory that cannot be created.
absl::Status CreateSocketDirectories(const std::string& socket_path, std::string* created_top);

/// OK when `socket_path` does not exist or is a socket (live or stale: the caller probes
/// which). FAILED_PRECONDITION naming the path and what it is otherwise (a regular file,
/// a directory, a symbolic link, ...), or when it cannot be examined. Touches nothing.
absl::Status CheckSocketPathIsFreeOrASocket(const std::string& socket_path);

}  // namespace epd
