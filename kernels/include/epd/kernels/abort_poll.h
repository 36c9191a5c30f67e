// How a spin wait of the daemon's kernels checks the daemon's shutdown word
// (CudaRankContext::abort_flag) without a read over the bus per iteration: one type for the
// kernels (kernels/cuda/common.cuh) and the host tests of its cadence.
#pragma once

#include <cstdint>

#include "epd/kernels/types.h"

namespace epd::kernels::cuda {

/// Period of a spin wait's reads of its abort word, in ns of %globaltimer. A wait reads
/// nothing during its first kAbortPollNs (an op's waits mostly end within microseconds,
/// and those pay nothing), then once per kAbortPollNs: one load of host-mapped memory over
/// PCIe per millisecond of a long wait, and a raised word ends the wait within about
/// 2 * kAbortPollNs of the host's store. A late rank keeps up to every block's waiting
/// threads of every rank on the GPU in such waits (thousands): at 1 ms they read the bus
/// about a million times a second, not the tens of millions a 20 us period would, beside
/// the clients' and the NICs' traffic; the stop's drain allows 1 s.
inline constexpr uint64_t kAbortPollNs = 1'000'000;

/// The abort-word cadence of one spin wait, fed the clock the wait already reads. A fresh
/// AbortPoll per wait (in registers: no memory, no allocation).
struct AbortPoll {
  uint64_t next_ns = 0;
  bool started = false;

  /// Whether the wait should read its abort word now (`now_ns`: %globaltimer). False at
  /// the first call (it starts the period) and until kAbortPollNs after the last true.
  EPD_HD bool Due(uint64_t now_ns) {
    if (!started) {
      started = true;
      next_ns = now_ns + kAbortPollNs;
      return false;
    }
    if (now_ns < next_ns) return false;
    next_ns = now_ns + kAbortPollNs;
    return true;
  }
};

/// The end test of one iteration of a bounded spin wait, at `now_ns`: the deadline has
/// passed, or (when `poll` says it is due) `abort_raised()` reads the abort word as raised.
/// `abort_raised` is called only then: at most once per kAbortPollNs.
template <typename AbortRaised>
EPD_HD bool SpinEnds(uint64_t now_ns, uint64_t deadline_ns, AbortPoll* poll,
                     AbortRaised&& abort_raised) {
  if (now_ns > deadline_ns) return true;
  return poll->Due(now_ns) && abort_raised();
}

}  // namespace epd::kernels::cuda
