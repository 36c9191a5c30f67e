// The Peer service's and the transports' DaemonConfig fields (peer_*, transport, tcp_*,
// rdma): defaults, validation naming field and value (every RdmaConfig range, the device
// list forms "mlx5_0" / "mlx5_0:2"), flags, and the secret file's checks.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "absl/flags/reflection.h"
#include "daemon/core/config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/config_flags_testing.h"

namespace epd {
namespace {

using ::epd::testing::GiveFlag;
using ::testing::AllOf;
using ::testing::HasSubstr;

v1::DaemonConfig Filled() {
  v1::DaemonConfig config;
  FillDaemonConfigDefaults(&config);
  return config;
}

v1::DaemonConfig WithPeer() {
  v1::DaemonConfig config = Filled();
  config.set_peer_listen("127.0.0.1:7100");
  config.set_peer_secret_file("/etc/epd/peer.secret");
  return config;
}

TEST(PeerConfigTest, Defaults) {
  v1::DaemonConfig config = Filled();
  EXPECT_EQ(config.peer_listen(), "");
  EXPECT_EQ(config.peer_advertise(), "");
  EXPECT_EQ(config.peer_heartbeat_ms(), 500u);
  EXPECT_EQ(config.transport(), "tcp");
  EXPECT_EQ(config.tcp_connections_per_peer(), 2u);
  EXPECT_TRUE(ValidateDaemonConfig(config).ok());
  EXPECT_TRUE(ValidateDaemonConfig(WithPeer()).ok()) << ValidateDaemonConfig(WithPeer());
  v1::DaemonConfig advertised = WithPeer();
  advertised.set_peer_listen("0.0.0.0:7100");
  advertised.set_peer_advertise("node-2.cluster:7100");
  EXPECT_TRUE(ValidateDaemonConfig(advertised).ok()) << ValidateDaemonConfig(advertised);
}

TEST(PeerConfigTest, BadValuesAreNamed) {
  struct Case {
    std::function<void(v1::DaemonConfig*)> mutate;
    std::string field;
    std::string value;
  };
  for (const Case& c : std::vector<Case>{
           {[](v1::DaemonConfig* x) { x->set_peer_listen("nowhere"); }, "peer_listen", "nowhere"},
           {[](v1::DaemonConfig* x) { x->set_peer_listen("0.0.0.0:7100"); }, "peer_listen",
            "peer_advertise"},
           {[](v1::DaemonConfig* x) { x->set_peer_listen("[::]:7100"); }, "peer_listen", "[::]"},
           {[](v1::DaemonConfig* x) { x->clear_peer_secret_file(); }, "peer_secret_file",
            "required"},
           {[](v1::DaemonConfig* x) { x->set_peer_advertise("0.0.0.0:7100"); }, "peer_advertise",
            "0.0.0.0:7100"},
           {[](v1::DaemonConfig* x) { x->set_peer_advertise("host:0"); }, "peer_advertise",
            "host:0"},
           {[](v1::DaemonConfig* x) { x->set_peer_tls_cert_file("/c.pem"); }, "peer_tls_ca_file",
            "1 given"},
           {[](v1::DaemonConfig* x) {
              x->set_peer_tls_cert_file("/c.pem");
              x->set_peer_tls_key_file("/k.pem");
            },
            "peer_tls_cert_file", "2 given"},
           {[](v1::DaemonConfig* x) { x->set_peer_heartbeat_ms(9); }, "peer_heartbeat_ms", "9"},
           {[](v1::DaemonConfig* x) { x->set_transport("udp"); }, "transport", "udp"},
           {[](v1::DaemonConfig* x) { x->set_tcp_listen("x"); }, "tcp_listen", "x"},
           {[](v1::DaemonConfig* x) { x->set_tcp_connections_per_peer(0); },
            "tcp_connections_per_peer", "0"},
           {[](v1::DaemonConfig* x) { x->set_tcp_connections_per_peer(17); },
            "tcp_connections_per_peer", "17"},
       }) {
    v1::DaemonConfig config = WithPeer();
    c.mutate(&config);
    absl::Status status = ValidateDaemonConfig(config);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(status.message()), AllOf(HasSubstr(c.field), HasSubstr(c.value)));
  }
  v1::DaemonConfig advertise_alone = Filled();
  advertise_alone.set_peer_advertise("10.0.0.2:7100");
  EXPECT_THAT(ValidateDaemonConfig(advertise_alone).message(), HasSubstr("peer_listen"));
}

TEST(PeerConfigTest, FlagsOverrideTheFile) {
  absl::FlagSaver saver;
  GiveFlag("peer_listen", "127.0.0.1:7200");
  GiveFlag("peer_advertise", "node-a:7200");
  GiveFlag("peer_secret_file", "/s");
  GiveFlag("peer_heartbeat_ms", "40");
  GiveFlag("transport", "TCP");
  GiveFlag("tcp_listen", "127.0.0.1:0");
  GiveFlag("tcp_connections_per_peer", "4");
  ConfigFlags flags = ConfigFlagsFromCommandLine();
  v1::DaemonConfig config;
  config.set_peer_listen("127.0.0.1:7100");
  ASSERT_TRUE(ApplyConfigFlags(flags, &config).ok());
  FillDaemonConfigDefaults(&config);
  EXPECT_TRUE(ValidateDaemonConfig(config).ok()) << ValidateDaemonConfig(config);
  EXPECT_EQ(config.peer_listen(), "127.0.0.1:7200");
  EXPECT_EQ(config.peer_advertise(), "node-a:7200");
  EXPECT_EQ(config.peer_secret_file(), "/s");
  EXPECT_EQ(config.peer_heartbeat_ms(), 40u);
  EXPECT_EQ(config.transport(), "tcp");
  EXPECT_EQ(config.tcp_listen(), "127.0.0.1:0");
  EXPECT_EQ(config.tcp_connections_per_peer(), 4u);

  ConfigFlags off;
  off.peer_listen = "off";
  ASSERT_TRUE(ApplyConfigFlags(off, &config).ok());
  EXPECT_EQ(config.peer_listen(), "");
  ConfigFlags empty_transport;
  empty_transport.transport = "";
  EXPECT_THAT(ApplyConfigFlags(empty_transport, &config).message(), HasSubstr("--transport"));
  const char* flag_names[] = {
      "peer_listen",       "peer_advertise",          "peer_secret_file",  "peer_tls_cert_file",
      "peer_tls_key_file", "peer_tls_ca_file",        "peer_heartbeat_ms", "transport",
      "tcp_listen",        "tcp_connections_per_peer"};
  for (const char* name : flag_names) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    ASSERT_NE(flag, nullptr) << name;
    EXPECT_THAT(flag->Filename(), HasSubstr("daemon/core/config.cc")) << name;
  }
}

class SecretFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char path[] = "/tmp/epd_peer_secret_XXXXXX";
    int fd = ::mkstemp(path);
    ASSERT_GE(fd, 0);
    ::close(fd);
    path_ = path;
  }
  void TearDown() override { std::remove(path_.c_str()); }
  void Write(const std::string& text, mode_t mode) {
    std::ofstream(path_, std::ios::binary | std::ios::trunc) << text;
    ASSERT_EQ(::chmod(path_.c_str(), mode), 0);
  }
  std::string path_;
};

TEST_F(SecretFileTest, ReadsAndStripsOneNewline) {
  Write("0123456789abcdefXYZ\n", 0600);
  absl::StatusOr<std::string> s = ReadPeerSecretFile(path_);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s, "0123456789abcdefXYZ");
  Write("0123456789abcdef\r\n", 0400);
  EXPECT_EQ(*ReadPeerSecretFile(path_), "0123456789abcdef");
}

TEST_F(SecretFileTest, RefusesShortOpenOrMissing) {
  Write("short\n", 0600);
  EXPECT_THAT(ReadPeerSecretFile(path_).status().message(),
              AllOf(HasSubstr("peer_secret_file"), HasSubstr("5 bytes"), HasSubstr(path_)));
  Write("0123456789abcdef0123", 0640);
  absl::Status open = ReadPeerSecretFile(path_).status();
  EXPECT_EQ(open.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(open.message(), AllOf(HasSubstr("0640"), HasSubstr("chmod 600")));
  Write("0123456789abcdef0123", 0604);
  EXPECT_EQ(ReadPeerSecretFile(path_).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ReadPeerSecretFile(path_ + ".absent").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ReadPeerSecretFile("/tmp").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(RdmaConfigTest, DefaultsAreTheDocumentedOnes) {
  v1::DaemonConfig config = Filled();
  const v1::RdmaConfig& r = config.rdma();
  EXPECT_EQ(r.devices_size(), 0);
  EXPECT_FALSE(r.has_gid_index());
  EXPECT_FALSE(r.has_mtu());
  EXPECT_EQ(r.service_level(), 0u);
  EXPECT_EQ(r.traffic_class(), 0u);
  EXPECT_EQ(r.timeout(), 14u);
  EXPECT_EQ(r.retry_count(), 7u);
  EXPECT_EQ(r.rnr_retry(), 7u);
  EXPECT_EQ(r.qps_per_peer(), 2u);
  EXPECT_EQ(r.max_send_wr(), 1024u);
  EXPECT_EQ(r.cq_depth(), 4096u);
  EXPECT_EQ(r.gpudirect(), "auto");
  EXPECT_TRUE(ValidateDaemonConfig(config).ok()) << ValidateDaemonConfig(config);
  config.set_transport("rdma");
  EXPECT_TRUE(ValidateDaemonConfig(config).ok()) << ValidateDaemonConfig(config);
  // Present values are kept, also the extremes of each range.
  v1::DaemonConfig edges;
  v1::RdmaConfig* e = edges.mutable_rdma();
  e->set_gid_index(255);
  e->set_service_level(15);
  e->set_traffic_class(255);
  e->set_timeout(31);
  e->set_retry_count(0);
  e->set_rnr_retry(0);
  e->set_qps_per_peer(16);
  e->set_max_send_wr(16);
  e->set_cq_depth(1048576);
  e->set_mtu(256);
  e->set_gpudirect("off");
  FillDaemonConfigDefaults(&edges);
  EXPECT_EQ(edges.rdma().retry_count(), 0u);
  EXPECT_TRUE(ValidateDaemonConfig(edges).ok()) << ValidateDaemonConfig(edges);
}

TEST(RdmaConfigTest, OutOfRangeValuesAreNamed) {
  struct Case {
    std::function<void(v1::RdmaConfig*)> mutate;
    std::string field;
    std::string value;
  };
  for (const Case& c : std::vector<Case>{
           {[](v1::RdmaConfig* r) { r->set_gid_index(256); }, "rdma.gid_index", "256"},
           {[](v1::RdmaConfig* r) { r->set_service_level(16); }, "rdma.service_level", "16"},
           {[](v1::RdmaConfig* r) { r->set_traffic_class(256); }, "rdma.traffic_class", "256"},
           {[](v1::RdmaConfig* r) { r->set_timeout(0); }, "rdma.timeout", "0"},
           {[](v1::RdmaConfig* r) { r->set_timeout(32); }, "rdma.timeout", "32"},
           {[](v1::RdmaConfig* r) { r->set_retry_count(8); }, "rdma.retry_count", "8"},
           {[](v1::RdmaConfig* r) { r->set_rnr_retry(8); }, "rdma.rnr_retry", "8"},
           {[](v1::RdmaConfig* r) { r->set_qps_per_peer(0); }, "rdma.qps_per_peer", "0"},
           {[](v1::RdmaConfig* r) { r->set_qps_per_peer(17); }, "rdma.qps_per_peer", "17"},
           {[](v1::RdmaConfig* r) { r->set_max_send_wr(15); }, "rdma.max_send_wr", "15"},
           {[](v1::RdmaConfig* r) { r->set_max_send_wr(32769); }, "rdma.max_send_wr", "32769"},
           {[](v1::RdmaConfig* r) { r->set_cq_depth(63); }, "rdma.cq_depth", "63"},
           {[](v1::RdmaConfig* r) { r->set_cq_depth(1048577); }, "rdma.cq_depth", "1048577"},
           {[](v1::RdmaConfig* r) { r->set_mtu(1500); }, "rdma.mtu", "1500"},
           {[](v1::RdmaConfig* r) { r->set_mtu(0); }, "rdma.mtu", "0"},
           {[](v1::RdmaConfig* r) { r->set_gpudirect("yes"); }, "rdma.gpudirect", "yes"},
           {[](v1::RdmaConfig* r) { r->add_devices()->set_device(""); }, "rdma.devices[0].device",
            "\"\""},
           {[](v1::RdmaConfig* r) { r->add_devices()->set_device("mlx5 0"); },
            "rdma.devices[0].device", "mlx5 0"},
           {[](v1::RdmaConfig* r) {
              v1::RdmaDevicePort* d = r->add_devices();
              d->set_device("mlx5_0");
              d->set_port(256);
            },
            "rdma.devices[0].port", "256"},
           {[](v1::RdmaConfig* r) {
              r->add_devices()->set_device("mlx5_0");  // Port 0 = 1.
              v1::RdmaDevicePort* d = r->add_devices();
              d->set_device("mlx5_0");
              d->set_port(1);
            },
            "rdma.devices[1]", "mlx5_0:1 is listed twice"},
       }) {
    v1::DaemonConfig config;
    c.mutate(config.mutable_rdma());
    FillDaemonConfigDefaults(&config);
    absl::Status status = ValidateDaemonConfig(config);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(status.message()), AllOf(HasSubstr(c.field), HasSubstr(c.value)));
  }
  v1::DaemonConfig udp = Filled();
  udp.set_transport("udp");
  EXPECT_THAT(ValidateDaemonConfig(udp).message(),
              AllOf(HasSubstr("transport"), HasSubstr("udp"), HasSubstr("tcp or rdma")));
}

TEST(RdmaConfigTest, DeviceListForms) {
  auto list = ParseRdmaDevices("mlx5_0, mlx5_1:2", "--rdma_devices");
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 2u);
  EXPECT_EQ((*list)[0].device(), "mlx5_0");
  EXPECT_EQ((*list)[0].port(), 1u);
  EXPECT_EQ((*list)[1].device(), "mlx5_1");
  EXPECT_EQ((*list)[1].port(), 2u);
  EXPECT_TRUE(ParseRdmaDevices("", "--rdma_devices")->empty());
  for (const char* bad : {"mlx5_0:0", "mlx5_0:x", "mlx5_0:256", ":1", "mlx5_0,", "a b"}) {
    auto r = ParseRdmaDevices(bad, "--rdma_devices");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(r.status().message(), HasSubstr("--rdma_devices")) << bad;
  }
  // The longest name the kernel allows, and one beyond it, which the error explains.
  EXPECT_TRUE(ParseRdmaDevices(std::string(63, 'm'), "--rdma_devices").ok());
  auto too_long = ParseRdmaDevices(std::string(64, 'm'), "--rdma_devices");
  EXPECT_THAT(too_long.status().message(), HasSubstr("1 to 63 characters"));
}

// The word-valued settings take any case in the config file, as on the command line, and
// are kept lower-case.
TEST(RdmaConfigTest, FileAndFlagsTakeTheSameSpellings) {
  absl::StatusOr<v1::DaemonConfig> file =
      ParseDaemonConfig("transport: \"RDMA\" rdma { gpudirect: \"Off\" }", "test");
  ASSERT_TRUE(file.ok()) << file.status();
  v1::DaemonConfig config = *file;
  FillDaemonConfigDefaults(&config);
  EXPECT_TRUE(ValidateDaemonConfig(config).ok()) << ValidateDaemonConfig(config);
  EXPECT_EQ(config.transport(), "rdma");
  EXPECT_EQ(config.rdma().gpudirect(), "off");
  // A word that is no value is still refused, naming the field.
  file = ParseDaemonConfig("transport: \"Udp\"", "test");
  ASSERT_TRUE(file.ok()) << file.status();
  config = *file;
  FillDaemonConfigDefaults(&config);
  EXPECT_THAT(ValidateDaemonConfig(config).message(),
              AllOf(HasSubstr("transport"), HasSubstr("\"udp\" is not a transport")));
}

TEST(RdmaConfigTest, FlagsOverrideTheFile) {
  absl::FlagSaver saver;
  absl::StatusOr<v1::DaemonConfig> file = ParseDaemonConfig(
      "transport: \"tcp\" rdma { devices { device: \"mlx5_9\" } service_level: 1 }", "test");
  ASSERT_TRUE(file.ok()) << file.status();
  GiveFlag("transport", "RDMA");
  GiveFlag("rdma_devices", "mlx5_0,mlx5_1:2");
  GiveFlag("rdma_gid_index", "3");
  GiveFlag("rdma_service_level", "5");
  GiveFlag("rdma_traffic_class", "106");
  GiveFlag("rdma_qps_per_peer", "4");
  GiveFlag("rdma_gpudirect", "Off");
  v1::DaemonConfig config = *file;
  ASSERT_TRUE(ApplyConfigFlags(ConfigFlagsFromCommandLine(), &config).ok());
  FillDaemonConfigDefaults(&config);
  EXPECT_EQ(config.transport(), "rdma");
  ASSERT_EQ(config.rdma().devices_size(), 2);
  EXPECT_EQ(config.rdma().devices(1).device(), "mlx5_1");
  EXPECT_EQ(config.rdma().devices(1).port(), 2u);
  EXPECT_EQ(config.rdma().gid_index(), 3u);
  EXPECT_EQ(config.rdma().service_level(), 5u);
  EXPECT_EQ(config.rdma().traffic_class(), 106u);
  EXPECT_EQ(config.rdma().qps_per_peer(), 4u);
  EXPECT_EQ(config.rdma().gpudirect(), "off");
  EXPECT_TRUE(ValidateDaemonConfig(config).ok()) << ValidateDaemonConfig(config);

  ConfigFlags bad;
  bad.rdma_devices = "mlx5_0:0";
  EXPECT_THAT(ApplyConfigFlags(bad, &config).message(),
              AllOf(HasSubstr("--rdma_devices"), HasSubstr("mlx5_0:0")));
  ConfigFlags every;
  every.rdma_devices = "";
  ASSERT_TRUE(ApplyConfigFlags(every, &config).ok());
  EXPECT_EQ(config.rdma().devices_size(), 0);
  for (const char* name : {"rdma_devices", "rdma_gid_index", "rdma_service_level",
                           "rdma_traffic_class", "rdma_qps_per_peer", "rdma_gpudirect"}) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    ASSERT_NE(flag, nullptr) << name;
    EXPECT_THAT(flag->Filename(), HasSubstr("daemon/core/config.cc")) << name;
  }
}

}  // namespace
}  // namespace epd
