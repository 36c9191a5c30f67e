// AuditLog: one JSON line per control action (a session opened or closed, a join, a leave,
// a group created or destroyed, a rank mask changed, a drain), naming who asked by the
// kernel's credentials of its connection (SO_PEERCRED, daemon/server/peer_credentials.h),
// never by anything in the request, and the outcome. docs/DEPLOYMENT.md "Audit log" shows
// the format. Never a join secret or a session id in full.
//
// Where the lines go (DaemonConfig.audit_log): a regular file, opened
// O_WRONLY|O_APPEND|O_CREAT|O_NOFOLLOW|O_NONBLOCK (mode 0640) and checked with fstat, so a
// symlink or a FIFO planted at the path is refused, never followed or blocked on; before each line
// the path is compared with the open file (stat vs fstat) and reopened when it was renamed or
// removed, so logrotate's rename-and-create works without a signal and copytruncate works because
// of O_APPEND. Or "journal": stderr, each line prefixed "EPD_AUDIT " (journald stores stderr of a
// unit; `journalctl -u epd | grep EPD_AUDIT`). A line that cannot be written is counted and warned
// about (at most every 10 s) but never refuses the action.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/os/scoped_fd.h"
#include "daemon/server/peer_credentials.h"
#include "epd/v1/control.pb.h"

namespace epd {

/// The actions AuditEvent.action names.
namespace audit {
inline constexpr char kSessionOpen[] = "session_open";
inline constexpr char kSessionClose[] = "session_close";
inline constexpr char kJoin[] = "join";
inline constexpr char kLeave[] = "leave";
inline constexpr char kGroupCreate[] = "group_create";
inline constexpr char kGroupDestroy[] = "group_destroy";
inline constexpr char kRankMask[] = "rank_mask";
inline constexpr char kConfigReload[] = "config_reload";
inline constexpr char kDrain[] = "drain";
inline constexpr char kUndrain[] = "undrain";
}  // namespace audit

/// One control action.
struct AuditEvent {
  std::string action;  ///< One of audit::k*.
  /// Who asked (SO_PEERCRED); nullopt for epd's own actions (a drain on SIGTERM, an
  /// endpoint expired unmapped): "pid"/"uid"/"gid" are then absent.
  std::optional<PeerCredentials> peer;
  std::string group;  ///< "" when the action has none.
  int32_t rank = -1;  ///< -1 when the action has none.
  absl::Status result;
  std::string detail;  ///< Short free text (e.g. "released 2 endpoint(s)"); never a secret.
};

/// The JSON line of `event` at `time`, ending in '\n':
///   {"time":"2026-12-02T07:01:02.345678Z","action":"join","pid":4242,"uid":1000,
///    "gid":1000,"group":"moe","rank":3,"result":"OK","message":"","detail":"..."}
/// "result" is the absl::StatusCode name; "message" the error's message. Strings are JSON
/// escaped (bytes outside printable ASCII as \u00XX) and cut to 512 bytes.
std::string FormatAuditLine(const AuditEvent& event, absl::Time time);

class AuditLog {
 public:
  /// Opens the audit log `target` (DaemonConfig.audit_log): "journal" or an absolute path.
  /// FAILED_PRECONDITION naming the path and errno when the file cannot be opened for
  /// appending, and naming the path when it is a symbolic link or not a regular file (a
  /// FIFO, a device); INVALID_ARGUMENT for "" or a relative path.
  static absl::StatusOr<std::unique_ptr<AuditLog>> Open(const std::string& target);

  /// Appends one line (FormatAuditLine at now). Thread-safe; one write(2) per line.
  void Record(const AuditEvent& event);

  /// Lines that could not be written since start.
  uint64_t write_failures() const;

 private:
  explicit AuditLog(std::string path) : path_(std::move(path)) {}
  /// (Re)opens path_ when it no longer names the open file. Call with mu_ held.
  absl::Status EnsureOpenLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;  ///< "" = the journal (stderr).
  mutable absl::Mutex mu_;
  ScopedFd fd_ ABSL_GUARDED_BY(mu_);
  uint64_t write_failures_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_warning_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

/// The part of a session id that ListGroups, error messages and the audit log show (its
/// first 8 characters and "..."): the whole id is the session's only credential
/// (LeaveGroup, GetGroupEndpoints check it), so no reply or log line may carry it.
std::string RedactSessionId(const std::string& id);

/// The event of an UpdateRankMask call by `caller` (its SO_PEERCRED) that ended with
/// `result`: group, the caller's rank, and "mask [..] unmask [..] clean" as the detail,
/// each list naming at most 64 ranks, then "and N more".
AuditEvent RankMaskEvent(const PeerCredentials& caller, const v1::UpdateRankMaskRequest& request,
                         const absl::Status& result);

/// Records `event` when `log` is not null (the audit log is off otherwise).
inline void Audit(AuditLog* log, const AuditEvent& event) {
  if (log != nullptr) log->Record(event);
}

}  // namespace epd
