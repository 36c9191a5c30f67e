// The audit log (daemon/control/audit_log.h): the JSON line, escaping, the file opened for
// appending and reopened when rotated away, a symlink or FIFO planted at the path refused
// (never followed, never blocked on), the journal's prefix.
#include "daemon/control/audit_log.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "daemon/core/config.h"
#include "gmock/gmock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"

namespace epd {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class AuditLogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/epd_audit_unit_XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

TEST_F(AuditLogTest, ALineIsOneJsonObjectWithTheCredentialsAndTheOutcome) {
  AuditEvent event{audit::kJoin,
                   PeerCredentials{4242, 1000, 100},
                   "moe",
                   3,
                   absl::PermissionDeniedError("join_secret: \"bad\"\n"),
                   "GPU-1"};
  const std::string line = FormatAuditLine(event, absl::FromUnixMillis(1764658862345));
  ASSERT_FALSE(line.empty());
  EXPECT_EQ(line.back(), '\n');
  EXPECT_EQ(line.find('\n'), line.size() - 1) << "one line, whatever the message holds";
  google::protobuf::Struct parsed;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(line, &parsed).ok()) << line;
  const auto& f = parsed.fields();
  EXPECT_EQ(f.at("time").string_value(), "2025-12-02T07:01:02.345000Z");
  EXPECT_EQ(f.at("action").string_value(), "join");
  EXPECT_EQ(f.at("pid").number_value(), 4242);
  EXPECT_EQ(f.at("uid").number_value(), 1000);
  EXPECT_EQ(f.at("gid").number_value(), 100);
  EXPECT_EQ(f.at("group").string_value(), "moe");
  EXPECT_EQ(f.at("rank").number_value(), 3);
  EXPECT_EQ(f.at("result").string_value(), "PERMISSION_DENIED");
  EXPECT_EQ(f.at("message").string_value(), "join_secret: \"bad\"\n");
  EXPECT_EQ(f.at("detail").string_value(), "GPU-1");
}

TEST_F(AuditLogTest, EpdsOwnActionsHaveNoCredentialsAndControlBytesAreEscaped) {
  AuditEvent event{audit::kDrain, std::nullopt, "g\x01\xff", -1, absl::OkStatus(), ""};
  const std::string line = FormatAuditLine(event, absl::UnixEpoch());
  EXPECT_THAT(line, Not(HasSubstr("\"pid\"")));
  EXPECT_THAT(line, Not(HasSubstr("\"rank\"")));
  EXPECT_THAT(line, Not(HasSubstr("\"detail\"")));
  EXPECT_THAT(line, HasSubstr("\"group\":\"g\\u0001\\u00ff\""));
  EXPECT_THAT(line, HasSubstr("\"result\":\"OK\""));
  AuditEvent long_name{audit::kJoin, std::nullopt, std::string(5000, 'x'), 0, {}, ""};
  EXPECT_LT(FormatAuditLine(long_name, absl::UnixEpoch()).size(), 1000u);
}

TEST_F(AuditLogTest, TheFileIsAppendedToAndReopenedWhenRotatedAway) {
  const std::string path = dir_ + "/audit.log";
  { std::ofstream(path) << "earlier line\n"; }
  absl::StatusOr<std::unique_ptr<AuditLog>> log = AuditLog::Open(path);
  ASSERT_TRUE(log.ok()) << log.status();
  (*log)->Record({audit::kLeave, PeerCredentials{1, 2, 3}, "g", 0, absl::OkStatus(), ""});
  EXPECT_THAT(ReadFile(path), HasSubstr("earlier line\n{"));
  // logrotate: rename, and the next line goes to a new file of the old name.
  std::filesystem::rename(path, path + ".1");
  (*log)->Record({audit::kJoin, PeerCredentials{1, 2, 3}, "g", 1, absl::OkStatus(), ""});
  EXPECT_THAT(ReadFile(path + ".1"), HasSubstr("\"leave\""));
  EXPECT_THAT(ReadFile(path + ".1"), Not(HasSubstr("\"join\"")));
  EXPECT_THAT(ReadFile(path), HasSubstr("\"join\""));
  EXPECT_EQ(std::filesystem::status(path).permissions() & std::filesystem::perms::others_all,
            std::filesystem::perms::none);
  EXPECT_EQ((*log)->write_failures(), 0u);
}

TEST_F(AuditLogTest, AnUnwritablePathOrARelativeOneIsRefusedByName) {
  absl::StatusOr<std::unique_ptr<AuditLog>> missing = AuditLog::Open(dir_ + "/no/such/dir/a.log");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(missing.status().message(), HasSubstr("no/such/dir/a.log"));
  EXPECT_EQ(AuditLog::Open("audit.log").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AuditLog::Open("").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(AuditLogTest, ASymlinkAtThePathIsRefusedNotFollowed) {
  const std::string target = dir_ + "/elsewhere";
  { std::ofstream(target) << "precious\n"; }
  const std::string path = dir_ + "/audit.log";
  std::filesystem::create_symlink(target, path);
  absl::StatusOr<std::unique_ptr<AuditLog>> refused = AuditLog::Open(path);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr(path));
  EXPECT_THAT(refused.status().message(), HasSubstr("symbolic link"));
  // Planted after a rotation, while epd runs: the next line is not written through it.
  std::filesystem::remove(path);
  absl::StatusOr<std::unique_ptr<AuditLog>> log = AuditLog::Open(path);
  ASSERT_TRUE(log.ok()) << log.status();
  std::filesystem::rename(path, path + ".1");
  std::filesystem::create_symlink(target, path);
  (*log)->Record({audit::kJoin, PeerCredentials{1, 2, 3}, "g", 1, absl::OkStatus(), ""});
  EXPECT_EQ(ReadFile(target), "precious\n");
  EXPECT_EQ((*log)->write_failures(), 1u);
}

TEST_F(AuditLogTest, AFileOthersMayWriteOrAnotherUserOwnsIsRefused) {
  const std::string path = dir_ + "/audit.log";
  { std::ofstream(path) << "{\"forged\":1}\n"; }
  ASSERT_EQ(::chmod(path.c_str(), 0666), 0);
  absl::StatusOr<std::unique_ptr<AuditLog>> writable = AuditLog::Open(path);
  EXPECT_EQ(writable.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(writable.status().message(), HasSubstr("0666"));
  ASSERT_EQ(::chmod(path.c_str(), 0640), 0);
  EXPECT_TRUE(AuditLog::Open(path).ok());
  if (::geteuid() == 0) {  // Only root can give the file away.
    ASSERT_EQ(::chown(path.c_str(), 65534, 65534), 0);
    absl::StatusOr<std::unique_ptr<AuditLog>> owned = AuditLog::Open(path);
    EXPECT_EQ(owned.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(owned.status().message(), HasSubstr("owned by uid 65534"));
  }
}

TEST_F(AuditLogTest, AFifoAtThePathIsRefusedWithoutBlocking) {
  const std::string path = dir_ + "/audit.fifo";
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  // No reader: a blocking open would wait for one forever. After 3 s a watchdog opens one,
  // so the test ends either way; it must not have been needed.
  std::atomic<bool> done{false};
  std::atomic<bool> watchdog_opened{false};
  std::thread watchdog([&] {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    while (!done.load() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (done.load()) return;
    watchdog_opened.store(true);
    ScopedFd reader(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
    while (!done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  });
  absl::StatusOr<std::unique_ptr<AuditLog>> no_reader = AuditLog::Open(path);
  done.store(true);
  watchdog.join();
  EXPECT_FALSE(watchdog_opened.load()) << "AuditLog::Open blocked on a FIFO without a reader";
  EXPECT_EQ(no_reader.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(no_reader.status().message(), HasSubstr(path));
  // With a reader the open succeeds; fstat refuses it as not a regular file.
  ScopedFd reader(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
  ASSERT_TRUE(reader.valid());
  absl::StatusOr<std::unique_ptr<AuditLog>> with_reader = AuditLog::Open(path);
  EXPECT_EQ(with_reader.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(with_reader.status().message(), HasSubstr(path));
  EXPECT_THAT(with_reader.status().message(), HasSubstr("not a regular file"));
}

TEST_F(AuditLogTest, TheJournalGetsPrefixedLinesOnStderr) {
  absl::StatusOr<std::unique_ptr<AuditLog>> log = AuditLog::Open("journal");
  ASSERT_TRUE(log.ok()) << log.status();
  ::testing::internal::CaptureStderr();
  (*log)->Record({audit::kGroupCreate, PeerCredentials{7, 8, 9}, "g", -1, absl::OkStatus(), ""});
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(err, HasSubstr("EPD_AUDIT {\"time\":"));
  EXPECT_THAT(err, HasSubstr("\"action\":\"group_create\""));
}

TEST_F(AuditLogTest, ARankMaskEventNamesTheRanksButNoSession) {
  v1::UpdateRankMaskRequest request;
  request.set_group("g");
  request.set_rank(2);
  request.set_session_id("0123456789abcdef0123456789abcdef");
  request.add_mask(5);
  request.add_mask(6);
  request.add_unmask(1);
  AuditEvent event = RankMaskEvent(PeerCredentials{1, 2, 3}, request, absl::OkStatus());
  EXPECT_EQ(event.action, "rank_mask");
  EXPECT_EQ(event.detail, "mask [5,6] unmask [1]");
  EXPECT_THAT(FormatAuditLine(event, absl::UnixEpoch()), Not(HasSubstr("0123456789abcdef")));
  EXPECT_EQ(RedactSessionId("0123456789abcdef"), "01234567...");
}

TEST_F(AuditLogTest, ARankMaskEventNamesAtMost64RanksOfEachList) {
  v1::UpdateRankMaskRequest request;
  request.set_group("g");
  for (int32_t r = 0; r < 100'000; ++r) request.add_mask(r);
  request.add_unmask(7);
  AuditEvent event = RankMaskEvent(PeerCredentials{1, 2, 3}, request, absl::OkStatus());
  EXPECT_THAT(event.detail, ::testing::StartsWith("mask [0,1,2,"));
  EXPECT_THAT(event.detail, ::testing::EndsWith(",62,63 and 99936 more] unmask [7]"));
}

TEST(AuditLogConfigTest, TheFlagSetsTheFieldAndOnlyAnAbsolutePathOrJournalIsTaken) {
  ConfigFlags flags;
  flags.audit_log = "/var/log/epd/audit.log";
  absl::StatusOr<v1::DaemonConfig> config = ResolveDaemonConfig(flags);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->audit_log(), "/var/log/epd/audit.log");
  flags.audit_log = "journal";
  EXPECT_TRUE(ResolveDaemonConfig(flags).ok());
  flags.audit_log = "audit.log";
  absl::Status relative = ResolveDaemonConfig(flags).status();
  EXPECT_EQ(relative.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(relative.message(), HasSubstr("audit_log"));
  EXPECT_TRUE(ResolveDaemonConfig(ConfigFlags()).ok()) << "off by default";
}

}  // namespace
}  // namespace epd
