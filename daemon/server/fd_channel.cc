#include "daemon/server/fd_channel.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/errors/reason.h"
#include "daemon/core/logging.h"

namespace epd {
namespace {

/// At most kBurst refusal lines per kWindow from all fd-channel connections together (a
/// flood of bad connections must not flood the log); the next line says how many were
/// dropped. The channel's thread only.
class RefusalLog {
 public:
  void Log(const PeerCredentials& peer, const absl::Status& why) {
    const absl::Time now = absl::Now();
    if (now - window_start_ >= kWindow) {
      window_start_ = now;
      in_window_ = 0;
    }
    if (in_window_ >= kBurst) {
      ++dropped_;
      return;
    }
    ++in_window_;
    const uint64_t dropped = std::exchange(dropped_, 0);
    GetLogger(kLogControl)
        ->info("fd channel: refused {}: {}{}", DescribeCredentials(peer), errors::StatusText(why),
               dropped == 0 ? std::string()
                            : absl::StrCat(" (", dropped, " earlier refusal(s) not logged)"));
  }

 private:
  static constexpr int kBurst = 20;
  static constexpr absl::Duration kWindow = absl::Seconds(10);
  absl::Time window_start_ = absl::InfinitePast();
  int in_window_ = 0;
  uint64_t dropped_ = 0;
};

RefusalLog& Refusals() {
  static RefusalLog* log = new RefusalLog();  // Never destroyed; the loop thread's only.
  return *log;
}

}  // namespace

absl::StatusOr<std::unique_ptr<FdChannel>> FdChannel::Start(Fetch fetch, FdChannelOptions options) {
  ScopedFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) {
    return absl::InternalError(absl::StrCat("fd channel: eventfd: ", std::strerror(errno)));
  }
  std::unique_ptr<FdChannel> channel(new FdChannel(std::move(fetch), options, std::move(wake)));
  channel->loop_ = std::thread([raw = channel.get()] { raw->Loop(); });
  return channel;
}

FdChannel::FdChannel(Fetch fetch, FdChannelOptions options, ScopedFd wake)
    : fetch_(std::move(fetch)), options_(options), wake_(std::move(wake)) {}

FdChannel::~FdChannel() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  const uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof(one));
  if (loop_.joinable()) loop_.join();
}

void FdChannel::Serve(ScopedFd conn, const PeerCredentials& peer) {
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;  // `conn` closes.
    incoming_.push_back(
        std::make_unique<Pending>(std::move(conn), peer, absl::Now() + options_.request_timeout));
  }
  const uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof(one));
}

void FdChannel::Loop() {
  std::vector<pollfd> fds;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) break;
      // A connection's time starts when this loop takes it: one that arrived while the
      // loop was busy answering another (a fetch can wait on a join that allocates GBs)
      // has not been slow itself.
      const absl::Time taken = absl::Now();
      while (!incoming_.empty()) {
        incoming_.front()->deadline = taken + options_.request_timeout;
        pending_.push_back(std::move(incoming_.front()));
        incoming_.pop_front();
      }
    }
    // A new connection that finds the set full closes the oldest (the front).
    while (pending_.size() > options_.max_pending) {
      Refusals().Log(pending_.front()->peer,
                     absl::ResourceExhaustedError(
                         absl::StrCat("closed unanswered: more than ", options_.max_pending,
                                      " fd-channel connections were waiting for their request")));
      pending_.erase(pending_.begin());
    }
    // Requests that may already be complete are read before any wait (their bytes may
    // have arrived with the preamble).
    const absl::Time now = absl::Now();
    absl::Time next_deadline = absl::InfiniteFuture();
    for (size_t i = 0; i < pending_.size();) {
      Pending& p = *pending_[i];
      if (now >= p.deadline) {
        Refusals().Log(
            p.peer, absl::DeadlineExceededError(absl::StrCat(
                        "closed unanswered: no complete request within ",
                        absl::FormatDuration(options_.request_timeout), " (", p.reader.received(),
                        " of ", p.reader.needed(), " bytes came)")));
        pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
        continue;
      }
      next_deadline = std::min(next_deadline, p.deadline);
      ++i;
    }
    fds.clear();
    fds.push_back({wake_.get(), POLLIN, 0});
    for (const auto& p : pending_) fds.push_back({p->conn.get(), POLLIN, 0});
    const int64_t ms =
        next_deadline == absl::InfiniteFuture()
            ? -1
            : std::clamp<int64_t>(
                  absl::ToInt64Milliseconds(absl::Ceil(next_deadline - now, absl::Milliseconds(1))),
                  0, INT_MAX);
    const int ready = ::poll(fds.data(), fds.size(), static_cast<int>(ms));
    if (ready < 0 && errno != EINTR) {
      GetLogger(kLogControl)->error("fd channel: poll: {}", std::strerror(errno));
      absl::SleepFor(absl::Milliseconds(10));
      continue;
    }
    if (ready <= 0) continue;
    if (fds[0].revents != 0) {
      uint64_t count = 0;
      (void)!::read(wake_.get(), &count, sizeof(count));
    }
    // pending_ is unchanged since fds was built: fds[i + 1] is pending_[i].
    std::vector<std::unique_ptr<Pending>> still;
    still.reserve(pending_.size());
    const absl::Time busy_from = absl::Now();
    for (size_t i = 0; i < pending_.size(); ++i) {
      if (fds[i + 1].revents != 0 && Advance(*pending_[i])) continue;
      still.push_back(std::move(pending_[i]));
    }
    // The time spent answering is the channel's, not the waiting peers': their deadlines
    // move by it.
    const absl::Duration busy = absl::Now() - busy_from;
    for (auto& p : still) p->deadline += busy;
    pending_ = std::move(still);
  }
  pending_.clear();
  absl::MutexLock lock(&mu_);
  incoming_.clear();
}

bool FdChannel::Advance(Pending& p) {
  absl::StatusOr<bool> done = p.reader.Continue(p.conn.get());
  if (done.ok() && !*done) return false;  // More to come.
  EndpointFds fds;
  absl::Status status;
  if (!done.ok()) {
    if (!absl::IsInvalidArgument(done.status())) {
      Refusals().Log(p.peer, done.status());  // The peer left: nobody to answer.
      return true;
    }
    status = done.status();
  } else {
    ReceivedFrame frame = p.reader.TakeFrame();
    v1::FdChannelRequest request;
    if (!request.ParseFromString(frame.body)) {
      status = absl::InvalidArgumentError(absl::StrCat(
          "fd channel: the request frame (", frame.body.size(),
          " bytes) is not an epd.v1.FdChannelRequest; send abi::kFdChannelPreamble, then one "
          "frame as common/os/fd_frame.h describes"));
    } else {
      absl::StatusOr<EndpointFds> fetched = fetch_(request, p.peer);
      if (fetched.ok()) {
        fds = *std::move(fetched);
      } else {
        status = fetched.status();
      }
    }
  }
  Answer(p, status, fds);
  return true;
}

void FdChannel::Answer(Pending& p, const absl::Status& status, const EndpointFds& fds) {
  v1::FdChannelResponse response;
  response.set_code(static_cast<int32_t>(status.code()));
  response.set_message(std::string(status.message()));
  std::vector<int> attached;
  if (status.ok()) {
    response.set_endpoint_id(fds.endpoint_id);
    attached = {fds.region.get(), fds.doorbell.get()};
  } else {
    Refusals().Log(p.peer, status);
  }
  absl::Status sent = SendFrame(p.conn.get(), response.SerializeAsString(), attached,
                                absl::Now() + options_.response_timeout);
  if (!sent.ok()) {
    Refusals().Log(p.peer, absl::Status(sent.code(), absl::StrCat("answering: ", sent.message())));
  } else if (status.ok()) {
    GetLogger(kLogControl)
        ->debug("fd channel: endpoint {} handed to {}", fds.endpoint_id,
                DescribeCredentials(p.peer));
  }
  // The answer is queued; the peer reads it after the close too.
  ::shutdown(p.conn.get(), SHUT_WR);
}

}  // namespace epd
