#include "shm_region.h"

#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/futex.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <mutex>
#include <random>
#include <set>
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

/// The names of the regions this process created and still holds (ShmRegion::Create until
/// Unlink), which RemoveStale skips without opening them.
class HeldNames {
 public:
  static HeldNames& Get() {
    // Destroyed at exit, like CreatorTag(): no ShmRegion may be a static (none is).
    static HeldNames names;
    return names;
  }
  void Add(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    names_.insert(name);
  }
  void Remove(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    names_.erase(name);
  }
  bool Contains(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    return names_.count(name) != 0;
  }

 private:
  std::mutex mu_;
  std::set<std::string> names_;
};

/// Whether `name` ("/epd-...") in /dev/shm is still the object open as `fd`.
bool NameIsOpenFile(const std::string& name, int fd) {
  struct stat by_name {};
  struct stat by_fd {};
  if (::stat(absl::StrCat("/dev/shm", name).c_str(), &by_name) != 0) return false;
  if (::fstat(fd, &by_fd) != 0) return false;
  return by_name.st_dev == by_fd.st_dev && by_name.st_ino == by_fd.st_ino;
}

/// How many times Create tries a fresh name when another process's RemoveStale took the
/// new name between its creation and its lock (each try is a few syscalls).
constexpr int kMaxCreateAttempts = 8;

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
    case EMFILE:
    case ENFILE:
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
      linked_(std::exchange(o.linked_, false)),
      hold_(std::move(o.hold_)) {}

ShmRegion& ShmRegion::operator=(ShmRegion&& o) noexcept {
  if (this != &o) {
    Reset();
    addr_ = std::exchange(o.addr_, nullptr);
    size_ = std::exchange(o.size_, 0);
    name_ = std::move(o.name_);
    linked_ = std::exchange(o.linked_, false);
    hold_ = std::move(o.hold_);
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
  if (hold_.valid()) {
    // The name is gone first, then the lock: RemoveStale never sees a linked unheld name.
    HeldNames::Get().Remove(name_);
    hold_.Reset();
  }
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

absl::StatusOr<std::vector<std::string>> ShmRegion::NamesWithTag(const std::string& tag) {
  if (tag.empty()) return absl::InvalidArgumentError("shm creator tag is empty");
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return Errno("opendir(/dev/shm)", errno);
  const std::string infix = absl::StrCat("-", tag, "-");
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (name.rfind("epd-", 0) == 0 && name.find(infix) != std::string::npos) {
      names.push_back(absl::StrCat("/", name));
    }
  }
  ::closedir(dir);
  std::sort(names.begin(), names.end());
  return names;
}

absl::StatusOr<int> ShmRegion::RemoveStale(const std::string& tag, int* held) {
  if (held != nullptr) *held = 0;
  absl::StatusOr<std::vector<std::string>> candidates = NamesWithTag(tag);
  if (!candidates.ok()) return candidates.status();
  int removed = 0;
  for (const std::string& name : *candidates) {
    if (HeldNames::Get().Contains(name)) continue;  // Ours, and live.
    // Any access mode will do for flock; a region's mode may grant its owner only one.
    ScopedFd fd(::shm_open(name.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK, 0));
    if (!fd.valid() && errno == EACCES) {
      fd = ScopedFd(::shm_open(name.c_str(), O_WRONLY | O_CLOEXEC | O_NONBLOCK, 0));
    }
    if (!fd.valid()) continue;  // Gone meanwhile, or not ours to judge.
    if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
      if (errno == EWOULDBLOCK && held != nullptr) ++*held;  // Its creator is alive.
      continue;
    }
    // Still the object we hold exclusively (not unlinked and replaced meanwhile): no live
    // creator can take it any more (Create checks its name after taking its lock).
    if (NameIsOpenFile(name, fd.get()) && ::shm_unlink(name.c_str()) == 0) ++removed;
  }
  return removed;
}

absl::StatusOr<ShmRegion> ShmRegion::Create(const std::string& prefix, uint64_t bytes,
                                            uint32_t mode, const std::string& group) {
  if (bytes == 0) return absl::InvalidArgumentError("shm region of 0 bytes");
  ShmRegion r;
  const std::string& tag = CreatorTag();
  ScopedFd fd;
  for (int attempt = 0; !fd.valid(); ++attempt) {
    if (attempt == kMaxCreateAttempts) {
      return absl::InternalError(absl::StrCat("shm_open(/", prefix, "-...): ", kMaxCreateAttempts,
                                              " new names were each removed by another "
                                              "process's clean-up of stale regions before "
                                              "they could be locked"));
    }
    r = ShmRegion();
    r.name_ = tag.empty() ? absl::StrCat("/", prefix, "-", RandomHex128())
                          : absl::StrCat("/", prefix, "-", tag, "-", RandomHex128());
    fd = ScopedFd(::shm_open(r.name_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, mode & 0777));
    if (!fd.valid()) return Errno(absl::StrCat("shm_open(", r.name_, ")"), errno);
    r.linked_ = true;
    // Held from here on: RemoveStale (another epd's start-up clean-up) leaves it alone. Until
    // then a clean-up may have taken it (LOCK_EX) and unlinked it: then try a new name.
    if (::flock(fd.get(), LOCK_SH | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK) return Errno(absl::StrCat("flock(", r.name_, ")"), errno);
      fd.Reset();
    } else if (!NameIsOpenFile(r.name_, fd.get())) {
      r.linked_ = false;  // Already unlinked by a clean-up: not ours to unlink any more.
      fd.Reset();
    }
  }
  // shm_open applies the umask: set the mode explicitly.
  if (::fchmod(fd.get(), mode & 0777) != 0) return Errno("fchmod", errno);
  if (!group.empty()) {
    struct group* g = ::getgrnam(group.c_str());
    if (g == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("shm group '", group, "' does not exist"));
    }
    if (::fchown(fd.get(), static_cast<uid_t>(-1), g->gr_gid) != 0) {
      const int err = errno;
      const std::string what = absl::StrCat("cannot give shm region ", r.name_, " to group \"",
                                            group, "\" (gid ", g->gr_gid, ")");
      if (err != EPERM) return Errno(what, err);
      // Never advise joining group root: it gives far more than these files.
      const std::string fix =
          g->gr_gid == 0
              ? "set socket_group to a dedicated group instead of root (e.g. epd, which "
                "deploy/systemd/epd.sysusers creates) that epd's user is a member of, or run "
                "epd as root"
              : absl::StrCat("add it to the group (e.g. `usermod -aG ", group,
                             " <user>`, then restart epd), choose a group it is in, or run epd "
                             "as root");
      return absl::PermissionDeniedError(
          absl::StrCat(what, ": ", std::strerror(err), "; epd's user (uid ", ::geteuid(),
                       ") must be a member of group \"", group,
                       "\" (socket_group) to give it its files: ", fix));
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
  r.hold_ = std::move(fd);
  HeldNames::Get().Add(r.name_);
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
