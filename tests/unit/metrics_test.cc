// The metrics registry (daemon/metrics/): histogram buckets and quantiles, concurrent
// increments, a group's series, the Prometheus text format, the GetStats filter, the start
// counter, epctl's table and the HTTP listener (a real HTTP client, and hostile raw ones:
// a flood of header lines, a head sent byte by byte, idle connections past the cap).
#include "daemon/metrics/metrics.h"

#include <httplib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/epctl/format.h"
#include "daemon/metrics/exposition.h"
#include "daemon/metrics/metrics_server.h"
#include "daemon/metrics/start_count.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/raw_http.h"

namespace epd::metrics {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

const v1::MetricFamily* FindFamily(const v1::MetricsSnapshot& s, const std::string& name) {
  for (const v1::MetricFamily& f : s.families()) {
    if (f.name() == name) return &f;
  }
  return nullptr;
}

TEST(MetricsHistogramTest, ObservationsLandInTheirBuckets) {
  const std::vector<double> bounds = {1e-6, 1e-3, 1.0};
  Histogram h(bounds);
  h.ObserveNs(500);            // 0.5 µs -> le 1e-6
  h.ObserveNs(1000);           // exactly 1 µs -> le 1e-6 (bounds are inclusive)
  h.ObserveNs(1001);           // -> le 1e-3
  h.ObserveNs(2'000'000);      // 2 ms -> le 1
  h.ObserveNs(5'000'000'000);  // 5 s -> +Inf
  v1::HistogramValue v;
  h.Read(&v);
  ASSERT_EQ(v.upper_bounds_size(), 3);
  ASSERT_EQ(v.cumulative_counts_size(), 4);
  EXPECT_EQ(v.cumulative_counts(0), 2u);
  EXPECT_EQ(v.cumulative_counts(1), 3u);
  EXPECT_EQ(v.cumulative_counts(2), 4u);
  EXPECT_EQ(v.cumulative_counts(3), 5u);
  EXPECT_EQ(v.count(), 5u);
  EXPECT_NEAR(v.sum(), (500 + 1000 + 1001 + 2e6 + 5e9) * 1e-9, 1e-12);
  EXPECT_EQ(h.count(), 5u);
}

TEST(MetricsHistogramTest, QuantilesInterpolateWithinTheBucket) {
  const std::vector<double> bounds = {1, 2, 4};
  const std::vector<uint64_t> cumulative = {10, 20, 30, 40};
  EXPECT_DOUBLE_EQ(HistogramQuantile(bounds, cumulative, 0.25), 1.0);   // rank 10: end of [0,1]
  EXPECT_DOUBLE_EQ(HistogramQuantile(bounds, cumulative, 0.5), 2.0);    // rank 20: end of (1,2]
  EXPECT_DOUBLE_EQ(HistogramQuantile(bounds, cumulative, 0.625), 3.0);  // rank 25: mid (2,4]
  EXPECT_DOUBLE_EQ(HistogramQuantile(bounds, cumulative, 0.125), 0.5);  // rank 5: mid [0,1]
  // In +Inf: the largest finite bound, as Prometheus answers.
  EXPECT_DOUBLE_EQ(HistogramQuantile(bounds, cumulative, 0.9), 4.0);
  const std::vector<uint64_t> empty = {0, 0, 0, 0};
  EXPECT_EQ(HistogramQuantile(bounds, empty, 0.99), 0.0);
  // Wrong sizes answer 0 rather than reading out of bounds.
  EXPECT_EQ(HistogramQuantile(bounds, std::vector<uint64_t>{1, 2}, 0.5), 0.0);
}

TEST(MetricsHistogramTest, ReadFillsP50P95P99) {
  Histogram h;                                                             // LatencyBuckets
  for (int i = 0; i < 100; ++i) h.ObserveNs(i < 90 ? 20'000 : 4'000'000);  // 20 µs, 4 ms
  v1::HistogramValue v;
  h.Read(&v);
  EXPECT_GT(v.p50(), 10e-6);
  EXPECT_LE(v.p50(), 25e-6);
  EXPECT_GT(v.p95(), 2.5e-3);
  EXPECT_LE(v.p95(), 5e-3);
  EXPECT_LE(v.p99(), 5e-3);
  EXPECT_GE(v.p99(), v.p95());
}

TEST(MetricsCounterTest, ConcurrentIncrementsAreAllCounted) {
  Counter c;
  Histogram h;
  constexpr int kThreads = 4, kEach = 100000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        c.Add();
        h.ObserveNs(static_cast<uint64_t>(t) * 1000 + 1);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(c.value(), uint64_t{kThreads} * kEach);
  EXPECT_EQ(h.count(), uint64_t{kThreads} * kEach);
}

TEST(MetricsGroupMetricsTest, CollectsOpsFailuresLatencyStragglersExpertsAndMasks) {
  Registry registry;
  std::shared_ptr<GroupMetrics> g = registry.AddGroup("g1", 4, 8);
  const uint32_t dispatch = static_cast<uint32_t>(abi::OpKind::kDispatch);
  g->RecordOp(dispatch, absl::StatusCode::kOk, 30'000, 1024);
  g->RecordOp(dispatch, absl::StatusCode::kOk, 40'000, 1024);
  g->RecordOp(dispatch, absl::StatusCode::kDeadlineExceeded, 0, 0);
  g->RecordStraggler(3, 5'000);
  g->RecordStraggler(3, 7'000);
  g->RecordStraggler(1, 1'000);
  g->AddExpertTokens(5, 12);
  g->AddExpertTokens(99, 1);  // Out of range: ignored.
  g->SetRankMasked(2, true);
  g->SetRankMasked(2, true);         // Already masked: counted once.
  OnRankMasked("no-such-group", 0);  // Unknown group (Default registry): ignored.
  const v1::MetricsSnapshot s = registry.Collect();
  const std::string text = RenderPrometheus(s);
  EXPECT_THAT(text, HasSubstr("epd_ops_total{group=\"g1\",op=\"Dispatch\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("epd_op_failures_total{code=\"DEADLINE_EXCEEDED\",group=\"g1\","
                              "op=\"Dispatch\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("epd_op_bytes_total{group=\"g1\",op=\"Dispatch\"} 2048\n"));
  EXPECT_THAT(text, HasSubstr("epd_op_latency_seconds_count{group=\"g1\",op=\"Dispatch\"} 2\n"));
  EXPECT_THAT(
      text,
      HasSubstr("epd_op_latency_seconds_bucket{group=\"g1\",op=\"Dispatch\",le=\"5e-05\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("epd_straggler_last_total{group=\"g1\",rank=\"3\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("epd_straggler_last_total{group=\"g1\",rank=\"1\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("epd_straggler_lag_seconds_count{group=\"g1\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("epd_expert_received_tokens_total{expert=\"5\",group=\"g1\"} 12\n"));
  EXPECT_THAT(text, HasSubstr("epd_masked_ranks{group=\"g1\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("epd_rank_masks_total{group=\"g1\"} 1\n"));
  // Op kinds the group never ran have no series.
  EXPECT_THAT(text, Not(HasSubstr("op=\"Combine\"")));
  g->SetRankMasked(2, false);
  const std::string after = RenderPrometheus(registry.Collect());
  EXPECT_THAT(after, HasSubstr("epd_masked_ranks{group=\"g1\"} 0\n"));
  EXPECT_THAT(after, HasSubstr("epd_rank_rejoins_total{group=\"g1\"} 1\n"));
  // The group's series go with it.
  g.reset();
  EXPECT_THAT(RenderPrometheus(registry.Collect()), Not(HasSubstr("g1")));
}

TEST(MetricsNodeOpTotalsTest, CountEveryGroupAndOutliveThem) {
  Registry registry;
  const uint32_t dispatch = static_cast<uint32_t>(abi::OpKind::kDispatch);
  const uint32_t combine = static_cast<uint32_t>(abi::OpKind::kCombine);
  {
    std::shared_ptr<GroupMetrics> a = registry.AddGroup("a", 2, 4);
    std::shared_ptr<GroupMetrics> b = registry.AddGroup("b", 2, 4);
    a->RecordOp(dispatch, absl::StatusCode::kOk, 10'000, 100);
    b->RecordOp(dispatch, absl::StatusCode::kOk, 20'000, 50);
    b->RecordOp(dispatch, absl::StatusCode::kUnavailable, 0, 0);
    b->AddOpBytes(dispatch, 7);
    a->RecordOp(combine, static_cast<absl::StatusCode>(99), 0, 0);  // Out of range: UNKNOWN.
  }
  // Both groups are gone: their own series went with them, the node's totals stay.
  EXPECT_EQ(registry.node_totals().ops(dispatch), 3u);
  EXPECT_EQ(registry.node_totals().failures(dispatch, absl::StatusCode::kUnavailable), 1u);
  EXPECT_EQ(registry.node_totals().failures(combine, absl::StatusCode::kUnknown), 1u);
  const std::string text = RenderPrometheus(registry.Collect());
  EXPECT_THAT(text, Not(HasSubstr("group=")));
  EXPECT_THAT(text, HasSubstr("epd_node_ops_total{op=\"Dispatch\"} 3\n"));
  EXPECT_THAT(text,
              HasSubstr("epd_node_op_failures_total{code=\"UNAVAILABLE\",op=\"Dispatch\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("epd_node_op_failures_total{code=\"UNKNOWN\",op=\"Combine\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("epd_node_op_bytes_total{op=\"Dispatch\"} 157\n"));
  EXPECT_THAT(text, HasSubstr("epd_node_op_latency_seconds_count{op=\"Dispatch\"} 2\n"));
  EXPECT_THAT(text, Not(HasSubstr("op=\"LowLatencyDispatch\"")));
}

TEST(MetricsGroupMetricsTest, MaskApiFindsTheLiveGroupInTheDefaultRegistry) {
  std::shared_ptr<GroupMetrics> g = Default().AddGroup("metrics-test-mask", 2, 2);
  OnRankMasked("metrics-test-mask", 1);
  OnRankRejoined("metrics-test-mask", 1);
  OnRankMasked("metrics-test-mask", 0);
  const std::string text = RenderPrometheus(Default().Collect());
  EXPECT_THAT(text, HasSubstr("epd_masked_ranks{group=\"metrics-test-mask\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("epd_rank_masks_total{group=\"metrics-test-mask\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("epd_rank_rejoins_total{group=\"metrics-test-mask\"} 1\n"));
}

TEST(MetricsExpositionTest, TextFormatWithEscapingAndHistogramLines) {
  v1::MetricsSnapshot s;
  SnapshotBuilder b(&s);
  b.AddGauge("epd_x", "Help with \\ and\nnewline.", {{"name", "a\"b\\c\nd"}}, 1.5);
  b.AddCounter("epd_y_total", "Y.", {}, 42);
  const std::vector<double> bounds = {0.001, 0.5};
  Histogram h(bounds);
  h.ObserveNs(250'000'000);
  b.AddHistogram("epd_z_seconds", "Z.", {{"group", "g"}}, h);
  EXPECT_EQ(RenderPrometheus(s),
            "# HELP epd_x Help with \\\\ and\\nnewline.\n"
            "# TYPE epd_x gauge\n"
            "epd_x{name=\"a\\\"b\\\\c\\nd\"} 1.5\n"
            "# HELP epd_y_total Y.\n"
            "# TYPE epd_y_total counter\n"
            "epd_y_total 42\n"
            "# HELP epd_z_seconds Z.\n"
            "# TYPE epd_z_seconds histogram\n"
            "epd_z_seconds_bucket{group=\"g\",le=\"0.001\"} 0\n"
            "epd_z_seconds_bucket{group=\"g\",le=\"0.5\"} 1\n"
            "epd_z_seconds_bucket{group=\"g\",le=\"+Inf\"} 1\n"
            "epd_z_seconds_sum{group=\"g\"} 0.25\n"
            "epd_z_seconds_count{group=\"g\"} 1\n");
}

TEST(MetricsExpositionTest, KeepGroupsDropsOtherGroupsSeries) {
  v1::MetricsSnapshot s;
  SnapshotBuilder b(&s);
  b.AddCounter("epd_ops_total", "", {{"group", "mine"}}, 1);
  b.AddCounter("epd_ops_total", "", {{"group", "theirs"}}, 2);
  b.AddCounter("epd_only_theirs_total", "", {{"group", "theirs"}}, 3);
  b.AddGauge("epd_sessions", "", {}, 4);
  KeepGroups(&s, {"mine"});
  const std::string text = RenderPrometheus(s);
  EXPECT_THAT(text, HasSubstr("epd_ops_total{group=\"mine\"} 1"));
  EXPECT_THAT(text, Not(HasSubstr("theirs")));
  EXPECT_THAT(text, HasSubstr("epd_sessions 4"));
  EXPECT_EQ(FindFamily(s, "epd_only_theirs_total"), nullptr);
}

TEST(MetricsRegistryTest, CollectorsAndSourcesStopWithTheirRegistration) {
  Registry registry;
  Registration r = registry.AddCollector(
      [](SnapshotBuilder& out) { out.AddGauge("epd_collected", "C.", {}, 7); });
  registry.GetCounter("epd_fixed_total", "F.", {{"engine", "0"}})->Add(3);
  std::string text = RenderPrometheus(registry.Collect());
  EXPECT_THAT(text, HasSubstr("epd_collected 7\n"));
  EXPECT_THAT(text, HasSubstr("epd_fixed_total{engine=\"0\"} 3\n"));
  // The same name and labels: the same counter.
  EXPECT_EQ(registry.GetCounter("epd_fixed_total", "F.", {{"engine", "0"}})->value(), 3u);
  r.Reset();
  text = RenderPrometheus(registry.Collect());
  EXPECT_THAT(text, Not(HasSubstr("epd_collected")));
}

TEST(MetricsStartCountTest, CountsStartsAndRecoversFromAGarbledFile) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/epd.starts.", ::getpid());
  std::remove(path.c_str());
  EXPECT_EQ(StartCountPath("", "/run/epd/epd.sock"), "/run/epd/epd.starts");
  EXPECT_EQ(StartCountPath("off", "/run/epd/epd.sock"), "");
  EXPECT_EQ(StartCountPath("/var/lib/epd/starts", "/run/epd/epd.sock"), "/var/lib/epd/starts");
  absl::StatusOr<uint64_t> first = RecordStart(path);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(*first, 0u);
  absl::StatusOr<uint64_t> second = RecordStart(path);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(*second, 1u);
  std::ofstream(path) << "garbage";
  absl::StatusOr<uint64_t> bad = RecordStart(path);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr(path));
  absl::StatusOr<uint64_t> after = RecordStart(path);  // Rewritten as 1 start.
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(*after, 1u);
  EXPECT_EQ(RecordStart("/nonexistent-dir/epd.starts").status().code(),
            absl::StatusCode::kUnavailable);
  std::remove(path.c_str());
}

// A symbolic link planted where RecordStart writes its temporary file (the path, ".tmp.",
// epd's pid: predictable) must not make epd truncate and write the file it points to.
TEST(MetricsStartCountTest, DoesNotWriteThroughAPlantedTemporaryLink) {
  const std::string dir = ::testing::TempDir();
  const std::string path = absl::StrCat(dir, "/epd.starts.link.", ::getpid());
  const std::string victim = absl::StrCat(dir, "/epd.victim.", ::getpid());
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  std::remove(path.c_str());
  std::remove(tmp.c_str());
  std::ofstream(victim) << "precious";
  ASSERT_EQ(::symlink(victim.c_str(), tmp.c_str()), 0) << std::strerror(errno);
  EXPECT_EQ(RecordStart(path).status().code(), absl::StatusCode::kUnavailable);
  std::ifstream in(victim);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "precious");
  std::remove(tmp.c_str());
  std::remove(victim.c_str());
  std::remove(path.c_str());
}

// What is planted at the path itself: a link is not followed (nor its target's bytes
// echoed), a FIFO does not block, a device is not read without end.
TEST(MetricsStartCountTest, RefusesALinkAFifoAndADeviceAtThePath) {
  const std::string dir = ::testing::TempDir();
  const std::string path = absl::StrCat(dir, "/epd.starts.planted.", ::getpid());
  const std::string secret = absl::StrCat(dir, "/epd.secret.", ::getpid());
  std::remove(path.c_str());
  std::ofstream(secret) << "root:secret-hash\n";
  ASSERT_EQ(::symlink(secret.c_str(), path.c_str()), 0) << std::strerror(errno);
  absl::StatusOr<uint64_t> linked = RecordStart(path);
  EXPECT_EQ(linked.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(linked.status().message()), Not(HasSubstr("secret")));
  std::remove(path.c_str());
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << std::strerror(errno);
  EXPECT_EQ(RecordStart(path).status().code(), absl::StatusCode::kFailedPrecondition);
  std::remove(path.c_str());
  EXPECT_EQ(RecordStart("/dev/zero").status().code(), absl::StatusCode::kFailedPrecondition);
  std::remove(secret.c_str());
}

TEST(MetricsEpctlMetricsTest, TableShowsOpsWithQuantilesAndOtherSeries) {
  Registry registry;
  std::shared_ptr<GroupMetrics> g = registry.AddGroup("tg", 2, 2);
  const uint32_t combine = static_cast<uint32_t>(abi::OpKind::kCombine);
  for (int i = 0; i < 10; ++i) g->RecordOp(combine, absl::StatusCode::kOk, 20'000, 100);
  g->RecordOp(combine, absl::StatusCode::kInvalidArgument, 0, 0);
  g->AddExpertTokens(1, 9);
  const std::string table = epctl::FormatMetrics(registry.Collect());
  EXPECT_THAT(table, HasSubstr("GROUP"));
  EXPECT_THAT(table, HasSubstr("P99"));
  // tg Combine: 11 ops, 1 failed, 1000 bytes, quantiles in the (10 µs, 25 µs] bucket.
  EXPECT_THAT(table, ::testing::ContainsRegex("tg +Combine +11 +1 +1000 B +[0-9.]+us"));
  EXPECT_THAT(table, HasSubstr("epd_expert_received_tokens_total"));
  EXPECT_THAT(table, HasSubstr("code=INVALID_ARGUMENT"));
}

TEST(MetricsServerTest, ServesMetricsOnlyAtSlashMetrics) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", [] { return std::string("epd_up 1\n"); });
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->port(), 0);
  httplib::Client client("127.0.0.1", (*server)->port());
  client.set_connection_timeout(5, 0);
  client.set_read_timeout(5, 0);
  httplib::Result ok = client.Get("/metrics");
  ASSERT_TRUE(ok) << httplib::to_string(ok.error());
  EXPECT_EQ(ok->status, 200);
  EXPECT_EQ(ok->body, "epd_up 1\n");
  EXPECT_EQ(ok->get_header_value("Content-Type"), kPrometheusContentType);
  httplib::Result other = client.Get("/");
  ASSERT_TRUE(other);
  EXPECT_EQ(other->status, 404);
  httplib::Result post = client.Post("/metrics", "x", "text/plain");
  ASSERT_TRUE(post);
  EXPECT_EQ(post->status, 405);
  // A body past the bound is refused without being read whole.
  httplib::Result big = client.Post("/metrics", std::string(64 * 1024, 'x'), "text/plain");
  ASSERT_TRUE(big);
  EXPECT_NE(big->status, 200);
  // The same port again: refused, naming the field.
  absl::StatusOr<std::unique_ptr<MetricsServer>> again = MetricsServer::Start(
      absl::StrCat("127.0.0.1:", (*server)->port()), [] { return std::string(); });
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(again.status().message()), HasSubstr("metrics_listen"));
  EXPECT_EQ(MetricsServer::Start("nonsense", [] { return std::string(); }).status().code(),
            absl::StatusCode::kInvalidArgument);
  (*server)->Stop();
  (*server)->Stop();  // Idempotent.
}

/// Short bounds, so the hostile-client tests take about a second each.
MetricsServer::Limits FastLimits() {
  MetricsServer::Limits limits;
  limits.head_timeout = std::chrono::milliseconds(1000);
  limits.write_timeout = std::chrono::milliseconds(1000);
  limits.max_connections = 4;
  return limits;
}

std::unique_ptr<MetricsServer> StartUp(MetricsServer::Limits limits = {}) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server = MetricsServer::Start(
      "127.0.0.1:0", [] { return std::string("epd_up 1\n"); }, limits);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

TEST(MetricsServerTest, HeaderLineFloodIsRefusedPastTheHeadBound) {
  std::unique_ptr<MetricsServer> server = StartUp();
  ASSERT_NE(server, nullptr);
  // Short header lines, never the empty line: the listener refuses once the head passes
  // 8 KiB (431, then it closes), long before the 8 MiB are sent.
  constexpr size_t kFlood = size_t{8} << 20;
  testing::FloodResult flood = testing::FloodHeaderLines(server->port(), kFlood);
  EXPECT_TRUE(flood.refused || flood.reply.closed);
  EXPECT_LT(flood.sent, kFlood);
  if (!flood.reply.bytes.empty()) {
    EXPECT_THAT(flood.reply.bytes, ::testing::StartsWith("HTTP/1.1 431 "));
  }
  // A head just within the bound is still answered.
  std::string head = "GET /metrics HTTP/1.1\r\n";
  while (head.size() < 8 * 1024 - 64) head += "X-Pad: 0123456789abcdef0123456789abcdef\r\n";
  head += "\r\n";
  ScopedFd fd = testing::ConnectTcp(server->port());
  ASSERT_TRUE(fd.valid());
  ASSERT_EQ(::send(fd.get(), head.data(), head.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(head.size()));
  EXPECT_THAT(testing::ReadUntilClosed(fd.get(), absl::Seconds(5)).bytes,
              ::testing::AllOf(::testing::StartsWith("HTTP/1.1 200 "), HasSubstr("epd_up 1")));
}

TEST(MetricsServerTest, SlowHeadIsClosedAtTheHeadTimeout) {
  std::unique_ptr<MetricsServer> server = StartUp(FastLimits());
  ASSERT_NE(server, nullptr);
  // One byte every 100 ms: each read is quick, the head never completes; closed at 1 s.
  const absl::Duration held =
      testing::SlowHeadHeldFor(server->port(), absl::Milliseconds(100), absl::Seconds(6));
  EXPECT_GE(held, absl::Milliseconds(900));
  EXPECT_LT(held, absl::Milliseconds(2500));
}

TEST(MetricsServerTest, IdleConnectionsDoNotHoldOffAScrapePastOneHeadTimeout) {
  std::unique_ptr<MetricsServer> server = StartUp(FastLimits());
  ASSERT_NE(server, nullptr);
  {
    // Below the cap, idle connections cost no worker: a scrape is answered at once.
    std::vector<ScopedFd> idle = testing::OpenIdleConnections(server->port(), 3);
    const absl::Time start = absl::Now();
    EXPECT_THAT(testing::RawGet(server->port(), "/metrics"), HasSubstr("epd_up 1"));
    EXPECT_LT(absl::Now() - start, absl::Milliseconds(500));
  }
  // One past the cap (4): the scrape waits in the listen queue until the head timeout
  // (1 s) closes the idle ones, then is answered.
  std::vector<ScopedFd> idle = testing::OpenIdleConnections(server->port(), 5);
  const absl::Time start = absl::Now();
  EXPECT_THAT(testing::RawGet(server->port(), "/metrics"), HasSubstr("epd_up 1"));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(2500));
  // Each idle one was closed unanswered.
  for (ScopedFd& fd : idle) {
    testing::Reply reply = testing::ReadUntilClosed(fd.get(), absl::Seconds(3));
    EXPECT_TRUE(reply.closed);
    EXPECT_EQ(reply.bytes, "");
  }
}

TEST(MetricsServerTest, AnswersMalformedHeadsAndOtherMethods) {
  std::unique_ptr<MetricsServer> server = StartUp();
  ASSERT_NE(server, nullptr);
  auto ask = [&](const std::string& head) {
    ScopedFd fd = testing::ConnectTcp(server->port());
    EXPECT_EQ(::send(fd.get(), head.data(), head.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(head.size()));
    return testing::ReadUntilClosed(fd.get(), absl::Seconds(5)).bytes;
  };
  EXPECT_THAT(ask("nonsense\r\n\r\n"), ::testing::StartsWith("HTTP/1.1 400 "));
  EXPECT_THAT(ask("DELETE /metrics HTTP/1.1\r\n\r\n"),
              ::testing::AllOf(::testing::StartsWith("HTTP/1.1 405 "), HasSubstr("Allow: GET")));
  EXPECT_THAT(ask("GET /metrics?x=1 HTTP/1.0\n\n"), HasSubstr("epd_up 1"));
  EXPECT_THAT(ask("GET /other HTTP/1.1\r\n\r\n"), ::testing::StartsWith("HTTP/1.1 404 "));
}

}  // namespace
}  // namespace epd::metrics
