// RAII for the shared-memory regions of proto/abi/shm_abi.h: sealed memfds that the daemon
// creates (ShmRegion::Create) and libepdclient maps from a descriptor the daemon handed it
// (ShmRegion::Map). docs/SECURITY.md "Shared memory the client cannot resize".
#pragma once

#include <fcntl.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/os/scoped_fd.h"

namespace epd {

/// The seals every shared region carries (ShmRegion::Create), and which ShmRegion::Map
/// requires: its size can never change again (ftruncate, and fallocate beyond the end,
/// fail with EPERM for everyone, so no mapping of it can be cut short: no SIGBUS), and no
/// seal can be added or removed.
inline constexpr int kRequiredSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

/// A mapped, size-sealed shared-memory file (memfd): an endpoint region or a doorbell page
/// of proto/abi/shm_abi.h. It has no name anywhere (nothing in /dev/shm): a process reaches it
/// only through a file descriptor, which epd hands to the client that holds the endpoint
/// (SCM_RIGHTS on the fd channel, common/os/fd_frame.h). Move-only; the destructor unmaps and
/// closes the descriptor it still holds. The mapping stays valid after the descriptor is
/// closed (CloseFd, TakeFd).
class ShmRegion {
 public:
  ShmRegion() = default;
  ~ShmRegion();
  ShmRegion(ShmRegion&& o) noexcept;
  ShmRegion& operator=(ShmRegion&& o) noexcept;
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  /// Creates a zero-filled memfd of `bytes` named `debug_name` (shown only in
  /// /proc/<pid>/fd, e.g. "memfd:epd-ep"), reserves its pages (so a shortage of memory
  /// fails here with RESOURCE_EXHAUSTED, not with SIGBUS on first touch), seals it with
  /// kRequiredSeals, and maps it read-write. The region keeps its descriptor (fd()) until
  /// CloseFd/TakeFd. Errors: INVALID_ARGUMENT for 0 bytes, RESOURCE_EXHAUSTED when memory
  /// or file descriptors (EMFILE/ENFILE) run out, INTERNAL otherwise; each names the call.
  static absl::StatusOr<ShmRegion> Create(const char* debug_name, uint64_t bytes);

  /// Maps the region behind `fd` read-write (the client side), after checking that it is
  /// what epd creates: a memfd carrying kRequiredSeals (F_GET_SEALS) of exactly
  /// `expected_bytes` (fstat). Closes `fd` once mapped (the mapping stays). `what` names
  /// the region in errors ("endpoint region", "doorbell"). FAILED_PRECONDITION naming
  /// `what` and the missing seals or the sizes when the check fails (nothing is mapped);
  /// INVALID_ARGUMENT for an invalid fd; INTERNAL when mmap fails.
  static absl::StatusOr<ShmRegion> Map(ScopedFd fd, uint64_t expected_bytes,
                                       absl::string_view what);

  /// A new descriptor of the region (close-on-exec), e.g. to hand to a client while this
  /// region keeps its own. FAILED_PRECONDITION when the region holds none any more,
  /// RESOURCE_EXHAUSTED when the process is out of descriptors.
  absl::StatusOr<ScopedFd> DupFd() const;
  /// Gives up the region's descriptor to the caller (invalid when it holds none); the
  /// mapping stays.
  ScopedFd TakeFd() { return std::move(fd_); }
  /// The region's descriptor, -1 when it holds none.
  int fd() const { return fd_.get(); }

  uint8_t* data() const { return static_cast<uint8_t*>(addr_); }
  uint64_t size() const { return size_; }

 private:
  void Reset();
  void* addr_ = nullptr;
  uint64_t size_ = 0;
  ScopedFd fd_;
};

/// The seals of kRequiredSeals missing from `seals` (an F_GET_SEALS result), named
/// ("F_SEAL_SHRINK|F_SEAL_GROW"),
/// "" when it carries them all. For error messages.
std::string MissingSealNames(int seals);

/// Bytes of memory available for new regions (MemAvailable of /proc/meminfo): memfd pages
/// come from RAM and swap, not from the /dev/shm file system. INTERNAL when it cannot be
/// read.
absl::StatusOr<uint64_t> ShmFreeBytes();

}  // namespace epd
