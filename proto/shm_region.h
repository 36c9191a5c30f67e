// RAII for the POSIX shm regions of proto/shm_abi.h, used by the daemon (creates) and by
// libepdclient (opens). Move-only; the destructor unmaps, and unlinks when it still owns
// the name. A created region is held with flock(LOCK_SH) while its name exists, so that no
// other process's clean-up of leftovers (RemoveStale) deletes a live region.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "shm_abi.h"

namespace epd {

/// A move-only file descriptor.
class ScopedFd {
 public:
  ScopedFd() = default;
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() { Reset(); }
  ScopedFd(ScopedFd&& o) noexcept : fd_(o.Release()) {}
  ScopedFd& operator=(ScopedFd&& o) noexcept {
    if (this != &o) Reset(o.Release());
    return *this;
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int Release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void Reset(int fd = -1);

 private:
  int fd_ = -1;
};

/// The shm creator tag of a daemon serving `socket_path`: 16 hex digits of the 64-bit
/// FNV-1a hash of the path (stable across builds and runs, so an epd restarted on the same
/// socket finds what the previous one left; see ShmRegion::SetCreatorTag).
std::string ShmCreatorTag(const std::string& socket_path);

/// A mapped POSIX shared-memory object.
class ShmRegion {
 public:
  ShmRegion() = default;
  ~ShmRegion();
  ShmRegion(ShmRegion&& o) noexcept;
  ShmRegion& operator=(ShmRegion&& o) noexcept;
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  /// Sets the creator tag of this process (empty by default): from then on Create names
  /// objects `/<prefix>-<tag>-<random>`, so that a later process with the same tag can
  /// find and remove what this one left behind if it is killed (RemoveStale). The daemon
  /// sets ShmCreatorTag(its socket path) once at start-up, before creating any region.
  /// Not thread-safe against concurrent Create calls.
  static void SetCreatorTag(std::string tag);

  /// The names ("/epd-...", sorted) of the POSIX shm objects (files in /dev/shm) that carry
  /// creator tag `tag`: those starting with "epd-" and containing "-<tag>-", live or not.
  /// INTERNAL when /dev/shm cannot be read; `tag` must be non-empty (INVALID_ARGUMENT).
  static absl::StatusOr<std::vector<std::string>> NamesWithTag(const std::string& tag);

  /// Unlinks the POSIX shm objects with creator tag `tag` (NamesWithTag) that no live
  /// process holds: the regions of an earlier process
  /// with this creator tag that could not unlink them (an epd on the same socket that was
  /// SIGKILLed). A region held by a live creator (Create: flock(LOCK_SH) until its name is
  /// unlinked) is left alone, whoever that creator is: the lock is on the tmpfs inode, so
  /// this holds across mount and pid namespaces that share /dev/shm (e.g. the same socket
  /// path in a container with --ipc=host). Each candidate is opened and taken with
  /// flock(LOCK_EX|LOCK_NB) before its name is unlinked; names of this process's own live
  /// regions are skipped without opening them. A name that cannot be opened (another
  /// user's, mode without read or write for us) is left alone. Processes that still map a
  /// removed region (clients: Open holds no lock) keep their mapping; only the name goes.
  /// Returns how many names were removed, and in `*held` (when not null) how many were
  /// left because another live process holds them. INTERNAL when /dev/shm cannot be read;
  /// `tag` must be non-empty (INVALID_ARGUMENT).
  static absl::StatusOr<int> RemoveStale(const std::string& tag, int* held = nullptr);

  /// Creates a new object named `/<prefix>-<128 random bits in hex>` (with a creator tag:
  /// `/<prefix>-<tag>-<random>`; O_EXCL), sizes it to `bytes` (zero-filled), sets `mode`
  /// (e.g. 0600) and, when `group` is not empty, its group, and maps it read-write. The
  /// region keeps one file descriptor open, holding flock(LOCK_SH) on the object, until
  /// its name is unlinked (Unlink, destruction): that is what tells RemoveStale in any
  /// process that the name is live. So a process has one fd per region whose name still
  /// exists (the daemon unlinks an endpoint's name once both sides mapped it; its engines'
  /// doorbell pages keep theirs, one fd each). Errors: RESOURCE_EXHAUSTED when /dev/shm
  /// cannot hold `bytes` or the process is out of file descriptors (EMFILE), INVALID_ARGUMENT
  /// for an unknown group, PERMISSION_DENIED naming the region and the group when this
  /// process may not give files to `group` (its user is not a member and it is not root),
  /// INTERNAL otherwise.
  static absl::StatusOr<ShmRegion> Create(const std::string& prefix, uint64_t bytes, uint32_t mode,
                                          const std::string& group);

  /// Opens and maps an existing object read-write (the client side). `expected_bytes` must
  /// match its size. Holds no lock and keeps no fd once mapped, so a client's mapping never
  /// keeps RemoveStale from removing the name of a dead creator's region. Errors: NOT_FOUND
  /// (no such name), PERMISSION_DENIED, FAILED_PRECONDITION (size).
  static absl::StatusOr<ShmRegion> Open(const std::string& name, uint64_t expected_bytes);

  /// Removes the name (the mapping stays valid) and, for a created region, closes the fd
  /// that held it (RemoveStale has no name left to look at). Idempotent.
  void Unlink();

  uint8_t* data() const { return static_cast<uint8_t*>(addr_); }
  uint64_t size() const { return size_; }
  const std::string& name() const { return name_; }
  bool linked() const { return linked_; }

 private:
  void Reset();
  void* addr_ = nullptr;
  uint64_t size_ = 0;
  std::string name_;
  bool linked_ = false;
  ScopedFd hold_;  // Create only: flock(LOCK_SH) on the object while the name is linked.
};

/// Bytes free in the filesystem behind POSIX shm (/dev/shm).
absl::StatusOr<uint64_t> ShmFreeBytes();

/// FUTEX_WAIT on a shared (non-private) futex word while it equals `expected`, for at
/// most `timeout_us` microseconds. Returns on wake, timeout, or value change.
void FutexWait(uint32_t* word, uint32_t expected, int64_t timeout_us);
/// FUTEX_WAKE every waiter of a shared futex word.
void FutexWakeAll(uint32_t* word);

/// Client side of the engine doorbell (shm_abi.h DoorbellPage): call after publishing a
/// request; wakes the engine when it sleeps (one futex syscall only in that case).
/// Returns true when it had to wake the engine.
bool RingDoorbell(abi::DoorbellPage* doorbell);

}  // namespace epd
