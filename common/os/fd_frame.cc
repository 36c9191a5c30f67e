#include "common/os/fd_frame.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace epd {
namespace {

constexpr size_t kHeaderBytes = 4;

/// Waits until `socket` is ready for `events` or `deadline` passes (DEADLINE_EXCEEDED,
/// naming `what`). A peer that hung up counts as ready: the next call reports it.
absl::Status WaitReady(int socket, short events, absl::Time deadline, absl::string_view what) {
  for (;;) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat(what, ": timed out"));
    }
    pollfd p{socket, events, 0};
    const int64_t ms = std::min<int64_t>(
        absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))), INT_MAX);
    const int rc = ::poll(&p, 1, static_cast<int>(ms));
    if (rc > 0) return absl::OkStatus();
    if (rc < 0 && errno != EINTR) {
      return absl::InternalError(absl::StrCat(what, ": poll: ", std::strerror(errno)));
    }
  }
}

absl::Status SocketError(absl::string_view what, int err) {
  const std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  if (err == EPIPE || err == ECONNRESET || err == ENOTCONN) return absl::UnavailableError(msg);
  return absl::InternalError(msg);
}

/// One non-blocking sendmsg of `bytes`, with `fds` attached when not empty. Returns the
/// bytes sent (0 when the socket would block).
absl::StatusOr<size_t> SendChunk(int socket, absl::string_view bytes, absl::Span<const int> fds) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdFrameFds)] = {};
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  const ssize_t n = ::sendmsg(socket, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (n >= 0) return static_cast<size_t>(n);
  if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
  return SocketError("fd channel: send", errno);
}

/// Sends all of `bytes`, the first byte with `fds` attached.
absl::Status SendWithFds(int socket, absl::string_view bytes, absl::Span<const int> fds,
                         absl::Time deadline) {
  size_t sent = 0;
  bool fds_sent = fds.empty();
  while (sent < bytes.size()) {
    absl::StatusOr<size_t> n =
        SendChunk(socket, bytes.substr(sent), fds_sent ? absl::Span<const int>() : fds);
    if (!n.ok()) return n.status();
    if (*n > 0) {
      sent += *n;
      fds_sent = true;
      continue;
    }
    if (absl::Status ready = WaitReady(socket, POLLOUT, deadline, "fd channel: send");
        !ready.ok()) {
      return ready;
    }
  }
  return absl::OkStatus();
}

/// One non-blocking recvmsg into `bytes`; descriptors that arrive are appended to `*fds`
/// (at most `max_fds` fit; `*truncated` is set when the kernel had to drop some). Returns
/// the bytes read, 0 when none are there yet; UNAVAILABLE when the peer closed.
absl::StatusOr<size_t> ReceiveSome(int socket, absl::Span<char> bytes, int max_fds,
                                   std::vector<ScopedFd>* fds, bool* truncated) {
  iovec iov{bytes.data(), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdFrameFds)] = {};
  if (max_fds > 0) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * std::min(max_fds, kMaxFdFrameFds));
  }
  const ssize_t n = ::recvmsg(socket, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
    return SocketError("fd channel: receive", errno);
  }
  if (msg.msg_flags & MSG_CTRUNC) *truncated = true;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd = -1;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds->emplace_back(fd);
    }
  }
  if (n == 0) return absl::UnavailableError("fd channel: the peer closed the connection");
  return static_cast<size_t>(n);
}

}  // namespace

absl::Status SendAll(int socket, absl::string_view bytes, absl::Time deadline) {
  return SendWithFds(socket, bytes, {}, deadline);
}

absl::Status SendFrame(int socket, absl::string_view body, absl::Span<const int> fds,
                       absl::Time deadline) {
  if (body.size() > kMaxFdFrameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fd channel: a frame of ", body.size(), " bytes exceeds the limit of ", kMaxFdFrameBytes));
  }
  if (fds.size() > static_cast<size_t>(kMaxFdFrameFds)) {
    return absl::InvalidArgumentError(absl::StrCat("fd channel: ", fds.size(),
                                                   " descriptors exceed the limit of ",
                                                   kMaxFdFrameFds, " per frame"));
  }
  std::string bytes(kHeaderBytes, '\0');
  const uint32_t length = static_cast<uint32_t>(body.size());
  for (size_t i = 0; i < kHeaderBytes; ++i)
    bytes[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  bytes.append(body.data(), body.size());
  return SendWithFds(socket, bytes, fds, deadline);
}

FrameReader::FrameReader(uint32_t max_bytes, int max_fds)
    : max_bytes_(std::min(max_bytes, kMaxFdFrameBytes)),
      max_fds_(std::clamp(max_fds, 0, kMaxFdFrameFds)) {}

absl::StatusOr<bool> FrameReader::Continue(int socket) {
  while (received_ < needed_) {
    absl::Span<char> into =
        received_ < kHeaderBytes
            ? absl::MakeSpan(header_ + received_, kHeaderBytes - received_)
            : absl::MakeSpan(frame_.body.data() + (received_ - kHeaderBytes), needed_ - received_);
    absl::StatusOr<size_t> n = ReceiveSome(socket, into, max_fds_, &frame_.fds, &truncated_);
    if (!n.ok()) {
      return absl::Status(n.status().code(), absl::StrCat(n.status().message(), " after ",
                                                          received_, " of ", needed_, " bytes"));
    }
    if (*n == 0) return false;
    received_ += *n;
    if (received_ == kHeaderBytes && needed_ == kHeaderBytes) {
      uint32_t length = 0;
      for (size_t i = 0; i < kHeaderBytes; ++i) {
        length |= static_cast<uint32_t>(static_cast<unsigned char>(header_[i])) << (8 * i);
      }
      if (length > max_bytes_) {
        return absl::InvalidArgumentError(absl::StrCat(
            "fd channel: frame length ", length, " exceeds the limit of ", max_bytes_, " bytes"));
      }
      frame_.body.resize(length);
      needed_ = kHeaderBytes + length;
    }
  }
  if (truncated_ || frame_.fds.size() > static_cast<size_t>(max_fds_)) {
    frame_.fds.clear();
    return absl::InvalidArgumentError(
        absl::StrCat("fd channel: the frame carried more than ", max_fds_,
                     " file descriptor(s); the surplus was discarded"));
  }
  return true;
}

absl::StatusOr<ReceivedFrame> ReceiveFrame(int socket, uint32_t max_bytes, int max_fds,
                                           absl::Time deadline) {
  FrameReader reader(max_bytes, max_fds);
  for (;;) {
    absl::StatusOr<bool> done = reader.Continue(socket);
    if (!done.ok()) return done.status();
    if (*done) return reader.TakeFrame();
    absl::Status ready = WaitReady(socket, POLLIN, deadline,
                                   absl::StrCat("fd channel: receive (", reader.received(), " of ",
                                                reader.needed(), " bytes came)"));
    if (!ready.ok()) return ready;
  }
}

}  // namespace epd
