// The launch_flags region of an endpoint's data area (GPU memory): the words of the
// stream-ordered hand-off between a client's stream and the daemon's stream in
// daemon-launched mode, and of graph-mode programs (DESIGN.md §3.2). One layout for host
// code and kernels; covered by kShmAbiVersion (shm_abi.h): bump it when a byte moves or a
// meaning changes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#define EPD_HOST_DEVICE __host__ __device__
#else
#define EPD_HOST_DEVICE
#endif

namespace epd::abi {

/// The launch_flags region, zeroed at creation; every word in GPU memory of the endpoint.
struct LaunchFlags {
  /// The client's stream writes the op's seq once the op's inputs are staged (the last
  /// block of the staging kernel); the daemon's stream waits for ready_seq >= seq before
  /// the op's kernels.
  uint64_t ready_seq;
  /// Written with seq once the op's outputs are complete (by the daemon's low-latency
  /// kernel itself, else by the daemon's stream after the kernels, and by the engine for
  /// an op that fails before launch); the client's stream waits for done_seq >= seq.
  /// kReleasedSeq, written by the client from the host, releases every wait.
  uint64_t done_seq;
  /// Tickets of the staging kernel's blocks (low half: started, the last one writes
  /// staging_seq; high half: finished, the last one writes ready_seq); 0 between ops.
  /// Client-owned.
  uint32_t ready_signal_counter;
  uint32_t reserved0;
  /// The staging kernel writes the op's seq once all its blocks are resident, before its
  /// copies; the daemon's wait of a low-latency op passes on staging_seq >= seq (or
  /// ready_seq >= seq) and that op's kernel then waits for ready_seq itself.
  uint64_t staging_seq;
  uint64_t reserved1[4];
  /// Graph mode: the client's stream writes 1 once a program step's inputs are staged;
  /// the daemon's stream waits for go >= 1, writes 0, then runs the step's kernels.
  uint64_t program_go;
  /// Graph mode: the step's kernel writes 1 once its outputs are complete (the daemon's
  /// stream if the launch failed); the client's stream waits for done >= 1, then swaps 1
  /// for 0 (atomicCAS): a stream wait and a one-thread kernel, or under MPS the staging
  /// kernel's spinning thread (kernels::cuda::DoneWait::clear), the same CAS either way.
  /// kProgramReleased once the program is disarmed (no CAS clears it).
  uint64_t program_done;
  /// Graph mode: the step's kernel writes the instance number (1, 2, ... since the
  /// program was armed) just before program_done.
  uint64_t program_instance;
  uint8_t reserved2[4096 - 88];

  /// The region at byte `offset` of a data area whose base is `base`.
  EPD_HOST_DEVICE static LaunchFlags* At(uint8_t* base, uint64_t offset) {
    return reinterpret_cast<LaunchFlags*>(base + offset);
  }
};
static_assert(std::is_trivially_copyable_v<LaunchFlags>);
static_assert(sizeof(LaunchFlags) == 4096);

/// Size of the launch_flags region in bytes.
inline constexpr uint64_t kLaunchFlagsRegionBytes = sizeof(LaunchFlags);
/// Byte offsets of the words inside the region.
inline constexpr uint64_t kReadyFlagOffset = offsetof(LaunchFlags, ready_seq);
inline constexpr uint64_t kDoneFlagOffset = offsetof(LaunchFlags, done_seq);
inline constexpr uint64_t kReadySignalCounterOffset = offsetof(LaunchFlags, ready_signal_counter);
inline constexpr uint64_t kStagingFlagOffset = offsetof(LaunchFlags, staging_seq);
inline constexpr uint64_t kProgramGoOffset = offsetof(LaunchFlags, program_go);
inline constexpr uint64_t kProgramDoneOffset = offsetof(LaunchFlags, program_done);
inline constexpr uint64_t kProgramInstanceOffset = offsetof(LaunchFlags, program_instance);
static_assert(kReadyFlagOffset == 0 && kDoneFlagOffset == 8 && kReadySignalCounterOffset == 16 &&
              kStagingFlagOffset == 24 && kProgramGoOffset == 64 && kProgramDoneOffset == 72 &&
              kProgramInstanceOffset == 80);

/// program_done once the program is disarmed: graph-mode words otherwise hold only 0/1, so
/// every value a captured client graph writes or waits for is a constant.
inline constexpr uint64_t kProgramReleased = 2;

/// The done_seq value the client writes from the host to release a stream whose daemon is
/// gone (above every real sequence number, so every pending and later wait passes).
inline constexpr uint64_t kReleasedSeq = UINT64_MAX / 2;

}  // namespace epd::abi
