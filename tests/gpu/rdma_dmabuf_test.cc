// GPU memory for the RDMA transport without an RDMA device: the CUDA driver exports device
// memory as a dmabuf at the region's offset in its covering pages (rdma::ExportCudaDmabuf),
// the half of GPUDirect registration that a GPU machine without a NIC can check. Skips
// without a CUDA device, without RDMA support built, or where dmabuf export is unusable
// (saying why).
#include <gtest/gtest.h>

#if defined(EPD_HAVE_RDMA)
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstdint>
#include <vector>

#include "daemon/transport/rdma/rdma_memory.h"

namespace epd::transport::rdma {
namespace {

TEST(RdmaDmabuf, DeviceMemoryExportsAtItsOffset) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    GTEST_SKIP() << "no CUDA device";
  }
  const std::vector<int> zero = {0};
  if (const absl::Status usable = CudaDmabufUsable(zero); !usable.ok()) {
    GTEST_SKIP() << "dmabuf export unusable here: " << usable;
  }
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  void* mem = nullptr;
  ASSERT_EQ(cudaMalloc(&mem, 8 << 20), cudaSuccess);
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  MemoryRegion r{static_cast<char*>(mem) + page + 100, 1 << 20, MemoryKind::kCudaDevice, 0};
  absl::StatusOr<DmabufRange> d = ExportCudaDmabuf(r, "test region");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(d->fd.valid());
  EXPECT_EQ(d->offset, reinterpret_cast<uint64_t>(r.base) % page);
  EXPECT_EQ(d->bytes, r.bytes);
  const off_t size = ::lseek(d->fd.get(), 0, SEEK_END);
  EXPECT_GE(static_cast<uint64_t>(size), d->offset + d->bytes) << "the dmabuf's size";
  EXPECT_EQ(static_cast<uint64_t>(size) % page, 0u);
  // Host memory is not exported.
  std::vector<char> host(4096);
  EXPECT_TRUE(absl::IsInvalidArgument(
      ExportCudaDmabuf(MemoryRegion{host.data(), host.size(), MemoryKind::kHost, -1}, "h")
          .status()));
  EXPECT_EQ(cudaFree(mem), cudaSuccess);
}

}  // namespace
}  // namespace epd::transport::rdma

#else

TEST(RdmaDmabuf, DeviceMemoryExportsAtItsOffset) {
  GTEST_SKIP() << "epd was built without RDMA support (libibverbs-dev missing)";
}

#endif
