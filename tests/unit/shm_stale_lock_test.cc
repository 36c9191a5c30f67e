// The start-up clean-up of leftover shm regions (ShmRegion::RemoveStale, proto/shm_region.h)
// removes only regions no live process holds: every region ShmRegion::Create makes is held
// with flock(LOCK_SH) for as long as its name exists, so another epd whose socket path
// hashes to the same creator tag (the same socket path in another mount namespace sharing
// /dev/shm) cannot delete a live epd's doorbell page or endpoint regions. A client's own
// mapping (ShmRegion::Open) holds nothing, so it never keeps a dead epd's leftovers.
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "shm_region.h"

namespace epd {
namespace {

constexpr uint64_t kBytes = 4096;

/// Whether `name` ("/epd-...") is a name in /dev/shm.
bool ShmNameExists(const std::string& name) {
  return ::access(absl::StrCat("/dev/shm", name).c_str(), F_OK) == 0;
}

/// A leftover region nobody holds, as a SIGKILLed epd (or one of an older build) leaves it.
std::string MakeUnheldLeftover(const std::string& tag) {
  const std::string name = absl::StrCat("/epd-doorbell-", tag, "-leftover", ::getpid());
  ScopedFd fd(::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  EXPECT_TRUE(fd.valid()) << name << ": " << std::strerror(errno);
  EXPECT_EQ(::ftruncate(fd.get(), kBytes), 0);
  return name;
}

/// A child process that creates one region with `tag` (ShmRegion::Create) and keeps it
/// until told to go (Release) or killed (Kill): another live epd, as far as /dev/shm can
/// tell.
class CreatorProcess {
 public:
  explicit CreatorProcess(const std::string& tag) {
    int to_child[2], to_parent[2];
    if (::pipe2(to_child, O_CLOEXEC) != 0 || ::pipe2(to_parent, O_CLOEXEC) != 0) {
      ADD_FAILURE() << "pipe2: " << std::strerror(errno);
      return;
    }
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(to_child[1]);
      ::close(to_parent[0]);
      ShmRegion::SetCreatorTag(tag);
      absl::StatusOr<ShmRegion> region = ShmRegion::Create("epd-doorbell", kBytes, 0600, "");
      const std::string reply = region.ok() ? region->name() : "";
      (void)!::write(to_parent[1], reply.data(), reply.size());
      ::close(to_parent[1]);
      char byte;
      (void)!::read(to_child[0], &byte, 1);  // Until Release() (EOF) or SIGKILL.
      std::_Exit(0);                         // Like a crash: no destructor unlinks the name.
    }
    ::close(to_child[0]);
    ::close(to_parent[1]);
    to_child_ = ScopedFd(to_child[1]);
    ScopedFd from_child(to_parent[0]);
    char buffer[256];
    ssize_t n;
    while ((n = ::read(from_child.get(), buffer, sizeof(buffer))) > 0) name_.append(buffer, n);
  }
  ~CreatorProcess() { Kill(); }

  /// The region's name ("" when the child could not create it).
  const std::string& name() const { return name_; }
  /// SIGKILL and reap: the kernel drops the child's locks.
  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  ScopedFd to_child_;
  std::string name_;
};

class ShmStaleLockTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tag_ = ShmCreatorTag(
        absl::StrCat("/shm-stale-lock-test/", ::getpid(), "/",
                     ::testing::UnitTest::GetInstance()->current_test_info()->name()));
  }
  void TearDown() override {
    ShmRegion::SetCreatorTag("");
    for (const std::string& name : cleanup_) ::shm_unlink(name.c_str());
  }
  std::string tag_;
  std::vector<std::string> cleanup_;  ///< Names to unlink whatever the test did.
};

// The bug: an epd whose creator tag matches a live epd's (the same socket path in another
// mount namespace) deleted the live epd's regions at start-up.
TEST_F(ShmStaleLockTest, RegionOfALiveCreatorInThisProcessIsKept) {
  ShmRegion::SetCreatorTag(tag_);
  absl::StatusOr<ShmRegion> live = ShmRegion::Create("epd-doorbell", kBytes, 0600, "");
  ASSERT_TRUE(live.ok()) << live.status();
  const std::string leftover = MakeUnheldLeftover(tag_);
  cleanup_ = {live->name(), leftover};

  absl::StatusOr<int> removed = ShmRegion::RemoveStale(tag_);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_TRUE(ShmNameExists(live->name())) << live->name() << " was removed while held";
  EXPECT_FALSE(ShmNameExists(leftover)) << leftover << " (held by nobody) was kept";
  EXPECT_EQ(*removed, 1);
  // The live region still works, and its owner still unlinks it.
  live->data()[0] = 42;
  absl::StatusOr<ShmRegion> peer = ShmRegion::Open(live->name(), kBytes);
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_EQ(peer->data()[0], 42);
  const std::string name = live->name();
  *live = ShmRegion();
  EXPECT_FALSE(ShmNameExists(name));
}

// The same across processes (the lock is on the inode, so it holds whatever the mount or
// pid namespaces of the two epd are, as long as they share /dev/shm).
TEST_F(ShmStaleLockTest, RegionOfALiveCreatorInAnotherProcessIsKeptUntilItDies) {
  CreatorProcess creator(tag_);
  ASSERT_FALSE(creator.name().empty());
  cleanup_ = {creator.name()};
  ASSERT_TRUE(ShmNameExists(creator.name()));

  absl::StatusOr<int> removed = ShmRegion::RemoveStale(tag_);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(*removed, 0);
  EXPECT_TRUE(ShmNameExists(creator.name())) << "removed while its creator is alive";

  creator.Kill();  // SIGKILL: its name stays, held by nobody.
  ASSERT_TRUE(ShmNameExists(creator.name()));
  removed = ShmRegion::RemoveStale(tag_);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(*removed, 1);
  EXPECT_FALSE(ShmNameExists(creator.name()));
}

// A client's mapping (ShmRegion::Open) holds no lock: a killed epd's regions that clients
// still map are removed by the next epd (the clients keep their mappings).
TEST_F(ShmStaleLockTest, AClientsMappingDoesNotKeepADeadCreatorsRegion) {
  CreatorProcess creator(tag_);
  ASSERT_FALSE(creator.name().empty());
  cleanup_ = {creator.name()};
  absl::StatusOr<ShmRegion> client = ShmRegion::Open(creator.name(), kBytes);
  ASSERT_TRUE(client.ok()) << client.status();
  creator.Kill();

  absl::StatusOr<int> removed = ShmRegion::RemoveStale(tag_);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(*removed, 1);
  EXPECT_FALSE(ShmNameExists(creator.name()));
  client->data()[kBytes - 1] = 7;  // The mapping stays valid.
  EXPECT_EQ(client->data()[kBytes - 1], 7);
}

// The hold moves with the region, and ends with its name: a region whose name its owner
// already unlinked (endpoints do once both sides mapped it) needs no lock.
TEST_F(ShmStaleLockTest, MovedRegionStaysHeld) {
  ShmRegion::SetCreatorTag(tag_);
  absl::StatusOr<ShmRegion> created = ShmRegion::Create("epd-ep", kBytes, 0600, "");
  ASSERT_TRUE(created.ok()) << created.status();
  ShmRegion moved(*std::move(created));
  ShmRegion assigned;
  assigned = std::move(moved);
  cleanup_ = {assigned.name()};
  absl::StatusOr<int> removed = ShmRegion::RemoveStale(tag_);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(*removed, 0);
  EXPECT_TRUE(ShmNameExists(assigned.name()));
  assigned.Unlink();
  EXPECT_FALSE(ShmNameExists(assigned.name()));
  EXPECT_TRUE(assigned.data() != nullptr);
}

// Finding 8: a socket_group epd's user is not in. The message names the region and says
// what to do. As root (CI), the region is created by a child that dropped to nobody.
TEST(ShmRegionGroupTest, GroupTheUserIsNotInNamesTheRegionAndTheMembership) {
  const group* root_group = ::getgrnam("root");
  if (root_group == nullptr) GTEST_SKIP() << "this machine has no group \"root\"";
  if (::geteuid() != 0) {
    std::vector<gid_t> groups(::getgroups(0, nullptr) + 1);
    groups.resize(::getgroups(static_cast<int>(groups.size()), groups.data()));
    groups.push_back(::getegid());
    for (gid_t g : groups) {
      if (g == 0) GTEST_SKIP() << "the test user is in group root (gid 0)";
    }
  }
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        if (::geteuid() == 0 &&
            (::setgroups(0, nullptr) != 0 || ::setgid(65534) != 0 || ::setuid(65534) != 0)) {
          std::fprintf(stderr, "cannot drop to uid/gid 65534: %s\n", std::strerror(errno));
          std::_Exit(4);
        }
        absl::StatusOr<ShmRegion> r = ShmRegion::Create("epd-grouptest", kBytes, 0660, "root");
        std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
        std::_Exit(r.ok() ? 3 : 0);
      },
      ::testing::ExitedWithCode(0),
      "PERMISSION_DENIED: .*/epd-grouptest-[0-9a-f]+.* group \"root\" \\(gid 0\\).*"
      "must be a member of group \"root\".*or run epd as root");
}

}  // namespace
}  // namespace epd
