// The GPU drain of a graceful stop (see gpu_drain.h).
#include "daemon/dataplane/gpu_drain.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace epd {

std::string DescribeGpuDrain(const GpuDrainReport& r) {
  const auto ms = [](absl::Duration d) { return absl::ToInt64Milliseconds(d); };
  std::string line = absl::StrCat(
      "stopped ", r.groups, " group(s): ", r.ops_failed, " op(s) failed with UNAVAILABLE, ",
      r.programs_disarmed, " graph-mode program(s) disarmed; ", r.stagings_awaited,
      " client staging kernel(s) awaited (", ms(r.staging_wait), " ms); ");
  if (r.busy.empty()) {
    absl::StrAppend(&line, "GPU work drained in ", ms(r.took), " ms");
  } else {
    absl::StrAppend(&line, "GPU work NOT drained within ", ms(r.took),
                    " ms, still busy: ", absl::StrJoin(r.busy, ", "),
                    " (clients reading epd's memory there may fail once it is freed)");
  }
  if (!r.stagings_missed.empty()) {
    absl::StrAppend(&line, "; staging never came for ", absl::StrJoin(r.stagings_missed, ", "),
                    " (those clients' streams write into epd's memory when they run it: restart "
                    "them if their CUDA context fails)");
  }
  return line;
}

bool PollUntil(const std::function<bool()>& done, absl::Time deadline, absl::Duration interval) {
  for (;;) {
    if (done()) return true;
    const absl::Time now = absl::Now();
    if (now >= deadline) return false;
    absl::SleepFor(std::min(interval, deadline - now));
  }
}

}  // namespace epd
