#include "tests/gpu/gpu_test_util.h"

#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "common/status_macros.h"
#include "proto/abi/launch_flags.h"

namespace epd::testing {
namespace {

// Before the CUDA runtime starts: enough hardware queues that up to 32 streams (8 virtual
// ranks of several groups) run side by side instead of sharing queues (false dependencies
// between streams would serialise kernels that spin on each other), and eager module
// loading (DESIGN.md §3.2). setenv does not override a value the user set.
const bool kEnvironmentSet = [] {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  return true;
}();

}  // namespace

bool HaveGpu(std::string* reason) {
  (void)kEnvironmentSet;
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    if (reason != nullptr) {
      *reason = err != cudaSuccess ? absl::StrCat("no CUDA device: ", cudaGetErrorString(err))
                                   : "no CUDA device";
    }
    cudaGetLastError();
    return false;
  }
  return true;
}

// ---- DeviceBuffer -----------------------------------------------------------------------

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes) {
  DeviceBuffer b;
  if (bytes == 0) return b;
  void* p = nullptr;
  EPD_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes));
  b.ptr_ = static_cast<uint8_t*>(p);
  b.bytes_ = bytes;
  EPD_CUDA_RETURN_IF_ERROR(cudaMemset(p, 0, bytes));
  // Done before the buffer is used on a non-blocking stream, which the legacy default
  // stream's memset does not order against.
  EPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(nullptr));
  return b;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

// ---- CudaStream -------------------------------------------------------------------------

absl::StatusOr<CudaStream> CudaStream::Create() {
  CudaStream s;
  EPD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s.stream_, cudaStreamNonBlocking));
  return s;
}

CudaStream::CudaStream(CudaStream&& other) noexcept
    : stream_(std::exchange(other.stream_, nullptr)) {}

CudaStream& CudaStream::operator=(CudaStream&& other) noexcept {
  if (this != &other) {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

CudaStream::~CudaStream() {
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

// ---- VirtualRankGroup -------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<VirtualRankGroup>> VirtualRankGroup::Create(
    const kernels::GroupShape& shape, int64_t timeout_ns, int32_t num_sms,
    int32_t ranks_on_device) {
  (void)kEnvironmentSet;
  std::unique_ptr<VirtualRankGroup> g(new VirtualRankGroup());
  g->shape_ = shape;
  g->layout_ = kernels::EndpointLayout::Compute(shape);
  g->timeout_ns_ = timeout_ns;
  g->num_sms_ = num_sms;
  g->ranks_on_device_ = ranks_on_device;
  std::vector<uint8_t*> bases;
  for (int32_t r = 0; r < shape.num_ranks; ++r) {
    EPD_ASSIGN_OR_RETURN(DeviceBuffer area, DeviceBuffer::Allocate(g->layout_.total_bytes));
    bases.push_back(area.get());
    g->areas_.push_back(std::move(area));
    EPD_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
    g->streams_.push_back(std::move(stream));
  }
  EPD_ASSIGN_OR_RETURN(g->peer_bases_, DeviceBuffer::Allocate(bases.size() * sizeof(uint8_t*)));
  EPD_CUDA_RETURN_IF_ERROR(cudaMemcpy(g->peer_bases_.get(), bases.data(),
                                      bases.size() * sizeof(uint8_t*), cudaMemcpyHostToDevice));
  return g;
}

kernels::cuda::CudaRankContext VirtualRankGroup::Context(int32_t r) const {
  kernels::cuda::CudaRankContext ctx;
  ctx.shape = shape_;
  ctx.layout = layout_;
  ctx.rank = r;
  ctx.peer_bases = reinterpret_cast<uint8_t* const*>(peer_bases_.get());
  ctx.own_base = base(r);
  ctx.num_sms = num_sms_;
  ctx.ranks_on_device = ranks_on_device_;
  ctx.all_ranks_on_device = all_ranks_on_device_;
  if (timeout_ns_ > 0) ctx.timeout_ns = timeout_ns_;
  return ctx;
}

absl::Status VirtualRankGroup::Upload(int32_t r, const kernels::Region& region, const void* src,
                                      size_t bytes, size_t offset) {
  if (offset + bytes > region.bytes) {
    return absl::InvalidArgumentError(absl::StrCat("Upload of ", bytes, " bytes at offset ", offset,
                                                   " exceeds the region's ", region.bytes,
                                                   " bytes"));
  }
  if (bytes == 0) return absl::OkStatus();
  EPD_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(base(r) + region.offset + offset, src, bytes, cudaMemcpyHostToDevice));
  // From pageable memory, cudaMemcpy returns once the bytes are staged for DMA, possibly
  // before they have landed (CUDA runtime API, "API synchronization behavior"); the ranks'
  // streams are non-blocking, so their next kernel could read the old bytes
  // (a cached normal re-dispatch would read the previous x). Wait for the legacy stream,
  // which holds the copy (not cudaDeviceSynchronize: other streams may hold spinning
  // kernels).
  return EPD_CUDA_STATUS(cudaStreamSynchronize(cudaStreamLegacy));
}

absl::Status VirtualRankGroup::Download(int32_t r, const kernels::Region& region, void* dst,
                                        size_t bytes, size_t offset) const {
  if (offset + bytes > region.bytes) {
    return absl::InvalidArgumentError(absl::StrCat("Download of ", bytes, " bytes at offset ",
                                                   offset, " exceeds the region's ", region.bytes,
                                                   " bytes"));
  }
  if (bytes == 0) return absl::OkStatus();
  return EPD_CUDA_STATUS(
      cudaMemcpy(dst, base(r) + region.offset + offset, bytes, cudaMemcpyDeviceToHost));
}

absl::Status VirtualRankGroup::LaunchAll(
    const std::function<absl::Status(int32_t, cudaStream_t)>& launch) {
  for (int32_t r = 0; r < num_ranks(); ++r) EPD_RETURN_IF_ERROR(launch(r, stream(r)));
  return absl::OkStatus();
}

absl::Status VirtualRankGroup::SynchronizeAll() {
  for (int32_t r = 0; r < num_ranks(); ++r) {
    EPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream(r)));
  }
  return absl::OkStatus();
}

// ---- random inputs ----------------------------------------------------------------------

std::vector<kernels::bf16_bits> RandomBf16(size_t n, std::mt19937_64& rng, float stddev) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<kernels::bf16_bits> v(n);
  for (auto& x : v) x = kernels::FloatToBf16(dist(rng));
  return v;
}

std::vector<float> RandomFloats(size_t n, std::mt19937_64& rng, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

std::vector<int64_t> RandomTopk(int32_t num_tokens, int32_t num_topk, int32_t num_experts,
                                const RoutingOptions& options, std::mt19937_64& rng) {
  std::vector<int64_t> idx(static_cast<size_t>(num_tokens) * num_topk, -1);
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  std::vector<int64_t> perm(num_experts);
  for (int32_t e = 0; e < num_experts; ++e) perm[e] = e;
  for (int32_t t = 0; t < num_tokens; ++t) {
    int64_t* row = idx.data() + static_cast<size_t>(t) * num_topk;
    // Partial Fisher-Yates: K distinct experts (with wrap-around when K > E).
    for (int32_t k = 0; k < num_topk; ++k) {
      const int32_t j = k % num_experts;
      std::uniform_int_distribution<int32_t> pick(j, num_experts - 1);
      std::swap(perm[j], perm[pick(rng)]);
      row[k] = perm[j];
    }
    for (int32_t k = 0; k < num_topk; ++k) {
      if (options.one_expert >= 0) row[k] = options.one_expert;
      if (k > 0 && coin(rng) < options.duplicate_fraction) {
        std::uniform_int_distribution<int32_t> earlier(0, k - 1);
        row[k] = row[earlier(rng)];
      }
      if (coin(rng) < options.masked_fraction) row[k] = -1;
    }
  }
  return idx;
}

absl::Status CompareBytes(const void* expected, const void* actual, size_t bytes,
                          const std::string& what) {
  const auto* e = static_cast<const uint8_t*>(expected);
  const auto* a = static_cast<const uint8_t*>(actual);
  if (bytes == 0 || std::memcmp(e, a, bytes) == 0) return absl::OkStatus();
  size_t first = 0;
  while (e[first] == a[first]) ++first;
  size_t differing = 0;
  for (size_t i = first; i < bytes; ++i) differing += e[i] != a[i];
  return absl::InternalError(absl::StrCat(what, ": ", differing, " of ", bytes,
                                          " bytes differ; first at byte ", first, ": expected 0x",
                                          absl::Hex(e[first]), ", got 0x", absl::Hex(a[first])));
}

uint64_t* LaunchFlag(VirtualRankGroup& g, int32_t r, uint64_t offset) {
  return reinterpret_cast<uint64_t*>(g.At<uint8_t>(r, g.layout().launch_flags) + offset);
}

uint64_t ReadWord(const void* device_word) {
  uint64_t v = 0;
  if (cudaMemcpy(&v, device_word, sizeof(v), cudaMemcpyDeviceToHost) != cudaSuccess) return 0;
  return v;
}

kernels::cuda::KernelHandoff DaemonHandoff(VirtualRankGroup& g, int32_t r, uint64_t seq) {
  kernels::cuda::KernelHandoff h;
  h.ready_flag = LaunchFlag(g, r, abi::kReadyFlagOffset);
  h.ready_value = seq;
  h.done_flag = LaunchFlag(g, r, abi::kDoneFlagOffset);
  h.done_value = seq;
  h.programmatic = true;
  return h;
}

}  // namespace epd::testing
