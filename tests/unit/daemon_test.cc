// The Daemon core run in-process with a fake data plane: backend choice, health per
// service, GetStats, socket handling (live epd refused, stale file replaced, mode), and
// shutdown (daemon/core/daemon.h).
#include "daemon/core/daemon.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "daemon/core/config.h"
#include "daemon/core/config_overrides.h"
#include "daemon/core/logging.h"
#include "daemon/metrics/metrics.h"
#include "epd/v1/control.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/unit/fake_data_plane.h"

namespace epd {
namespace {

using grpc::health::v1::HealthCheckResponse;
using ::testing::HasSubstr;

GpuInventory NoGpu() { return GpuInventory::FromList({}, "no CUDA device found (test)"); }
GpuInventory TwoGpus() {
  std::vector<v1::GpuInfo> gpus(2);
  for (int i = 0; i < 2; ++i) {
    gpus[i].set_ordinal(i);
    gpus[i].set_uuid(absl::StrCat("GPU-", i));
    gpus[i].set_name("Fake H200");
  }
  return GpuInventory::FromList(gpus, "2 GPU(s): Fake H200 x2", MpsStatus{true, "test"});
}

TEST(ChooseBackendTest, Table) {
  auto host = ChooseBackend(v1::BACKEND_HOST, TwoGpus(), true);
  ASSERT_TRUE(host.ok());
  EXPECT_EQ(host->backend, "host");
  EXPECT_THAT(host->reason, HasSubstr("--backend=host"));

  auto auto_no_gpu = ChooseBackend(v1::BACKEND_AUTO, NoGpu(), true);
  ASSERT_TRUE(auto_no_gpu.ok());
  EXPECT_EQ(auto_no_gpu->backend, "host");
  EXPECT_THAT(auto_no_gpu->reason, HasSubstr("no CUDA device found (test)"));

  auto auto_gpu = ChooseBackend(v1::BACKEND_AUTO, TwoGpus(), true);
  ASSERT_TRUE(auto_gpu.ok());
  EXPECT_EQ(auto_gpu->backend, "cuda");

  auto auto_gpu_unbuilt = ChooseBackend(v1::BACKEND_UNSPECIFIED, TwoGpus(), false);
  ASSERT_TRUE(auto_gpu_unbuilt.ok());
  EXPECT_EQ(auto_gpu_unbuilt->backend, "host");
  EXPECT_THAT(auto_gpu_unbuilt->reason, HasSubstr("CUDA data plane is not built yet"));

  auto cuda_unbuilt = ChooseBackend(v1::BACKEND_CUDA, TwoGpus(), false);
  ASSERT_TRUE(cuda_unbuilt.ok());
  EXPECT_EQ(cuda_unbuilt->backend, "host");
  EXPECT_THAT(cuda_unbuilt->reason, HasSubstr("using host buffers"));

  auto cuda_no_gpu = ChooseBackend(v1::BACKEND_CUDA, NoGpu(), true);
  EXPECT_EQ(cuda_no_gpu.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(cuda_no_gpu.status().message()), HasSubstr("no CUDA device found"));
}

class DaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/epd_daemon_test_XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
    socket_ = dir_ + "/epd.sock";
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  v1::DaemonConfig Config() {
    v1::DaemonConfig config;
    config.set_socket_path(socket_);
    config.set_socket_mode("0600");
    config.set_log_level("warn");
    FillDaemonConfigDefaults(&config);
    return config;
  }
  DaemonOptions Options(GpuInventory inventory = NoGpu()) {
    DaemonOptions options;
    options.inventory = std::move(inventory);
    options.drain_grace = absl::Milliseconds(50);
    options.data_plane_factory =
        [this](const v1::DaemonConfig&,
               const BackendChoice&) -> absl::StatusOr<std::unique_ptr<DataPlane>> {
      return std::unique_ptr<DataPlane>(new testing::FakeDataPlane(state_));
    };
    return options;
  }
  HealthCheckResponse::ServingStatus Health(const std::string& service) {
    auto channel = grpc::CreateChannel("unix://" + socket_, grpc::InsecureChannelCredentials());
    auto stub = grpc::health::v1::Health::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    HealthCheckResponse response;
    grpc::Status status = stub->Check(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.status();
  }

  std::shared_ptr<testing::FakeDataPlaneState> state_ =
      std::make_shared<testing::FakeDataPlaneState>();
  std::string dir_;
  std::string socket_;
};

TEST_F(DaemonTest, ServesHealthAndStatsThenShutsDown) {
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(Config(), Options(TwoGpus()));
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  EXPECT_EQ(Health(""), HealthCheckResponse::SERVING);
  EXPECT_EQ(Health(kControlServiceName), HealthCheckResponse::SERVING);

  struct stat st {};
  ASSERT_EQ(::stat(socket_.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0600u);

  v1::GetStatsResponse stats = (*daemon)->Stats();
  EXPECT_EQ(stats.version(), kEpdVersion);
  EXPECT_EQ(stats.backend(), "host");
#if EPD_HAVE_CUDA
  // Built with the CUDA data plane: auto picks it (the test's factory still serves host).
  EXPECT_THAT(stats.backend_reason(), HasSubstr("auto: 2 GPU(s)"));
#else
  EXPECT_THAT(stats.backend_reason(), HasSubstr("CUDA data plane is not built yet"));
#endif
  EXPECT_TRUE(stats.mps_active());
  EXPECT_EQ(stats.gpus_size(), 2);
  EXPECT_EQ(stats.serving_status(), "SERVING");
  EXPECT_EQ(stats.effective_config().socket_path(), socket_);
  EXPECT_EQ(stats.pid(), ::getpid());

  (*daemon)->Shutdown();
  EXPECT_THAT((*daemon)->Stats().serving_status(), HasSubstr("NOT_SERVING"));
  EXPECT_TRUE(state_->shut_down);
  EXPECT_FALSE(std::filesystem::exists(socket_));
}

TEST_F(DaemonTest, SecondDaemonOnTheSameSocketIsRefused) {
  absl::StatusOr<std::unique_ptr<Daemon>> first = Daemon::Start(Config(), Options());
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::unique_ptr<Daemon>> second = Daemon::Start(Config(), Options());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(second.status().message()), HasSubstr(absl::StrCat("pid ", ::getpid())));
  // The first one is untouched.
  EXPECT_EQ(Health(""), HealthCheckResponse::SERVING);
}

TEST_F(DaemonTest, StaleSocketFileIsReplaced) {
  // A socket file nobody listens on, as a crashed epd leaves behind.
  int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, socket_.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ::close(fd);
  ASSERT_TRUE(std::filesystem::exists(socket_));
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(Config(), Options());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  EXPECT_EQ(Health(""), HealthCheckResponse::SERVING);
}

TEST_F(DaemonTest, RegularFileAtSocketPathIsNotTouched) {
  std::ofstream(socket_) << "precious";
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(Config(), Options());
  EXPECT_EQ(daemon.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(daemon.status().message()), HasSubstr("is not a socket"));
  std::ifstream in(socket_);
  std::string content;
  in >> content;
  EXPECT_EQ(content, "precious");
}

TEST_F(DaemonTest, CudaBackendWithoutGpuRefusesToStart) {
  v1::DaemonConfig config = Config();
  config.set_backend(v1::BACKEND_CUDA);
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(config, Options(NoGpu()));
  EXPECT_EQ(daemon.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(std::filesystem::exists(socket_));
}

TEST_F(DaemonTest, UnknownSocketGroupIsNamed) {
  v1::DaemonConfig config = Config();
  config.set_socket_group("no-such-group-epd");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(config, Options());
  EXPECT_EQ(daemon.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(daemon.status().message()), HasSubstr("no-such-group-epd"));
}

TEST_F(DaemonTest, StuckListenerTurnsHealthNotServingUntilItRecovers) {
  std::atomic<bool> stall{false};
  absl::Notification stalled;
  absl::Notification release;
  DaemonOptions options = Options();
  options.health_interval = absl::Milliseconds(50);
  options.listener_stall_limit = absl::Milliseconds(500);
  options.listener_loop_hook_for_testing = [&] {
    if (stall.load() && !release.HasBeenNotified()) {
      if (!stalled.HasBeenNotified()) stalled.Notify();
      release.WaitForNotificationWithTimeout(absl::Seconds(20));
    }
  };
  v1::DaemonConfig config = Config();
  config.set_listen("127.0.0.1:0");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(config, options);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto check = [](const std::shared_ptr<grpc::Channel>& channel) {
    auto stub = grpc::health::v1::Health::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckRequest request;
    HealthCheckResponse response;
    grpc::Status status = stub->Check(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.status();
  };
  auto wait_for = [&](const std::string& prefix) {
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (absl::Now() < deadline &&
           !absl::StartsWith((*daemon)->Stats().serving_status(), prefix)) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    return (*daemon)->Stats().serving_status();
  };
  // Connections made before the stall stay gRPC's and keep being answered.
  auto unix_channel = grpc::CreateChannel("unix://" + socket_, grpc::InsecureChannelCredentials());
  auto tcp_channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*daemon)->tcp_port()),
                                         grpc::InsecureChannelCredentials());
  EXPECT_EQ(check(unix_channel), HealthCheckResponse::SERVING);
  EXPECT_EQ(check(tcp_channel), HealthCheckResponse::SERVING);

  stall = true;
  ASSERT_TRUE(stalled.WaitForNotificationWithTimeout(absl::Seconds(2)));
  EXPECT_THAT(wait_for("NOT_SERVING"), HasSubstr("NOT_SERVING (listener stuck: its accept loop"));
  EXPECT_EQ(check(tcp_channel), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(check(unix_channel), HealthCheckResponse::NOT_SERVING);

  release.Notify();
  EXPECT_EQ(wait_for("SERVING"), "SERVING");
  EXPECT_EQ(check(tcp_channel), HealthCheckResponse::SERVING);
  EXPECT_EQ(Health(""), HealthCheckResponse::SERVING);  // A new connection is accepted.
  (*daemon)->Shutdown();
}

TEST_F(DaemonTest, ApplyConfigAppliesLiveFieldsAndRefusesTheRest) {
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(Config(), Options());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  v1::DaemonConfig next = Config();
  next.set_log_level("error,epd.config=info");
  next.set_max_sessions_per_uid(3);
  next.set_metrics_listen("127.0.0.1:0");
  next.set_socket_mode("0660");  // Needs a restart.
  absl::StatusOr<v1::ReloadConfigResponse> reloaded = (*daemon)->ApplyConfig(next);
  ASSERT_TRUE(reloaded.ok()) << reloaded.status();
  EXPECT_EQ(reloaded->result(), "refused");
  EXPECT_THAT(reloaded->applied(),
              ::testing::ElementsAre("log_level", "max_sessions_per_uid", "metrics_listen"));
  EXPECT_THAT(reloaded->refused(), ::testing::ElementsAre("socket_mode"));
  const v1::DaemonConfig now = (*daemon)->config();
  EXPECT_EQ(now.log_level(), "error,epd.config=info");
  EXPECT_EQ(now.max_sessions_per_uid(), 3u);
  EXPECT_EQ(now.socket_mode(), "0600");
  EXPECT_EQ((*daemon)->Stats().effective_config().max_sessions_per_uid(), 3u);
  EXPECT_EQ(GetLogger(kLogDaemon)->level(), spdlog::level::err);
  EXPECT_EQ(GetLogger(kLogConfig)->level(), spdlog::level::info);
  EXPECT_GT((*daemon)->metrics_port(), 0);

  // The same again: nothing left to apply but the refused field.
  reloaded = (*daemon)->ApplyConfig(next);
  ASSERT_TRUE(reloaded.ok()) << reloaded.status();
  EXPECT_THAT(reloaded->applied(), ::testing::IsEmpty());

  // Invalid: nothing changes.
  v1::DaemonConfig bad = Config();
  bad.set_log_level("loud");
  bad.set_max_sessions_per_uid(9);
  reloaded = (*daemon)->ApplyConfig(bad);
  EXPECT_EQ(reloaded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(reloaded.status().message()), HasSubstr("log_level"));
  EXPECT_EQ((*daemon)->config().max_sessions_per_uid(), 3u);
  EXPECT_GT((*daemon)->metrics_port(), 0);

  // Back to the start: the metrics listener stops.
  reloaded = (*daemon)->ApplyConfig(Config());
  ASSERT_TRUE(reloaded.ok()) << reloaded.status();
  EXPECT_EQ(reloaded->result(), "ok");
  EXPECT_EQ((*daemon)->metrics_port(), 0);
  EXPECT_EQ(GetLogger(kLogDaemon)->level(), spdlog::level::warn);

  v1::MetricsSnapshot metrics = metrics::Default().Collect();
  std::map<std::string, double> reloads;
  for (const v1::MetricFamily& f : metrics.families()) {
    if (f.name() != "epd_config_reloads_total") continue;
    for (const v1::MetricSample& m : f.samples()) reloads[m.labels(0).value()] = m.value();
  }
  EXPECT_EQ(reloads["ok"], 1);
  EXPECT_EQ(reloads["refused"], 2);
  EXPECT_EQ(reloads["failed"], 1);
  (*daemon)->Shutdown();
}

TEST_F(DaemonTest, ReloadReadsTheConfigSourceAgain) {
  DaemonOptions options = Options();
  v1::DaemonConfig source = Config();
  options.config_source = [&source]() -> absl::StatusOr<ResolvedDaemonConfig> {
    return ResolvedDaemonConfig{source, {}};
  };
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(Config(), std::move(options));
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  source.set_max_groups(5);
  absl::StatusOr<v1::ReloadConfigResponse> reloaded = (*daemon)->ReloadConfig(std::nullopt);
  ASSERT_TRUE(reloaded.ok()) << reloaded.status();
  EXPECT_EQ(reloaded->result(), "ok");
  EXPECT_EQ((*daemon)->config().max_groups(), 5u);
  (*daemon)->Shutdown();
  EXPECT_EQ((*daemon)->ReloadConfig(std::nullopt).status().code(), absl::StatusCode::kUnavailable);
}

// metrics_listen "off" in a reloaded config stops the listener (as --metrics_listen=off).
TEST_F(DaemonTest, ReloadWithMetricsListenOffStopsTheListener) {
  v1::DaemonConfig start = Config();
  start.set_metrics_listen("127.0.0.1:0");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(start, Options());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  EXPECT_GT((*daemon)->metrics_port(), 0);
  v1::DaemonConfig next = Config();
  next.set_metrics_listen("off");
  absl::StatusOr<v1::ReloadConfigResponse> reloaded = (*daemon)->ApplyConfig(next);
  ASSERT_TRUE(reloaded.ok()) << reloaded.status();
  EXPECT_THAT(reloaded->applied(), ::testing::ElementsAre("metrics_listen"));
  EXPECT_EQ((*daemon)->metrics_port(), 0);
  EXPECT_EQ((*daemon)->config().metrics_listen(), "");
  (*daemon)->Shutdown();
}

// The fields the source says a flag overrides are named in the response (the reload is
// still "ok": nothing changed that it could not apply).
TEST_F(DaemonTest, ReloadNamesTheFieldsAFlagOverrides) {
  DaemonOptions options = Options();
  options.config_source = [this]() -> absl::StatusOr<ResolvedDaemonConfig> {
    return ResolvedDaemonConfig{
        Config(), {{"log_level", "--log_level", "log_level: \"debug\"", "log_level: \"info\""}}};
  };
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(Config(), std::move(options));
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  absl::StatusOr<v1::ReloadConfigResponse> reloaded = (*daemon)->ReloadConfig(std::nullopt);
  ASSERT_TRUE(reloaded.ok()) << reloaded.status();
  EXPECT_EQ(reloaded->result(), "ok");
  ASSERT_EQ(reloaded->overridden_size(), 1);
  EXPECT_EQ(reloaded->overridden(0).field(), "log_level");
  EXPECT_EQ(reloaded->overridden(0).flag(), "--log_level");
  (*daemon)->Shutdown();
}

TEST_F(DaemonTest, ReloadWithoutAConfigSourceIsRefused) {
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(Config(), Options());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  EXPECT_EQ((*daemon)->ReloadConfig(std::nullopt).status().code(),
            absl::StatusCode::kFailedPrecondition);
  (*daemon)->Shutdown();
}

TEST_F(DaemonTest, DrainTurnsControlHealthNotServingUntilUndrainedButNotTheProcesss) {
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(Config(), Options());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto channel = grpc::CreateChannel("unix://" + socket_, grpc::InsecureChannelCredentials());
  auto stub = v1::Control::NewStub(channel);
  auto drain = [&](bool on) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::DrainRequest request;
    request.set_drain(on);
    v1::DrainResponse response;
    grpc::Status status = stub->Drain(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();  // This process runs as epd's uid.
    return response;
  };
  v1::DrainResponse response = drain(true);
  EXPECT_TRUE(response.draining());
  EXPECT_FALSE(response.was_draining());
  EXPECT_TRUE((*daemon)->drained());
  // Readiness (the Control service) says no; liveness ("") stays SERVING: a drain must
  // not get epd restarted.
  EXPECT_EQ(Health(""), HealthCheckResponse::SERVING);
  EXPECT_EQ(Health(kControlServiceName), HealthCheckResponse::NOT_SERVING);
  const v1::GetStatsResponse stats = (*daemon)->Stats();
  EXPECT_TRUE(stats.draining());
  EXPECT_THAT(stats.serving_status(), HasSubstr("NOT_SERVING (drained by the operator"));

  EXPECT_TRUE(drain(true).was_draining());
  response = drain(false);
  EXPECT_FALSE(response.draining());
  EXPECT_TRUE(response.was_draining());
  EXPECT_EQ(Health(""), HealthCheckResponse::SERVING);
  EXPECT_EQ(Health(kControlServiceName), HealthCheckResponse::SERVING);
  EXPECT_FALSE((*daemon)->Stats().draining());
  (*daemon)->Shutdown();
}

}  // namespace
}  // namespace epd
