// GpuInventory without a GPU, GPU lookup by UUID or PCI bus id, and MPS detection through
// the control socket of $CUDA_MPS_PIPE_DIRECTORY (daemon/gpu/gpu_inventory.h).
#include "daemon/gpu/gpu_inventory.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace epd {
namespace {

using ::testing::HasSubstr;

TEST(GpuInventoryTest, FindByUuidOrPciBusId) {
  v1::GpuInfo a, b;
  a.set_ordinal(0);
  a.set_uuid("GPU-aaaa");
  a.set_pci_bus_id("00000000:3B:00.0");
  b.set_ordinal(1);
  b.set_uuid("GPU-bbbb");
  b.set_pci_bus_id("0000:5e:00.0");
  GpuInventory inventory = GpuInventory::FromList({a, b}, "2 GPU(s)");
  EXPECT_EQ(inventory.Find("GPU-bbbb")->ordinal(), 1);
  EXPECT_EQ(inventory.Find("0000:3b:00.0")->uuid(), "GPU-aaaa");
  EXPECT_EQ(inventory.Find("3B:00.0")->uuid(), "GPU-aaaa");
  EXPECT_EQ(inventory.Find("00000000:5E:00.0")->uuid(), "GPU-bbbb");
  absl::StatusOr<v1::GpuInfo> missing = inventory.Find("GPU-cccc");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()),
              testing::AllOf(HasSubstr("GPU-cccc"), HasSubstr("GPU-aaaa"), HasSubstr("GPU-bbbb")));
}

TEST(GpuInventoryTest, ComputeCapabilityBelowAmpereIsUnsupported) {
  for (auto [major, minor] : {std::pair{8, 0}, {8, 6}, {8, 9}, {9, 0}, {10, 0}, {12, 0}}) {
    EXPECT_TRUE(CheckComputeCapability("GPU 0", major, minor).ok()) << major << "." << minor;
  }
  for (auto [major, minor] : {std::pair{7, 5}, {7, 0}, {6, 1}, {0, 0}}) {
    const absl::Status st = CheckComputeCapability("GPU 3 (Tesla T4)", major, minor);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(st.message()),
                testing::AllOf(HasSubstr("GPU 3 (Tesla T4)"),
                               HasSubstr(absl::StrCat("sm_", major, minor)), HasSubstr("sm_80")));
  }
}

TEST(GpuInventoryTest, EmptyInventorySaysWhy) {
  absl::StatusOr<GpuInventory> inventory = GpuInventory::Discover({});
  ASSERT_TRUE(inventory.ok()) << inventory.status();
  if (!inventory->empty()) GTEST_SKIP() << "a GPU is visible here: " << inventory->reason();
  EXPECT_FALSE(inventory->reason().empty());
  absl::StatusOr<v1::GpuInfo> any = inventory->Find("GPU-x");
  EXPECT_EQ(any.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(any.status().message()), HasSubstr(inventory->reason()));
}

class MpsDetectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/epd_mps_test_XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
    const char* old = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
    if (old != nullptr) old_ = old;
    ::setenv("CUDA_MPS_PIPE_DIRECTORY", dir_.c_str(), 1);
  }
  void TearDown() override {
    if (fd_ >= 0) ::close(fd_);
    if (old_.empty()) {
      ::unsetenv("CUDA_MPS_PIPE_DIRECTORY");
    } else {
      ::setenv("CUDA_MPS_PIPE_DIRECTORY", old_.c_str(), 1);
    }
    std::filesystem::remove_all(dir_);
  }
  /// A listening unix socket of `type` at <dir>/control, as the MPS control daemon has.
  void Listen(int type) {
    fd_ = ::socket(AF_UNIX, type, 0);
    ASSERT_GE(fd_, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::string path = dir_ + "/control";
    std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
    ASSERT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    if (type != SOCK_DGRAM) ASSERT_EQ(::listen(fd_, 4), 0);
  }

  std::string dir_;
  std::string old_;
  int fd_ = -1;
};

TEST_F(MpsDetectionTest, NoControlSocketIsNotActive) {
  MpsStatus mps = DetectMps();
  EXPECT_FALSE(mps.active);
  EXPECT_THAT(mps.detail, HasSubstr(dir_ + "/control"));
}

TEST_F(MpsDetectionTest, SeqpacketControlSocketIsActive) {
  Listen(SOCK_SEQPACKET);  // What nvidia-cuda-mps-control creates (driver 580).
  MpsStatus mps = DetectMps();
  EXPECT_TRUE(mps.active) << mps.detail;
  EXPECT_THAT(mps.detail, HasSubstr(dir_ + "/control"));
}

TEST_F(MpsDetectionTest, StreamControlSocketIsActive) {
  Listen(SOCK_STREAM);
  EXPECT_TRUE(DetectMps().active);
}

TEST_F(MpsDetectionTest, StaleControlSocketIsNotActive) {
  Listen(SOCK_SEQPACKET);
  ::close(fd_);  // The file stays; nobody listens.
  fd_ = -1;
  EXPECT_FALSE(DetectMps().active);
}

}  // namespace
}  // namespace epd
