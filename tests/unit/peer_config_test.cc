// The Peer service's and the transport's DaemonConfig fields (peer_*, transport, tcp_*):
// defaults, validation naming field and value, flags, and the secret file's checks.
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
           {[](v1::DaemonConfig* x) { x->set_transport("rdma"); }, "transport", "rdma"},
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

}  // namespace
}  // namespace epd
