#include "daemon/fd_channel.h"

#include <sys/socket.h>

#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/logging.h"
#include "fd_frame.h"

namespace epd {
namespace {

/// At most kBurst refusal lines per kWindow from all fd-channel connections together (a
/// flood of bad connections must not flood the log); the next line says how many were
/// dropped.
class RefusalLogLimiter {
 public:
  static RefusalLogLimiter& Get() {
    static RefusalLogLimiter* limiter = new RefusalLogLimiter();  // Never destroyed.
    return *limiter;
  }
  /// Whether to log one more line now; `*dropped` is set to the lines dropped since the
  /// last one logged.
  bool Allow(uint64_t* dropped) {
    std::lock_guard<std::mutex> lock(mu_);
    const absl::Time now = absl::Now();
    if (now - window_start_ >= kWindow) {
      window_start_ = now;
      in_window_ = 0;
    }
    if (in_window_ >= kBurst) {
      ++dropped_;
      return false;
    }
    ++in_window_;
    *dropped = std::exchange(dropped_, 0);
    return true;
  }

 private:
  static constexpr int kBurst = 20;
  static constexpr absl::Duration kWindow = absl::Seconds(10);
  std::mutex mu_;
  absl::Time window_start_ = absl::InfinitePast();
  int in_window_ = 0;
  uint64_t dropped_ = 0;
};

void LogRefusal(const PeerCredentials& peer, const absl::Status& why) {
  uint64_t dropped = 0;
  if (!RefusalLogLimiter::Get().Allow(&dropped)) return;
  GetLogger(kLogControl)
      ->info("fd channel: refused {}: {}{}", DescribeCredentials(peer), why.ToString(),
             dropped == 0 ? std::string()
                          : absl::StrCat(" (", dropped, " earlier refusal(s) not logged)"));
}

}  // namespace

FdChannel::FdChannel(Fetch fetch, FdChannelOptions options)
    : fetch_(std::move(fetch)), options_(options) {}

void FdChannel::Serve(ScopedFd conn, const PeerCredentials& peer) const {
  absl::StatusOr<ReceivedFrame> frame = ReceiveFrame(conn.get(), kMaxFdFrameBytes, /*max_fds=*/0,
                                                     absl::Now() + options_.request_timeout);
  if (!frame.ok() && !absl::IsInvalidArgument(frame.status())) {
    // Nothing complete in time, or the peer left: nobody to answer.
    LogRefusal(peer, frame.status());
    return;
  }
  absl::Status status = frame.status();
  EndpointFds fds;
  if (status.ok()) {
    v1::FdChannelRequest request;
    if (!request.ParseFromString(frame->body)) {
      status = absl::InvalidArgumentError(absl::StrCat(
          "fd channel: the request frame (", frame->body.size(),
          " bytes) is not an epd.v1.FdChannelRequest; send abi::kFdChannelPreamble, then one "
          "frame as proto/fd_frame.h describes"));
    } else {
      absl::StatusOr<EndpointFds> fetched = fetch_(request, peer);
      if (fetched.ok()) {
        fds = *std::move(fetched);
      } else {
        status = fetched.status();
      }
    }
  }
  v1::FdChannelResponse response;
  response.set_code(static_cast<int32_t>(status.code()));
  response.set_message(std::string(status.message()));
  std::vector<int> attached;
  if (status.ok()) {
    response.set_endpoint_id(fds.endpoint_id);
    attached = {fds.region.get(), fds.doorbell.get()};
  } else {
    LogRefusal(peer, status);
  }
  absl::Status sent = SendFrame(conn.get(), response.SerializeAsString(), attached,
                                absl::Now() + options_.response_timeout);
  if (!sent.ok()) {
    LogRefusal(peer, absl::Status(sent.code(), absl::StrCat("answering: ", sent.message())));
  } else if (status.ok()) {
    GetLogger(kLogControl)
        ->debug("fd channel: endpoint {} handed to {}", fds.endpoint_id, DescribeCredentials(peer));
  }
  // Our answer is queued; the peer reads it even after we close.
  ::shutdown(conn.get(), SHUT_WR);
}

}  // namespace epd
