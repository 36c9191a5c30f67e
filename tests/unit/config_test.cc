// DaemonConfig loading: text format, unknown fields, bad values (the error names them),
// defaults, and flags overriding the file (daemon/core/config.h).
#include "daemon/core/config.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "daemon/core/config_overrides.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/config_flags_testing.h"

namespace epd {
namespace {

using ::epd::testing::GiveFlag;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr char kGoodConfig[] = R"pb(
  # A comment.
  socket_path: "/tmp/epd-test/epd.sock"
  socket_mode: "0600"
  listen: "127.0.0.1:50051"
  backend: BACKEND_HOST
  log_level: "debug"
  op_timeout_ms: 2500
  engine_idle_us: 50
  max_groups: 4
  gpu_uuids: "GPU-a"
  gpu_uuids: "GPU-b"
  host_threads: 3
)pb";

/// The names of epd's flags (daemon/core/config.cc).
const std::vector<std::string>& EpdFlagNames() {
  static const auto* names = new std::vector<std::string>{"config",
                                                          "socket",
                                                          "socket_mode",
                                                          "socket_group",
                                                          "listen",
                                                          "backend",
                                                          "log_level",
                                                          "op_timeout",
                                                          "shm_mode",
                                                          "engine_idle_us",
                                                          "host_threads",
                                                          "cuda_op_graphs",
                                                          "cuda_fused_launch",
                                                          "max_request_bytes",
                                                          "max_groups",
                                                          "gpu_uuids",
                                                          "max_groups_per_uid",
                                                          "max_endpoints_per_uid",
                                                          "max_endpoint_bytes_per_uid",
                                                          "max_sessions_per_uid",
                                                          "max_connections_per_uid"};
  return *names;
}

std::string WriteTempFile(const std::string& text) {
  char path[] = "/tmp/epd_config_test_XXXXXX";
  int fd = ::mkstemp(path);
  EXPECT_GE(fd, 0);
  ::close(fd);
  std::ofstream(path) << text;
  return path;
}

TEST(ParseDaemonConfigTest, GoodInput) {
  absl::StatusOr<v1::DaemonConfig> config = ParseDaemonConfig(kGoodConfig, "good.textproto");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->socket_path(), "/tmp/epd-test/epd.sock");
  EXPECT_EQ(config->socket_mode(), "0600");
  EXPECT_EQ(config->listen(), "127.0.0.1:50051");
  EXPECT_EQ(config->backend(), v1::BACKEND_HOST);
  EXPECT_EQ(config->log_level(), "debug");
  EXPECT_EQ(config->op_timeout_ms(), 2500u);
  EXPECT_EQ(config->engine_idle_us(), 50u);
  EXPECT_EQ(config->max_groups(), 4u);
  ASSERT_EQ(config->gpu_uuids_size(), 2);
  EXPECT_EQ(config->gpu_uuids(1), "GPU-b");
  EXPECT_EQ(config->host_threads(), 3u);
  EXPECT_TRUE(ValidateDaemonConfig([&] {
                v1::DaemonConfig c = *config;
                FillDaemonConfigDefaults(&c);
                return c;
              }())
                  .ok());
}

TEST(ParseDaemonConfigTest, UnknownFieldIsNamed) {
  absl::StatusOr<v1::DaemonConfig> config =
      ParseDaemonConfig("socket_path: \"/x\"\nsocket_colour: \"blue\"\n", "bad.textproto");
  ASSERT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(config.status().message()),
              AllOf(HasSubstr("bad.textproto:2:"), HasSubstr("socket_colour")));
}

TEST(ParseDaemonConfigTest, BadValuesAreNamed) {
  struct Case {
    std::string text;
    std::string field;
    std::string value;
  };
  for (const Case& c : std::vector<Case>{
           {"op_timeout_ms: \"ten\"", "op_timeout_ms", "ten"},
           {"op_timeout_ms: -5", "op_timeout_ms", "-5"},
           {"backend: BACKEND_GPU", "backend", "BACKEND_GPU"},
           {"max_groups: 1.5", "max_groups", "1.5"},
       }) {
    absl::StatusOr<v1::DaemonConfig> config = ParseDaemonConfig(c.text, "bad.textproto");
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(std::string(config.status().message()),
                AllOf(HasSubstr(c.field), HasSubstr(c.value), HasSubstr("bad.textproto:1:")))
        << c.text;
  }
}

TEST(ValidateDaemonConfigTest, BadValuesAreNamed) {
  struct Case {
    std::function<void(v1::DaemonConfig*)> mutate;
    std::string field;
    std::string value;
  };
  for (const Case& c : std::vector<Case>{
           {[](v1::DaemonConfig* x) { x->set_socket_mode("0999"); }, "socket_mode", "0999"},
           {[](v1::DaemonConfig* x) { x->set_socket_mode("rw-rw----"); }, "socket_mode",
            "rw-rw----"},
           {[](v1::DaemonConfig* x) { x->set_log_level("verbose"); }, "log_level", "verbose"},
           {[](v1::DaemonConfig* x) { x->set_listen("localhost"); }, "listen", "localhost"},
           {[](v1::DaemonConfig* x) { x->set_listen("host:99999"); }, "listen", "host:99999"},
           {[](v1::DaemonConfig* x) { x->set_socket_path("relative/epd.sock"); }, "socket_path",
            "relative/epd.sock"},
           {[](v1::DaemonConfig* x) { x->set_socket_path("/" + std::string(200, 'a')); },
            "socket_path", "aaaa"},
           {[](v1::DaemonConfig* x) { x->set_max_request_bytes(100); }, "max_request_bytes", "100"},
           {[](v1::DaemonConfig* x) { x->add_gpu_uuids(""); }, "gpu_uuids", "empty"},
           {[](v1::DaemonConfig* x) { x->set_socket_mode("7777"); }, "socket_mode", "setuid"},
           {[](v1::DaemonConfig* x) { x->set_socket_mode("0"); }, "socket_mode", "owner"},
           {[](v1::DaemonConfig* x) { x->set_host_threads(100000); }, "host_threads", "100000"},
           {[](v1::DaemonConfig* x) { x->set_cuda_op_graphs("yes"); }, "cuda_op_graphs", "yes"},
           {[](v1::DaemonConfig* x) { x->set_cuda_fused_launch("1"); }, "cuda_fused_launch", "1"},
           {[](v1::DaemonConfig* x) { x->set_op_timeout_ms(0); }, "op_timeout_ms", "0"},
           {[](v1::DaemonConfig* x) { x->set_max_groups(0); }, "max_groups", "0"},
       }) {
    v1::DaemonConfig config;
    FillDaemonConfigDefaults(&config);
    ASSERT_TRUE(ValidateDaemonConfig(config).ok());
    c.mutate(&config);
    absl::Status status = ValidateDaemonConfig(config);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(status.message()), AllOf(HasSubstr(c.field), HasSubstr(c.value)));
  }
}

TEST(FillDaemonConfigDefaultsTest, DocumentedDefaults) {
  v1::DaemonConfig config;
  FillDaemonConfigDefaults(&config);
  EXPECT_EQ(config.socket_path(), "/run/epd/epd.sock");
  EXPECT_EQ(config.socket_mode(), "0660");
  EXPECT_EQ(config.socket_group(), "");
  EXPECT_EQ(config.listen(), "");
  EXPECT_EQ(config.backend(), v1::BACKEND_AUTO);
  EXPECT_EQ(config.log_level(), "info");
  EXPECT_EQ(config.op_timeout_ms(), 10000u);
  EXPECT_EQ(config.shm_mode(), "");  // Deprecated and ignored: no default.
  EXPECT_EQ(config.engine_idle_us(), 100u);
  EXPECT_EQ(config.max_request_bytes(), 4194304u);
  EXPECT_EQ(config.max_groups(), 64u);
  EXPECT_EQ(config.gpu_uuids_size(), 0);
  EXPECT_EQ(config.host_threads(), 0u);
  EXPECT_EQ(config.cuda_op_graphs(), "off");
  EXPECT_EQ(config.cuda_fused_launch(), "on");
  EXPECT_TRUE(ValidateDaemonConfig(config).ok());
}

// --cuda_op_graphs reaches the config (lower-cased); the file's "ON" is taken as "on".
TEST(ResolveDaemonConfigTest, CudaOpGraphsFromTheFlagAndTheFile) {
  ConfigFlags flags;
  flags.cuda_op_graphs = "On";
  absl::StatusOr<v1::DaemonConfig> from_flag = ResolveDaemonConfig(flags);
  ASSERT_TRUE(from_flag.ok()) << from_flag.status();
  EXPECT_EQ(from_flag->cuda_op_graphs(), "on");
  std::string path = WriteTempFile("cuda_op_graphs: \"ON\"\n");
  ConfigFlags from_file_flags;
  from_file_flags.config_path = path;
  absl::StatusOr<v1::DaemonConfig> from_file = ResolveDaemonConfig(from_file_flags);
  ::unlink(path.c_str());
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  EXPECT_EQ(from_file->cuda_op_graphs(), "on");
  flags.cuda_op_graphs = "sometimes";
  absl::StatusOr<v1::DaemonConfig> bad = ResolveDaemonConfig(flags);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              AllOf(HasSubstr("cuda_op_graphs"), HasSubstr("sometimes")));
}

// --cuda_fused_launch reaches the config (lower-cased) and "off" stays off.
TEST(ResolveDaemonConfigTest, CudaFusedLaunchFromTheFlag) {
  ConfigFlags flags;
  flags.cuda_fused_launch = "OFF";
  absl::StatusOr<v1::DaemonConfig> off = ResolveDaemonConfig(flags);
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_EQ(off->cuda_fused_launch(), "off");
  flags.cuda_fused_launch = "maybe";
  absl::StatusOr<v1::DaemonConfig> bad = ResolveDaemonConfig(flags);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              AllOf(HasSubstr("cuda_fused_launch"), HasSubstr("maybe")));
}

TEST(ResolveDaemonConfigTest, FlagsOverrideTheFile) {
  std::string path = WriteTempFile(kGoodConfig);
  ConfigFlags flags;
  flags.config_path = path;
  flags.socket = "unix:///tmp/epd-flag/epd.sock";
  flags.backend = "auto";
  flags.op_timeout = absl::Seconds(3);
  flags.log_level = "warn";
  flags.gpu_uuids = std::vector<std::string>{"GPU-c"};
  absl::StatusOr<v1::DaemonConfig> config = ResolveDaemonConfig(flags);
  ::unlink(path.c_str());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->socket_path(), "unix:///tmp/epd-flag/epd.sock");
  EXPECT_EQ(SocketFilePath(config->socket_path()), "/tmp/epd-flag/epd.sock");
  EXPECT_EQ(config->backend(), v1::BACKEND_AUTO);
  EXPECT_EQ(config->op_timeout_ms(), 3000u);
  EXPECT_EQ(config->log_level(), "warn");
  ASSERT_EQ(config->gpu_uuids_size(), 1);
  EXPECT_EQ(config->gpu_uuids(0), "GPU-c");
  // Fields no flag names keep the file's values.
  EXPECT_EQ(config->socket_mode(), "0600");
  EXPECT_EQ(config->listen(), "127.0.0.1:50051");
  EXPECT_EQ(config->max_groups(), 4u);
  EXPECT_EQ(config->engine_idle_us(), 50u);
  // And absent ones take defaults.
  EXPECT_EQ(config->shm_mode(), "");
  EXPECT_EQ(config->max_request_bytes(), kDefaultMaxRequestBytes);
}

// proto3 `optional`: a 0 written in the file (or given as a flag) is an error, never read
// as "absent" and replaced by the default.
TEST(ResolveDaemonConfigTest, ZerosInTheFileOrFlagsAreErrorsNotDefaults) {
  for (const std::string text : {"op_timeout_ms: 0", "max_groups: 0", "max_request_bytes: 0"}) {
    absl::StatusOr<v1::DaemonConfig> parsed = ParseDaemonConfig(text, "test.textproto");
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    v1::DaemonConfig config = *parsed;
    FillDaemonConfigDefaults(&config);
    absl::Status st = ValidateDaemonConfig(config);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_NE(st.message().find(text.substr(0, text.find(':'))), std::string::npos) << st;
  }
  ConfigFlags zero_bytes;
  zero_bytes.max_request_bytes = 0u;
  absl::StatusOr<v1::DaemonConfig> resolved = ResolveDaemonConfig(zero_bytes);
  EXPECT_EQ(resolved.status().code(), absl::StatusCode::kInvalidArgument);
  // Absent fields still take their defaults.
  v1::DaemonConfig empty;
  FillDaemonConfigDefaults(&empty);
  EXPECT_EQ(empty.op_timeout_ms(), kDefaultOpTimeoutMs);
  EXPECT_EQ(empty.max_groups(), kDefaultMaxGroups);
  EXPECT_TRUE(ValidateDaemonConfig(empty).ok());
}

// Per-uid quotas: defaults a single big job fits in; a present 0 (file or flag) means no
// limit and stays 0 rather than taking the default; flags override the file.
TEST(ResolveDaemonConfigTest, PerUidQuotas) {
  v1::DaemonConfig defaults;
  FillDaemonConfigDefaults(&defaults);
  EXPECT_EQ(defaults.max_groups_per_uid(), 64u);
  EXPECT_EQ(defaults.max_endpoints_per_uid(), 256u);
  EXPECT_EQ(defaults.max_endpoint_bytes_per_uid(), 0u);
  EXPECT_EQ(defaults.max_sessions_per_uid(), 256u);
  EXPECT_EQ(defaults.max_connections_per_uid(), 128u);

  std::string path = WriteTempFile(
      "max_groups_per_uid: 0\nmax_endpoints_per_uid: 0\nmax_endpoint_bytes_per_uid: 1000\n"
      "max_sessions_per_uid: 0\nmax_connections_per_uid: 0\n");
  ConfigFlags from_file;
  from_file.config_path = path;
  absl::StatusOr<v1::DaemonConfig> config = ResolveDaemonConfig(from_file);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->max_groups_per_uid(), 0u);
  EXPECT_EQ(config->max_endpoints_per_uid(), 0u);
  EXPECT_EQ(config->max_endpoint_bytes_per_uid(), 1000u);
  EXPECT_EQ(config->max_sessions_per_uid(), 0u);
  EXPECT_EQ(config->max_connections_per_uid(), 0u);

  ConfigFlags flags = from_file;
  {
    absl::FlagSaver saver;
    GiveFlag("max_groups_per_uid", "3");
    GiveFlag("max_endpoints_per_uid", "5");
    GiveFlag("max_endpoint_bytes_per_uid", "68719476736");  // 64 GiB: above 32 bits.
    GiveFlag("max_sessions_per_uid", "7");
    GiveFlag("max_connections_per_uid", "9");
    ConfigFlags given = ConfigFlagsFromCommandLine();
    flags.max_groups_per_uid = given.max_groups_per_uid;
    flags.max_endpoints_per_uid = given.max_endpoints_per_uid;
    flags.max_endpoint_bytes_per_uid = given.max_endpoint_bytes_per_uid;
    flags.max_sessions_per_uid = given.max_sessions_per_uid;
    flags.max_connections_per_uid = given.max_connections_per_uid;
  }
  config = ResolveDaemonConfig(flags);
  ::unlink(path.c_str());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->max_groups_per_uid(), 3u);
  EXPECT_EQ(config->max_endpoints_per_uid(), 5u);
  EXPECT_EQ(config->max_endpoint_bytes_per_uid(), 68719476736u);
  EXPECT_EQ(config->max_sessions_per_uid(), 7u);
  EXPECT_EQ(config->max_connections_per_uid(), 9u);

  std::string error;
  EXPECT_FALSE(absl::FindCommandLineFlag("max_endpoint_bytes_per_uid")->ParseFrom("-1", &error));
  EXPECT_THAT(error, HasSubstr("whole number"));
}

TEST(ResolveDaemonConfigTest, DirectoryAsConfigAndSilentFlagValuesAreErrors) {
  absl::StatusOr<v1::DaemonConfig> dir = LoadDaemonConfigFile("/tmp");
  ASSERT_FALSE(dir.ok());
  EXPECT_NE(dir.status().message().find("not a regular file"), std::string::npos);
  ConfigFlags zero_groups;
  zero_groups.max_groups = 0u;
  v1::DaemonConfig config;
  absl::Status st = ApplyConfigFlags(zero_groups, &config);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("--max_groups"), std::string::npos);
  ConfigFlags fractional;
  fractional.op_timeout = absl::Microseconds(1500);
  st = ApplyConfigFlags(fractional, &config);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("--op_timeout"), std::string::npos);
}

TEST(ResolveDaemonConfigTest, ListenOffClearsTheFilesListener) {
  std::string path = WriteTempFile(kGoodConfig);
  ConfigFlags flags;
  flags.config_path = path;
  flags.listen = "off";
  absl::StatusOr<v1::DaemonConfig> config = ResolveDaemonConfig(flags);
  ::unlink(path.c_str());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->listen(), "");
}

// "off" in the config file turns a listener off exactly as the flag does (a reload reads
// the file through the same code): it was refused as "not host:port".
TEST(ResolveDaemonConfigTest, OffInTheFileTurnsAListenerOff) {
  std::string path = WriteTempFile(
      "metrics_listen: \"off\"\nlisten: \"off\"\npeer_listen: \"off\"\nbackend: BACKEND_HOST\n");
  ConfigFlags flags;
  flags.config_path = path;
  absl::StatusOr<v1::DaemonConfig> config = ResolveDaemonConfig(flags);
  ::unlink(path.c_str());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->metrics_listen(), "");
  EXPECT_EQ(config->listen(), "");
  EXPECT_EQ(config->peer_listen(), "");
  v1::DaemonConfig filled;
  filled.set_metrics_listen("off");
  FillDaemonConfigDefaults(&filled);
  EXPECT_EQ(filled.metrics_listen(), "");
  EXPECT_TRUE(ValidateDaemonConfig(filled).ok());
}

// A flag that overrides a value the file sets is reported (field, flag, both values), in
// config.proto's order; a flag giving the file's own value, or a field the file leaves
// out, is no override.
TEST(ResolveDaemonConfigTest, OverridesNameTheFieldsAFlagTakesFromTheFile) {
  std::string path = WriteTempFile(
      "log_level: \"debug\"\nmax_groups: 9\nlisten: \"127.0.0.1:50051\"\n"
      "metrics_listen: \"off\"\nrdma { qps_per_peer: 4 }\n");
  ConfigFlags flags;
  flags.config_path = path;
  flags.log_level = "info";
  flags.max_groups = 9;                 // The file's own value.
  flags.listen = "off";                 // Turns the file's listener off.
  flags.metrics_listen = "";            // "off" in the file: the same.
  flags.op_timeout = absl::Seconds(3);  // Not in the file.
  flags.rdma_qps_per_peer = 2;
  absl::StatusOr<ResolvedDaemonConfig> resolved = ResolveDaemonConfigWithOverrides(flags);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->config.log_level(), "info");
  std::vector<std::string> fields;
  for (const ConfigFlagOverride& o : resolved->overridden) fields.push_back(o.field);
  EXPECT_THAT(fields, ::testing::ElementsAre("listen", "log_level", "rdma.qps_per_peer"));
  ASSERT_EQ(resolved->overridden.size(), 3u);
  const ConfigFlagOverride& log_level = resolved->overridden[1];
  EXPECT_EQ(log_level.flag, "--log_level");
  EXPECT_EQ(log_level.file_value, "log_level: \"debug\"");
  EXPECT_EQ(log_level.value, "log_level: \"info\"");
  EXPECT_EQ(ConfigFlagOverrideText(log_level),
            "log_level: set by --log_level on the command line (log_level: \"info\"); the "
            "config file's value (log_level: \"debug\") is not applied");
  EXPECT_EQ(resolved->overridden[2].flag, "--rdma_qps_per_peer");
  // ResolveDaemonConfig gives the same config.
  absl::StatusOr<v1::DaemonConfig> config = ResolveDaemonConfig(flags);
  ::unlink(path.c_str());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->SerializeAsString(), resolved->config.SerializeAsString());
  // Without a file, nothing is overridden.
  flags.config_path.reset();
  resolved = ResolveDaemonConfigWithOverrides(flags);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_TRUE(resolved->overridden.empty());
}

TEST(FlagOfConfigFieldTest, NamesTheFlagOfAField) {
  EXPECT_EQ(FlagOfConfigField("socket_path"), "--socket");
  EXPECT_EQ(FlagOfConfigField("op_timeout_ms"), "--op_timeout");
  EXPECT_EQ(FlagOfConfigField("rdma.devices"), "--rdma_devices");
  EXPECT_EQ(FlagOfConfigField("rdma.gid_index"), "--rdma_gid_index");
  EXPECT_EQ(FlagOfConfigField("max_sessions_per_uid"), "--max_sessions_per_uid");
}

TEST(ResolveDaemonConfigTest, RealFlagsOverrideTheFile) {
  std::string path = WriteTempFile(kGoodConfig);
  ConfigFlags flags;
  {
    absl::FlagSaver saver;
    GiveFlag("config", path);
    GiveFlag("socket", "/tmp/epd-real-flag.sock");
    GiveFlag("op_timeout", "1500ms");
    flags = ConfigFlagsFromCommandLine();
  }
  EXPECT_FALSE(flags.backend.has_value());
  absl::StatusOr<v1::DaemonConfig> config = ResolveDaemonConfig(flags);
  ::unlink(path.c_str());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->socket_path(), "/tmp/epd-real-flag.sock");
  EXPECT_EQ(config->op_timeout_ms(), 1500u);
  EXPECT_EQ(config->backend(), v1::BACKEND_HOST);  // From the file.
}

// The flags' defaults are the real ones (for --help) but are never applied by themselves:
// a flag not given leaves the file's value; a flag given, even with the default's value,
// overrides it.
TEST(ResolveDaemonConfigTest, OnlyFlagsGivenOverrideTheFile) {
  std::string path = WriteTempFile(kGoodConfig);
  ConfigFlags absent;
  ConfigFlags given;
  {
    absl::FlagSaver saver;
    GiveFlag("config", path);
    absent = ConfigFlagsFromCommandLine();
    GiveFlag("socket", kDefaultSocketPath);
    GiveFlag("log_level", kDefaultLogLevel);
    GiveFlag("backend", "auto");
    GiveFlag("listen", "");  // "--listen=": no listener, as "--listen=off".
    GiveFlag("gpu_uuids", "");
    given = ConfigFlagsFromCommandLine();
  }
  EXPECT_FALSE(absent.socket || absent.socket_mode || absent.socket_group || absent.listen ||
               absent.backend || absent.log_level || absent.op_timeout || absent.shm_mode ||
               absent.engine_idle_us || absent.host_threads || absent.max_request_bytes ||
               absent.max_groups || absent.gpu_uuids || absent.max_groups_per_uid ||
               absent.max_endpoints_per_uid || absent.max_endpoint_bytes_per_uid);
  absl::StatusOr<v1::DaemonConfig> from_file = ResolveDaemonConfig(absent);
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  EXPECT_EQ(from_file->socket_path(), "/tmp/epd-test/epd.sock");
  EXPECT_EQ(from_file->log_level(), "debug");
  EXPECT_EQ(from_file->backend(), v1::BACKEND_HOST);
  EXPECT_EQ(from_file->listen(), "127.0.0.1:50051");
  EXPECT_EQ(from_file->gpu_uuids_size(), 2);
  absl::StatusOr<v1::DaemonConfig> overridden = ResolveDaemonConfig(given);
  ::unlink(path.c_str());
  ASSERT_TRUE(overridden.ok()) << overridden.status();
  EXPECT_EQ(overridden->socket_path(), kDefaultSocketPath);
  EXPECT_EQ(overridden->log_level(), kDefaultLogLevel);
  EXPECT_EQ(overridden->backend(), v1::BACKEND_AUTO);
  EXPECT_EQ(overridden->listen(), "");
  EXPECT_EQ(overridden->gpu_uuids_size(), 0);
}

// --help prints "default: <DefaultValue>;" for every flag: the real default, never empty
// (std::optional flags printed "default: ;").
TEST(ConfigFlagsTest, HelpShowsTheRealDefaults) {
  for (const std::string& name : EpdFlagNames()) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    ASSERT_NE(flag, nullptr) << name;
    EXPECT_FALSE(flag->DefaultValue().empty()) << "--" << name;
    EXPECT_THAT(flag->Filename(), HasSubstr("daemon/core/config.cc")) << name;
  }
  auto default_of = [](const char* name) {
    return absl::FindCommandLineFlag(name)->DefaultValue();
  };
  EXPECT_EQ(default_of("socket"), "\"/run/epd/epd.sock\"");
  EXPECT_EQ(default_of("socket_mode"), "\"0660\"");
  EXPECT_EQ(default_of("socket_group"), "\"\"");
  EXPECT_EQ(default_of("backend"), "\"auto\"");
  EXPECT_EQ(default_of("log_level"), "\"info\"");
  EXPECT_EQ(default_of("op_timeout"), "10s");
  EXPECT_EQ(default_of("shm_mode"), "\"\"");  // Deprecated and ignored.
  EXPECT_EQ(default_of("engine_idle_us"), "100");
  EXPECT_EQ(default_of("host_threads"), "0");
  EXPECT_EQ(default_of("cuda_op_graphs"), "\"off\"");
  EXPECT_EQ(default_of("max_request_bytes"), "4194304");
  EXPECT_EQ(default_of("max_groups"), "64");
  EXPECT_EQ(default_of("gpu_uuids"), "\"\"");
  EXPECT_EQ(default_of("max_groups_per_uid"), "64");
  EXPECT_EQ(default_of("max_endpoints_per_uid"), "256");
  EXPECT_EQ(default_of("max_endpoint_bytes_per_uid"), "0");
  EXPECT_EQ(default_of("max_sessions_per_uid"), "256");
  EXPECT_EQ(default_of("max_connections_per_uid"), "128");
  // And they are the DaemonConfig defaults.
  v1::DaemonConfig defaults;
  FillDaemonConfigDefaults(&defaults);
  EXPECT_EQ(default_of("socket"), "\"" + defaults.socket_path() + "\"");
  EXPECT_EQ(default_of("max_groups"), std::to_string(defaults.max_groups()));
  EXPECT_EQ(default_of("max_groups_per_uid"), std::to_string(defaults.max_groups_per_uid()));
  EXPECT_EQ(default_of("max_endpoints_per_uid"), std::to_string(defaults.max_endpoints_per_uid()));
  EXPECT_EQ(default_of("backend"), "\"" + BackendFlagName(defaults.backend()) + "\"");
}

TEST(ResolveDaemonConfigTest, BadFlagValuesAreNamed) {
  ConfigFlags flags;
  flags.backend = "gpu";
  absl::Status status = ResolveDaemonConfig(flags).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), AllOf(HasSubstr("--backend"), HasSubstr("gpu")));

  flags = ConfigFlags();
  flags.op_timeout = absl::ZeroDuration();
  status = ResolveDaemonConfig(flags).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("--op_timeout"));

  flags = ConfigFlags();
  flags.socket_mode = "0888";
  status = ResolveDaemonConfig(flags).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), AllOf(HasSubstr("socket_mode"), HasSubstr("0888")));
}

// A flag given with an empty value is an error naming it, never the default; the config
// file's field written empty is the same as leaving it out (proto3: it takes the default).
TEST(ResolveDaemonConfigTest, ExplicitlyEmptyFlagsAreErrorsNamingThem) {
  for (const std::string name : {"socket", "socket_mode", "log_level"}) {
    ConfigFlags flags;
    {
      absl::FlagSaver saver;
      GiveFlag(name, "");
      flags = ConfigFlagsFromCommandLine();
    }
    absl::Status status = ResolveDaemonConfig(flags).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_THAT(std::string(status.message()),
                AllOf(HasSubstr("--" + name + ": \"\""), HasSubstr("empty"),
                      HasSubstr("leave the flag out")));
  }
  ConfigFlags direct;
  direct.socket = "";
  EXPECT_EQ(ResolveDaemonConfig(direct).status().code(), absl::StatusCode::kInvalidArgument);

  std::string path = WriteTempFile("socket_path: \"\"\nshm_mode: \"\"\n");
  ConfigFlags from_file;
  from_file.config_path = path;
  absl::StatusOr<v1::DaemonConfig> config = ResolveDaemonConfig(from_file);
  ::unlink(path.c_str());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->socket_path(), kDefaultSocketPath);
  EXPECT_EQ(config->shm_mode(), "");
}

// shm_mode is deprecated (endpoint regions are sealed memfds with no file mode): any value,
// from a config file or --shm_mode, still starts (older configs keep working), is ignored,
// and start-up warns naming the field, the value and that it is ignored; the defaults warn
// about nothing.
TEST(DaemonConfigWarningsTest, ShmModeIsDeprecatedIgnoredAndWarnedAbout) {
  v1::DaemonConfig config;
  FillDaemonConfigDefaults(&config);
  EXPECT_THAT(DaemonConfigWarnings(config), ::testing::IsEmpty());
  for (const std::string mode : {"0600", "0660", "0777", "77777", "rw"}) {
    config.set_shm_mode(mode);
    ASSERT_TRUE(ValidateDaemonConfig(config).ok()) << mode;
    std::vector<std::string> warnings = DaemonConfigWarnings(config);
    ASSERT_EQ(warnings.size(), 1u) << mode;
    EXPECT_THAT(warnings[0], AllOf(HasSubstr("shm_mode: \"" + mode + "\""),
                                   HasSubstr("deprecated and ignored"), HasSubstr("remove")));
  }
  ConfigFlags flags;
  flags.shm_mode = "0660";
  absl::StatusOr<v1::DaemonConfig> resolved = ResolveDaemonConfig(flags);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_THAT(DaemonConfigWarnings(*resolved), ::testing::ElementsAre(HasSubstr("--shm_mode")));
}

TEST(ResolveDaemonConfigTest, MissingFileIsNamed) {
  ConfigFlags flags;
  flags.config_path = "/nonexistent/epd.textproto";
  absl::Status status = ResolveDaemonConfig(flags).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(status.message()), HasSubstr("/nonexistent/epd.textproto"));
}

TEST(ParseFileModeTest, OctalModes) {
  EXPECT_EQ(*ParseFileMode("m", "0660"), 0660u);
  EXPECT_EQ(*ParseFileMode("m", "600"), 0600u);
  EXPECT_EQ(*ParseFileMode("m", "02770"), 02770u);
  EXPECT_FALSE(ParseFileMode("m", "").ok());
  EXPECT_FALSE(ParseFileMode("m", "0o660").ok());
  EXPECT_FALSE(ParseFileMode("m", "0680").ok());
  EXPECT_FALSE(ParseFileMode("m", "17777").ok());
}

// engine_idle_us 0 means "sleep as soon as the rings are empty" (config.proto) and is kept,
// from the file and from --engine_idle_us=0 alike; it was silently replaced by 100. Absent,
// it still takes the default.
TEST(ResolveDaemonConfigTest, EngineIdleUsZeroIsKeptFromFileAndFlag) {
  std::string zero_file = WriteTempFile("engine_idle_us: 0\n");
  ConfigFlags from_file;
  from_file.config_path = zero_file;
  absl::StatusOr<v1::DaemonConfig> config = ResolveDaemonConfig(from_file);
  ::unlink(zero_file.c_str());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->has_engine_idle_us());
  EXPECT_EQ(config->engine_idle_us(), 0u);

  std::string good = WriteTempFile(kGoodConfig);  // engine_idle_us: 50
  ConfigFlags flags;
  {
    absl::FlagSaver saver;
    GiveFlag("config", good);
    GiveFlag("engine_idle_us", "0");
    flags = ConfigFlagsFromCommandLine();
  }
  ASSERT_TRUE(flags.engine_idle_us.has_value());
  config = ResolveDaemonConfig(flags);
  ::unlink(good.c_str());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->engine_idle_us(), 0u);

  v1::DaemonConfig absent;
  FillDaemonConfigDefaults(&absent);
  EXPECT_EQ(absent.engine_idle_us(), kDefaultEngineIdleUs);
  // The text epctl config shows keeps the 0 (presence is tracked).
  v1::DaemonConfig zero;
  zero.set_engine_idle_us(0);
  FillDaemonConfigDefaults(&zero);
  EXPECT_EQ(zero.engine_idle_us(), 0u);
  EXPECT_THAT(zero.ShortDebugString(), HasSubstr("engine_idle_us: 0"));
}

// gRPC takes the message size limit as an int: a max_request_bytes above INT32_MAX was
// cast to a negative limit. Refused from the file and from the flag, naming the maximum.
TEST(ValidateDaemonConfigTest, MaxRequestBytesAboveInt32MaxIsRefused) {
  v1::DaemonConfig config;
  FillDaemonConfigDefaults(&config);
  config.set_max_request_bytes(2147483647u);
  EXPECT_TRUE(ValidateDaemonConfig(config).ok()) << ValidateDaemonConfig(config);
  for (uint32_t bytes : {2147483648u, 4294967295u}) {
    config.set_max_request_bytes(bytes);
    absl::Status status = ValidateDaemonConfig(config);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bytes;
    EXPECT_THAT(std::string(status.message()),
                AllOf(HasSubstr("max_request_bytes"), HasSubstr(absl::StrCat(bytes)),
                      HasSubstr("above the maximum 2147483647")));
  }
  std::string path = WriteTempFile("max_request_bytes: 3000000000\n");
  ConfigFlags from_file;
  from_file.config_path = path;
  absl::Status status = ResolveDaemonConfig(from_file).status();
  ::unlink(path.c_str());
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("max_request_bytes: 3000000000"), HasSubstr("2147483647")));
  ConfigFlags flags;
  {
    absl::FlagSaver saver;
    GiveFlag("max_request_bytes", "2147483648");
    flags = ConfigFlagsFromCommandLine();
  }
  status = ResolveDaemonConfig(flags).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("max_request_bytes: 2147483648"), HasSubstr("2147483647")));
}

/// An absolute socket path of exactly `bytes` bytes.
std::string SocketPathOfLength(size_t bytes) {
  const std::string dir = "/tmp/epd-socket-length/";
  return dir + std::string(bytes - dir.size(), 's');
}

// gRPC 1.51 listens on "unix:///path" as "//" + path, so 105 bytes is the most: 106 and
// 107 passed validation and then failed to listen ("address in use or not permitted").
TEST(ValidateDaemonConfigTest, SocketPathUpTo105BytesIsAccepted) {
  for (const std::string prefix : {"", "unix://", "unix:"}) {
    v1::DaemonConfig config;
    config.set_socket_path(prefix + SocketPathOfLength(105));
    FillDaemonConfigDefaults(&config);
    EXPECT_TRUE(ValidateDaemonConfig(config).ok()) << ValidateDaemonConfig(config);
    for (size_t bytes : {106, 107, 108}) {
      config.set_socket_path(prefix + SocketPathOfLength(bytes));
      absl::Status status = ValidateDaemonConfig(config);
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bytes;
      EXPECT_THAT(std::string(status.message()),
                  AllOf(HasSubstr("socket_path"), HasSubstr(SocketPathOfLength(bytes)),
                        HasSubstr(absl::StrCat("is ", bytes, " bytes long")),
                        HasSubstr("the most epd can listen on is 105 bytes")));
    }
  }
}

TEST(SocketFilePathTest, AcceptedSpellings) {
  EXPECT_EQ(SocketFilePath("/run/epd/epd.sock"), "/run/epd/epd.sock");
  EXPECT_EQ(SocketFilePath("unix:///run/epd/epd.sock"), "/run/epd/epd.sock");
  EXPECT_EQ(SocketFilePath("unix:/run/epd/epd.sock"), "/run/epd/epd.sock");
}

}  // namespace
}  // namespace epd
