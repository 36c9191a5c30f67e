// GpuInventory: the GPUs this daemon sees at start-up: per GPU its UUID, PCI bus
// id, name, SM count, memory, compute capability and peer-access row, plus whether the
// CUDA MPS control daemon is running. Built with CUDA (EPD_HAVE_CUDA) it queries the CUDA
// runtime; without CUDA, or with no usable device, the list is empty and `reason` says why.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/gpu/mps.h"
#include "epd/v1/control.pb.h"

namespace epd {

/// The oldest architecture epd's kernels are built for (compute_80 PTX and up: Ampere,
/// Hopper and newer).
inline constexpr int kMinComputeCapabilityMajor = 8;

/// OK when epd's kernels run on a GPU of compute capability `major`.`minor`; else
/// FAILED_PRECONDITION naming the GPU (`what`), its sm_XY and the minimum.
absl::Status CheckComputeCapability(const std::string& what, int major, int minor);

class GpuInventory {
 public:
  /// Queries every visible GPU (each marked supported or not: CheckComputeCapability). When
  /// `allowed_uuids` is not empty, keeps only those (an allowed UUID that is not visible →
  /// NOT_FOUND naming it). No GPU is not an error: the inventory is empty and reason() says why
  /// ("built without CUDA", "no CUDA device: cudaGetDeviceCount: ...").
  static absl::StatusOr<GpuInventory> Discover(const std::vector<std::string>& allowed_uuids);

  /// An inventory of given GPUs (tests, fakes).
  static GpuInventory FromList(std::vector<v1::GpuInfo> gpus, std::string reason,
                               MpsStatus mps = {});

  const std::vector<v1::GpuInfo>& gpus() const { return gpus_; }
  bool empty() const { return gpus_.empty(); }
  /// Why the list is empty, or a summary ("2 GPU(s): NVIDIA H200 x2") when not.
  const std::string& reason() const { return reason_; }
  const MpsStatus& mps() const { return mps_; }

  /// The GPU named by `id`: a UUID ("GPU-..."), or a PCI bus id ("0000:3b:00.0", case and
  /// a missing domain ignored). NOT_FOUND naming `id` and the known UUIDs otherwise.
  absl::StatusOr<v1::GpuInfo> Find(const std::string& id) const;

  /// Re-reads free memory of every GPU. With CUDA, an error (e.g. the GPU fell off the bus)
  /// → UNAVAILABLE naming the GPU and the CUDA error: the daemon turns NOT_SERVING. No-op
  /// without CUDA.
  absl::Status Refresh();

 private:
  std::vector<v1::GpuInfo> gpus_;
  std::string reason_;
  MpsStatus mps_;
};

}  // namespace epd
