// The client/daemon version rule (common/version.h): parsing, the compatible range, and
// the FAILED_PRECONDITION an incompatible client gets.
#include "common/version.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace epd {
namespace {

using ::testing::HasSubstr;

Version V(int major, int minor, int patch = 0) { return Version{major, minor, patch}; }

TEST(VersionRuleTest, ParsesMajorMinorPatchAndIgnoresSuffixes) {
  absl::StatusOr<Version> v = ParseVersion("1.22.333-rc1+abc");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->major, 1);
  EXPECT_EQ(v->minor, 22);
  EXPECT_EQ(v->patch, 333);
  for (const char* bad : {"", "1", "1.2", "1.2.3.4", "a.b.c", "1..3", "-1.2.3", "1.2.x"}) {
    EXPECT_EQ(ParseVersion(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_TRUE(ParseVersion(kEpdVersion).ok());
}

TEST(VersionRuleTest, SameMajorAndAMinorUpToKClientMinorsBehindTheDaemonIsCompatible) {
  const Version daemon = V(1, 5, 3);
  EXPECT_TRUE(ClientVersionCompatible(V(1, 5, 0), daemon));
  EXPECT_TRUE(ClientVersionCompatible(V(1, 5, 9), daemon)) << "patch levels never matter";
  EXPECT_TRUE(ClientVersionCompatible(V(1, 5 - kClientMinorsBehind), daemon));
  EXPECT_FALSE(ClientVersionCompatible(V(1, 5 - kClientMinorsBehind - 1), daemon));
  EXPECT_FALSE(ClientVersionCompatible(V(1, 6), daemon)) << "a client newer than its daemon";
  EXPECT_FALSE(ClientVersionCompatible(V(2, 5), daemon));
  EXPECT_FALSE(ClientVersionCompatible(V(0, 5), daemon));
  EXPECT_EQ(CompatibleClientVersions(daemon), "1.3.x to 1.5.x");
  EXPECT_EQ(CompatibleClientVersions(V(0, 1)), "0.0.x to 0.1.x");
}

TEST(VersionRuleTest, AnIncompatibleClientIsAFailedPreconditionNamingBothVersionsAndTheRange) {
  EXPECT_TRUE(CheckClientVersion("1.4.0", "1.5.3").ok());
  EXPECT_TRUE(CheckClientVersion("", "1.5.3").ok()) << "a client from before the exchange";
  absl::Status newer = CheckClientVersion("1.6.0", "1.5.3");
  EXPECT_EQ(newer.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(newer.message(), HasSubstr("1.6.0"));
  EXPECT_THAT(newer.message(), HasSubstr("1.5.3"));
  EXPECT_THAT(newer.message(), HasSubstr("1.3.x to 1.5.x"));
  EXPECT_THAT(newer.message(), HasSubstr("upgrade epd"));
  absl::Status older = CheckClientVersion("1.1.0", "1.5.3");
  EXPECT_EQ(older.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(older.message(), HasSubstr("upgrade the client"));
  absl::Status garbage = CheckClientVersion("latest", "1.5.3");
  EXPECT_EQ(garbage.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(garbage.message(), HasSubstr("client_version"));
}

TEST(VersionRuleTest, AClientVersionIsEchoedCutTo64BytesAndEscaped) {
  const std::string junk(1 << 20, 'x');
  // Parses (the suffix after '-' is ignored), is not served: FAILED_PRECONDITION.
  absl::Status far = CheckClientVersion("9.0.0-\n\x1b[31mFORGED" + junk, "1.5.3");
  EXPECT_EQ(far.code(), absl::StatusCode::kFailedPrecondition);
  // Does not parse: INVALID_ARGUMENT.
  absl::Status garbage = CheckClientVersion("x\n\x1b[31mFORGED" + junk, "1.5.3");
  EXPECT_EQ(garbage.code(), absl::StatusCode::kInvalidArgument);
  for (const absl::Status& st : {far, garbage}) {
    const std::string message(st.message());
    EXPECT_LT(message.size(), 640u) << message.substr(0, 200);
    EXPECT_THAT(message, HasSubstr("\\n\\x1b[31mFORGED"));
    EXPECT_THAT(message, ::testing::ContainsRegex("\\.\\.\\.\\(10485[0-9][0-9] bytes\\)"));
    for (char c : message) {
      EXPECT_TRUE(c >= 0x20 && c < 0x7f) << "a raw byte " << int(c) << " is echoed";
    }
  }
}

}  // namespace
}  // namespace epd
