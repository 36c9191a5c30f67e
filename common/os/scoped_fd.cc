// ScopedFd (scoped_fd.h).
#include "common/os/scoped_fd.h"

#include <unistd.h>

namespace epd {

void ScopedFd::Reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

}  // namespace epd
