#include "common/os/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/errors/reason.h"

namespace epd {
namespace {

absl::Status Errno(const std::string& what, int err) {
  std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOSPC:
    case ENOMEM:
    case EMFILE:
    case ENFILE:
      return errors::WithReason(absl::ResourceExhaustedError(msg), errors::Reason::kShmFailed);
    default:
      return errors::WithReason(absl::InternalError(msg), errors::Reason::kShmFailed);
  }
}

}  // namespace

std::string MissingSealNames(int seals) {
  std::string names;
  for (const auto& [bit, name] : {std::pair<int, const char*>{F_SEAL_SHRINK, "F_SEAL_SHRINK"},
                                  {F_SEAL_GROW, "F_SEAL_GROW"},
                                  {F_SEAL_SEAL, "F_SEAL_SEAL"}}) {
    if ((seals & bit) == 0) absl::StrAppend(&names, names.empty() ? "" : "|", name);
  }
  return names;
}

ShmRegion::~ShmRegion() { Reset(); }

ShmRegion::ShmRegion(ShmRegion&& o) noexcept
    : addr_(std::exchange(o.addr_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      fd_(std::move(o.fd_)) {}

ShmRegion& ShmRegion::operator=(ShmRegion&& o) noexcept {
  if (this != &o) {
    Reset();
    addr_ = std::exchange(o.addr_, nullptr);
    size_ = std::exchange(o.size_, 0);
    fd_ = std::move(o.fd_);
  }
  return *this;
}

void ShmRegion::Reset() {
  if (addr_ != nullptr) ::munmap(addr_, size_);
  addr_ = nullptr;
  size_ = 0;
  fd_.Reset();
}

absl::StatusOr<ShmRegion> ShmRegion::Create(const char* debug_name, uint64_t bytes) {
  if (bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat("shared region ", debug_name, " of 0 bytes"));
  }
  ScopedFd fd(::memfd_create(debug_name, MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return Errno(absl::StrCat("memfd_create(", debug_name, ")"), errno);
  // posix_fallocate sizes the file and reserves its pages now, so a shortage fails here
  // with ENOSPC/ENOMEM instead of SIGBUS on first touch.
  if (int err = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(bytes)); err != 0) {
    return Errno(absl::StrCat("reserving ", bytes, " bytes of shared memory for ", debug_name),
                 err);
  }
  if (::fcntl(fd.get(), F_ADD_SEALS, kRequiredSeals) != 0) {
    return Errno(absl::StrCat("sealing ", debug_name, " (F_ADD_SEALS)"), errno);
  }
  void* addr = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (addr == MAP_FAILED) return Errno(absl::StrCat("mmap of ", debug_name), errno);
  ShmRegion r;
  r.addr_ = addr;
  r.size_ = bytes;
  r.fd_ = std::move(fd);
  return r;
}

absl::StatusOr<ShmRegion> ShmRegion::Map(ScopedFd fd, uint64_t expected_bytes,
                                         absl::string_view what) {
  if (!fd.valid()) return absl::InvalidArgumentError(absl::StrCat(what, ": no file descriptor"));
  const int seals = ::fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": the file descriptor epd handed over is not a sealable memfd (F_GET_SEALS: ",
        std::strerror(errno), "); refusing to map it"));
  }
  if ((seals & kRequiredSeals) != kRequiredSeals) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": the memfd lacks the seal(s) ", MissingSealNames(seals),
                     ", so its size could change under the mapping; refusing to map it"));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return Errno(absl::StrCat("fstat of ", what), errno);
  if (st.st_size < 0 || static_cast<uint64_t>(st.st_size) != expected_bytes) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": the memfd has ", st.st_size, " bytes, expected ", expected_bytes));
  }
  void* addr = ::mmap(nullptr, expected_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (addr == MAP_FAILED) return Errno(absl::StrCat("mmap of ", what), errno);
  ShmRegion r;
  r.addr_ = addr;
  r.size_ = expected_bytes;
  return r;  // `fd` closes here; the mapping stays.
}

absl::StatusOr<ScopedFd> ShmRegion::DupFd() const {
  if (!fd_.valid()) {
    return absl::FailedPreconditionError("the shared region no longer holds a file descriptor");
  }
  ScopedFd copy(::fcntl(fd_.get(), F_DUPFD_CLOEXEC, 0));
  if (!copy.valid()) return Errno("dup of a shared region's file descriptor", errno);
  return copy;
}

absl::StatusOr<uint64_t> ShmFreeBytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    // "MemAvailable:   12345678 kB"
    std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
    uint64_t kib = 0;
    if (words.size() >= 2 && words[0] == "MemAvailable:" && absl::SimpleAtoi(words[1], &kib)) {
      return kib * 1024;
    }
  }
  return absl::InternalError("cannot read MemAvailable from /proc/meminfo");
}

}  // namespace epd
