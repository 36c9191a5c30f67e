// GrpcPeerMesh over mutual TLS: certificates made here with libcrypto (a CA and leaf
// certificates for 127.0.0.1). Daemons of the same CA rendezvous; one whose certificate
// another CA signed, or one without TLS, never does.
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "daemon/peer/grpc_peer_mesh.h"
#include "epd/v1/peer.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace epd::peer {
namespace {

constexpr char kSecret[] = "0123456789abcdef-tls-test-secret";

struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct CertFree {
  void operator()(X509* x) const { X509_free(x); }
};
struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
using Key = std::unique_ptr<EVP_PKEY, KeyFree>;
using Cert = std::unique_ptr<X509, CertFree>;

/// A key and its certificate, signed by `issuer` (self-signed CA when null).
struct Identity {
  Key key;
  Cert cert;
};

void AddExtension(X509* cert, X509* issuer, int nid, const char* value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
  ASSERT_NE(ext, nullptr) << value;
  X509_add_ext(cert, ext, -1);
  X509_EXTENSION_free(ext);
}

Identity MakeIdentity(const char* common_name, const Identity* issuer,
                      const char* alt_names = "IP:127.0.0.1,DNS:localhost") {
  static long serial = 1;
  Identity id;
  id.key.reset(EVP_EC_gen("P-256"));
  id.cert.reset(X509_new());
  X509* x = id.cert.get();
  X509_set_version(x, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(x), serial++);
  X509_gmtime_adj(X509_getm_notBefore(x), -3600);
  X509_gmtime_adj(X509_getm_notAfter(x), 24 * 3600);
  X509_set_pubkey(x, id.key.get());
  X509_NAME* name = X509_get_subject_name(x);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(common_name), -1, -1, 0);
  X509* issuer_cert = issuer != nullptr ? issuer->cert.get() : x;
  X509_set_issuer_name(x, X509_get_subject_name(issuer_cert));
  if (issuer == nullptr) {
    AddExtension(x, issuer_cert, NID_basic_constraints, "critical,CA:TRUE");
    AddExtension(x, issuer_cert, NID_key_usage, "critical,keyCertSign,cRLSign");
  } else {
    AddExtension(x, issuer_cert, NID_basic_constraints, "CA:FALSE");
    AddExtension(x, issuer_cert, NID_subject_alt_name, alt_names);
    AddExtension(x, issuer_cert, NID_ext_key_usage, "serverAuth,clientAuth");
  }
  X509_sign(x, issuer != nullptr ? issuer->key.get() : id.key.get(), EVP_sha256());
  return id;
}

std::string ToPem(const std::function<int(BIO*)>& write) {
  std::unique_ptr<BIO, BioFree> bio(BIO_new(BIO_s_mem()));
  EXPECT_EQ(write(bio.get()), 1);
  char* data = nullptr;
  long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

PeerMeshOptions TlsOptions(const Identity& ca, const Identity& self) {
  PeerMeshOptions o;
  o.listen = "127.0.0.1:0";
  o.secret = kSecret;
  o.heartbeat_interval = absl::Milliseconds(50);
  o.tls_ca_pem = ToPem([&](BIO* b) { return PEM_write_bio_X509(b, ca.cert.get()); });
  o.tls_cert_pem = ToPem([&](BIO* b) { return PEM_write_bio_X509(b, self.cert.get()); });
  o.tls_key_pem = ToPem([&](BIO* b) {
    return PEM_write_bio_PrivateKey(b, self.key.get(), nullptr, nullptr, 0, nullptr, nullptr);
  });
  return o;
}

v1::GroupSpec Spec(const std::string& a, const std::string& b) {
  v1::GroupSpec spec;
  spec.set_name("tls");
  spec.set_num_ranks(2);
  spec.set_num_experts(2);
  spec.set_hidden(128);
  spec.set_num_topk(1);
  spec.set_max_tokens_per_rank(1);
  for (const std::string& address : {a, b}) {
    v1::NodeSpec* n = spec.add_nodes();
    n->set_peer_address(address);
    n->set_num_ranks(1);
  }
  return spec;
}

std::unique_ptr<GroupPeers> Register(GrpcPeerMesh& mesh, const v1::GroupSpec& spec, int node) {
  GroupMembership m;
  m.spec = spec;
  m.self_node = node;
  m.transport_descriptor = "d" + std::to_string(node);
  absl::StatusOr<std::unique_ptr<GroupPeers>> p = mesh.RegisterGroup(std::move(m));
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *std::move(p) : nullptr;
}

bool Paired(const GroupPeers& a, const GroupPeers& b, absl::Duration limit) {
  const absl::Time until = absl::Now() + limit;
  while (absl::Now() < until) {
    if (a.Descriptor(1).has_value() && b.Descriptor(0).has_value()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

TEST(PeerMeshTlsTest, SameCaRendezvousOtherCaAndPlaintextDoNot) {
  Identity ca = MakeIdentity("epd test CA", nullptr);
  Identity n0 = MakeIdentity("node0", &ca);
  Identity n1 = MakeIdentity("node1", &ca);
  Identity rogue_ca = MakeIdentity("rogue CA", nullptr);
  Identity rogue = MakeIdentity("rogue", &rogue_ca);

  absl::StatusOr<std::unique_ptr<GrpcPeerMesh>> m0 = GrpcPeerMesh::Start(TlsOptions(ca, n0));
  absl::StatusOr<std::unique_ptr<GrpcPeerMesh>> m1 = GrpcPeerMesh::Start(TlsOptions(ca, n1));
  ASSERT_TRUE(m0.ok()) << m0.status();
  ASSERT_TRUE(m1.ok()) << m1.status();
  {
    v1::GroupSpec spec = Spec((*m0)->advertised_address(), (*m1)->advertised_address());
    auto a = Register(**m0, spec, 0);
    auto b = Register(**m1, spec, 1);
    ASSERT_TRUE(a && b);
    EXPECT_TRUE(Paired(*a, *b, absl::Seconds(10)));
    EXPECT_EQ(a->Descriptor(1)->transport, "d1");
  }

  // The same secret, but a certificate of another CA: TLS refuses it both ways.
  absl::StatusOr<std::unique_ptr<GrpcPeerMesh>> m2 =
      GrpcPeerMesh::Start(TlsOptions(rogue_ca, rogue));
  ASSERT_TRUE(m2.ok()) << m2.status();
  {
    v1::GroupSpec spec = Spec((*m0)->advertised_address(), (*m2)->advertised_address());
    spec.set_name("rogue");
    auto a = Register(**m0, spec, 0);
    auto b = Register(**m2, spec, 1);
    ASSERT_TRUE(a && b);
    EXPECT_FALSE(Paired(*a, *b, absl::Seconds(1)));
    EXPECT_NE(a->DescribeMissing(), "");
  }

  // No TLS at all against a TLS daemon.
  PeerMeshOptions plain;
  plain.listen = "127.0.0.1:0";
  plain.secret = kSecret;
  plain.heartbeat_interval = absl::Milliseconds(50);
  absl::StatusOr<std::unique_ptr<GrpcPeerMesh>> m3 = GrpcPeerMesh::Start(plain);
  ASSERT_TRUE(m3.ok()) << m3.status();
  {
    v1::GroupSpec spec = Spec((*m0)->advertised_address(), (*m3)->advertised_address());
    spec.set_name("plain");
    auto a = Register(**m0, spec, 0);
    auto b = Register(**m3, spec, 1);
    ASSERT_TRUE(a && b);
    EXPECT_FALSE(Paired(*a, *b, absl::Seconds(1)));
  }
}

/// Challenge and Hello over mutual TLS with `self`'s certificate, claiming `daemon_id`.
grpc::Status HelloOverTls(const Identity& ca, const Identity& self, const std::string& target,
                          const std::string& daemon_id) {
  const PeerMeshOptions pems = TlsOptions(ca, self);
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = pems.tls_ca_pem;
  ssl.pem_private_key = pems.tls_key_pem;
  ssl.pem_cert_chain = pems.tls_cert_pem;
  auto stub = v1::Peer::NewStub(grpc::CreateChannel(target, grpc::SslCredentials(ssl)));
  const auto deadline = [] { return std::chrono::system_clock::now() + std::chrono::seconds(5); };
  grpc::ClientContext c1;
  c1.set_deadline(deadline());
  v1::ChallengeRequest challenge;
  challenge.set_protocol_version(kPeerProtocolVersion);
  v1::ChallengeResponse nonce;
  if (grpc::Status s = stub->Challenge(&c1, challenge, &nonce); !s.ok()) return s;
  v1::HelloRequest hello;
  hello.set_protocol_version(kPeerProtocolVersion);
  hello.set_daemon_id(daemon_id);
  hello.set_server_nonce(nonce.server_nonce());
  hello.set_client_nonce(std::string(32, 'n'));
  hello.set_proof(HelloProof(kSecret, hello.server_nonce(), hello.client_nonce(), daemon_id));
  grpc::ClientContext c2;
  c2.set_deadline(deadline());
  v1::HelloResponse welcome;
  return stub->Hello(&c2, hello, &welcome);
}

TEST(PeerMeshTlsTest, ACallerMayClaimOnlyAHostItsCertificateNames) {
  Identity ca = MakeIdentity("epd test CA", nullptr);
  Identity n0 = MakeIdentity("node0", &ca);
  Identity n1 = MakeIdentity("node1", &ca);
  Identity elsewhere = MakeIdentity("elsewhere", &ca, "DNS:elsewhere.example");
  absl::StatusOr<std::unique_ptr<GrpcPeerMesh>> m0 = GrpcPeerMesh::Start(TlsOptions(ca, n0));
  ASSERT_TRUE(m0.ok()) << m0.status();
  const std::string target = (*m0)->advertised_address();

  // The certificate names 127.0.0.1: that host, any port, is the caller's to claim.
  EXPECT_TRUE(HelloOverTls(ca, n1, target, "127.0.0.1:7001").ok());
  // Another host is not, though the CA signed the certificate and the secret is right.
  grpc::Status other = HelloOverTls(ca, n1, target, "127.0.0.2:7001");
  EXPECT_EQ(other.error_code(), grpc::StatusCode::PERMISSION_DENIED) << other.error_message();
  EXPECT_THAT(other.error_message(), ::testing::HasSubstr("127.0.0.2:7001"));
  EXPECT_THAT(other.error_message(), ::testing::HasSubstr("127.0.0.1"));
  // A certificate for another name cannot claim this host.
  grpc::Status named = HelloOverTls(ca, elsewhere, target, "127.0.0.1:7001");
  EXPECT_EQ(named.error_code(), grpc::StatusCode::PERMISSION_DENIED) << named.error_message();
  EXPECT_THAT(named.error_message(), ::testing::HasSubstr("elsewhere.example"));
}

}  // namespace
}  // namespace epd::peer
