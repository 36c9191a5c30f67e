#include "daemon/gpu/mps.h"

#include <dirent.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace epd {
namespace {

/// True when a unix socket at `path` accepts a connection, of any of the socket types a
/// service may use (the MPS control socket is not necessarily SOCK_STREAM). Otherwise
/// `*error` says why the stream connect failed.
bool UnixSocketAccepts(const std::string& path, std::string* error) {
  if (path.size() >= sizeof(sockaddr_un{}.sun_path)) {
    *error = "path too long";
    return false;
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  error->clear();
  for (int type : {SOCK_STREAM, SOCK_SEQPACKET, SOCK_DGRAM}) {
    int fd = ::socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    if (!ok && error->empty()) *error = std::strerror(errno);
    ::close(fd);
    if (ok) return true;
  }
  return false;
}

/// Pid of the first live (not zombie) process whose /proc/<pid>/comm starts with
/// `prefix`, or 0.
long FindProcess(absl::string_view prefix) {
  DIR* dir = ::opendir("/proc");
  if (dir == nullptr) return 0;
  long found = 0;
  while (dirent* entry = ::readdir(dir)) {
    char* end = nullptr;
    long pid = std::strtol(entry->d_name, &end, 10);
    if (pid <= 0 || *end != '\0') continue;
    std::ifstream comm(absl::StrCat("/proc/", entry->d_name, "/comm"));
    std::string name;
    if (!std::getline(comm, name) || !absl::StartsWith(name, prefix)) continue;
    // /proc/<pid>/stat: "pid (comm) S ..."; a zombie (Z) or dead (X) process serves nothing.
    std::ifstream stat_file(absl::StrCat("/proc/", entry->d_name, "/stat"));
    std::string stat;
    std::getline(stat_file, stat);
    size_t paren = stat.rfind(')');
    char state = paren != std::string::npos && paren + 2 < stat.size() ? stat[paren + 2] : '?';
    if (state == 'Z' || state == 'X') continue;
    found = pid;
    break;
  }
  ::closedir(dir);
  return found;
}

}  // namespace

MpsStatus DetectMps() {
  MpsStatus status;
  const char* env = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  std::string pipe_dir = env != nullptr && *env != '\0' ? env : "/tmp/nvidia-mps";
  std::string control = absl::StrCat(pipe_dir, "/control");
  // CUDA joins MPS through the control socket of its pipe directory: that socket accepting
  // connections is what makes MPS active for this daemon.
  std::string connect_error;
  if (UnixSocketAccepts(control, &connect_error)) {
    status.active = true;
    status.detail = absl::StrCat("MPS control socket ", control, " accepts connections");
    if (long pid = FindProcess("nvidia-cuda-mps"); pid != 0) {
      absl::StrAppend(&status.detail, " (MPS process pid ", pid, ")");
    }
    return status;
  }
  if (long pid = FindProcess("nvidia-cuda-mps"); pid != 0) {
    status.detail = absl::StrCat(
        "an MPS process runs (pid ", pid, ") but the control socket ", control,
        " does not answer (", connect_error,
        "): this process does not use it (set CUDA_MPS_PIPE_DIRECTORY to its pipe directory)");
    return status;
  }
  status.detail =
      absl::StrCat("no MPS control socket at ", control, " and no nvidia-cuda-mps-* process");
  return status;
}

}  // namespace epd
