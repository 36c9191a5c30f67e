#include "tests/security/security_harness.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "epd/client.h"
#include "tests/common/dtypes.h"
#include "tests/security/security_spec.h"

#ifndef EPD_VICTIM_BINARY
#define EPD_VICTIM_BINARY "epd_victim"
#endif
#ifndef EPD_ATTACKER_BINARY
#define EPD_ATTACKER_BINARY "epd_attacker"
#endif

namespace epd::testing::security {
namespace {

std::string FromEnvOr(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : fallback;
}

/// The last `n` lines of `text`.
std::string Tail(const std::string& text, size_t n) {
  std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
  if (lines.size() > n) lines.erase(lines.begin(), lines.end() - static_cast<ptrdiff_t>(n));
  return absl::StrJoin(lines, "\n");
}

/// Victim rank output: the number of "ROUND <n> OK" lines.
int64_t OkRounds(const std::string& output) {
  int64_t n = 0;
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    n += absl::StartsWith(line, "ROUND ") && absl::EndsWith(line, " OK");
  }
  return n;
}

}  // namespace

std::string VictimBinary() { return FromEnvOr("EPD_VICTIM_BINARY", EPD_VICTIM_BINARY); }
std::string AttackerBinary() { return FromEnvOr("EPD_ATTACKER_BINARY", EPD_ATTACKER_BINARY); }

std::vector<std::string> AsNobody(std::vector<std::string> argv) {
  std::vector<std::string> full = {"/usr/bin/setpriv", "--reuid=65534", "--regid=65534",
                                   "--clear-groups"};
  full.insert(full.end(), argv.begin(), argv.end());
  return full;
}

std::string WhyNotAsNobody() {
  if (::geteuid() != 0) return "needs root to run the attacker as another user";
  if (::access("/usr/bin/setpriv", X_OK) != 0) return "needs setpriv (util-linux)";
  return "";
}

std::string Token(const std::string& line, size_t i) {
  std::vector<std::string> tokens = absl::StrSplit(line, ' ', absl::SkipEmpty());
  return i < tokens.size() ? tokens[i] : "";
}

std::vector<std::string> LinesStartingWith(const std::string& text, const std::string& prefix) {
  std::vector<std::string> out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StartsWith(line, prefix)) out.emplace_back(line);
  }
  return out;
}

void SecurityTest::TearDown() {
  if (!HasFailure()) return;
  if (epd_ != nullptr) {
    std::cerr << "---- epd log (last 150 lines) ----\n" << Tail(epd_->Logs(), 150) << "\n";
  }
  for (size_t i = 0; i < victims_.size(); ++i) {
    const std::string out = victims_[i]->Stdout();
    std::cerr << "---- victim " << i << " (last 15 lines; then its first MISMATCH lines) ----\n"
              << Tail(out, 15) << "\n";
    std::vector<std::string> mismatches = LinesStartingWith(out, "MISMATCH");
    if (mismatches.size() > 10) mismatches.resize(10);
    for (const std::string& m : mismatches) std::cerr << m << "\n";
    std::cerr << victims_[i]->Stderr();
  }
  for (size_t i = 0; i < attackers_.size(); ++i) {
    std::cerr << "---- attacker " << i << " (last 40 lines) ----\n"
              << Tail(attackers_[i]->Stdout(), 40) << "\n"
              << Tail(attackers_[i]->Stderr(), 20) << "\n";
  }
}

void SecurityTest::StartEpd(EpdOptions epd_options) {
  DaemonProcessOptions options;
  options.tcp = false;
  options.log_level = "info";
  options.extra_args = {"--op_timeout=2s"};
  if (epd_options.world_socket) options.extra_args.push_back("--socket_mode=0666");
  options.extra_args.insert(options.extra_args.end(), epd_options.extra_args.begin(),
                            epd_options.extra_args.end());
  options.wrapper = std::move(epd_options.wrapper);
  options.config_text = std::move(epd_options.config_text);
  auto epd = DaemonProcess::Start(options);
  ASSERT_TRUE(epd.ok()) << epd.status();
  epd_ = *std::move(epd);
  if (epd_options.world_socket) ASSERT_EQ(::chmod(epd_->dir().c_str(), 0755), 0);
}

void SecurityTest::StartVictimRank(const std::string& group, int rank, const std::string& secret) {
  ASSERT_NE(epd_, nullptr);
  SubprocessOptions options;
  const std::string name = absl::StrCat("victim-", group, "-", rank);
  options.stdout_path = epd_->dir() + "/" + name + ".out";
  options.stderr_path = epd_->dir() + "/" + name + ".err";
  options.pipe_stdin = true;  // Closed to stop it.
  auto p = Subprocess::Spawn({VictimBinary(), "--socket=" + epd_->socket_path(), "--group=" + group,
                              absl::StrCat("--rank=", rank), "--join_secret=" + secret},
                             options);
  ASSERT_TRUE(p.ok()) << p.status();
  victims_.push_back(*std::move(p));
  absl::Status joined = victims_.back()->WaitForOutput("JOINED", absl::Seconds(20));
  ASSERT_TRUE(joined.ok()) << joined;
}

void SecurityTest::StartVictims(const std::string& group, const std::string& secret, int rounds) {
  for (int r = 0; r < 2; ++r) ASSERT_NO_FATAL_FAILURE(StartVictimRank(group, r, secret));
  ASSERT_NO_FATAL_FAILURE(WaitVictimOkRounds(rounds, absl::Seconds(30)));
}

int64_t SecurityTest::VictimOkRounds() const {
  int64_t fewest = INT64_MAX;
  for (const auto& v : victims_) fewest = std::min(fewest, OkRounds(v->Stdout()));
  return victims_.empty() ? 0 : fewest;
}

void SecurityTest::WaitVictimOkRounds(int64_t count, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (VictimOkRounds() < count) {
    ASSERT_LT(absl::Now(), deadline)
        << "the victims did not reach " << count << " OK rounds within " << timeout
        << " (fewest: " << VictimOkRounds() << ")";
    for (const auto& v : victims_) {
      ASSERT_TRUE(v->Running()) << "a victim exited: " << Tail(v->Stdout(), 10);
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

void SecurityTest::ExpectVictimProgress(int64_t before, int64_t min_new,
                                        const std::string& during) {
  const int64_t now = VictimOkRounds();
  EXPECT_GE(now - before, min_new)
      << "the victim group ran only " << now - before << " OK rounds during " << during;
}

void SecurityTest::StopVictimsAndExpectExact() {
  // They keep getting OK results after the attack (when epd is still there to give them).
  bool running = epd_ != nullptr && epd_->Running();
  for (const auto& v : victims_) running = running && v->Running();
  if (running) {
    const int64_t now = VictimOkRounds();
    EXPECT_NO_FATAL_FAILURE(WaitVictimOkRounds(now + 3, absl::Seconds(20)))
        << "the victims got no OK rounds after the attack";
  }
  for (const auto& v : victims_) v->CloseStdin();
  for (size_t i = 0; i < victims_.size(); ++i) {
    Subprocess& v = *victims_[i];
    absl::StatusOr<int> rc = v.Wait(absl::Seconds(15));
    if (!rc.ok()) {
      ADD_FAILURE() << "victim " << i << " did not stop within 15 s (killed): " << rc.status();
      v.Signal(SIGKILL);
      rc = v.Wait(absl::Seconds(5));
    }
    const std::string out = v.Stdout();
    const std::vector<std::string> mismatches = LinesStartingWith(out, "MISMATCH");
    EXPECT_TRUE(mismatches.empty())
        << "victim " << i << " got " << mismatches.size()
        << " wrong OK results, the first: " << (mismatches.empty() ? "" : mismatches.front());
    if (rc.ok()) {
      EXPECT_EQ(*rc, 0) << "victim " << i << " exited " << *rc << ": " << Tail(out, 5);
      if (*rc == 0) EXPECT_EQ(LinesStartingWith(out, "VICTIM").size(), 1u) << Tail(out, 5);
    }
    ExpectNoSanitizerReport(absl::StrCat("victim ", i), v.Stderr());
  }
  if (epd_ != nullptr) ExpectNoSanitizerReport("epd", epd_->Logs());
}

void SecurityTest::ExpectNoSanitizerReport(const std::string& who, const std::string& output) {
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    const bool report = absl::StrContains(line, "ERROR: AddressSanitizer") ||
                        absl::StrContains(line, "ERROR: LeakSanitizer") ||
                        absl::StrContains(line, ": runtime error: ");
    EXPECT_FALSE(report) << who << " reported: " << line;
    if (report) return;  // The first one is enough.
  }
}

std::unique_ptr<Subprocess> SecurityTest::SpawnAttacker(std::vector<std::string> args,
                                                        bool as_nobody) {
  std::vector<std::string> argv = {AttackerBinary(), "--socket=" + epd_->socket_path()};
  argv.insert(argv.end(), args.begin(), args.end());
  if (as_nobody) argv = AsNobody(argv);
  SubprocessOptions options;
  const std::string name = absl::StrCat("attacker-", attacker_runs_++);
  options.stdout_path = epd_->dir() + "/" + name + ".out";
  options.stderr_path = epd_->dir() + "/" + name + ".err";
  auto p = Subprocess::Spawn(argv, options);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *std::move(p) : nullptr;
}

namespace {

/// The numeric key=value fields of `line` after its first word.
std::map<std::string, int64_t> Fields(const std::string& line) {
  std::map<std::string, int64_t> out;
  std::vector<absl::string_view> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
  for (size_t i = 1; i < words.size(); ++i) {
    std::pair<std::string, std::string> kv = absl::StrSplit(words[i], absl::MaxSplits('=', 1));
    double value = 0;
    if (absl::SimpleAtod(kv.second, &value)) out[kv.first] = static_cast<int64_t>(value);
  }
  return out;
}

}  // namespace

AttackResult SecurityTest::ResultOf(Subprocess& attacker, int exit_code) {
  AttackResult result;
  result.exit_code = exit_code;
  result.output = attacker.Stdout();
  for (const std::string& line : LinesStartingWith(result.output, "SUMMARY ")) {
    for (const auto& [key, value] : Fields(line)) result.summary[key] += value;
  }
  std::map<int64_t, std::map<std::string, int64_t>> last_by_child;
  for (const std::string& line : LinesStartingWith(result.output, "PROGRESS ")) {
    std::map<std::string, int64_t> fields = Fields(line);
    last_by_child[fields["child"]] = fields;
  }
  for (const auto& [child, fields] : last_by_child) {
    for (const auto& [key, value] : fields) {
      if (key != "child") result.progress[key] += value;
    }
  }
  return result;
}

AttackResult SecurityTest::RunAttacker(std::vector<std::string> args, absl::Duration timeout,
                                       bool as_nobody) {
  std::unique_ptr<Subprocess> p = SpawnAttacker(std::move(args), as_nobody);
  if (p == nullptr) return AttackResult{-1000, "", {}};
  absl::StatusOr<int> rc = p->Wait(timeout);
  EXPECT_TRUE(rc.ok()) << "the attacker did not finish within " << timeout
                       << " (killed): " << Tail(p->Stdout(), 10);
  if (!rc.ok()) {
    p->Signal(SIGKILL);
    rc = p->Wait(absl::Seconds(5));
  }
  AttackResult result = ResultOf(*p, rc.value_or(-1000));
  attackers_.push_back(std::move(p));
  return result;
}

void SecurityTest::ExpectEpdServing(const std::string& when) {
  ASSERT_NE(epd_, nullptr);
  if (!epd_->Running()) {
    absl::StatusOr<int> code = epd_->WaitExit(absl::Seconds(1));
    ADD_FAILURE() << "epd is not running " << when << ": exit code "
                  << (code.ok() ? absl::StrCat(*code) : std::string(code.status().message()))
                  << (code.ok() && *code < 0 ? absl::StrCat(" (killed by signal ", -*code, ")")
                                             : std::string());
    return;
  }
  auto health = epd_->CheckHealth("", "", absl::Seconds(5));
  EXPECT_TRUE(health.ok()) << "epd's health check failed " << when << ": " << health.status();
  if (health.ok()) {
    EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING) << when;
  }
}

absl::Status SecurityTest::ProbeFreshClient(const std::string& group, bool join) {
  ClientOptions options;
  options.socket_path = epd_->socket_path();
  options.client_name = "security test probe";
  auto client = Client::Connect(options);
  if (!client.ok())
    return absl::Status(client.status().code(), "connect: " + client.status().ToString());
  if (!join) return absl::OkStatus();
  JoinOptions join_options;
  join_options.spec = epd::security::SecuritySpec(group, 1);
  auto ep = (*client)->Join(join_options);
  if (!ep.ok()) return absl::Status(ep.status().code(), "join: " + ep.status().ToString());
  std::vector<int64_t> idx = {0, 1}, shape = {1, epd::security::kNumTopk};
  DLTensor t = MakeDLTensor(idx.data(), kI64, shape);
  auto op = (*ep)->GetDispatchLayout(t);
  if (!op.ok()) return op.status();
  absl::Status st = op->Wait(absl::Seconds(10)).status();
  if (!st.ok()) return absl::Status(st.code(), "op: " + st.ToString());
  return absl::OkStatus();
}

void SecurityTest::ExpectNewClientServed(const std::string& when) {
  if (epd_ == nullptr || !epd_->Running()) return;  // ExpectEpdServing reports it.
  absl::Status probe = ProbeFreshClient(absl::StrCat("probe-", probes_++));
  EXPECT_TRUE(probe.ok()) << "a new client is not served " << when << ": " << probe;
}

LogMark SecurityTest::MarkLog() const {
  LogMark mark;
  for (absl::string_view line : absl::StrSplit(epd_->Logs(), '\n')) {
    if (line.empty()) continue;
    ++mark.lines;
    mark.warnings += absl::StrContains(line, "] [warning] ") ||
                     absl::StrContains(line, "] [error] ") ||
                     absl::StrContains(line, "] [critical] ");
  }
  return mark;
}

void SecurityTest::ExpectLogBounded(const LogMark& since, int64_t line_budget,
                                    int64_t warning_budget, const std::string& what) {
  const LogMark now = MarkLog();
  EXPECT_LE(now.lines - since.lines, line_budget)
      << "epd logged " << now.lines - since.lines << " lines during " << what;
  EXPECT_LE(now.warnings - since.warnings, warning_budget)
      << "epd logged " << now.warnings - since.warnings << " warnings and errors during " << what
      << " (client-caused warnings must be rate-limited per uid); its last lines:\n"
      << Tail(epd_->Logs(), 5);
}

}  // namespace epd::testing::security
