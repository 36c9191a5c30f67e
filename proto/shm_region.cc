#include "shm_region.h"

#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace epd {
namespace {

std::string& CreatorTag() {
  static std::string tag;  // Set once at daemon start-up (SetCreatorTag).
  return tag;
}

std::string RandomHex128() {
  std::random_device rd;
  return absl::StrFormat("%08x%08x%08x%08x", rd(), rd(), rd(), rd());
}

absl::Status Errno(const std::string& what, int err) {
  std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(msg);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(msg);
    case ENOSPC:
    case ENOMEM:
      return absl::ResourceExhaustedError(msg);
    default:
      return absl::InternalError(msg);
  }
}

}  // namespace

void ScopedFd::Reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

ShmRegion::~ShmRegion() { Reset(); }

ShmRegion::ShmRegion(ShmRegion&& o) noexcept
    : addr_(std::exchange(o.addr_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      name_(std::move(o.name_)),
      linked_(std::exchange(o.linked_, false)) {}

ShmRegion& ShmRegion::operator=(ShmRegion&& o) noexcept {
  if (this != &o) {
    Reset();
    addr_ = std::exchange(o.addr_, nullptr);
    size_ = std::exchange(o.size_, 0);
    name_ = std::move(o.name_);
    linked_ = std::exchange(o.linked_, false);
  }
  return *this;
}

void ShmRegion::Reset() {
  if (addr_ != nullptr) ::munmap(addr_, size_);
  addr_ = nullptr;
  Unlink();
  size_ = 0;
}

void ShmRegion::Unlink() {
  if (linked_) ::shm_unlink(name_.c_str());
  linked_ = false;
}

std::string ShmCreatorTag(const std::string& socket_path) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a 64.
  for (unsigned char c : socket_path) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return absl::StrFormat("%016x", h);
}

void ShmRegion::SetCreatorTag(std::string tag) { CreatorTag() = std::move(tag); }

absl::StatusOr<int> ShmRegion::RemoveStale(const std::string& tag) {
  if (tag.empty()) return absl::InvalidArgumentError("RemoveStale: empty creator tag");
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return Errno("opendir(/dev/shm)", errno);
  const std::string infix = absl::StrCat("-", tag, "-");
  std::vector<std::string> stale;
  while (const dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (name.rfind("epd-", 0) == 0 && name.find(infix) != std::string::npos) stale.push_back(name);
  }
  ::closedir(dir);
  int removed = 0;
  for (const std::string& name : stale) {
    if (::shm_unlink(absl::StrCat("/", name).c_str()) == 0) ++removed;
  }
  return removed;
}

absl::StatusOr<ShmRegion> ShmRegion::Create(const std::string& prefix, uint64_t bytes,
                                            uint32_t mode, const std::string& group) {
  if (bytes == 0) return absl::InvalidArgumentError("shm region of 0 bytes");
  ShmRegion r;
  const std::string& tag = CreatorTag();
  r.name_ = tag.empty() ? absl::StrCat("/", prefix, "-", RandomHex128())
                        : absl::StrCat("/", prefix, "-", tag, "-", RandomHex128());
  ScopedFd fd(::shm_open(r.name_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, mode & 0777));
  if (!fd.valid()) return Errno(absl::StrCat("shm_open(", r.name_, ")"), errno);
  r.linked_ = true;
  // shm_open applies the umask: set the mode explicitly.
  if (::fchmod(fd.get(), mode & 0777) != 0) return Errno("fchmod", errno);
  if (!group.empty()) {
    struct group* g = ::getgrnam(group.c_str());
    if (g == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("shm group '", group, "' does not exist"));
    }
    if (::fchown(fd.get(), static_cast<uid_t>(-1), g->gr_gid) != 0) {
      return Errno(absl::StrCat("fchown to group ", group), errno);
    }
  }
  // posix_fallocate reserves the pages now, so a full /dev/shm fails here with ENOSPC
  // instead of SIGBUS on first touch.
  int err = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(bytes));
  if (err != 0) {
    return Errno(absl::StrCat("reserving ", bytes, " bytes of shm for ", r.name_), err);
  }
  void* addr = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (addr == MAP_FAILED) return Errno("mmap", errno);
  r.addr_ = addr;
  r.size_ = bytes;
  return r;
}

absl::StatusOr<ShmRegion> ShmRegion::Open(const std::string& name, uint64_t expected_bytes) {
  ScopedFd fd(::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0));
  if (!fd.valid()) return Errno(absl::StrCat("shm_open(", name, ")"), errno);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return Errno("fstat", errno);
  if (static_cast<uint64_t>(st.st_size) != expected_bytes) {
    return absl::FailedPreconditionError(
        absl::StrCat("shm ", name, " has ", st.st_size, " bytes, expected ", expected_bytes));
  }
  void* addr = ::mmap(nullptr, expected_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (addr == MAP_FAILED) return Errno("mmap", errno);
  ShmRegion r;
  r.addr_ = addr;
  r.size_ = expected_bytes;
  r.name_ = name;
  r.linked_ = false;  // The creator owns the name.
  return r;
}

absl::StatusOr<uint64_t> ShmFreeBytes() {
  struct statvfs st {};
  if (::statvfs("/dev/shm", &st) != 0) return Errno("statvfs(/dev/shm)", errno);
  return static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
}

void FutexWait(uint32_t* word, uint32_t expected, int64_t timeout_us) {
  struct timespec ts;
  ts.tv_sec = timeout_us / 1000000;
  ts.tv_nsec = (timeout_us % 1000000) * 1000;
  ::syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWakeAll(uint32_t* word) {
  ::syscall(SYS_futex, word, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

bool RingDoorbell(abi::DoorbellPage* doorbell) {
  if (abi::Atomic(doorbell->engine_sleeping).load(std::memory_order_seq_cst) == 0) return false;
  abi::Atomic(doorbell->futex_word).fetch_add(1, std::memory_order_seq_cst);
  FutexWakeAll(&doorbell->futex_word);
  return true;
}

}  // namespace epd
