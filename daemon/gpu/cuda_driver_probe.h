// The CUDA driver and runtime as a process without CUDA linked sees them: libcuda.so.1
// (and libcudart) loaded with dlopen, asked for versions, GPUs and peer access. For tools
// that must run on a node before anything is installed (epctl doctor --standalone) and
// for the daemon's GetStats.cuda_driver_version. Never fails: what cannot be asked is
// left unknown and `error` says why.
#pragma once

#include <string>
#include <vector>

#include "epd/v1/control.pb.h"

namespace epd {

/// Peer access between two GPUs as the driver reports it.
enum class P2pLink {
  kNone = 0,    ///< No peer access (copies go through the host).
  kAccess = 1,  ///< Peer access without native atomics (PCIe).
  kAtomics = 2  ///< Peer access with native atomics (NVLink / NVSwitch).
};

struct CudaDriverFacts {
  bool library_loaded = false;  ///< libcuda.so.1 was found.
  std::string error;            ///< Why something is unknown ("" when everything answered).
  int driver_version = 0;       ///< cuDriverGetVersion: 12080 = 12.8; 0 = unknown.
  int runtime_version = 0;      ///< cudaRuntimeGetVersion of libcudart found by dlopen; 0.
  /// Every visible GPU (ordinal, uuid, pci_bus_id, name, sm_count, total_memory_bytes,
  /// compute capability, peer_access); free_memory_bytes is not asked (needs a context).
  std::vector<v1::GpuInfo> gpus;
  /// p2p[i][j]: the link from GPU i to GPU j (kNone on the diagonal).
  std::vector<std::vector<P2pLink>> p2p;
};

/// Loads the driver and reads the facts; with `list_gpus` it also initialises it (cuInit(0))
/// and lists the GPUs and their peer links, else it only reads the versions (no CUDA
/// context, no MPS connection: cheap enough for a daemon). Each call dlopens and dlcloses.
CudaDriverFacts ProbeCudaDriver(bool list_gpus = true);

/// "12.8" from 12080; "unknown" for 0.
std::string CudaVersionText(int version);

}  // namespace epd
