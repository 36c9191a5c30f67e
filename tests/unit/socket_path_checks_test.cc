// daemon/server/socket_path_checks.h: which socket directories epd accepts
// (ClassifySocketDirectory, from lstat results, so every owner and mode is covered without root),
// and the checks of the real file system that PrepareSocketPath makes before it creates anything.
#include "daemon/server/socket_path_checks.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace epd {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr char kSocket[] = "/srv/x/epd.sock";
constexpr uid_t kEpd = 990;  // epd's uid when it runs as a service user.

DirectoryStat Dir(uid_t uid, mode_t mode, gid_t gid = 0) {
  DirectoryStat d;
  d.path = "/srv/x";
  d.uid = uid;
  d.gid = gid;
  d.mode = S_IFDIR | mode;
  d.owner_name = uid == 0 ? "root" : uid == kEpd ? "epd" : "alice";
  d.group_name = gid == 0 ? "root" : "staff";
  return d;
}

TEST(ClassifySocketDirectory, OwnedByRootOrEpdAndWritableByTheOwnerAloneIsAccepted) {
  for (uid_t owner : {uid_t{0}, kEpd}) {
    for (mode_t mode : {0755, 0750, 0700, 0711, 0555}) {
      EXPECT_TRUE(ClassifySocketDirectory(kSocket, Dir(owner, mode), kEpd).ok())
          << "owner " << owner << " mode " << std::oct << mode;
    }
  }
  // A root epd trusts root alone.
  EXPECT_TRUE(ClassifySocketDirectory(kSocket, Dir(0, 0755), 0).ok());
}

// /tmp: others may add entries, but with the sticky bit they cannot remove or rename epd's.
TEST(ClassifySocketDirectory, WorldWritableWithTheStickyBitIsAccepted) {
  EXPECT_TRUE(ClassifySocketDirectory(kSocket, Dir(0, 01777), 0).ok());
  EXPECT_TRUE(ClassifySocketDirectory(kSocket, Dir(0, 01777), kEpd).ok());
  EXPECT_TRUE(ClassifySocketDirectory(kSocket, Dir(kEpd, 01770, 50), kEpd).ok());
}

TEST(ClassifySocketDirectory, WritableByGroupOrOthersWithoutStickyBitIsRefused) {
  struct Case {
    mode_t mode;
    const char* who;
  };
  for (const Case& c : {Case{0777, "every user"}, Case{0757, "every user"},
                        Case{0775, "every member of group staff (gid 50)"},
                        Case{0770, "every member of group staff (gid 50)"}}) {
    const absl::Status status = ClassifySocketDirectory(kSocket, Dir(0, c.mode, 50), 0);
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << std::oct << c.mode;
    char mode_text[8];
    std::snprintf(mode_text, sizeof(mode_text), "%04o", c.mode);
    EXPECT_THAT(std::string(status.message()),
                AllOf(HasSubstr(std::string("socket_path: ") + kSocket),
                      HasSubstr("/srv/x (owner root (uid 0), group staff (gid 50), mode " +
                                std::string(mode_text) + ")"),
                      HasSubstr(std::string("writable by ") + c.who), HasSubstr("no sticky bit"),
                      HasSubstr("chmod go-w /srv/x"), HasSubstr("chmod +t /srv/x")));
  }
}

// Another user owns it: whatever the mode (and even with the sticky bit: the owner may
// remove anything in it), that user can replace the socket and the lock file.
TEST(ClassifySocketDirectory, OwnedByAnotherUserIsRefusedWhateverTheMode) {
  for (uid_t epd_uid : {uid_t{0}, kEpd}) {
    for (mode_t mode : {0700, 0755, 0777, 01777}) {
      const absl::Status status = ClassifySocketDirectory(kSocket, Dir(1000, mode), epd_uid);
      EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition)
          << std::oct << mode << " epd uid " << std::dec << epd_uid;
      EXPECT_THAT(std::string(status.message()),
                  AllOf(HasSubstr("/srv/x (owner alice (uid 1000)"),
                        HasSubstr("belongs to another user than root and epd's (uid " +
                                  std::to_string(epd_uid) + ")"),
                        HasSubstr("/run/epd")));
    }
  }
  // Names missing from the user and group databases show as numbers.
  DirectoryStat unnamed = Dir(4242, 0755, 4243);
  unnamed.owner_name.clear();
  unnamed.group_name.clear();
  EXPECT_THAT(std::string(ClassifySocketDirectory(kSocket, unnamed, 0).message()),
              HasSubstr("(owner uid 4242, group gid 4243, mode 0755)"));
}

TEST(ClassifySocketDirectory, NotADirectoryIsRefused) {
  DirectoryStat file = Dir(0, 0644);
  file.mode = S_IFREG | 0644;
  EXPECT_THAT(std::string(ClassifySocketDirectory(kSocket, file, 0).message()),
              HasSubstr("/srv/x is not a directory (a regular file)"));
}

TEST(FileTypeName, NamesEveryType) {
  EXPECT_EQ(FileTypeName(S_IFREG), "a regular file");
  EXPECT_EQ(FileTypeName(S_IFDIR), "a directory");
  EXPECT_EQ(FileTypeName(S_IFLNK), "a symbolic link");
  EXPECT_EQ(FileTypeName(S_IFIFO), "a FIFO");
  EXPECT_EQ(FileTypeName(S_IFSOCK), "a socket");
  EXPECT_EQ(FileTypeName(S_IFCHR), "a character device");
  EXPECT_EQ(FileTypeName(S_IFBLK), "a block device");
}

/// A fresh directory of this user, mode 0700, under the test's temporary directory.
std::string FreshDir() {
  std::string pattern = ::testing::TempDir() + "epd_sockdir_XXXXXX";
  const char* made = ::mkdtemp(pattern.data());
  EXPECT_NE(made, nullptr);
  return pattern;
}

TEST(CheckSocketPathIsFreeOrASocket, RefusesAnythingButASocketNamingItsType) {
  const std::string dir = FreshDir();
  std::ofstream(dir + "/file") << "x";
  ASSERT_EQ(::mkdir((dir + "/dir").c_str(), 0700), 0);
  ASSERT_EQ(::symlink((dir + "/file").c_str(), (dir + "/link").c_str()), 0);
  ASSERT_EQ(::mkfifo((dir + "/fifo").c_str(), 0600), 0);
  for (const auto& [name, type] : {std::pair<const char*, const char*>{"file", "a regular file"},
                                   {"dir", "a directory"},
                                   {"link", "a symbolic link"},
                                   {"fifo", "a FIFO"}}) {
    const absl::Status status = CheckSocketPathIsFreeOrASocket(dir + "/" + name);
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << name;
    EXPECT_THAT(std::string(status.message()),
                HasSubstr(dir + "/" + name + " exists and is not a socket (it is " + type + ")"));
  }
  EXPECT_TRUE(CheckSocketPathIsFreeOrASocket(dir + "/missing").ok());
  // A socket (live or stale) is the caller's to probe.
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string socket = dir + "/s";
  ASSERT_LT(socket.size(), sizeof(addr.sun_path));
  std::memcpy(addr.sun_path, socket.c_str(), socket.size() + 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ::close(fd);
  EXPECT_TRUE(CheckSocketPathIsFreeOrASocket(socket).ok());
  std::filesystem::remove_all(dir);
}

// The real file system: the socket's directory and every one above it are checked; a
// missing socket directory is created 0755 whatever the umask, and then passes.
TEST(CheckSocketDirectories, ChecksTheWholeChainAndCreatesMissingDirectoriesSafely) {
  const std::string dir = FreshDir();
  EXPECT_TRUE(CheckSocketDirectories(dir + "/epd.sock", ::geteuid()).ok());
  ASSERT_EQ(::chmod(dir.c_str(), 0777), 0);
  // Refused below it too: a directory above the socket's could be swapped as a whole.
  for (const std::string socket : {dir + "/epd.sock", dir + "/a/b/epd.sock"}) {
    const absl::Status status = CheckSocketDirectories(socket, ::geteuid());
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << socket;
    EXPECT_THAT(std::string(status.message()),
                AllOf(HasSubstr(dir + " (owner "), HasSubstr("mode 0777"),
                      HasSubstr("writable by every user")));
  }
  ASSERT_EQ(::chmod(dir.c_str(), 0700), 0);
  const mode_t old_umask = ::umask(0);
  std::string created;
  ASSERT_TRUE(CreateSocketDirectories(dir + "/a/b/epd.sock", &created).ok());
  ::umask(old_umask);
  EXPECT_EQ(created, dir + "/a");
  struct stat st {};
  ASSERT_EQ(::stat((dir + "/a/b").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0755u);
  EXPECT_TRUE(CheckSocketDirectories(dir + "/a/b/epd.sock", ::geteuid()).ok());
  ASSERT_TRUE(CreateSocketDirectories(dir + "/a/b/epd.sock", &created).ok());
  EXPECT_EQ(created, "");
  std::filesystem::remove_all(dir);
}

DirectoryStat Link(uid_t uid) {
  DirectoryStat link;
  link.path = "/tmp/evil";
  link.uid = uid;
  link.gid = uid;
  link.mode = S_IFLNK | 0777;
  link.owner_name = uid == 0 ? "root" : uid == kEpd ? "epd" : "nobody";
  link.group_name = "nogroup";
  return link;
}

// A link owned by root or epd's user cannot be replaced by anyone else (in a sticky
// directory only an entry's owner may remove it); files that are not links are not its
// business.
TEST(ClassifySocketPathLink, LinkOwnedByRootOrEpdAndFilesThatAreNotLinksAreAccepted) {
  EXPECT_TRUE(ClassifySocketPathLink(kSocket, Link(0), "/run/epd", kEpd).ok());
  EXPECT_TRUE(ClassifySocketPathLink(kSocket, Link(kEpd), "/run/epd", kEpd).ok());
  EXPECT_TRUE(ClassifySocketPathLink(kSocket, Link(0), "/run/epd", 0).ok());
  EXPECT_TRUE(ClassifySocketPathLink(kSocket, Dir(65534, 0755), "", 0).ok());
}

// `ln -s /run/epdtarget /tmp/evil` by nobody: nobody may later point /tmp/evil at a
// directory of its own, where clients would meet its socket.
TEST(ClassifySocketPathLink, LinkOwnedByAnotherUserIsRefusedNamingItsOwnerAndTheFix) {
  for (uid_t epd_uid : {uid_t{0}, kEpd}) {
    const absl::Status status =
        ClassifySocketPathLink("/tmp/evil/epd.sock", Link(65534), "/run/epdtarget", epd_uid);
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(
        std::string(status.message()),
        AllOf(HasSubstr("socket_path: /tmp/evil/epd.sock"),
              HasSubstr("symbolic link /tmp/evil -> /run/epdtarget"),
              HasSubstr("belongs to nobody (uid 65534)"),
              HasSubstr("another user than root and epd's (uid " + std::to_string(epd_uid) + ")"),
              HasSubstr("realpath /tmp/evil"), HasSubstr("chown -h root /tmp/evil")));
  }
}

// The real file system: a link whose target passes, in a directory every user may write
// (so anyone could replace the link), is refused naming that directory; the same link in
// a directory of epd's own is accepted, and so is a chain of links. Links are followed no
// further than the kernel would.
TEST(CheckSocketDirectories, WalksTheConfiguredPathCheckingEveryLinkAndItsDirectory) {
  const std::string dir = FreshDir();
  ASSERT_EQ(::mkdir((dir + "/target").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((dir + "/open").c_str(), 0755), 0);
  ASSERT_EQ(::chmod((dir + "/open").c_str(), 0777), 0);
  ASSERT_EQ(::symlink((dir + "/target").c_str(), (dir + "/open/link").c_str()), 0);
  const absl::Status status = CheckSocketDirectories(dir + "/open/link/epd.sock", ::geteuid());
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr(dir + "/open (owner "), HasSubstr("mode 0777"),
                    HasSubstr("writable by every user")));

  ASSERT_EQ(::symlink("target", (dir + "/rel").c_str()), 0);
  ASSERT_EQ(::symlink((dir + "/rel").c_str(), (dir + "/chain").c_str()), 0);
  EXPECT_TRUE(CheckSocketDirectories(dir + "/chain/epd.sock", ::geteuid()).ok());
  EXPECT_TRUE(CheckSocketDirectories(dir + "/chain/new/epd.sock", ::geteuid()).ok());

  ASSERT_EQ(::symlink("loop", (dir + "/loop").c_str()), 0);
  const absl::Status loop = CheckSocketDirectories(dir + "/loop/epd.sock", ::geteuid());
  EXPECT_EQ(loop.code(), absl::StatusCode::kFailedPrecondition);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace epd
