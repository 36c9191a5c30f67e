// EscapeClientText (daemon/control/spec_validation.h): every client-supplied string that reaches a
// log line or an error message goes through it; and ValidateGroupSpec's errors echo an
// oversized or forged name only through it (an 8200-byte name was echoed whole, so the
// client got "received initial metadata size exceeds limit" instead of the error).
#include <string>

#include "absl/strings/match.h"
#include "daemon/control/spec_validation.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/fake_data_plane.h"

namespace epd {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

TEST(EscapeClientText, PrintableTextStaysAsIs) {
  EXPECT_EQ(EscapeClientText("moe-layer_0.v2"), "moe-layer_0.v2");
  EXPECT_EQ(EscapeClientText(""), "");
}

TEST(EscapeClientText, EscapesControlNonAsciiQuoteAndBackslash) {
  EXPECT_EQ(EscapeClientText("x\n[epd] [error] FORGED"), "x\\n[epd] [error] FORGED");
  EXPECT_EQ(EscapeClientText("a\rb\tc"), "a\\rb\\tc");
  EXPECT_EQ(EscapeClientText("\x1b[31mred"), "\\x1b[31mred");
  EXPECT_EQ(EscapeClientText(std::string("nul\0x", 5)), "nul\\x00x");
  EXPECT_EQ(EscapeClientText("\xc3\xa9"), "\\xc3\\xa9");
  EXPECT_EQ(EscapeClientText("q\"\\"), "q\\\"\\\\");
}

TEST(EscapeClientText, CapsLengthAndGivesTheFullSize) {
  const std::string name(8200, 'n');
  const std::string text = EscapeClientText(name);
  EXPECT_EQ(text, std::string(kMaxEchoedClientBytes, 'n') + "...(8200 bytes)");
  EXPECT_EQ(EscapeClientText(std::string(kMaxEchoedClientBytes, 'n')),
            std::string(kMaxEchoedClientBytes, 'n'));
  EXPECT_EQ(EscapeClientText("abcdef", 3), "abc...(6 bytes)");
  // Escaping never lifts the bound above 4 bytes per byte kept.
  const std::string controls(4096, '\x01');
  EXPECT_LE(EscapeClientText(controls).size(), 4 * kMaxEchoedClientBytes + 32);
  EXPECT_FALSE(absl::StrContains(EscapeClientText(controls), '\x01'));
}

TEST(ValidateGroupSpecEcho, OversizedNameIsCappedInTheError) {
  v1::GroupSpec spec = testing::SmallSpec();
  spec.set_name(std::string(8200, 'a'));
  absl::Status status = ValidateGroupSpec(spec);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("spec.name"), HasSubstr("must be 1 to 64 characters"),
                    HasSubstr("(8200 bytes)")));
  EXPECT_LT(status.message().size(), 512u);
}

TEST(ValidateGroupSpecEcho, NameWithNewlineIsEscapedInTheError) {
  v1::GroupSpec spec = testing::SmallSpec();
  spec.set_name("x\n[2026-11-30 05:18:00.000] [epd.daemon] [error] FORGED LINE");
  absl::Status status = ValidateGroupSpec(spec);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), AllOf(HasSubstr("spec.name"), HasSubstr("x\\n[2026"),
                                                   HasSubstr("'\\n'"), Not(HasSubstr("\n"))));
  // Too long and forged: cut and escaped.
  spec.set_name(std::string(200, 'b') + "\n" + "FORGED");
  status = ValidateGroupSpec(spec);
  EXPECT_THAT(std::string(status.message()), AllOf(HasSubstr("(207 bytes)"), Not(HasSubstr("\n"))));
}

}  // namespace
}  // namespace epd
